"""Writer fencing (storage/fence.py) on a local directory, on loopback S3 with conditional writes (moto
honours If-None-Match / If-Match) and on loopback S3 that ignores them (LocalS3(conditional_writes=False)):
two writers on one store, interleaved at the worst moments. No Ray.

Each test writer carries its training state as the list of (attempt, step) it went through, and writes
that list into every checkpoint it commits: what a restore reads back is checked against the writer that
really produced it, not against the lineage code.

Without conditional writes two writers that picked the same generation number are ordered by their random
nonces; here every new writer's nonce sorts *below* every earlier one's (the worst draw, every run), so
only the number can make a newer writer the newest: a writer that reused its predecessor's number is
caught deterministically, not by the draw."""
from __future__ import annotations

import json
import os
import threading

import pytest

from spotfill.config.errors import WriterFenced
from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.storage import fence as fence_module
from spotfill.storage.fence import LISTING, Generation, WriterFence
from spotfill.testing.s3local import LocalS3


@pytest.fixture(autouse=True)
def descending_nonces(monkeypatch):
    """Each listing writer's nonce sorts below the previous writer's (storage/fence.py orders equal numbers
    by nonce): the draw that makes a reused number lose to the writer it should supersede."""
    lock, count = threading.Lock(), [0]

    def nonce() -> str:
        with lock:
            count[0] += 1
            return f"{0xFFFFFFFFFFFF - count[0]:012x}"
    monkeypatch.setattr(fence_module, "_nonce", nonce)


@pytest.fixture(scope="module")
def plain_s3(s3_server):
    """An S3 endpoint without conditional writes (the headers are dropped before moto sees them)."""
    with LocalS3(bucket="spotfill-plain", conditional_writes=False) as server:
        yield server


@pytest.fixture(params=["local", "s3", "s3-unconditional"])
def uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "s3":
        return request.getfixturevalue("s3_uri")
    return request.getfixturevalue("plain_s3").uri(f"t/{tmp_path.name}")


class Writer:
    """One training attempt's rank 0 (world size 1): its store, its attempt and its true state."""

    def __init__(self, uri: str, attempt: int, root, keep_last: int = 2):
        self.store = CheckpointStore(open_storage(uri), keep_last=keep_last)
        self.attempt, self.root, self.state = str(attempt), root, []

    def take(self) -> "Writer":
        self.store.take_generation(attempt=int(self.attempt))
        return self

    def restore(self) -> "Writer":
        got = self.store.restore(str(self.root / f"restore-{self.attempt}"))
        self.state = [] if got is None else read_state(got)
        return self

    def upload(self, step: int) -> str:
        tag = tag_for(step, self.attempt)
        snap = self.root / f"snap-{self.attempt}-{step}"
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "state.json").write_text(json.dumps(self.state + [[int(self.attempt), step]]))
        self.store.upload_part(tag, 0, 1, str(snap), attempt=self.attempt)
        return tag

    def commit(self, step: int) -> str:
        tag = self.upload(step)
        self.store.commit(tag, step, 1, attempt=self.attempt, meta={"attempt": self.attempt})
        self.state = self.state + [[int(self.attempt), step]]
        return tag


def read_state(restored: dict) -> list:
    with open(os.path.join(restored["path"], "rank-0", "state.json")) as f:
        return json.load(f)


def test_a_stale_writer_commits_moves_latest_quarantines_and_deletes_nothing(uri, tmp_path):
    a = Writer(uri, 0, tmp_path, keep_last=3).take()
    a.store.mark_resumed(None)
    a.commit(10), a.commit(20)
    b = Writer(uri, 1, tmp_path, keep_last=3).take().restore()   # the next attempt: resumes from A's 20
    assert b.state == [[0, 10], [0, 20]]
    b_tags = [b.commit(25), b.commit(30)]
    before = dict(b.store.storage.list())

    with pytest.raises(WriterFenced) as refused:
        a.commit(40)                                         # the zombie's commit: no manifest
    assert refused.value.op == "commit" and refused.value.tag == tag_for(40, "0")
    assert (refused.value.generation, refused.value.newest) == (str(a.store.fence.generation),
                                                                str(b.store.fence.generation))
    assert not b.store.storage.exists(f"checkpoints/{tag_for(40, '0')}/manifest.json")
    with pytest.raises(WriterFenced, match="move latest"):
        a.store.mark_resumed(tag_for(20, "0"), 20)
    with pytest.raises(WriterFenced, match="quarantine"):
        a.store.quarantine(b_tags[-1], "the zombie thinks it is damaged")
    with pytest.raises(WriterFenced, match="delete"):
        a.store.cleanup(a.store.lineage(head=tag_for(20, "0")))   # A's lineage: B's tags are its dead branch
    with pytest.raises(WriterFenced, match="delete"):
        a.store.discard_uncommitted()                        # its own debris, or a live save mid-upload

    after = dict(b.store.storage.list())
    lost = {k for k in before if k not in after}
    assert not lost, lost                                    # the zombie deleted nothing
    assert b.store.latest_tag() == b_tags[-1] and b.store.quarantined() == {}
    assert b.store.committed()[:2] == b_tags[::-1]
    got = Writer(uri, 2, tmp_path).take().restore()           # what the next attempt reads: B's own state
    assert got.state == [[0, 10], [0, 20], [1, 25], [1, 30]]


