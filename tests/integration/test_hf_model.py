"""A Hugging Face causal LM (a small Llama written with save_pretrained, no download) trains elastically
like the presets: an announced preemption shrinks it from 2 workers to 1 (ZeRO-2's elastic layout: nothing converted),
with nothing lost or repeated."""
from __future__ import annotations

import pytest

from spotfill.telemetry.events import read_events
from spotfill.sim.outcomes import digest
from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario

transformers = pytest.importorskip("transformers")

# Long enough (about 8 s of stepping on 2 workers) that the notice, polled every second, lands mid-run.
STEPS = 400


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    import torch
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_hf_llama_trains_and_reshards(llama_dir, tmp_path):
    scenario = {
        "cluster": {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": 1}, {"gpus": 1}]},
        "training": {"model": f"hf:{llama_dir}", "workers": [1, 2], "steps": STEPS, "global_batch": 8,
                     "max_micro_batch": 4, "checkpoint_every": 50, "zero_stage": 2, "warmup_steps": 5},
        "events": [{"at_step": 12, "action": "drain_node", "node": 1, "deadline_s": 15}],
    }
    report = run_scenario(parse_scenario(scenario, "hf-llama"), str(tmp_path), quiet=True)
    assert report["ok"], digest(report)
    tr = report["training"]
    assert tr["steps_completed"] == STEPS
    assert tr["samples"] == {"consumed": STEPS * 8, "duplicates": 0, "missing": 0,
                             "source": "checkpoint-ledger"}
    assert [n for _, n in tr["world_size_timeline"]] == [2, 1]
    resumes = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == "resume"]
    assert resumes and resumes[0]["from_world_size"] == 2 and resumes[0]["world_size"] == 1
    assert resumes[0]["zero_elastic"] and not resumes[0]["universal"] and resumes[0]["conversions"] == 0
    losses = [e["loss"] for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == "step"]
    assert losses[-1] < losses[0]          # it learns: ln(320) = 5.77 at the start
