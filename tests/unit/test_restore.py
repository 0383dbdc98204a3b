"""restore_on_workers as a collective, without Ray: ranks are threads, "nodes" are folders, the store a
local directory. Checks the damaged-checkpoint paths (quarantine, fail loudly, opt-in restart) and that
node leaders download at the same time, once per node."""
from __future__ import annotations

import copy
import os
import threading
import time

import pytest

from spotfill.config.errors import NoIntactCheckpoint
from spotfill.storage.base import LocalStorage, open_storage
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.train.restore import restore_on_workers


class _Group:
    def __init__(self, world: int):
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world, timeout=30)

    def exchange(self, rank: int, obj):
        self.slots[rank] = copy.deepcopy(obj)     # like pickling across processes
        self.barrier.wait()
        out = copy.deepcopy(self.slots)
        self.barrier.wait()
        return out


class ThreadComms:
    """The slice of torch.distributed restore_on_workers uses."""

    def __init__(self, group: _Group, rank: int):
        self.group, self.rank, self.dist = group, rank, self

    def bcast(self, obj):
        return self.group.exchange(self.rank, obj)[0]

    def all_gather_object(self, out: list, obj) -> None:
        out[:] = self.group.exchange(self.rank, obj)

    def barrier(self) -> None:
        self.group.exchange(self.rank, None)


