"""Choosing the next token: greedy (temperature 0), or sampling with temperature and top-p.

Every random number a request uses comes from (its seed, the index of the token being chosen, a stream name)
alone -- no generator state carried from token to token. Token n of a request is therefore the same whether
it is generated in one go or after a re-prefill on another replica (spotfill/generation/relay.py), and
whatever else shares the batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1
# independent uniform streams per token index
MAIN, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0           # 0: greedy
    top_p: float = 1.0
    seed: int | None = None            # None: drawn once when the request is made (then carried with it)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False           # benchmarks: generate max_tokens whatever the model says
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def with_seed(self) -> "SamplingParams":
        """These parameters with a concrete seed (a fresh random one when none was given)."""
        if self.seed is not None:
            return self
        from dataclasses import replace
        return replace(self, seed=int.from_bytes(os.urandom(8), "little") >> 1)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int, stream: int = MAIN) -> float:
    """A uniform number in [0, 1) determined by (seed, token index, stream) alone."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & MASK64) ^ index) ^ (stream * 0x632BE59BD9B4E019))
    return (h >> 11) * (1.0 / (1 << 53))


def probabilities(logits, temperature, top_p):
    """Row-wise sampling distributions [n, vocab] (float32) from logits [n, vocab]: softmax(logits / T),
    restricted to the smallest set of most likely tokens whose mass reaches top_p, renormalised.
    `temperature`, `top_p`: tensors [n] (temperature > 0)."""
    import torch
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if bool((top_p < 1.0).any()):
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered          # mass of the more likely tokens
        ordered = ordered.masked_fill(before >= top_p[:, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs, u):
    """One token per row from `probs` [n, vocab] by inverse CDF with uniforms `u` [n] (a tensor)."""
    import torch
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None].contiguous(), right=True)
    return idx[:, 0].clamp_(max=probs.shape[-1] - 1)


def param_tensors(params: list[SamplingParams], device):
    """(temperature [n], top_p [n]) for the rows' parameters (temperature 1 where greedy: unused)."""
    import torch
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    return temp, top_p


def choose(logits, params: list[SamplingParams], indices: list[int], stream: int = MAIN):
    """The next token of each row: logits [n, vocab]; params per row; indices: the index each row's token
    will have among its request's generated tokens (the random numbers' key). Returns (tokens [n] tensor,
    probs [n, vocab] or None when every row is greedy)."""
    import torch
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens, None
    temp, top_p = param_tensors(params, logits.device)
    probs = probabilities(logits, temp, top_p)
    u = torch.tensor([0.0 if p.greedy else uniform(p.seed, i, stream) for p, i in zip(params, indices)],
                     device=logits.device)
    drawn = draw(probs, u)
    rows = torch.tensor(sampled, device=logits.device)
    tokens[rows] = drawn[rows]
    return tokens, probs
