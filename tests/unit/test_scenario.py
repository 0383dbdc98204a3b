"""Scenario files: parsing, one-line errors, and the chaos generator (pure)."""
from __future__ import annotations

import pytest

from spotfill.config.errors import ConfigError
from spotfill.sim.scenario import DEFAULT_SCENARIO, chaos_scenario, parse_scenario, pick_node


def test_default_scenario_parses():
    s = parse_scenario(DEFAULT_SCENARIO)
    assert [e.action for e in s.events] == ["drain_node", "add_node", "kill_node"]
    assert not s.needs_controlled_storage()


@pytest.mark.parametrize("events, field", [
    ([{"at_step": 3, "action": "explode"}], "events[0].action"),
    ([{"at_step": 3, "action": "kill_node"}], "events[0].node"),
    ([{"at_step": 3, "at": 2, "action": "add_node"}], "events[0]"),
    ([{"at_step": 3, "action": "kill_node", "node": 7}], "events[0].node"),
    ([{"at_step": 3, "action": "drain_node", "node": 0, "deadline": 5}], "events[0].deadline"),
    ([{"at_step": -1, "action": "add_node"}], "events[0].at_step"),
    ([{"at_step": 3, "action": "kill_node", "node": "busiest"}], "events[0].node"),
    # a pick reads the arbiter's view: without fill-in there is none
    ([{"at_step": 3, "action": "kill_node", "node": "most_training"}], "events[0].node"),
])
def test_bad_events_name_the_field(events, field):
    with pytest.raises(ConfigError) as err:
        parse_scenario({"events": events})
    assert str(err.value).startswith(field)
    assert "\n" not in str(err.value)


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match="^clusterr: unknown key"):
        parse_scenario({"clusterr": {}})


def test_serve_fillin_parses_with_defaults():
    s = parse_scenario({"fillin": {"serve": {"enabled": True}}})
    assert s.fillin.serve_enabled and s.fillin.serve == {"enabled": True, "load_rps": 2.0, "max_replicas": None,
                                                                "launch_nodes": False, "floor_replicas": 0,
                                                                "standby_per_node": 1}
    assert not parse_scenario({}).fillin.serve_enabled
    assert parse_scenario(DEFAULT_SCENARIO).fillin.serve["load_rps"] == 2


def test_batch_fillin_and_reclaim_order_parse_with_defaults():
    s = parse_scenario({"fillin": {"batch": {"enabled": True, "rows": 64}}})
    assert s.fillin.batch_enabled and s.fillin.batch == {"enabled": True, "rows": 64, "prompts": 16,
                                                         "max_units": None, "standby_per_node": 1}
    assert s.fillin.reclaim_order == ["sweep", "batch", "serve"]
    assert not parse_scenario({}).fillin.batch_enabled
    s = parse_scenario({"fillin": {"reclaim_order": ["batch", "sweep", "serve"]}})
    assert s.fillin.reclaim_order == ["batch", "sweep", "serve"]
    assert s.fillin.turn_s is None and s.fillin.require_resumes is False
    s = parse_scenario({"fillin": {"turn_s": 45, "require_resumes": True}})
    assert s.fillin.turn_s == 45 and s.fillin.require_resumes is True


@pytest.mark.parametrize("fillin, field", [
    ({"batch": {"enabled": True, "rows": -1}}, "fillin.batch.rows"),
    ({"batch": {"enabled": True, "rows": 0, "prompts": 0}}, "fillin.batch.rows"),
    ({"batch": {"enabled": "yes"}}, "fillin.batch.enabled"),
    ({"batch": {"enabled": True, "row": 5}}, "fillin.batch.row"),
    ({"batch": {"enabled": True, "max_units": 0}}, "fillin.batch.max_units"),
    ({"batch": {"enabled": True, "standby_per_node": -1}}, "fillin.batch.standby_per_node"),
    ({"batch": []}, "fillin.batch"),
    ({"reclaim_order": ["serve", "batch"]}, "fillin.reclaim_order"),
    ({"reclaim_order": ["serve", "batch", "batch"]}, "fillin.reclaim_order"),
    ({"reclaim_order": "serve,batch,sweep"}, "fillin.reclaim_order"),
    ({"turn_s": 0}, "fillin.turn_s"),
    ({"turn_s": -30}, "fillin.turn_s"),
    ({"turn_s": "40s"}, "fillin.turn_s"),
    ({"turn_s": True}, "fillin.turn_s"),
    ({"require_resumes": "yes"}, "fillin.require_resumes"),
])
def test_bad_batch_fillin_or_reclaim_order_names_the_field(fillin, field):
    with pytest.raises(ConfigError) as err:
        parse_scenario({"fillin": fillin})
    assert str(err.value).startswith(field + ":") and "\n" not in str(err.value)


