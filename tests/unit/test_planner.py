"""Planner math against published references and hand-worked values."""
from __future__ import annotations

import ast
import pathlib

import pytest

import spotfill
from spotfill.planning import planner
from spotfill.config.errors import ConfigError
from spotfill.planning.planner import Arch, plan

GB = 1e9
LLAMA_7B = Arch(32, 4096, 32, 32, 11008, 32000, "swiglu", "test")


# ---------------------------------------------------------------- parsers
@pytest.mark.parametrize("text,expected", [
    ("7e9", 7_000_000_000), ("7B", 7_000_000_000), ("7.5B", 7_500_000_000), ("350M", 350_000_000),
    ("1.3b", 1_300_000_000), ("125m", 125_000_000), ("70000000000", 70_000_000_000), ("300B", 300 * 10**9),
    ("2T", 2 * 10**12), ("15.6T", 15_600_000_000_000), (" 8k ", 8000), (7e9, 7_000_000_000), (42, 42)])
def test_parse_count(text, expected):
    assert planner.parse_count(text) == expected


@pytest.mark.parametrize("bad", ["-7B", "abc", "0", "", "7X", "1e-3", None, True, "nan", float("inf"), -5])
def test_parse_count_rejects(bad):
    with pytest.raises(ConfigError) as exc:
        planner.parse_count(bad, "--tokens")
    assert exc.value.field == "--tokens" and "\n" not in str(exc.value)


# ---------------------------------------------------------------- ZeRO paper, Figure 1
def test_zero_paper_figure1_model_states():
    """Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, Nd = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB/device."""
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected.items():
        ms = planner.model_state_bytes(7_500_000_000, LLAMA_7B, "full", "bf16", stage, "none", dp=64)
        assert (ms["params"] + ms["grads"] + ms["optimizer"]) / GB == pytest.approx(gb, abs=0.05)
        out = plan(params="7.5B", gpus=64, zero=stage, offload="none", micro_batch=1)
        assert out["memory_per_gpu_gb"]["model_states"] == pytest.approx(gb, abs=0.05)
    exact = plan(params="7.5B", gpus=64, zero=1, offload="none", micro_batch=1)["memory_per_gpu_gb"]
    assert exact["model_states"] == pytest.approx(30 + 90 / 64)    # 2Psi + 2Psi + K*Psi/Nd
    assert (exact["params"], exact["grads"]) == (15.0, 15.0)


def test_tp_pp_shard_before_zero_and_fp32_bytes():
    ms = planner.model_state_bytes(7_500_000_000, LLAMA_7B, "full", "bf16", 1, "none", dp=16, t=2, p=2)
    assert ms["params"] + ms["grads"] == pytest.approx(4 * 7.5e9 / 4)
    assert ms["optimizer"] == pytest.approx(12 * 7.5e9 / 4 / 16)
    fp32 = planner.model_state_bytes(10**9, LLAMA_7B, "full", "fp32", 0, "none", dp=1)
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4e9, 4e9, 8e9)


def test_offload_moves_optimizer_and_zero3_params_off_gpu():
    n = 8 * 10**9
    z1 = planner.model_state_bytes(n, LLAMA_7B, "full", "bf16", 1, "cpu", dp=8)
    assert z1["optimizer"] == 0 and z1["grads"] == 2 * n and z1["host"] == pytest.approx(12 * n / 8)
    z2 = planner.model_state_bytes(n, LLAMA_7B, "full", "bf16", 2, "cpu", dp=8)
    assert z2["optimizer"] == z2["grads"] == 0 and z2["params"] == 2 * n
    assert z2["host"] == pytest.approx((12 + 2) * n / 8)       # optimizer + gradient partition
    z3 = planner.model_state_bytes(n, LLAMA_7B, "full", "bf16", 3, "nvme", dp=8)
    assert z3["params"] == z3["grads"] == z3["optimizer"] == 0
    assert z3["nvme"] == pytest.approx(14 * n / 8) and z3["host"] == pytest.approx(2 * n / 8)
    assert z3["buffers"] == pytest.approx(2 * 2 * n / 32)       # two gathered layers
    out = plan(params="8B", gpus=8, zero=3, offload="cpu", micro_batch=1, activation_checkpointing="full")
    assert out["offload_memory_gb"]["host_per_gpu"] == pytest.approx(16 * 8 / 8, rel=1e-6)
    assert out["memory_per_gpu_gb"]["model_states"] == 0
    assert out["slowdowns"]["offload"] == planner.OFFLOAD_SLOWDOWN["cpu"] > 1


