"""Checkpoint lineage (storage/lineage.py): hand-built manifests, expected values worked out by hand."""
from __future__ import annotations

import pytest

from spotfill.storage.checkpoint_store import next_attempt, parse_tag, tag_for, tag_key
from spotfill.storage.lineage import build_lineage

_NO = object()


def m(tag, step, created, attempt=None, parent=_NO):
    out = {"tag": tag, "step": step, "created": created, "meta": {} if attempt is None else {"attempt": attempt}}
    if parent is not _NO:
        out["parent"] = parent
    return out


def ms(*items):
    return {x["tag"]: x for x in items}


# A run: attempt 0 commits 10, 20, 40; 40 is damaged; attempt 1 resumes from 20 and commits 25.
RESUMED_PAST_DAMAGE = ms(m("s10", 10, 1.0, "0", None), m("s20", 20, 2.0, "0", "s10"),
                         m("s40", 40, 3.0, "0", "s20"), m("s25", 25, 4.0, "1", "s20"))
# The same run written before manifests had `parent` (legacy): parents come from attempts and resumes.
LEGACY = ms(m("s10", 10, 1.0, "0"), m("s20", 20, 2.0, "0"), m("s40", 40, 3.0, "0"), m("s25", 25, 4.0, "1"))
# attempt 1 started fresh (restart policy) after everything was damaged, then committed 5 and 10b
FRESH = ms(m("s10", 10, 1.0, "0", None), m("s20", 20, 2.0, "0", "s10"),
           m("s05", 5, 3.0, "1", None), m("s10b", 10, 4.0, "1", "s05"))
# a superseded attempt committed 30 after attempt 2 resumed from 20 (a dead branch)
DEAD_BRANCH = ms(m("s10", 10, 1.0, "0", None), m("s20", 20, 2.0, "0", "s10"),
                 m("s30", 30, 5.0, "0", "s20"), m("s22", 22, 6.0, "2", "s20"))

CASES = [
    # id, manifests, quarantined, head, resumes, expected live, newest intact, deletable(1), deletable(2)
    ("linear, no damage", ms(m("s10", 10, 1.0, "0", None), m("s20", 20, 2.0, "0", "s10"),
                             m("s30", 30, 3.0, "0", "s20")), {}, "s30", [],
     ("s30", "s20", "s10"), "s30", ("s20", "s10"), ("s10",)),
    ("resumed past damaged 40, head given", RESUMED_PAST_DAMAGE, {"s40": "checksum"}, "s25", [],
     ("s25", "s20", "s10"), "s25", ("s20", "s10"), ("s10",)),
    ("resumed past damaged 40, latest still at 40", RESUMED_PAST_DAMAGE, {"s40": "checksum"}, "s40", [],
     ("s25", "s20", "s10"), "s25", ("s20", "s10"), ("s10",)),
    ("legacy manifests + resume events", LEGACY, {"s40": "checksum"}, None,
     [{"attempt": "0", "from_tag": None}, {"attempt": "1", "from_tag": "s20"}],
     ("s25", "s20", "s10"), "s25", ("s20", "s10"), ("s10",)),
    ("restore time: head damaged, parent next", RESUMED_PAST_DAMAGE, {"s40": "x", "s25": "y"}, "s25", [],
     ("s25", "s20", "s10"), "s20", ("s40", "s10"), ()),
    ("damaged head: walk its chain, not a newer dead branch", DEAD_BRANCH, {"s22": "x"}, "s22", [],
     ("s22", "s20", "s10"), "s20", ("s30", "s10"), ("s30",)),
    ("fresh start after total damage", FRESH, {"s10": "a", "s20": "b"}, "s10b", [],
     ("s10b", "s05"), "s10b", ("s05", "s10"), ()),
    ("dead branch of a superseded attempt", DEAD_BRANCH, {}, "s22", [],
     ("s22", "s20", "s10"), "s22", ("s30", "s20", "s10"), ("s30", "s10")),
    ("nothing committed", {}, {}, None, [], (), None, (), ()),
]


