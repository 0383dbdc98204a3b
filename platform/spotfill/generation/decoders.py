"""A model behind the one interface the engine drives.

    decoder.new_cache(slots)                       -> cache (one row per running request)
    decoder.forward(cache, first_row, tokens, starts) -> logits [n, t, vocab] (float32)
        tokens: n lists of t ids each, the tokens of rows first_row.. first_row+n-1 at positions
        starts[i] .. starts[i]+t-1; the cache holds each row's tokens below starts[i] and is written at
        the new positions (a later call may overwrite positions it wrote: speculative tokens rolled back)
    decoder.move(cache, src, dst, length)          row src's first `length` positions to row dst
    decoder.context, decoder.vocab_size

`GPTDecoder`: spotfill's GPT with a key/value cache preallocated per row (rows are slots; the engine keeps
running requests in rows 0..n-1, so a batch is a contiguous view and nothing is gathered per step).
`layers=L` runs only the first L blocks and the model's own head: a self-speculative draft, which shares the
target's cache (its first L blocks compute the same keys and values for the same tokens).
`HFDecoder`: a Hugging Face causal LM (train.model.HFCausalLM: Llama, Qwen2, Mistral, GPT-2...) with its own
key/value cache per row (a transformers DynamicCache each): a call runs each row over its new tokens only,
its cache cut back to the row's start first (speculative tokens rolled back). Rows run one after another
(their lengths differ and transformers' caches are per batch); a token costs the same at any context length.
`self_draft(model, L)`: the first L layers and the model's own head, for GPT presets and for Hugging Face
models whose layers run in order (their forward stops at config.num_hidden_layers: Llama, Qwen2, Mistral).
`RecomputeDecoder`: any other `forward(idx) -> logits` model (a test model) without a cache: each call
recomputes every row's whole context. Correct, and slow.
"""
from __future__ import annotations

import copy
import inspect

import torch


class GPTDecoder:
    def __init__(self, model, layers: int | None = None):
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.layers = int(layers or cfg.n_layer)
        if not 1 <= self.layers <= cfg.n_layer:
            raise ValueError(f"layers {layers}: accepted 1..{cfg.n_layer}")
        self.context, self.vocab_size = cfg.seq_len, cfg.vocab_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def describe(self) -> str:
        return f"GPT {self.cfg.n_layer} layers" + ("" if self.layers == self.cfg.n_layer else
                                                    f", first {self.layers} (self-speculative)")

    def shares_cache_with(self, other) -> bool:
        """A draft made of the first layers of `other`'s own model reads and writes `other`'s cache."""
        return isinstance(other, GPTDecoder) and other.model is self.model and self.layers <= other.layers

    def new_cache(self, slots: int) -> list:
        shape = (slots, self.cfg.n_head, self.context, self.cfg.n_embd // self.cfg.n_head)
        return [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                 torch.zeros(shape, device=self.device, dtype=self.dtype)) for _ in range(self.layers)]

    def forward(self, cache, first_row: int, tokens: list[list[int]], starts: list[int]):
        n, t = len(tokens), len(tokens[0])
        idx = torch.tensor(tokens, device=self.device)
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(t, device=self.device)
        kv = [(k[first_row:first_row + n], v[first_row:first_row + n]) for k, v in cache[:self.layers]]
        with torch.no_grad():
            return self.model.decode(idx, pos, kv, max(starts) + t, self.layers).float()

    @staticmethod
    def move(cache, src: int, dst: int, length: int) -> None:
        for k, v in cache:
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]


class RecomputeDecoder:
    """No cache: the rows' tokens are kept and the whole context is run through `forward` each call."""

    def __init__(self, model, context: int, vocab_size: int):
        self.model, self.context, self.vocab_size = model, int(context), int(vocab_size)
        p = next(iter(model.parameters()), None)
        self.device = p.device if p is not None else torch.device("cpu")

    def describe(self) -> str:
        return f"{type(self.model).__name__} (no KV cache: recomputed)"

    def shares_cache_with(self, other) -> bool:
        return False

    def new_cache(self, slots: int) -> list:
        return [[] for _ in range(slots)]

    def forward(self, cache, first_row: int, tokens: list[list[int]], starts: list[int]):
        out = []
        for i, (row, start) in enumerate(zip(tokens, starts)):
            seq = cache[first_row + i]
            del seq[start:]
            seq.extend(row)
            with torch.no_grad():
                logits = self.model(torch.tensor([seq], device=self.device))[0, start:]
            out.append(logits.float())
        return torch.stack(out)

    @staticmethod
    def move(cache, src: int, dst: int, length: int) -> None:
        cache[dst] = list(cache[src][:length])