def _save(store, root, step: int, world: int = 4, attempt: str = "0") -> str:
    tag = tag_for(step, attempt)
    for rank in range(world):
        d = os.path.join(str(root), f"snap-{step}-{rank}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"zero_pp_rank_{rank}_optim_states.pt"), "wb") as f:
            f.write(bytes([step % 256, rank]) * 2000)
        store.upload_part(tag, rank, world, d, attempt=attempt)
    store.commit(tag, step, world, attempt=attempt)
    return tag


def _flip(storage, key):
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    storage.put_bytes(key, bytes(data))


def _run(uri, tmp_path, nodes, kwargs=None, storages=None):
    """Run restore_on_workers on len(nodes) thread-ranks; rank r sits on node nodes[r] and reads the store
    through `storages[node]` when given (a node's own view of it), else open_storage(uri)."""
    world = len(nodes)
    group, results, events = _Group(world), [None] * world, []

    def body(rank):
        store = CheckpointStore((storages or {}).get(nodes[rank]) or open_storage(uri), keep_last=5)
        node_dir = os.path.join(str(tmp_path), f"node-{nodes[rank]}", "restore")
        emit = (lambda kind, **f: events.append({"kind": kind, **f})) if rank == 0 else None
        try:
            results[rank] = restore_on_workers(store, ThreadComms(group, rank), rank, world, nodes[rank],
                                               node_dir, 2, **(kwargs or {}), **({"emit": emit} if emit else {}))
        except Exception as exc:  # noqa: BLE001 -- the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, events


@pytest.fixture
def uri(tmp_path):
    return str(tmp_path / "store")


def test_damaged_newest_is_quarantined_and_the_previous_restored_on_every_rank(uri, tmp_path):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    good, bad = _save(store, tmp_path, 10), _save(store, tmp_path, 20)
    _flip(store.storage, f"checkpoints/{bad}/rank-3/zero_pp_rank_3_optim_states.pt")
    plans, events = _run(uri, tmp_path, ["a", "a", "b", "b"])
    assert all(not isinstance(p, Exception) for p in plans), plans
    assert {p.tag for p in plans} == {good} and {p.step for p in plans} == {10}
    assert plans[0].quarantined == [(bad, f"{bad}: checksum mismatch in rank-3/zero_pp_rank_3_optim_states.pt")]
    assert [(e["kind"], e.get("tag")) for e in events] == [("checkpoint_quarantined", bad),
                                                          ("checkpoint_restored", good)]
    for node in ("a", "b"):   # each node has the flattened checkpoint
        flat = tmp_path / f"node-{node}" / "restore" / "ds" / good
        assert sorted(os.listdir(flat)) == [f"zero_pp_rank_{r}_optim_states.pt" for r in range(4)]
    assert CheckpointStore(open_storage(uri)).latest_tag() == good
    assert list(CheckpointStore(open_storage(uri)).quarantined()) == [bad]


def test_no_intact_checkpoint_fails_loudly_on_every_rank_by_default(uri, tmp_path):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    tags = [_save(store, tmp_path, s) for s in (10, 20)]
    for tag in tags:
        _flip(store.storage, f"checkpoints/{tag}/rank-0/zero_pp_rank_0_optim_states.pt")
    results, events = _run(uri, tmp_path, ["a", "b"])
    assert all(isinstance(r, NoIntactCheckpoint) for r in results), results
    msg = str(results[0])
    assert "\n" not in msg and all(t in msg for t in tags) and "on_no_intact_checkpoint" in msg
    assert sorted(e["tag"] for e in events if e["kind"] == "checkpoint_quarantined") == sorted(tags)


def test_no_intact_checkpoint_restart_is_opt_in_and_recorded(uri, tmp_path):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    tag = _save(store, tmp_path, 10)
    store.storage.delete(f"checkpoints/{tag}/rank-1/zero_pp_rank_1_optim_states.pt")
    plans, events = _run(uri, tmp_path, ["a", "b"], {"on_no_intact": "restart"})
    assert all(p.tag is None and p.fresh_start_cause for p in plans), plans
    fresh = [e for e in events if e["kind"] == "fresh_start"]
    assert len(fresh) == 1 and fresh[0]["damaged"] == [tag] and tag in fresh[0]["cause"]
    assert CheckpointStore(open_storage(uri)).latest_tag() is None


def test_empty_store_is_a_plain_fresh_start(uri, tmp_path):
    plans, events = _run(uri, tmp_path, ["a", "b"])
    assert all(p.tag is None and p.fresh_start_cause is None for p in plans) and events == []


def test_node_leaders_download_in_parallel_once_per_node(uri, tmp_path, monkeypatch):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    tag = _save(store, tmp_path, 10)
    spans, lock = [], threading.Lock()
    real = CheckpointStore.download

    def slow_download(self, manifest, local_dir, verify=True, want=None, **kwargs):
        t0 = time.monotonic()
        time.sleep(0.5)
        out = real(self, manifest, local_dir, verify, want, **kwargs)
        with lock:
            spans.append((local_dir, t0, time.monotonic()))
        return out
    monkeypatch.setattr(CheckpointStore, "download", slow_download)
    t0 = time.monotonic()
    plans, _ = _run(uri, tmp_path, ["a", "a", "b", "b"])
    assert {p.tag for p in plans} == {tag}
    assert sorted(os.path.basename(os.path.dirname(d)) for d, _, _ in spans) == ["node-a", "node-b"]
    (_, s1, e1), (_, s2, e2) = spans
    assert max(s1, s2) < min(e1, e2), "the two nodes' downloads did not overlap"
    assert time.monotonic() - t0 < 0.95
    assert plans[0].timings["nodes"] == 2


def test_on_no_intact_checkpoint_is_validated_in_one_line():
    from spotfill.config.errors import ConfigError
    from spotfill.config.job import JobConfig, from_mapping

    base = {"storage": "/tmp/s", "data": {"path": "/tmp/d"}}
    assert from_mapping(JobConfig, base).training.on_no_intact_checkpoint == "fail"
    ok = from_mapping(JobConfig, {**base, "training": {"on_no_intact_checkpoint": "restart"}})
    assert ok.training.on_no_intact_checkpoint == "restart"
    with pytest.raises(ConfigError) as err:
        from_mapping(JobConfig, {**base, "training": {"on_no_intact_checkpoint": "ignore"}})
    assert str(err.value) == "training.on_no_intact_checkpoint: bad value 'ignore'; accepted: fail, restart"


def test_unreadable_manifest_is_quarantined_and_reported(uri, tmp_path):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    good, bad = _save(store, tmp_path, 10), _save(store, tmp_path, 20)
    store.storage.put_bytes(f"checkpoints/{bad}/manifest.json", b"{not json")
    plans, events = _run(uri, tmp_path, ["a", "a", "b", "b"])
    assert {p.tag for p in plans} == {good}
    q = [e for e in events if e["kind"] == "checkpoint_quarantined"]
    assert [e["tag"] for e in q] == [bad] and "unreadable manifest" in q[0]["reason"]


def test_a_failed_conversion_is_raised_on_every_rank_not_waited_for(uri, tmp_path, monkeypatch):
    import spotfill.train.restore as restore

    def broken(*args, **kwargs):
        raise RuntimeError("ds_to_universal failed (1): boom")
    monkeypatch.setattr(restore, "convert_to_universal", broken)
    store = CheckpointStore(open_storage(uri), keep_last=5)
    tag = _save(store, tmp_path, 10)          # saved on 4 ranks, restored on 2: universal
    t0 = time.monotonic()
    results, _ = _run(uri, tmp_path, ["a", "b"])
    assert time.monotonic() - t0 < 10
    assert all(isinstance(r, RuntimeError) and "boom" in str(r) and tag in str(r) for r in results), results
    assert CheckpointStore(open_storage(uri)).quarantined() == {}     # not damage: nothing quarantined


def test_a_reader_of_a_live_store_never_moves_latest(tmp_path):
    """Serving loads the newest checkpoint while training commits. A reader that listed the store before
    training's next commit restored the older tag and (as training's restore does) marked it resumed:
    `latest` went back under the live run, and training's next restore after a node loss rolled back
    137 steps (seen in the fill-in scenario test). Readers restore with resume=False."""
    from spotfill.fillin.generate import load_newest  # noqa: F401 - the reader this guards

    uri = str(tmp_path / "store")
    writer = CheckpointStore(open_storage(uri), keep_last=5)
    _save(writer, tmp_path, 10)
    reader = CheckpointStore(open_storage(uri), keep_last=5)
    listed_before_the_commit = reader.restore_candidates()
    _save(writer, tmp_path, 20)
    assert writer.latest_tag() == tag_for(20, "0")

    reader.restore_candidates = lambda: listed_before_the_commit   # the race, made deterministic
    got = reader.restore(str(tmp_path / "r1"), resume=False)
    assert got["tag"] == tag_for(10, "0") and writer.latest_tag() == tag_for(20, "0")
    # what training's restore does with the same stale listing (and what serving used to do)
    reader.restore(str(tmp_path / "r2"))
    assert writer.latest_tag() == tag_for(10, "0")


def test_serving_loads_without_resuming(tmp_path, monkeypatch):
    from spotfill.fillin import generate

    seen = {}

    class Store:
        def latest_tag(self):
            return "step-00000010-a0"

        def restore(self, work_dir, **kwargs):
            seen.update(kwargs)
            return None

    assert generate.load_newest(Store(), str(tmp_path)) is None
    assert seen == {"resume": False}


class FlakyLocalDisk(LocalStorage):
    """A store whose objects are intact, read onto a node whose disk damages what it writes: the first
    `bad_writes` downloads of `name` land with one byte flipped (a fault of this node, not of storage)."""

    def __init__(self, root, name: str, bad_writes: int):
        super().__init__(root)
        self.name, self.bad_writes, self.lock = name, bad_writes, threading.Lock()

    def _move_many(self, items, upload):
        super()._move_many(items, upload)
        for local, key, _ in items if not upload else []:
            with self.lock:
                if not key.endswith(self.name) or self.bad_writes <= 0:
                    continue
                self.bad_writes -= 1
            with open(local, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))


