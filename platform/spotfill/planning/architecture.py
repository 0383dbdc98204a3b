"""Model shape for the planner: the decoder architecture (layers, width, heads, MLP kind), a table of
published models, deriving a shape from a parameter count, and LoRA adapter sizes. Pure arithmetic.

Sources: Llama 1 (Touvron et al. 2023a, Table 2), Llama 2 (2023b), Llama 3 (Dubey et al. 2024, Table 3),
GPT-3 (Brown et al. 2020, Table 2.1), LoRA (Hu et al. 2021).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# name: (params, layers, hidden, heads, kv_heads, ffn, vocab, mlp). Llama 1 (Touvron et al. 2023a,
# Table 2), Llama 2 70B (2023b), Llama 3 (Dubey et al. 2024, Table 3), GPT-3 (Brown et al. 2020, Table 2.1).
KNOWN_MODELS: dict[str, tuple] = {
    "llama-7b": (6.7e9, 32, 4096, 32, 32, 11008, 32000, "swiglu"),
    "llama-13b": (13.0e9, 40, 5120, 40, 40, 13824, 32000, "swiglu"),
    "llama-33b": (32.5e9, 60, 6656, 52, 52, 17920, 32000, "swiglu"),
    "llama-65b": (65.2e9, 80, 8192, 64, 64, 22016, 32000, "swiglu"),
    "llama-2-70b": (69.0e9, 80, 8192, 64, 8, 28672, 32000, "swiglu"),
    "llama-3-8b": (8.03e9, 32, 4096, 32, 8, 14336, 128256, "swiglu"),
    "llama-3-70b": (70.6e9, 80, 8192, 64, 8, 28672, 128256, "swiglu"),
    "llama-3-405b": (405e9, 126, 16384, 128, 8, 53248, 128256, "swiglu"),
    "gpt3-125m": (125e6, 12, 768, 12, 12, 3072, 50257, "gelu"),
    "gpt3-350m": (350e6, 24, 1024, 16, 16, 4096, 50257, "gelu"),
    "gpt3-760m": (760e6, 24, 1536, 16, 16, 6144, 50257, "gelu"),
    "gpt3-1.3b": (1.3e9, 24, 2048, 16, 16, 8192, 50257, "gelu"),   # Table 2.1 says 24 heads of 128: 16 fit
    "gpt3-2.7b": (2.7e9, 32, 2560, 32, 32, 10240, 50257, "gelu"),
    "gpt3-6.7b": (6.7e9, 32, 4096, 32, 32, 16384, 50257, "gelu"),
    "gpt3-175b": (175e9, 96, 12288, 96, 96, 49152, 50257, "gelu"),
}
# GPT-3 shares its token embedding with the output layer and learns a table of 2048 positions (Brown et al.
# 2020, Sec. 2.1, as GPT-2); Llama's embedding and output layer are separate matrices, and RoPE has no table.
TIED_WITH_POSITIONS = {name: 2048 for name in KNOWN_MODELS if name.startswith("gpt3-")}


@dataclass(frozen=True)
class Arch:
    """Decoder architecture: the shape the activation, attention-FLOPs and LoRA formulas need."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    mlp: str       # "gelu" (2 matrices h x ffn) or "swiglu" (3)
    source: str
    tied: bool = False     # the output layer is the token embedding's matrix (a matmul: it counts once)
    positions: int = 0     # rows of a learned position-embedding table (0: none, e.g. RoPE)

    @property
    def lookup_params(self) -> int:
        """Parameters used only by table lookups, which do no matmul: the input token embedding (unless the
        output layer shares it) and a learned position table. The FLOPs formula leaves them out."""
        return (0 if self.tied else self.vocab * self.hidden) + self.positions * self.hidden

    def linear_params_per_layer(self) -> int:
        kv = self.hidden * self.kv_heads // self.heads
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv + \
            (3 if self.mlp == "swiglu" else 2) * self.hidden * self.ffn


def _round_nice(x: float) -> int:
    """Round to a count with many divisors (multiple of 8 from 32, of 4 from 8, of 2 from 2)."""
    step = 8 if x >= 32 else 4 if x >= 8 else 2 if x >= 2 else 1
    return max(step, int(round(x / step)) * step)


def derive_architecture(params: int, layers=None, hidden=None, heads=None, kv_heads=None,
                        vocab=None) -> Arch:
    """Resolve the architecture. Neither --layers nor --hidden: the nearest KNOWN_MODELS entry within
    10% of `params`, else a shape from N ~ 12*L*h^2 + V*h with h ~ 128*L (the aspect ratio of the
    Llama/GPT-3 models) and 128-wide heads. One of them given: solve for the other."""
    V = vocab or 32000
    source = "given"
    if layers is None and hidden is None:
        name, spec = min(KNOWN_MODELS.items(), key=lambda kv: abs(math.log(params / kv[1][0])))
        if abs(params / spec[0] - 1) <= 0.10:
            _, L, h, a, kv, ffn, v, mlp = spec
            a = heads or a
            return Arch(L, h, a, kv_heads or (kv if a == spec[3] else a), ffn, vocab or v, mlp,
                        f"table: {name}", tied=name in TIED_WITH_POSITIONS,
                        positions=TIED_WITH_POSITIONS.get(name, 0))
        guess = _round_nice((params / (12 * 128 ** 2)) ** (1 / 3))
        h = (-V + math.sqrt(V * V + 48 * guess * params)) / (24 * guess)
        hidden = 128 * _round_nice(h / 128)     # then fit the layer count to the rounded width
        source = "derived: width from h ~ 128*L, layers from N ~ 12*L*h^2 + V*h"
    if hidden is None:
        h = (-V + math.sqrt(V * V + 48 * layers * params)) / (24 * layers)
        hidden = 128 * _round_nice(h / 128)
        source = "derived: hidden from N ~ 12*L*h^2 + V*h, 128-wide heads"
    elif layers is None:
        layers = _round_nice(max(1.0, (params - V * hidden) / (12 * hidden * hidden)))
        source = source if source != "given" else "derived: layers from N ~ 12*L*h^2 + V*h"
    heads = heads or max(1, hidden // 128)
    return Arch(int(layers), int(hidden), int(heads), int(kv_heads or heads), 4 * int(hidden), V, "gelu",
                source)


def lora_params(arch: Arch, rank: int, targets: str) -> int:
    """LoRA adapter parameters (Hu et al. 2021): r*(d_in + d_out) per adapted matrix; targets
    'attention' = q,k,v,o, 'all' = attention + every MLP matrix."""
    h, kv = arch.hidden, arch.hidden * arch.kv_heads // arch.heads
    per_layer = rank * (2 * (h + h) + 2 * (h + kv))
    if targets == "all":
        per_layer += rank * (3 if arch.mlp == "swiglu" else 2) * (h + arch.ffn)
    return per_layer * arch.layers