@pytest.mark.parametrize("serve, field", [
    ({"enabled": True, "load_rps": -1}, "fillin.serve.load_rps"),
    ({"enabled": True, "launch_nodes": "yes"}, "fillin.serve.launch_nodes"),
    ({"enabled": True, "load_rps": "fast"}, "fillin.serve.load_rps"),
    ({"enabled": "yes"}, "fillin.serve.enabled"),
    ({"enabled": True, "max_replicas": 0}, "fillin.serve.max_replicas"),
    ({"enabled": True, "rps": 3}, "fillin.serve.rps"),
])
def test_bad_serve_fillin_names_the_field(serve, field):
    with pytest.raises(ConfigError) as err:
        parse_scenario({"fillin": {"serve": serve}})
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


@pytest.mark.parametrize("seed", range(30))
def test_chaos_scenarios_are_valid_and_keep_a_node(seed):
    data = chaos_scenario(seed)
    s = parse_scenario(data)
    alive = set(range(len(data["cluster"]["nodes"])))
    nxt = len(alive)
    for e in s.events:
        if e.action == "add_node":
            alive.add(nxt)
            nxt += 1
        elif e.action in ("drain_node", "kill_node"):
            assert e.node in alive
            alive.discard(e.node)
        assert alive, "a chaos timeline must keep at least one node"
    assert chaos_scenario(seed) == data


def test_serve_reads_the_runs_own_checkpoints():
    from spotfill.sim.runner import run_storage_uri
    assert run_storage_uri("/runs/demo/storage", "demo") == "file:///runs/demo/storage/demo"
    assert run_storage_uri("s3://bucket/pre/", "demo") == "s3://bucket/pre/demo"
    assert run_storage_uri("s3://b/p?endpoint_override=http%3A//127.0.0.1%3A9000", "x") == \
        "s3://b/p/x?endpoint_override=http%3A//127.0.0.1%3A9000"


def test_node_picks_parse_with_fillin_and_describe_what_they_pick():
    sc = parse_scenario({**DEFAULT_SCENARIO, "events": [
        {"at_step": 5, "action": "kill_node", "node": "most_training"},
        {"at_step": 9, "action": "drain_node", "node": "most_lent", "deadline_s": 15}]})
    kill, drain = sc.events
    assert (kill.node, drain.node) == ("most_training", "most_lent")
    assert kill.describe() == "kill the node training uses most at step 5"
    from dataclasses import replace
    assert replace(drain, node=2, picked="most_lent").describe() == \
        "drain node 2 (the node fill-in uses most) (deadline 15s) at step 9"


def test_pick_node_follows_who_holds_the_gpus():
    ids = ["a", "b", "c", None]                       # index 3: launched, id not known yet
    owners = {"a": {"total": 3, "idle": 0, "training": 1, "reclaiming": 0, "serve": 1, "sweep": 1},
              "b": {"total": 3, "idle": 0, "training": 3, "reclaiming": 0},
              "c": {"total": 3, "idle": 1, "training": 0, "reclaiming": 2}}
    alive = lambda i: True                            # noqa: E731
    assert pick_node("most_training", owners, ids, alive) == 1
    assert pick_node("most_lent", owners, ids, alive) == 0            # 2 lent; c's 2 reclaiming tie: lower index
    assert pick_node("most_lent", owners, ids, lambda i: i != 0) == 2   # a dead: c, whose GPUs are still lent
    assert pick_node("most_training", owners, ids, lambda i: i != 1) == 0
    assert pick_node("most_lent", {"b": owners["b"]}, ids, alive) is None   # nothing lent anywhere
    assert pick_node("most_training", {}, ids, alive) is None              # no view of the cluster