class HFDecoder:
    """A Hugging Face causal LM (`inner`: transformers' model) with a DynamicCache per row."""

    def __init__(self, inner, context: int, vocab_size: int, layers: int | None = None):
        self.inner, self.context, self.vocab_size = inner, int(context), int(vocab_size)
        self.layers = layers            # a self-speculative draft of the first `layers` layers (None: all)
        p = next(iter(inner.parameters()), None)
        self.device = p.device if p is not None else torch.device("cpu")

    def describe(self) -> str:
        name = type(self.inner).__name__
        return f"{name} (KV cache per row)" + (f", first {self.layers} layers (self-speculative)"
                                               if self.layers else "")

    def shares_cache_with(self, other) -> bool:
        return False

    def new_cache(self, slots: int) -> list:
        return [None] * slots                     # made on a row's first tokens

    def forward(self, cache, first_row: int, tokens: list[list[int]], starts: list[int]):
        from transformers import DynamicCache
        out = []
        for i, (row, start) in enumerate(zip(tokens, starts)):
            r = first_row + i
            kv = cache[r]
            if kv is None or start == 0:
                kv = DynamicCache()
            have = kv.get_seq_length()
            if have > start:
                kv.crop(start)
            elif have < start:
                raise RuntimeError(f"row {r}: its cache holds {have} tokens, the call starts at {start}")
            pos = torch.arange(start, start + len(row), device=self.device)
            with torch.no_grad():
                res = self.inner(input_ids=torch.tensor([row], device=self.device), past_key_values=kv,
                                 use_cache=True, position_ids=pos[None], cache_position=pos)
            cache[r] = res.past_key_values
            out.append(res.logits[0].float())
        return torch.stack(out)

    @staticmethod
    def move(cache, src: int, dst: int, length: int) -> None:
        kv = copy.deepcopy(cache[src])
        if kv is not None and kv.get_seq_length() > length:
            kv.crop(length)
        cache[dst] = kv


def _hf_first_layers(inner, layers: int):
    """`inner` running only its first `layers` decoder layers, sharing every weight (None where its base
    model's forward does not stop at config.num_hidden_layers)."""
    base = getattr(inner, getattr(inner, "base_model_prefix", "model"), None)
    if base is None or "self.config.num_hidden_layers]" not in inspect.getsource(type(base).forward):
        return None
    short_base = copy.copy(base)                  # same submodules (the dict of modules is shared)
    short_base.config = copy.copy(base.config)
    short_base.config.num_hidden_layers = int(layers)
    short = copy.copy(inner)
    short._modules = dict(inner._modules)
    short._modules[inner.base_model_prefix] = short_base
    return short


def self_draft(model, layers: int):
    """A draft of `model`'s first `layers` layers and its own head (None for a model that cannot run so)."""
    from spotfill.train.model import GPT, HFCausalLM
    if isinstance(model, GPT):
        return GPTDecoder(model, layers=layers)
    if isinstance(model, HFCausalLM):
        short = _hf_first_layers(model.inner, layers)
        return None if short is None else HFDecoder(short, model.cfg.seq_len, model.cfg.vocab_size, layers)
    return None


def decoder_for(model):
    """The decoder for a loaded model: GPTDecoder for spotfill's GPT, HFDecoder for a Hugging Face causal LM,
    else RecomputeDecoder."""
    from spotfill.train.model import GPT, HFCausalLM
    if isinstance(model, GPT):
        return GPTDecoder(model)
    cfg = model.cfg
    if isinstance(model, HFCausalLM):
        return HFDecoder(model.inner, cfg.seq_len, cfg.vocab_size)
    return RecomputeDecoder(model, cfg.seq_len, cfg.vocab_size)