def test_a_local_disk_error_is_retried_from_storage_and_never_quarantines(uri, tmp_path):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    tag = _save(store, tmp_path, 10)
    name = "zero_pp_rank_2_optim_states.pt"
    flaky = {"b": FlakyLocalDisk(uri, name, bad_writes=1)}       # node b's disk, once
    plans, events = _run(uri, tmp_path, ["a", "a", "b", "b"], storages=flaky)
    assert all(not isinstance(p, Exception) for p in plans), plans
    assert {p.tag for p in plans} == {tag}
    assert CheckpointStore(open_storage(uri)).quarantined() == {}
    assert not [e for e in events if e["kind"] == "checkpoint_quarantined"]
    local = [e for e in events if e["kind"] == "checkpoint_local_error"]
    assert [(e["file"], e["recovered"]) for e in local] == [(f"rank-2/{name}", True)], local
    flat = tmp_path / "node-b" / "restore" / "ds" / tag / name
    assert flat.read_bytes() == open_storage(uri).get_bytes(f"checkpoints/{tag}/rank-2/{name}")


def test_a_local_disk_that_keeps_failing_fails_the_restore_without_quarantining(uri, tmp_path):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    tag = _save(store, tmp_path, 10)
    flaky = {"b": FlakyLocalDisk(uri, "zero_pp_rank_3_optim_states.pt", bad_writes=100)}
    results, events = _run(uri, tmp_path, ["a", "b", "b", "b"], storages=flaky)
    assert all(isinstance(r, RuntimeError) and "not the checkpoint" in str(r) for r in results), results
    assert CheckpointStore(open_storage(uri)).quarantined() == {}
    assert not [e for e in events if e["kind"] == "checkpoint_quarantined"]
    # the failed node's fetch report reaches the events: two faults got past, then the one it gave up on
    local = [e for e in events if e["kind"] == "checkpoint_local_error"]
    name = "rank-3/zero_pp_rank_3_optim_states.pt"
    assert [(e["node"], e["file"], e["recovered"]) for e in local] == \
        [("b", name, True), ("b", name, True), ("b", name, False)], local
    assert all(e["tag"] == tag and "checksum" in e["detail"] for e in local), local


