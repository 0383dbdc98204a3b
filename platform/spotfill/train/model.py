"""GPT-style decoder presets and an optional Hugging Face causal LM from a local path.

Presets (byte-level vocabulary by default, so nothing is downloaded):
  tiny   -- tests and the demo (~0.1M params, trains in seconds on a CPU)
  50m    -- checkpoint and overhead benchmarks on CPU (~57M params with Adam state)
  125m   -- GPT-3 Small shape (Brown et al. 2020, Table 2.1)
  1b     -- ~1.2B params for GPUs
`hf:/local/path` loads any Hugging Face causal LM from disk (`transformers` must be installed; local files only).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from spotfill.config.errors import ConfigError
from spotfill.train.presets import PRESETS, GPTConfig, preset  # noqa: F401 - re-exported


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def decode(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], pos: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Attention for new tokens `x` [n, t, c] at absolute positions `pos` [n, t] over a key/value cache
        `kv` ([n, heads, T, c/heads] each, written in place at `pos`); `mask` [n, 1, t, keys] says which
        cached positions each new token sees (spotfill/generation builds it). Generation only: `forward` is
        the training path and stays as it is."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        rows = torch.arange(b, device=x.device)[:, None]
        keys = mask.shape[-1]
        kv[0][rows, :, pos] = k.transpose(1, 2).to(kv[0].dtype)
        kv[1][rows, :, pos] = v.transpose(1, 2).to(kv[1].dtype)
        y = F.scaled_dot_product_attention(q, kv[0][:, :, :keys], kv[1][:, :, :keys], attn_mask=mask)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def decode(self, x: torch.Tensor, kv, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.decode(self.ln1(x), kv, pos, mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A nanoGPT-style decoder; `forward(idx) -> logits`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def decode(self, idx: torch.Tensor, pos: torch.Tensor, kv: list, keys: int,
               layers: int | None = None) -> torch.Tensor:
        """Logits [n, t, vocab] for tokens `idx` [n, t] at absolute positions `pos` [n, t] with a key/value
        cache (`kv[i]` = (K, V) of block i, [n, heads, >= keys, head_dim] each), attending to the cached
        positions below `keys` that are <= each token's own. The cache is written at `pos`. `layers`: run
        only the first that many blocks, then the final norm and head (a self-speculative draft)."""
        mask = torch.arange(keys, device=idx.device)[None, None, :] <= pos[:, :, None]
        x = self.wte(idx) + self.wpe(pos)
        for block, cache in zip(self.blocks[:layers], kv):
            x = block.decode(x, cache, pos, mask[:, None])
        return self.head(self.ln_f(x))


class HFCausalLM(nn.Module):
    """Adapter so a Hugging Face causal LM looks like GPT: `forward(idx) -> logits`."""

    def __init__(self, path: str):
        super().__init__()
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as exc:  # pragma: no cover - depends on optional extra
            raise ConfigError("training.model", f"hf:{path}",
                              reason="needs the `transformers` package (pip install spotfill[hf])") from exc
        import os
        if not os.path.isdir(path):
            raise ConfigError("training.model", f"hf:{path}", reason="not a local directory")
        self.inner = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        conf = self.inner.config
        self.cfg = GPTConfig(vocab_size=conf.vocab_size,
                             seq_len=getattr(conf, "max_position_embeddings", 2048),
                             n_layer=conf.num_hidden_layers, n_head=conf.num_attention_heads,
                             n_embd=conf.hidden_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=idx).logits


def build_model(name: str, seq_len: int | None = None, vocab_size: int | None = None) -> nn.Module:
    """Build a model from a preset name or `hf:/local/path`."""
    if name.startswith("hf:"):
        return HFCausalLM(name[3:])
    return GPT(preset(name, seq_len=seq_len, vocab_size=vocab_size))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: GPTConfig, n_params: int, seq_len: int | None = None,
                    recompute: str = "none") -> float:
    """Training FLOPs per token of a preset, by the planner's formula (PaLM: 6N + 12*L*h*s)."""
    return model_flops(cfg, n_params, seq_len, recompute)[0]


def model_flops(cfg: GPTConfig, n_params: int, seq_len: int | None = None,
                recompute: str = "none") -> tuple[float, float]:
    """(model, hardware) FLOPs per trained token (telemetry.throughput: the planner's formula)."""
    from spotfill.telemetry.throughput import flops_per_token as per_token

    return per_token(n_params, cfg.n_layer, cfg.n_embd, cfg.n_head, seq_len or cfg.seq_len, recompute)
