"""GPU catalogue: peak dense tensor throughput, memory, bandwidth and interconnect, with sources.

Every TFLOPS figure is the *dense* peak (NVIDIA datasheets list most tensor figures "with sparsity";
the dense figure is half of that). `None` marks a precision the GPU's tensor cores do not support
(FP8 before Hopper/Ada). Memory is in GB (1e9 bytes, as datasheets count it); bandwidths in GB/s.

Prices are NOT datasheet facts: they are planning assumptions (USD per GPU-hour, roughly AWS
us-east-1 list prices divided by GPUs per instance, 2024-2025; spot = a typical observed spot price).
They vary by region and by the hour; override them with `--price-spot` / `--price-on-demand`.

Pure module: no ray/torch/deepspeed/boto3 imports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from spotfill.config.errors import ConfigError

PRICE_SOURCE = ("assumption: approximate cloud list prices per GPU-hour (AWS us-east-1 instance price / "
                "GPUs per instance, 2024-2025; spot = typical observed); override with "
                "--price-spot/--price-on-demand")


@dataclass(frozen=True)
class GPU:
    """One accelerator model. TFLOPS are peak dense tensor-core figures."""

    name: str
    memory_gb: float
    memory_bandwidth_gb_s: float
    bf16_tflops: Optional[float]
    fp16_tflops: Optional[float]
    fp8_tflops: Optional[float]
    tf32_tflops: Optional[float]
    interconnect: str               # "NVLink" or "PCIe Gen4"/"PCIe Gen5"
    interconnect_gb_s: float        # NVLink total per GPU, or PCIe x16 bidirectional
    price_on_demand: float          # USD / GPU-hour (assumption, see PRICE_SOURCE)
    price_spot: float               # USD / GPU-hour (assumption, see PRICE_SOURCE)
    source: str

    def peak_tflops(self, precision: str) -> Optional[float]:
        """Dense peak for a training precision: bf16, fp16, fp8, or fp32 (runs on TF32 tensor cores)."""
        key = {"bf16": "bf16_tflops", "fp16": "fp16_tflops", "fp8": "fp8_tflops",
               "fp32": "tf32_tflops", "tf32": "tf32_tflops"}.get(precision)
        if key is None:
            raise ConfigError("--precision", precision, accepted=["bf16", "fp16", "fp32"])
        return getattr(self, key)

    def as_dict(self) -> dict:
        return {"name": self.name, "memory_gb": self.memory_gb,
                "memory_bandwidth_gb_s": self.memory_bandwidth_gb_s,
                "peak_dense_tflops": {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops,
                                      "fp8": self.fp8_tflops, "tf32": self.tf32_tflops},
                "interconnect": self.interconnect, "interconnect_gb_s": self.interconnect_gb_s,
                "price_usd_per_gpu_hour": {"spot": self.price_spot, "on_demand": self.price_on_demand,
                                           "source": PRICE_SOURCE},
                "source": self.source}


CATALOGUE: dict[str, GPU] = {g.name: g for g in (
    GPU("a100-40gb", 40, 1555, 312, 312, None, 156, "NVLink", 600, 4.10, 1.60,
        "NVIDIA A100 Tensor Core GPU datasheet (2021), A100 40GB SXM: BF16/FP16 312, TF32 156 "
        "(dense; 624/312 with sparsity), HBM2 1,555 GB/s, NVLink 600 GB/s"),
    GPU("a100-80gb", 80, 2039, 312, 312, None, 156, "NVLink", 600, 5.12, 2.00,
        "NVIDIA A100 Tensor Core GPU datasheet (2021), A100 80GB SXM: BF16/FP16 312, TF32 156 "
        "(dense), HBM2e 2,039 GB/s, NVLink 600 GB/s"),
    GPU("h100-80gb", 80, 3350, 989.5, 989.5, 1979, 494.5, "NVLink", 900, 6.88, 2.75,
        "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: BF16/FP16 1,979, FP8 3,958, "
        "TF32 989 with sparsity (dense = half), HBM3 3.35 TB/s, NVLink 900 GB/s"),
    GPU("h100-pcie", 80, 2000, 756, 756, 1513, 378, "PCIe Gen5", 128, 4.50, 1.90,
        "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 PCIe: BF16/FP16 1,513, FP8 3,026, "
        "TF32 756 with sparsity (dense = half), HBM2e 2 TB/s, PCIe Gen5 128 GB/s"),
    GPU("h200", 141, 4800, 989.5, 989.5, 1979, 494.5, "NVLink", 900, 7.90, 3.20,
        "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM: BF16/FP16 1,979, FP8 3,958, "
        "TF32 989 with sparsity (dense = half), 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s"),
    GPU("l4", 24, 300, 121, 121, 242.5, 60, "PCIe Gen4", 64, 0.80, 0.35,
        "NVIDIA L4 Tensor Core GPU datasheet (2023): BF16/FP16 242, FP8 485, TF32 120 with "
        "sparsity (dense = half), 24 GB GDDR6 300 GB/s, PCIe Gen4 x16 64 GB/s"),
    GPU("a10g", 24, 600, 70, 70, None, 35, "PCIe Gen4", 64, 1.01, 0.40,
        "AWS-only A10G has no public NVIDIA datasheet: 24 GB GDDR6 600 GB/s as NVIDIA A10 datasheet "
        "(2021); dense BF16/FP16 70, TF32 35 TFLOPS as published for EC2 G5 (A10 is 125/62.5)"),
    GPU("l40s", 48, 864, 362.05, 362.05, 733, 183, "PCIe Gen4", 64, 1.86, 0.80,
        "NVIDIA L40S GPU datasheet (2023): BF16/FP16 362.05, FP8 733, TF32 183 dense "
        "(733/1,466/366 with sparsity), 48 GB GDDR6 864 GB/s, PCIe Gen4 x16 64 GB/s"),
    GPU("b200", 180, 7700, 2250, 2250, 4500, 1100, "NVLink", 1800, 14.24, 5.70,
        "NVIDIA HGX B200 datasheet (2025), per GPU: FP16/BF16 4.5 PF, FP8 9 PF, TF32 2.2 PF with "
        "sparsity (dense = half), 180 GB HBM3e 7.7 TB/s, NVLink 5 1.8 TB/s"),
    GPU("a6000", 48, 768, 154.8, 154.8, None, 77.4, "PCIe Gen4", 64, 0.80, 0.40,
        "NVIDIA RTX A6000 datasheet (2021): FP16/BF16 tensor 309.7 with sparsity (dense = half), "
        "TF32 154.8 with sparsity, 48 GB GDDR6 768 GB/s, PCIe Gen4 x16 64 GB/s"),
)}

ALIASES = {
    "a100": "a100-80gb", "a100-40g": "a100-40gb", "a100-80g": "a100-80gb", "a100-sxm4-40gb": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h100-sxm5": "h100-80gb",
    "h100-80g": "h100-80gb", "h100pcie": "h100-pcie", "h200-141gb": "h200", "h200-sxm": "h200",
    "nvidia-l4": "l4", "l40s-48gb": "l40s", "b200-180gb": "b200", "rtx-a6000": "a6000",
}


def gpu_names() -> list[str]:
    """Canonical names, in catalogue order."""
    return list(CATALOGUE)


def lookup(name: str, field: str = "--gpu-type") -> GPU:
    """Find a GPU by name, case-insensitively (aliases such as 'H100' or 'A100-SXM4-80GB' work).

    Raises ConfigError(field, name, accepted=<catalogue names>) for an unknown name.
    """
    key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in CATALOGUE:
        raise ConfigError(field, name, accepted=gpu_names())
    return CATALOGUE[key]


def catalogue_table() -> str:
    """Plain-text table of the catalogue with sources (what `spotfill plan --list-gpus` prints)."""
    def fmt(v):
        return "-" if v is None else f"{v:g}"
    head = ["gpu", "mem GB", "mem GB/s", "bf16", "fp16", "fp8", "tf32", "interconnect", "spot $/h", "od $/h"]
    rows = [[g.name, fmt(g.memory_gb), fmt(g.memory_bandwidth_gb_s), fmt(g.bf16_tflops), fmt(g.fp16_tflops),
             fmt(g.fp8_tflops), fmt(g.tf32_tflops), f"{g.interconnect} {g.interconnect_gb_s:g} GB/s",
             f"{g.price_spot:.2f}", f"{g.price_on_demand:.2f}"] for g in CATALOGUE.values()]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("TFLOPS are peak dense tensor-core figures; fp32 training uses the tf32 column.")
    lines.append(f"Prices: {PRICE_SOURCE}.")
    lines.append("Sources:")
    lines.extend(f"  {g.name}: {g.source}" for g in CATALOGUE.values())
    return "\n".join(lines)