# ---------------------------------------------------------------- FLOPs: GPT-3 and Llama 3
def test_gpt3_175b_training_flops():
    """Brown et al. 2020, Table D.1: GPT-3 175B on 300B tokens = 3.14e23 FLOPs (6ND)."""
    out = plan(params="175B", tokens="300B", gpus=1024, gpu_type="a100-40gb")
    assert out["flops_6nd"] == pytest.approx(3.14e23, rel=0.01)
    assert out["inputs"]["architecture_source"] == "table: gpt3-175b"
    # PaLM's formula adds the attention term 12*L*h*s per token: a few percent more. Its N leaves out the
    # embedding lookups: GPT-3's 2048 x 12288 learned positions (its token embedding is also its output
    # layer, a matmul: counted), 25,165,824 parameters
    attention = 12 * 96 * 12288 * 2048 * 300e9
    n = 175e9 - 25_165_824
    assert out["total_flops"] == pytest.approx(6 * n * 300e9 + attention)
    assert 1.0 < out["total_flops"] / 3.14e23 < 1.05
    assert "PaLM" in out["flops_formula"]
    assert plan(params="175B", tokens="300B", flops_formula="6nd")["total_flops"] == pytest.approx(6 * n * 300e9)


def test_llama3_405b_training_flops():
    """Llama 3 paper (Dubey et al. 2024): 405B on 15.6T tokens ~ 3.8e25 FLOPs."""
    out = plan(params="405B", tokens="15.6T", gpus=16384, gpu_type="h100-80gb", seq_len=8192)
    assert out["flops_6nd"] == pytest.approx(3.8e25, rel=0.01)
    assert out["chinchilla_tokens"] == 20 * 405 * 10**9


def test_flops_per_token_model_and_hardware():
    gpt3 = Arch(96, 12288, 96, 96, 49152, 50257, "gelu", "t", tied=True, positions=2048)
    n, lhs = 175e9 - 2048 * 12288, 96 * 12288 * 2048        # N: no lookup table (positions) in it
    model, hw = planner.flops_per_token(175e9, gpt3, 2048, recompute="full")
    assert model == pytest.approx(6 * n + 12 * lhs) and hw == pytest.approx(8 * n + 16 * lhs)
    assert planner.flops_per_token(175e9, gpt3, 2048, recompute="selective")[1] == pytest.approx(6 * n + 16 * lhs)
    lora = planner.flops_per_token(175e9, gpt3, 2048, method="lora", n_adapter=10**8)[0]
    assert lora == pytest.approx(4 * n + 6e8 + 12 * lhs)


# ---------------------------------------------------------------- QLoRA
def test_qlora_65b_finetunes_on_one_48gb_gpu():
    """Dettmers et al. 2023: QLoRA fine-tunes a 65B model on a single 48 GB GPU."""
    for gpu in ("l40s", "a6000"):
        out = plan(params="65B", method="qlora", gpu_type=gpu, gpus=1, micro_batch=1,
                   activation_checkpointing=True, seq_len=512)
        assert out["fits"] and out["gpu_memory_gb"] == 48
        assert out["inputs"]["architecture_source"] == "table: llama-65b"
        # 4-bit base: ~4.127 bits/param on the linear layers
        assert 33 < out["memory_per_gpu_gb"]["params"] < 36
        assert out["checkpoint_size_gb"] == pytest.approx(14 * out["inputs"]["lora_params"] / GB)
    full = plan(params="65B", method="full", precision="fp16", gpu_type="l40s", gpus=1, micro_batch=1,
                activation_checkpointing=True, zero=0, offload="none")
    assert not full["fits"] and full["memory_per_gpu_gb"]["model_states"] == pytest.approx(16 * 65)
    lora16 = plan(params="65B", method="lora", gpu_type="l40s", gpus=1, micro_batch=1,
                  activation_checkpointing=True, zero=0, offload="none")
    assert not lora16["fits"]                      # 130 GB of 16-bit base weights


