"""GPU catalogue: names, lookups, dense datasheet numbers, sources."""
from __future__ import annotations

import re

import pytest

from spotfill.planning import hardware
from spotfill.config.errors import ConfigError

REQUIRED = ["a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h200", "l4", "a10g", "l40s", "b200"]


def test_catalogue_has_every_required_gpu():
    for name in REQUIRED:
        assert name in hardware.CATALOGUE


@pytest.mark.parametrize("name,expected", [
    ("A100-80GB", "a100-80gb"), ("h100", "h100-80gb"), ("H100-SXM", "h100-80gb"), (" L40S ", "l40s"),
    ("H100_PCIE", "h100-pcie"), ("B200", "b200"), ("a100", "a100-80gb")])
def test_lookup_is_case_insensitive_with_aliases(name, expected):
    assert hardware.lookup(name).name == expected


def test_unknown_gpu_raises_config_error_naming_the_flag_and_choices():
    with pytest.raises(ConfigError) as exc:
        hardware.lookup("v100")
    msg = str(exc.value)
    assert exc.value.field == "--gpu-type" and "v100" in msg
    for name in REQUIRED:
        assert name in msg
    assert "\n" not in msg


def test_dense_not_sparse_figures():
    # H100 SXM datasheet: 1,979 BF16 and 3,958 FP8 TFLOPS *with sparsity*; dense is half.
    h100 = hardware.lookup("h100-80gb")
    assert h100.bf16_tflops == pytest.approx(1979 / 2, rel=1e-3)
    assert h100.fp8_tflops == pytest.approx(3958 / 2, rel=1e-3)
    a100 = hardware.lookup("a100-80gb")
    assert (a100.bf16_tflops, a100.tf32_tflops, a100.memory_gb) == (312, 156, 80)
    assert hardware.lookup("h200").memory_gb == 141
    assert hardware.lookup("l40s").memory_gb == 48


def test_fp8_unsupported_before_hopper_and_ada():
    for name in ("a100-40gb", "a100-80gb", "a10g"):
        assert hardware.lookup(name).fp8_tflops is None
    for name in ("h100-80gb", "h100-pcie", "h200", "l4", "l40s", "b200"):
        assert hardware.lookup(name).fp8_tflops > 0


def test_every_entry_is_complete_and_cites_a_source_with_year():
    for gpu in hardware.CATALOGUE.values():
        assert gpu.memory_gb > 0 and gpu.memory_bandwidth_gb_s > 0 and gpu.interconnect_gb_s > 0
        assert gpu.bf16_tflops and gpu.fp16_tflops and gpu.tf32_tflops
        assert gpu.interconnect.startswith(("NVLink", "PCIe"))
        assert "datasheet" in gpu.source and re.search(r"\(20\d\d\)", gpu.source), gpu.name
        assert 0 < gpu.price_spot < gpu.price_on_demand


def test_peak_for_precision():
    a100 = hardware.lookup("a100-40gb")
    assert a100.peak_tflops("bf16") == 312
    assert a100.peak_tflops("fp32") == 156      # fp32 training runs on TF32 tensor cores
    with pytest.raises(ConfigError):
        a100.peak_tflops("int3")


def test_catalogue_table_lists_names_and_sources():
    table = hardware.catalogue_table()
    for name in hardware.CATALOGUE:
        assert name in table
    assert "Sources:" in table and "datasheet" in table
    assert hardware.lookup("b200").as_dict()["peak_dense_tflops"]["bf16"] == 2250