@pytest.mark.parametrize("manifests,quarantined,head,resumes,live,newest,del1,del2",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_lineage_table(manifests, quarantined, head, resumes, live, newest, del1, del2):
    lin = build_lineage(manifests, quarantined, head, resumes)
    assert lin.live == live
    assert lin.newest_intact == newest
    assert lin.restore_order == tuple(t for t in live if t not in quarantined)
    assert set(lin.deletable(1)) == set(del1)
    assert set(lin.deletable(2)) == set(del2)
    assert lin.deletable(0) == ()
    if newest:
        assert newest not in lin.deletable(1)   # retention never deletes the newest intact live one


def test_quarantined_listed_newest_first_and_kept_up_to_keep_last():
    lin = build_lineage(FRESH, {"s10": "bad a", "s20": "bad b"}, "s10b")
    assert lin.quarantined == (("s20", "bad b"), ("s10", "bad a"))
    assert "s20" not in lin.deletable(1) and "s10" in lin.deletable(1)


def test_head_from_the_last_resume_when_no_pointer():
    # attempt 1 resumed from s20 and has committed nothing yet: the live head is s20, not the newer s40
    lin = build_lineage(LEGACY, {}, None, [{"attempt": "0", "from_tag": None}, {"attempt": "1", "from_tag": "s20"}])
    assert lin.live[:2] == ("s25", "s20")
    only = {t: v for t, v in LEGACY.items() if t != "s25"}
    lin = build_lineage(only, {}, None, [{"attempt": "1", "from_tag": "s20"}])
    assert lin.head == "s20" and lin.live == ("s20", "s10")


@pytest.mark.parametrize("step,attempt,tag,parsed", [
    (120, None, "step-00000120", (120, None)),
    (120, 3, "step-00000120-a3", (120, "3")),
    (7, "run/2", "step-00000007-arun_2", (7, "run_2")),
])
def test_tag_for_is_unique_per_attempt_and_parseable(step, attempt, tag, parsed):
    assert tag_for(step, attempt) == tag
    assert parse_tag(tag) == parsed
    assert tag_key(tag)[0] == step


def test_tags_sort_by_step_then_attempt():
    tags = ["step-00000120-a3", "step-00000020-a9", "step-00000120", "step-00000040-a1"]
    assert sorted(tags, key=tag_key) == ["step-00000020-a9", "step-00000040-a1", "step-00000120",
                                         "step-00000120-a3"]


@pytest.mark.parametrize("tags,first", [
    ([], 0),
    (["step-00000020", "step-00000040"], 0),                          # tags without attempt numbers
    (["step-00000020-a0", "step-00000040-a2", "step-00000030-a11"], 12),  # numeric, not text, order
    (["step-00000020-arun_2", "step-00000020-a1", "latest-notes"], 2),
])
def test_a_new_run_numbers_its_attempts_past_the_stores(tags, first):
    assert next_attempt(tags) == first
    assert not {tag_for(20, first), tag_for(40, first)} & set(tags)


# -- several writers on one store: truth from the training states, not from the lineage code -----------------
# Each simulated writer (a training attempt's rank 0) carries its training state as the list of (attempt,
# step) it went through and writes it into every checkpoint it commits; a restore reads it back. So what
# the store hands the next attempt can be checked against the writer that really produced it. Writers
# interleave at random: new attempts take over (a generation, a restore), and earlier ones -- zombies that
# outlived their group -- keep committing, moving `latest`, quarantining and running retention.
import json  # noqa: E402
import os  # noqa: E402

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from spotfill.config.errors import WriterFenced  # noqa: E402
from spotfill.storage.base import open_storage  # noqa: E402
from spotfill.storage.checkpoint_store import CheckpointStore  # noqa: E402

KEEP = 2


class SimWriter:
    def __init__(self, root: str, attempt: int):
        self.store = CheckpointStore(open_storage(os.path.join(root, "store")), keep_last=KEEP)
        self.root, self.attempt, self.state, self.step = root, attempt, [], 0
        self.commits: list[tuple[str, list]] = []      # (tag, state) of the commits the store accepted

    def take_over(self) -> None:
        self.store.take_generation(attempt=self.attempt)
        got = self.store.restore(os.path.join(self.root, f"restore-{self.attempt}"))
        if got is not None:
            with open(os.path.join(got["path"], "rank-0", "state.json")) as f:
                self.state = json.load(f)
            self.step = self.state[-1][1]
        else:
            self.store.mark_resumed(None)

    def commit(self) -> None:
        self.step += 1
        tag = tag_for(self.step, self.attempt)
        snap = os.path.join(self.root, f"snap-{tag}")
        os.makedirs(snap, exist_ok=True)
        state = self.state + [[self.attempt, self.step]]
        with open(os.path.join(snap, "state.json"), "w") as f:
            json.dump(state, f)
        self.store.upload_part(tag, 0, 1, snap, attempt=str(self.attempt))
        self.store.commit(tag, self.step, 1, attempt=str(self.attempt), meta={"attempt": str(self.attempt)})
        self.state = state
        self.commits.append((tag, state))


OPS = st.lists(st.tuples(st.sampled_from(["commit", "take_over", "latest", "quarantine", "retention"]),
                         st.integers(0, 3)), min_size=4, max_size=24)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_whatever_zombies_do_the_store_hands_on_the_live_writers_state(tmp_path_factory, ops):
    root = str(tmp_path_factory.mktemp("writers"))
    writers = [SimWriter(root, 0)]
    writers[0].take_over()
    for op, pick in ops:
        live = writers[-1]
        w = writers[pick % len(writers)]
        if w is live and op in ("latest", "quarantine", "retention"):
            continue      # the live writer only commits (its retention runs in commit), as training does
        try:
            if op == "take_over":
                writers.append(SimWriter(root, len(writers)))
                writers[-1].take_over()
            elif op == "commit":
                w.commit()
            elif op == "latest" and w.commits:
                w.store.mark_resumed(w.commits[0][0], 1)          # roll `latest` back to its oldest
            elif op == "quarantine" and live.commits:
                w.store.quarantine(live.commits[-1][0], "a zombie thinks it is damaged")
            elif op == "retention" and w.commits:
                w.store.cleanup(w.store.lineage(head=w.commits[-1][0]))
        except WriterFenced:
            assert w is not writers[-1], "the newest writer was refused"
        live = writers[-1]
        # every write a stale writer tried was refused: only the live writer changed the store since it
        # took over, so its newest commits are all there and `latest` is its newest
        assert not live.store.quarantined()
        if live.commits:
            for tag, state in live.commits[-KEEP:]:
                assert live.store.storage.exists(f"checkpoints/{tag}/manifest.json"), (tag, ops)
            assert live.store.latest_tag() == live.commits[-1][0]
    # the next attempt resumes from exactly the live writer's training state
    nxt = SimWriter(root, len(writers))
    nxt.take_over()
    assert nxt.state == writers[-1].state, ops
    if writers[-1].state:   # and the lineage the store reports is that state's own history
        chain = nxt.store.lineage().live
        steps = [(a, s) for a, s in writers[-1].state]
        assert [parse_tag(t) for t in chain] == [(s, str(a)) for a, s in reversed(steps)][:len(chain)]