def test_lora_adapter_count_llama7b():
    # r=16 on q,k,v,o,gate,up,down of Llama-7B: the familiar 39,976,960 trainable parameters
    assert planner.lora_params(LLAMA_7B, 16, "all") == 39_976_960
    assert planner.lora_params(LLAMA_7B, 16, "attention") == 32 * 4 * 16 * (4096 + 4096)


# ---------------------------------------------------------------- activations (Korthikanti et al. 2022)
def test_activation_formula_hand_worked():
    sbh = 2048 * 1 * 4096
    f = planner.activation_bytes_per_layer
    assert f(2048, 1, 4096, 32) == sbh * (34 + 5 * 32 * 2048 / 4096) == 956_301_312
    assert f(2048, 1, 4096, 32, t=2) == sbh * (10 + 24 / 2 + 40)
    assert f(2048, 1, 4096, 32, t=2, sp=True) == sbh * (34 / 2 + 40)
    assert f(2048, 1, 4096, 32, recompute="selective") == sbh * 34
    assert f(2048, 1, 4096, 32, flash=True) == sbh * 34
    assert f(2048, 1, 4096, 32, recompute="full") == 2 * sbh
    assert f(2048, 1, 4096, 32, t=4, sp=True, recompute="full") == 2 * sbh / 4


def test_activation_pipeline_in_flight_and_logits():
    per = planner.activation_bytes_per_layer(2048, 1, 4096, 32)
    logits = 4 * 2048 * 32000
    assert planner.activation_bytes(LLAMA_7B, 2048, 1) == pytest.approx(32 * per + logits)
    # 1F1B: first of 4 stages holds min(p, m) micro-batches of its 8 layers
    assert planner.activation_bytes(LLAMA_7B, 2048, 1, p=4, m=8) == pytest.approx(8 * 4 * per)
    assert planner.activation_bytes(LLAMA_7B, 2048, 1, p=4, m=2) == pytest.approx(8 * 2 * per)
    full = planner.activation_bytes(LLAMA_7B, 2048, 1, recompute="full")
    assert full == pytest.approx(32 * 2 * 2048 * 4096 + per + logits)
    assert planner.activation_bytes(LLAMA_7B, 2048, 1, precision="fp32") == pytest.approx(2 * (32 * per + logits))


# ---------------------------------------------------------------- bubble, checkpoint, data, time, cost
def test_pipeline_bubble():
    assert planner.pipeline_bubble_fraction(4, 8) == 0.375
    assert planner.pipeline_bubble_fraction(1, 1) == 0
    out = plan(params="7B", gpus=4, pp=4, micro_batches=8, micro_batch=1)
    assert out["pipeline_bubble_fraction"] == 0.375
    assert out["deepspeed_config"]["gradient_accumulation_steps"] == 8
    assert out["inputs"]["zero"] <= 1                         # DeepSpeed pipeline: ZeRO 0/1 only
    assert out["slowdowns"]["pipeline_bubble"] == 1.375


def test_checkpoint_size_and_upload_time():
    out = plan(params="7B", gpus=8, bandwidth_gbps=10)
    assert out["checkpoint_size_gb"] == 98.0                   # 14 B/param
    assert out["checkpoint_upload_seconds"] == pytest.approx(98e9 * 8 / 10e9) == 78.4
    assert planner.upload_seconds(1.25e9, 1) == 10.0
    assert planner.checkpoint_bytes(10**9, "full", "fp32") == 12e9
    assert planner.checkpoint_bytes(10**9, "lora", "bf16", n_adapter=10**6) == 14e6


