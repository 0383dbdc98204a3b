"""Model presets as plain data (no torch import), so config validation stays fast.

The modules themselves are in model.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from spotfill.config.errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 257          # 256 bytes + end-of-document
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0


# training.activation_checkpointing: which activations the model recomputes in backward (train/model.py)
RECOMPUTE = ("none", "selective", "full")

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=64, n_layer=2, n_head=2, n_embd=64),
    "50m": GPTConfig(seq_len=256, n_layer=8, n_head=12, n_embd=768),
    "125m": GPTConfig(vocab_size=32000, seq_len=1024, n_layer=12, n_head=12, n_embd=768),
    "1b": GPTConfig(vocab_size=32000, seq_len=2048, n_layer=22, n_head=16, n_embd=2048),
}


def preset(name: str, seq_len: int | None = None, vocab_size: int | None = None) -> GPTConfig:
    if name not in PRESETS:
        raise ConfigError("training.model", name, accepted=[*PRESETS, "hf:/local/path"])
    cfg = PRESETS[name]
    if seq_len:
        cfg = replace(cfg, seq_len=seq_len)
    if vocab_size:
        cfg = replace(cfg, vocab_size=vocab_size)
    return cfg


def check_hf_model(spec: str, vocab_size: int, seq_len: int) -> dict:
    """Validate `hf:/local/dir` against the dataset before any worker starts (reads config.json only; no
    torch, no download). The folder must be a saved Hugging Face causal LM present at this path on every
    node. Returns its config."""
    import json
    import os

    path = spec[3:]
    field = "training.model"
    if not os.path.isdir(path):
        raise ConfigError(field, spec, reason="not a local directory",
                          accepted="hf:/dir written by save_pretrained(), at that path on every node")
    try:
        with open(os.path.join(path, "config.json")) as f:
            conf = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(field, spec, reason=f"no readable config.json ({exc.__class__.__name__})",
                          accepted="a folder written by save_pretrained()") from None
    model_vocab = int(conf.get("vocab_size") or 0)
    if model_vocab < vocab_size:
        raise ConfigError(field, spec, reason=f"the model's vocab_size {model_vocab} is smaller than the "
                          f"dataset's {vocab_size}", accepted="a model whose vocabulary covers the tokenizer's")
    positions = conf.get("max_position_embeddings") or conf.get("n_positions")
    if positions and int(positions) < seq_len:
        raise ConfigError(field, spec, reason=f"the model takes {positions} positions, the dataset's "
                          f"sequences need {seq_len}", accepted="a model with max_position_embeddings >= seq_len")
    return conf