def test_the_live_writers_commits_survive_a_zombie_that_committed_in_between(uri, tmp_path):
    """The reported loss: attempt 1 took over, then the zombie attempt 0 committed -- its fence check
    passed just before attempt 1 took its generation, so its manifest lands -- and attempt 1's next commits
    were deleted right after they were made (retention rebuilt the lineage from the zombie's `latest`)."""
    a = Writer(uri, 0, tmp_path, keep_last=1).take()
    a.store.mark_resumed(None)
    a.commit(10)
    zombie_tag = a.upload(12)
    storage, real_put = a.store.storage, a.store.storage.put_bytes
    took_over = {}

    def b_takes_over_before_the_manifest_lands(key, data):
        if key.endswith(f"{zombie_tag}/manifest.json"):
            took_over["b"] = Writer(uri, 1, tmp_path, keep_last=1).take()
        return real_put(key, data)
    storage.put_bytes = b_takes_over_before_the_manifest_lands
    with pytest.raises(WriterFenced, match="move latest"):
        a.store.commit(zombie_tag, 12, 1, attempt="0")     # the manifest landed; `latest` is refused
    storage.put_bytes = real_put
    b = took_over["b"].restore()
    assert b.state == [[0, 10]]                              # not the zombie's 12
    b15, b20 = b.commit(15), b.commit(20)
    assert b.store.latest_tag() == b20 and b.store.storage.exists(f"checkpoints/{b20}/manifest.json")
    assert zombie_tag not in b.store.committed()            # B's retention removed the dead branch
    assert b15 not in b.store.committed()                   # keep_last=1: by B's own retention only
    got = Writer(uri, 2, tmp_path).take().restore()
    assert got.state == [[0, 10], [1, 15], [1, 20]]


def test_a_latest_write_racing_the_new_writer_is_refused_by_compare_and_swap(uri, tmp_path):
    """A passes its fence check, B takes its generation (and claims `latest`), then A writes `latest`:
    the write must fail its If-Match, re-read, and be refused. Without conditional writes the window is
    open (documented in storage/fence.py): B's next commit puts `latest` right."""
    a = Writer(uri, 0, tmp_path).take()
    a.store.mark_resumed(None)
    a.commit(10)
    stale_tag = a.upload(20)
    storage = a.store.storage
    real = storage.get_versioned
    b_holder = {}

    def read_then_b_takes_over(key):
        out = real(key)
        if key.endswith("latest") and "b" not in b_holder:
            b_holder["b"] = Writer(uri, 1, tmp_path).take()    # between A's check/read and A's write
        return out
    storage.get_versioned = read_then_b_takes_over
    if a.store.fence.mechanism == LISTING:
        a.store.commit(stale_tag, 20, 1, attempt="0")      # lands: no compare-and-swap to stop it
        b = b_holder["b"].restore()
        assert b.state[-1] == [0, 20]                       # B reads what A wrote before B's claim...
        storage.get_versioned = real
        return
    with pytest.raises(WriterFenced, match="move latest"):
        a.store.commit(stale_tag, 20, 1, attempt="0")
    storage.get_versioned = real
    b = b_holder["b"]
    assert json.loads(storage.get_bytes("checkpoints/latest"))["writer"] == str(b.store.fence.generation)
    b.restore()
    assert b.state == [[0, 10]]                             # `latest` still A's 10, claimed by B


def test_concurrent_writers_get_distinct_ordered_generations_and_only_the_newest_writes(uri, tmp_path):
    """Six writers take a generation at once. Each gets its own; one superseded while it claimed `latest`
    learns it then (WriterFenced from take); of those that got through, only the newest may write."""
    fences, superseded, errors = {}, [], []

    def take(i):
        try:
            fences[i] = WriterFence.take(open_storage(uri), "checkpoints", attempt=i)
        except WriterFenced as exc:
            superseded.append(exc)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=take, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    listed = [g for g, _ in WriterFence.generations(open_storage(uri), "checkpoints")]
    assert len(listed) == len(set(listed)) == 6
    newest = max(listed)
    assert newest in [f.generation for f in fences.values()]    # nobody can supersede the newest
    assert all(Generation.parse(exc.newest) > Generation.parse(exc.generation) for exc in superseded)
    for f in fences.values():
        if f.generation == newest:
            f.check("commit")
        else:
            with pytest.raises(WriterFenced):
                f.check("commit")
    if fences[next(iter(fences))].mechanism != LISTING:   # numbers taken only where absent; `latest` by CAS
        assert [g.number for g in listed] == list(range(1, 7))
        assert json.loads(open_storage(uri).get_bytes("checkpoints/latest"))["writer"] == str(newest)


def test_the_mechanism_is_detected_per_endpoint(uri):
    fence = WriterFence.take(open_storage(uri), "checkpoints", attempt=0)
    expected = {"local": "local:", "s3": "s3: conditional writes", "s3-unconditional": "listing:"}
    kind = "local" if "://" not in uri else ("s3-unconditional" if "spotfill-plain" in uri else "s3")
    assert fence.mechanism.startswith(expected[kind]), fence.mechanism


def test_each_new_writer_takes_a_higher_number_than_every_writer_it_listed(uri):
    """A writer that takes its generation after another did gets a higher *number*, whatever the mechanism:
    the nonce (listing) only orders writers that raced for the same number."""
    taken = [WriterFence.take(open_storage(uri), "checkpoints", attempt=i) for i in range(3)]
    numbers = [f.generation.number for f in taken]
    assert numbers == sorted(set(numbers)) and numbers[0] >= 1, [str(f.generation) for f in taken]
    assert [f.generation for f in taken] == sorted(f.generation for f in taken)
    for older in taken[:-1]:
        with pytest.raises(WriterFenced):
            older.check("commit")
    taken[-1].check("commit")