def test_freeze_node_parses_on_listed_nodes_and_is_refused_with_an_autoscaler():
    s = parse_scenario({"events": [{"at_step": 5, "action": "freeze_node", "node": 1}]})
    (e,) = s.events
    assert e.action == "freeze_node" and e.node == 1
    assert e.describe() == "freeze node 1 (SIGSTOP, no TCP reset) at step 5"
    with pytest.raises(ConfigError) as err:
        parse_scenario({"events": [{"at_step": 5, "action": "freeze_node"}]})
    assert str(err.value).startswith("events[0].node")
    with pytest.raises(ConfigError) as err:
        parse_scenario({"cluster": {"autoscaler": {"node_types": {"g": {"gpus": 2, "max_workers": 1}}}},
                        "events": [{"at_step": 5, "action": "freeze_node", "node": 0}]})
    msg = str(err.value)
    assert msg.startswith("events[0].action: ") and "'freeze_node'" in msg and "cluster.autoscaler" in msg
    assert "\n" not in msg


def test_swap_shards_parses_with_default_shards_and_describes_them():
    s = parse_scenario({"events": [{"at_step": 4, "action": "swap_shards"},
                                   {"at_step": 5, "action": "swap_shards", "shards": [2, 0]}]})
    assert [e.shards for e in s.events] == [(0, 1), (2, 0)]
    assert s.events[1].describe() == "swap the contents of data shards 2 and 0 at step 5"


@pytest.mark.parametrize("shards", [[1], [0, 0], [0, -1], [0, "1"], [True, 1], "0,1", [0, 1, 2]])
def test_bad_swap_shards_fields_name_the_field(shards):
    with pytest.raises(ConfigError) as err:
        parse_scenario({"events": [{"at_step": 4, "action": "swap_shards", "shards": shards}]})
    assert str(err.value).startswith("events[0].shards: bad value") and "two different shard indices" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^events\[0\].node: unknown key for swap_shards"):
        parse_scenario({"events": [{"at_step": 4, "action": "swap_shards", "node": 1}]})


def test_swap_shards_beyond_the_prepared_dataset_is_refused_once_the_data_is_known():
    from spotfill.sim.data_faults import check_shard_refs

    events = parse_scenario({"events": [{"at_step": 4, "action": "swap_shards", "shards": [1, 2]}]}).events
    check_shard_refs(events, {"shards": [{}, {}, {}]})
    with pytest.raises(ConfigError, match=r"^events\[0\].shards: the prepared dataset has 2 shards \(got \[1, 2\]\); "
                                          r"accepted: two different indices in 0..1$"):
        check_shard_refs(events, {"shards": [{}, {}]})


def test_swap_shards_exchanges_two_shards_in_storage_and_the_reader_names_the_swap(tmp_path):
    import numpy as np

    from spotfill.config.errors import DataMismatch
    from spotfill.sim.data_faults import swap_outcome, swap_shards
    from spotfill.storage.base import open_storage
    from spotfill.train.data import ShardReader, ShardWriter

    storage = open_storage(str(tmp_path / "ds"))
    w = ShardWriter(storage, 4, 257, "bytes", rows_per_shard=4)
    w.add(np.arange(10 * 5).reshape(10, 5) % 257)
    w.close()
    said: list[str] = []
    out = swap_shards(str(tmp_path / "ds"), (0, 2), said.append)
    assert out["shards"] == ["shard-00000.npy", "shard-00002.npy"] and said
    with pytest.raises(DataMismatch, match=r"^data shard shard-00000.npy in .* \(it holds rows 8..9, "
                                           r"shard-00002.npy's by the manifest; sha256"):
        ShardReader(storage, str(tmp_path / "cache"))
    events = [{"kind": "data_mismatch", "t": out["t"] - 5, "reason": "earlier"},
              {"kind": "data_mismatch", "t": out["t"] + 1, "reason": "data shard x", "attempt": 2, "rank": 1}]
    assert swap_outcome(events, out["t"]) == {"caught": "data shard x", "caught_by": {"attempt": 2, "rank": 1}}
    assert swap_outcome(events[:1], out["t"]) == {"caught": None}


def test_gpu_slots_count_what_the_autoscaler_may_launch():
    # a batch job's or sweep's max_units defaults to every slot: on a head-only autoscaled cluster that is
    # what the autoscaler may launch (it was 1: the static nodes alone)
    from spotfill.sim.scenario import AUTOSCALING_SCENARIO
    assert parse_scenario(AUTOSCALING_SCENARIO).cluster.gpu_slots() == 2 * 3      # max_workers 2 x 3 GPUs
    assert parse_scenario(DEFAULT_SCENARIO).cluster.gpu_slots() == 5
    types = {"a": {"gpus": 2, "max_workers": 3}, "b": {"gpus": 4, "max_workers": 1}}
    assert parse_scenario({"cluster": {"nodes": [{"gpus": 1}], "autoscaler": {"node_types": types}}}
                          ).cluster.gpu_slots() == 1 + 6 + 4


