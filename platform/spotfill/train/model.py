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
from torch.utils.checkpoint import checkpoint

from spotfill.config.errors import ConfigError
from spotfill.config.presets import PRESETS, RECOMPUTE, GPTConfig, preset  # noqa: F401 - re-exported


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V, causal: what selective activation checkpointing recomputes."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _recomputing(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, recompute: str = "none"):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.selective = recompute == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.selective and _recomputing(self):
            y = checkpoint(attention_core, q, k, v, use_reentrant=False)
        else:
            y = attention_core(q, k, v)
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
    def __init__(self, cfg: GPTConfig, recompute: str = "none"):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, recompute)
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
    """A nanoGPT-style decoder; `forward(idx) -> logits`. `recompute` (training.activation_checkpointing):
    "full" keeps only each block's input and runs the block's forward again in backward; "selective" does
    that for the attention core alone (Korthikanti et al. 2022); "none" keeps every activation."""

    def __init__(self, cfg: GPTConfig, recompute: str = "none"):
        super().__init__()
        self.cfg = cfg
        self.recompute = recompute
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, recompute) for _ in range(cfg.n_layer))
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
        full = self.recompute == "full" and _recomputing(self)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if full else block(x)
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

    def recomputed_params(self) -> int:
        """Parameters whose forward "full" recomputation runs again: the blocks' (not embeddings or head)."""
        return count_params(self.blocks) if self.recompute == "full" else 0


class HFCausalLM(nn.Module):
    """Adapter so a Hugging Face causal LM looks like GPT: `forward(idx) -> logits`."""

    def __init__(self, path: str | None, recompute: str = "none", inner: nn.Module | None = None):
        super().__init__()
        if inner is None:
            try:
                from transformers import AutoModelForCausalLM
            except ImportError as exc:  # pragma: no cover - depends on optional extra
                raise ConfigError("training.model", f"hf:{path}",
                                  reason="needs the `transformers` package (pip install spotfill[hf])") from exc
            import os
            if not os.path.isdir(path):
                raise ConfigError("training.model", f"hf:{path}", reason="not a local directory")
            inner = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        self.inner = inner
        conf = self.inner.config
        self.cfg = GPTConfig(vocab_size=conf.vocab_size,
                             seq_len=getattr(conf, "max_position_embeddings", 2048),
                             n_layer=conf.num_hidden_layers, n_head=conf.num_attention_heads,
                             n_embd=conf.hidden_size)
        self.recompute = recompute
        if recompute == "full":      # its decoder layers' forward runs again in backward
            self.inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @classmethod
    def from_config(cls, config: dict) -> "HFCausalLM":
        """The untrained model of a config.json's contents (a checkpoint's model card: no folder needed)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        conf = dict(config)
        return cls(None, inner=AutoModelForCausalLM.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=idx).logits

    def recomputed_params(self) -> int:
        if self.recompute != "full":
            return 0
        ends = {id(p) for m in (self.inner.get_input_embeddings(), self.inner.get_output_embeddings())
                if m is not None for p in m.parameters()}
        return sum(p.numel() for p in self.inner.parameters() if id(p) not in ends)


def build_model(name: str, seq_len: int | None = None, vocab_size: int | None = None,
                recompute: str = "none") -> nn.Module:
    """Build a model from a preset name or `hf:/local/path`; `recompute`: activation checkpointing."""
    if name.startswith("hf:"):
        return HFCausalLM(name[3:], recompute)
    return GPT(preset(name, seq_len=seq_len, vocab_size=vocab_size), recompute)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_info(model: nn.Module, seq_len: int) -> dict:
    """What a step event's throughput needs: parameters, model FLOPs per token (the planner's 6N + 12Lhs)
    and hardware FLOPs per token (model FLOPs + the forward the model's activation checkpointing runs
    again: telemetry.throughput.recompute_flops_per_token)."""
    from spotfill.telemetry.throughput import recompute_flops_per_token

    params = count_params(model)
    recompute = getattr(model, "recompute", "none")
    fm = model_flops(model.cfg, params, seq_len)[0]
    extra = recompute_flops_per_token(recompute, model.recomputed_params(), model.cfg.n_layer, model.cfg.n_embd,
                                      seq_len)
    return {"params": params, "flops_per_token": fm, "hardware_flops_per_token": fm + extra,
            "recompute": recompute}


def flops_per_token(cfg: GPTConfig, n_params: int, seq_len: int | None = None,
                    recompute: str = "none") -> float:
    """Training FLOPs per token of a preset, by the planner's formula (PaLM: 6N + 12*L*h*s, N without the
    embedding lookups)."""
    return model_flops(cfg, n_params, seq_len, recompute)[0]


def model_flops(cfg: GPTConfig, n_params: int, seq_len: int | None = None,
                recompute: str = "none") -> tuple[float, float]:
    """(model, hardware) FLOPs per trained token (telemetry.throughput: the planner's formula). `n_params`:
    all of GPT's parameters; its lookups -- the token embedding wte (vocab x n_embd; the output layer is a
    matrix of its own) and the position table wpe (cfg.seq_len x n_embd) -- are left out of N."""
    from spotfill.telemetry.throughput import flops_per_token as per_token

    return per_token(n_params, cfg.n_layer, cfg.n_embd, cfg.n_head, seq_len or cfg.seq_len, recompute,
                     vocab=cfg.vocab_size, positions=cfg.seq_len)