def test_damage_in_storage_itself_is_still_quarantined_for_every_node(uri, tmp_path):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    good, bad = _save(store, tmp_path, 10), _save(store, tmp_path, 20)
    _flip(store.storage, f"checkpoints/{bad}/rank-1/zero_pp_rank_1_optim_states.pt")
    flaky = {"a": FlakyLocalDisk(uri, "zero_pp_rank_0_optim_states.pt", bad_writes=1)}
    plans, events = _run(uri, tmp_path, ["a", "a", "b", "b"], storages=flaky)
    assert {p.tag for p in plans} == {good}
    assert list(CheckpointStore(open_storage(uri)).quarantined()) == [bad]


def _save_ds(store, root, step: int, world: int, attempt: str = "0") -> str:
    """A checkpoint laid out as DeepSpeed saves ZeRO-1/2: rank 0 also writes the model states file."""
    tag = tag_for(step, attempt)
    for rank in range(world):
        d = os.path.join(str(root), f"ds-{step}-{rank}")
        os.makedirs(d, exist_ok=True)
        names = [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] + (["mp_rank_00_model_states.pt"] if rank == 0 else [])
        for name in names:
            with open(os.path.join(d, name), "wb") as f:
                f.write(bytes([step % 256, rank, len(name)]) * (3000 + 1000 * rank))
        store.upload_part(tag, rank, world, d, attempt=attempt)
    store.commit(tag, step, world, attempt=attempt, meta={"zero_elastic": True})
    return tag


def _sizes(store, tag) -> dict[str, int]:
    return {rel: info["size"] for rel, info in store.manifest(tag)["files"].items()}


