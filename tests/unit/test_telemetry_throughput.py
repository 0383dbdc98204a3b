"""MFU / HFU / tokens/s and the step split (telemetry.throughput), against numbers worked out by hand.

Worked example: a 6.7B decoder (32 layers, hidden 4096, sequence 2048) on 8 H100 SXM GPUs in bf16.
  model FLOPs/token    = 6 x 6.7e9 + 12 x 32 x 4096 x 2048      = 40.2e9 + 3.221225472e9 = 43,421,225,472
  hardware, full recompute: + one more forward 2 x 6.7e9 + 4 x 32 x 4096 x 2048 = + 14,473,741,824
                                                                 = 57,894,967,296
  H100 SXM dense bf16 peak (datasheet 1,979 with sparsity, halved) = 989.5e12 FLOP/s
  24,000 tokens/s on 8 GPUs: MFU = 24,000 x 43,421,225,472 / (8 x 989.5e12) = 0.131646
                             HFU = 24,000 x 57,894,967,296 / (8 x 989.5e12) = 0.175528
"""
import pytest

from spotfill.telemetry import throughput as tp

N, L, H, S = 6_700_000_000, 32, 4096, 2048


def test_flops_per_token_is_the_planners_formula_worked_by_hand():
    model, hardware = tp.flops_per_token(N, L, H, 32, S)
    assert model == 43_421_225_472 and hardware == model          # no recompute: HFU == MFU
    assert tp.flops_per_token(N, L, H, 32, S, recompute="full") == (43_421_225_472, 57_894_967_296)


def test_peak_for_detected_devices():
    assert tp.peak_flops_per_gpu("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert tp.peak_flops_per_gpu("NVIDIA A100-SXM4-40GB", "bf16") == 312e12
    assert tp.peak_flops_per_gpu("NVIDIA H100 PCIe", "fp16") == 756e12
    assert tp.peak_flops_per_gpu("NVIDIA H200", "bf16") == 989.5e12
    assert tp.peak_flops_per_gpu("NVIDIA L4", "bf16") == 121e12
    # fp32 runs on TF32 tensor cores only when torch allows it; plain FP32 units are not catalogued
    assert tp.peak_flops_per_gpu("NVIDIA A100-SXM4-80GB", "fp32", tf32_allowed=True) == 156e12
    assert tp.peak_flops_per_gpu("NVIDIA A100-SXM4-80GB", "fp32", tf32_allowed=False) is None


@pytest.mark.parametrize("device", [None, "", "cpu", "Tesla T4", "NVIDIA GeForce RTX 4090", "AMD Instinct MI300X"])
def test_unknown_devices_have_no_peak(device):
    assert tp.peak_flops_per_gpu(device, "bf16") is None


def test_mfu_and_hfu_worked_example():
    peak = tp.peak_flops_per_gpu("NVIDIA H100 80GB HBM3", "bf16")
    model, hardware = tp.flops_per_token(N, L, H, 32, S, recompute="full")
    # one second of 24,000 tokens over 8 GPUs
    assert tp.utilization(24_000, 1.0, model, 8, peak) == pytest.approx(0.131646, rel=1e-5)
    assert tp.utilization(24_000, 1.0, hardware, 8, peak) == pytest.approx(0.175528, rel=1e-5)
    # same rate over a 2.5 s step: 60,000 tokens
    assert tp.utilization(60_000, 2.5, model, 8, peak) == pytest.approx(0.131646, rel=1e-5)


def test_no_peak_or_no_time_means_none_never_a_number():
    assert tp.utilization(24_000, 1.0, 4e10, 8, None) is None
    assert tp.utilization(24_000, 0.0, 4e10, 8, 1e15) is None
    assert tp.tokens_per_s(1024, 0.0) is None
    assert tp.tokens_per_s(1024, 0.5) == 2048


def test_step_split_adds_up_and_the_rest_is_collective_wait():
    s = tp.split_step(step_s=0.100, data_wait_s=0.010, forward_backward_s=0.060, optimizer_s=0.020)
    assert (s.data_wait_s, s.forward_backward_s, s.optimizer_s) == (0.010, 0.060, 0.020)
    assert s.collective_wait_s == pytest.approx(0.010)
    ev = s.as_event()
    assert ev["compute_s"] == pytest.approx(0.090)
    assert ev["data_wait_s"] + ev["forward_backward_s"] + ev["optimizer_s"] + ev["collective_wait_s"] == \
        pytest.approx(ev["step_s"])


def test_step_split_device_times_that_overrun_the_wall_are_scaled_to_fit():
    # CUDA event times can exceed the host's window by clock skew: never a negative collective wait
    s = tp.split_step(step_s=0.100, data_wait_s=0.020, forward_backward_s=0.090, optimizer_s=0.030)
    assert s.collective_wait_s == 0.0
    assert s.forward_backward_s == pytest.approx(0.060) and s.optimizer_s == pytest.approx(0.020)


def test_step_metrics_on_cpu_has_tokens_per_s_and_null_utilisation():
    s = tp.split_step(0.5, 0.0, 0.4, 0.1)
    assert tp.step_metrics(1024, s, 1, 920_832.0, 920_832.0, None) == {"tokens_per_s": 2048.0, "mfu": None,
                                                                      "hfu": None}


def test_run_utilization_weights_by_step_time_and_refuses_partial_knowledge():
    h100 = {"peak_flops_per_gpu": 989.5e12, "flops_per_token": 43_421_225_472,
            "hardware_flops_per_token": 57_894_967_296}
    # attempt 0: 8 GPUs, 24,000 tokens/s; attempt 1: 4 GPUs at 12,000 tokens/s: the same per-GPU rate
    steps = [{"attempt": 0, "tokens": 24_000, "step_s": 1.0, "world_size": 8},
             {"attempt": 1, "tokens": 12_000, "step_s": 1.0, "world_size": 4}]
    u = tp.run_utilization(steps, {0: h100, 1: h100})
    assert u["mfu"] == pytest.approx(0.131646, rel=1e-5) and u["hfu"] == pytest.approx(0.175528, rel=1e-5)
    # attempt 1 restarted on a CPU (no peak): no run figure at all
    assert tp.run_utilization(steps, {0: h100, 1: {**h100, "peak_flops_per_gpu": None}}) == \
        {"mfu": None, "hfu": None}


def test_catalogue_names():
    assert tp.catalogue_name("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert tp.catalogue_name("NVIDIA A10G") == "a10g"
    assert tp.catalogue_name("NVIDIA L40S") == "l40s"
    assert tp.catalogue_name("NVIDIA L4") == "l4"
    assert tp.catalogue_name("NVIDIA B200") == "b200"


def test_phases_the_device_could_not_time_are_absent_not_guessed():
    s = tp.split_step(0.1, 0.01, None, None)
    assert (s.forward_backward_s, s.optimizer_s, s.collective_wait_s) == (None, None, None)
    assert s.as_event()["compute_s"] == pytest.approx(0.09)
    assert tp.split_totals([s.as_event(), tp.split_step(0.1, 0.0, 0.05, 0.05).as_event()])["optimizer_s"] == 0.05