def test_time_cost_and_data_bandwidth_hand_worked():
    out = plan(params="1B", layers=24, hidden=2048, tokens="10B", flops_formula="6nd", gpus=8,
               gpu_type="a100-80gb", mfu=0.5, zero=1, offload="none", activation_checkpointing="none",
               micro_batch=1, price_spot=1.5, price_on_demand=4.0, bytes_per_token=2)
    # N = 1e9 less the 32000 x 2048 token embedding (a lookup; the output layer is its own matrix)
    seconds = 6 * (1e9 - 65_536_000) * 1e10 / (8 * 312e12 * 0.5)          # 44,926.3 s
    assert out["train_time_hours"] == pytest.approx(seconds / 3600)
    assert out["gpu_hours"] == pytest.approx(8 * seconds / 3600)
    assert out["cost_usd"]["spot"] == pytest.approx(1.5 * 8 * seconds / 3600)
    assert out["cost_usd"]["on_demand"] == pytest.approx(4.0 * 8 * seconds / 3600)
    assert out["data_bandwidth_mb_s"] == pytest.approx(1e10 / seconds * 2 / 1e6)   # 0.445 MB/s
    assert planner.data_bandwidth_mb_s(1e6, 2) == 2.0
    assert out["expected_mfu"] == pytest.approx(0.5)


def test_recompute_and_offload_slow_the_run():
    base = dict(params="1B", gpus=8, zero=2, micro_batch=1, tokens="1B")
    none = plan(**base, offload="none", activation_checkpointing="none")
    full = plan(**base, offload="none", activation_checkpointing="full")
    cpu = plan(**base, offload="cpu", activation_checkpointing="none")
    assert full["train_time_hours"] > none["train_time_hours"] and full["hardware_flops"] > full["total_flops"]
    assert cpu["train_time_hours"] == pytest.approx(1.5 * none["train_time_hours"])
    assert full["memory_per_gpu_gb"]["activations"] < none["memory_per_gpu_gb"]["activations"]


# ---------------------------------------------------------------- fit + recommendation
def test_headroom_rule_is_stated():
    out = plan(params="7B", gpus=8)
    assert out["usable_gpu_memory_gb"] == pytest.approx(72.0) and out["headroom_fraction"] == 0.1
    assert "headroom" in out["fits_rule"]
    assert plan(params="7B", gpus=8, headroom=0)["usable_gpu_memory_gb"] == 80.0


def test_7b_on_8_a100_80gb_zero0_does_not_fit_but_recommendation_does():
    out = plan(params="7B", gpus=8, gpu_type="a100-80gb", zero=0)
    assert not out["fits"] and out["memory_per_gpu_gb"]["model_states"] == pytest.approx(112)
    rec = out["recommendation"]
    assert rec["found"] and rec["fits"] and rec["zero"] >= 1 and rec["gpus"] == 8
    assert rec["offload"] == "none" and rec["memory_per_gpu_gb"] <= 72
    assert not rec["matches_requested"]
    # it is the cheapest fitting configuration of everything searched
    pb, _, _ = planner._resolve(dict(params="7B", gpus=8, gpu_type="a100-80gb"))
    evals = [planner.evaluate(pb, k) for k in planner._options(pb, planner.Knobs(gpus=8))]
    assert min(e["gpu_hours"] for e in evals if e and e["fits"]) == pytest.approx(rec["gpu_hours"])
    # knobs left open are filled from the search
    auto = plan(params="7B", gpus=8, gpu_type="a100-80gb")
    assert auto["fits"] and set(auto["inputs"]["auto_selected"]) >= {"zero", "offload", "micro_batch"}