def test_an_event_may_wait_for_an_earlier_one_to_fire():
    s = parse_scenario({"events": [{"at_step": 25, "min_world": 4, "action": "kill_node", "node": 0},
                                   {"at_step": 10, "after": 0, "action": "add_node", "gpus": 2}]})
    assert s.events[1].after == 0 and "after event 0" in s.events[1].describe()
    with pytest.raises(ConfigError, match=r"events\[0\]\.after"):
        parse_scenario({"events": [{"at_step": 1, "after": 0, "action": "add_node"}]})


def test_an_event_may_wait_for_the_other_nodes_warm_spares():
    s = parse_scenario({"events": [{"at_step": 5, "action": "kill_node", "node": 0, "spares_ready": True}]})
    assert s.events[0].spares_ready and "spares are ready" in s.events[0].describe()
    with pytest.raises(ConfigError, match=r"events\[0\]\.spares_ready.*true or false"):
        parse_scenario({"events": [{"at_step": 5, "action": "kill_node", "node": 0, "spares_ready": "yes"}]})


def test_missing_spares_counts_per_node_what_a_restart_there_lacks_the_leaving_node_aside():
    from spotfill.sim.scenario import missing_spares
    group = {"a": 2, "b": 2}
    assert missing_spares(group, {"a": 2}, leaving="b") == {}                 # the survivor has both
    assert missing_spares(group, {"a": 1, "b": 2}, leaving="b") == {"a": 1}
    assert missing_spares(group, {}, leaving=None) == {"a": 2, "b": 2}
    assert missing_spares(group, {"a": 3, "b": 2, "c": 1}, leaving=None) == {}


def test_the_corpus_tokenizer_is_bytes_or_a_local_hf_folder():
    assert parse_scenario({}).data_tokenizer == "bytes"
    assert parse_scenario({"data": {"tokenizer": "hf:/tmp/tok"}}).data_tokenizer == "hf:/tmp/tok"
    with pytest.raises(ConfigError, match=r"^data.tokenizer.*bytes, or hf:"):
        parse_scenario({"data": {"tokenizer": "sentencepiece"}})
    with pytest.raises(ConfigError, match=r"^data\b"):
        parse_scenario({"data": {"vocab": 3}})


def test_an_event_may_be_timed_into_the_next_restart():
    s = parse_scenario({"events": [{"at_step": 5, "action": "add_node", "gpus": 1},
                                   {"at_step": 5, "after": 0, "action": "drain_node", "node": 1, "deadline_s": 8,
                                    "during_restart": True}]})
    assert s.events[1].during_restart and "while the next worker group starts" in s.events[1].describe()
    assert not s.events[0].during_restart
    with pytest.raises(ConfigError, match=r"^events\[0\]\.during_restart.*true or false"):
        parse_scenario({"events": [{"at_step": 5, "action": "kill_node", "node": 0, "during_restart": 1}]})


def test_in_restart_fires_only_into_a_group_start_begun_after_the_event_was_due():
    from spotfill.sim.scenario import in_restart
    assert not in_restart(None, 100.0)                                   # the group steps: no start under way
    assert not in_restart({"t": 90.0, "attempt": 1}, 100.0)             # a start begun before it was due
    assert in_restart({"t": 100.5, "attempt": 2}, 100.0)                # the next start, not stepped yet


def test_the_during_restart_wait_says_which_start_it_fired_into():
    from spotfill.sim.scenario import Event
    from spotfill.sim.triggers import during_restart
    ev, waits = Event(index=1, action="drain_node", node=1, at_step=5, during_restart=True), {}
    assert not during_restart(ev, {"t": 90.0, "attempt": 1}, waits, 100.0)
    assert not during_restart(ev, None, waits, 101.0)
    assert during_restart(ev, {"t": 104.0, "attempt": 2}, waits, 104.25)
    assert waits[1] == {"since": 100.0, "attempt": 2, "fired_after_attempt_s": 0.25}