def test_each_node_reads_only_what_its_ranks_load_and_says_so(uri, tmp_path):
    store = CheckpointStore(open_storage(uri), keep_last=5)
    tag = _save_ds(store, tmp_path, 10, world=4)
    size = _sizes(store, tag)
    plans, events = _run(uri, tmp_path, ["a", "a", "b", "b"])     # the saved size: each rank its own part
    assert {p.tag for p in plans} == {tag}
    model = "rank-0/mp_rank_00_model_states.pt"
    want = {"a": [model, *(f"rank-{r}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))],
            "b": [model, *(f"rank-{r}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (2, 3))]}
    for node, rels in want.items():
        flat = tmp_path / f"node-{node}" / "restore" / "ds" / tag
        assert sorted(os.listdir(flat)) == sorted(r.split("/")[1] for r in rels)
    reads = {r["node"]: r for r in next(e for e in events if e["kind"] == "checkpoint_restored")["reads"]}
    assert {n: (r["bytes_storage"], r["bytes_local"]) for n, r in reads.items()} == \
        {n: (sum(size[r] for r in rels), 0) for n, rels in want.items()}
    assert sum(r["bytes_storage"] for r in reads.values()) < 2 * sum(size.values())   # was 2x everything

    plans, events = _run(uri, tmp_path, ["a", "b"])                # another size: every partition merges
    reads = next(e for e in events if e["kind"] == "checkpoint_restored")["reads"]
    assert [r["bytes_storage"] for r in reads] == [sum(size.values())] * 2


def test_where_deepspeed_names_its_files_otherwise_every_node_brings_everything(uri, tmp_path, monkeypatch):
    """Hook restore_node_files off (the installed DeepSpeed does not build its checkpoint file names as
    0.19 does): the restore cannot tell whose partition a file holds, so every node brings every file."""
    from spotfill.ray_compat import catalog, hooks

    store = CheckpointStore(open_storage(uri), keep_last=5)
    tag = _save_ds(store, tmp_path, 10, world=4)
    size = _sizes(store, tag)
    renamed = lambda rel: (f"/x/{rel}", "def _get_ckpt_name(self):\n    return 'zero_rank_{}'\n")  # noqa: E731
    monkeypatch.setattr(catalog, "deepspeed_source", renamed)
    monkeypatch.delitem(hooks._problems, "restore_node_files", raising=False)
    try:
        plans, events = _run(uri, tmp_path, ["a", "a", "b", "b"])
    finally:
        hooks._problems.pop("restore_node_files", None)       # the next check reads the real DeepSpeed
        hooks._announced.discard("restore_node_files")
    assert {p.tag for p in plans} == {tag}
    reads = next(e for e in events if e["kind"] == "checkpoint_restored")["reads"]
    assert sorted((r["node"], r["bytes_storage"]) for r in reads) == [("a", sum(size.values())),
                                                                       ("b", sum(size.values()))]
    for node in "ab":
        assert len(os.listdir(tmp_path / f"node-{node}" / "restore" / "ds" / tag)) == len(size)


def test_a_node_reads_its_own_kept_snapshot_where_it_matches_the_manifest(uri, tmp_path):
    from spotfill.train.checkpointing import snapshot_roots

    store = CheckpointStore(open_storage(uri), keep_last=5)
    tag = _save_ds(store, tmp_path, 10, world=2)
    size = _sizes(store, tag)
    local_root = tmp_path / "node-a"
    # what the Checkpointer keeps after its upload: rank r's files under its snapshot root, in <tag>/
    for rank in (0, 1):
        kept = os.path.join(snapshot_roots(str(local_root), rank)[0], tag)
        os.makedirs(kept)
        for name in os.listdir(tmp_path / f"ds-10-{rank}"):
            data = (tmp_path / f"ds-10-{rank}" / name).read_bytes()
            if rank == 1:       # a stale or damaged local copy: it must not be used
                data = data[:-1] + bytes([data[-1] ^ 1])
            with open(os.path.join(kept, name), "wb") as f:
                f.write(data)
    plans, events = _run(uri, tmp_path, ["a", "a"], {"local_root": str(local_root)})
    assert {p.tag for p in plans} == {tag}
    read, = next(e for e in events if e["kind"] == "checkpoint_restored")["reads"]
    rank0 = sum(v for k, v in size.items() if k.startswith("rank-0/"))
    assert (read["bytes_local"], read["bytes_storage"]) == (rank0, sum(size.values()) - rank0)
    assert (read["files_local"], read["files_storage"]) == (2, 1)
    flat = tmp_path / "node-a" / "restore" / "ds" / tag
    for rel in size:
        assert (flat / rel.split("/")[1]).read_bytes() == store.storage.get_bytes(f"checkpoints/{tag}/{rel}")