def test_recommendation_prefers_cpu_offload_over_nvme_and_reports_when_nothing_fits():
    one = plan(params="7B", gpus=1, gpu_type="a100-80gb")
    assert one["fits"] and one["recommendation"]["offload"] == "cpu"
    none = plan(params="405B", gpus=1, gpu_type="l4", seq_len=8192)
    assert not none["fits"] and not none["recommendation"]["found"] and "reason" in none["recommendation"]


def test_search_over_gpu_counts_meets_max_hours():
    out = plan(params="7B")
    rec = out["recommendation"]
    assert rec["found"] and rec["train_time_hours"] <= 720 and rec["gpus"] & (rec["gpus"] - 1) == 0


# ---------------------------------------------------------------- DeepSpeed config
@pytest.mark.parametrize("kw", [
    dict(params="7B", gpus=8), dict(params="7B", gpus=8, global_batch=512, micro_batch=2),
    dict(params="13B", gpus=16, zero=3, offload="nvme", precision="fp16", activation_checkpointing="full"),
    dict(params="1B", gpus=4, tp=2, global_batch_tokens="1M", seq_len=4096),
    dict(params="7B", gpus=8, pp=2, micro_batches=16, micro_batch=2)])
def test_deepspeed_config_batch_arithmetic(kw):
    out = plan(**kw)
    ds, i = out["deepspeed_config"], out["inputs"]
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * i["dp"] == \
        ds["train_batch_size"] == i["global_batch"]
    assert i["dp"] == i["gpus"] // (i["tp"] * i["pp"])
    zo = ds["zero_optimization"]
    assert zo["stage"] == i["zero"] and zo["overlap_comm"] and zo["contiguous_gradients"]
    assert ds["optimizer"]["type"] == "AdamW" and ds["scheduler"]["type"] == "WarmupCosineLR"
    assert ds["gradient_clipping"] == 1.0


def test_deepspeed_config_blocks():
    ds = plan(params="13B", gpus=16, zero=3, offload="nvme", precision="fp16",
              activation_checkpointing="full")["deepspeed_config"]
    assert ds["fp16"]["enabled"] and "bf16" not in ds and "activation_checkpointing" in ds
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == "/local_nvme"
    ds2 = plan(params="7B", gpus=8, zero=2, offload="cpu", activation_checkpointing="none")["deepspeed_config"]
    assert ds2["bf16"] == {"enabled": True} and "offload_param" not in ds2["zero_optimization"]
    assert ds2["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "activation_checkpointing" not in ds2
    assert plan(params="1B", gpus=4, tp=2)["deepspeed_config"]["tensor_parallel"] == {"autotp_size": 2}


# ---------------------------------------------------------------- architecture + inputs echo
def test_architecture_from_table_or_derived():
    assert plan(params="7B", gpus=8)["inputs"]["architecture_source"] == "table: llama-7b"
    arch = planner.derive_architecture(2 * 10**10)              # no table entry within 10%
    assert arch.source.startswith("derived") and arch.hidden % 128 == 0 and arch.hidden // arch.heads == 128
    assert 0.8 < (12 * arch.layers * arch.hidden ** 2 + arch.vocab * arch.hidden) / 2e10 < 1.25
    only_layers = planner.derive_architecture(7 * 10**9, layers=32)
    assert 3584 <= only_layers.hidden <= 4608
    assert planner.derive_architecture(7 * 10**9, hidden=4096).layers in range(32, 37)


def test_known_model_table_is_consistent():
    for name, (n, layers, hidden, heads, kv, ffn, vocab, mlp) in planner.KNOWN_MODELS.items():
        arch = Arch(layers, hidden, heads, kv, ffn, vocab, mlp, name)
        assert hidden % heads == 0 and heads % kv == 0, name
        embeddings = vocab * hidden * (2 if mlp == "swiglu" else 1)     # Llama unties, GPT-3 ties
        assert arch.linear_params_per_layer() * layers + embeddings == pytest.approx(n, rel=0.03), name


def test_inputs_echo_every_resolved_input():
    i = plan(params="7B", gpus=8, method="lora", lora_rank=8)["inputs"]
    for key in ("params", "gpus", "gpu_type", "zero", "offload", "method", "precision", "tokens", "seq_len",
                "micro_batch", "global_batch", "layers", "hidden", "heads", "vocab", "activation_checkpointing",
                "tp", "pp", "dp", "mfu", "price_spot", "price_on_demand", "bandwidth_gbps", "bytes_per_token",
                "headroom", "lora_rank", "lora_params", "gradient_accumulation_steps", "flops_formula"):
        assert key in i, key
    assert i["lora_rank"] == 8 and i["tokens"] == 10**8


def test_required_contract_keys_and_lazy_export():
    out = spotfill.plan(params="350M", gpus=2)
    for key in ("inputs", "memory_per_gpu_gb", "fits", "gpu_memory_gb", "total_flops", "tokens",
                "chinchilla_tokens", "train_time_hours", "gpu_hours", "cost_usd", "pipeline_bubble_fraction",
                "checkpoint_size_gb", "checkpoint_upload_seconds", "data_bandwidth_mb_s", "recommendation",
                "deepspeed_config"):
        assert key in out
    assert set(out["memory_per_gpu_gb"]) >= {"params", "grads", "optimizer", "model_states", "activations",
                                             "total"}
    assert set(out["cost_usd"]) == {"spot", "on_demand"}


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kw,field", [
    (dict(params=-1), "--params"), (dict(params="abc"), "--params"), (dict(params=0), "--params"),
    (dict(), "--params"), (dict(params="7B", gpu_type="v100"), "--gpu-type"),
    (dict(params="7B", zero=4), "--zero"), (dict(params="7B", pp=64), "--pp"),
    (dict(params="7B", layers=10, hidden=1024, pp=3), "--pp"), (dict(params="7B", tp=3), "--tp"),
    (dict(params="7B", heads=7), "--heads"), (dict(params="7B", gpus=0), "--gpus"),
    (dict(params="7B", gpus=6, tp=4), "--gpus"), (dict(params="7B", mfu=0), "--mfu"),
    (dict(params="7B", mfu=1.5), "--mfu"), (dict(params="7B", mfu="x"), "--mfu"),
    (dict(params="7B", method="foo"), "--method"), (dict(params="7B", precision="fp8"), "--precision"),
    (dict(params="7B", offload="disk"), "--offload"), (dict(params="7B", zero=0, offload="cpu"), "--offload"),
    (dict(params="7B", zero=2, offload="nvme"), "--offload"), (dict(params="7B", pp=2, zero=2), "--zero"),
    (dict(params="7B", seq_len=-5), "--seq-len"), (dict(params="7B", tokens="2X"), "--tokens"),
    (dict(params="7B", gpus=8, global_batch=12), "--global-batch"), (dict(params="7B", bogus=1), "plan"),
    (dict(params="7B", gpus=1.5), "--gpus"), (dict(params="7B", micro_batch=0), "--micro-batch")])
def test_validation_errors_name_the_flag(kw, field):
    with pytest.raises(ConfigError) as exc:
        plan(**kw)
    assert exc.value.field == field and "\n" not in str(exc.value)


def test_mfu_flops_leave_the_embedding_lookups_out_llama_7b_by_hand():
    """PaLM App. B counts the matmul FLOPs, 6N + 12*L*h*s with N the parameters that enter a matmul: Llama
    7B's 32000 x 4096 input embedding is a lookup (its output layer is a separate matrix, counted).
    N = 6.7e9 - 131,072,000 = 6,568,928,000; 6N = 39,413,568,000; 12 x 32 x 4096 x 2048 = 3,221,225,472."""
    arch = planner.derive_architecture(6.7e9)
    assert arch.source == "table: llama-7b" and not arch.tied and arch.positions == 0
    assert planner.flops_per_token(6.7e9, arch, 2048)[0] == pytest.approx(42_634_793_472)
