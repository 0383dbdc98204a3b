"""Speculative decoding's acceptance rule: a draft proposed k tokens, the target scored them in one pass;
which of them are kept and what comes after (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Greedy: keep the draft tokens while each equals the target's most likely token, then the target's own token
-- by induction the target's greedy output, token for token.
Sampling: keep draft token x (drawn from q) with probability min(1, p(x)/q(x)); at the first rejection draw
from norm(max(0, p - q)) and stop; with all k kept, draw one more from the target's next distribution. Each
position's token is then distributed exactly as the target's p.
"""
from __future__ import annotations

import torch

from spotfill.generation.sampling import ACCEPT, RESIDUAL, draw, uniform


def accept_greedy(draft: list[int], target_best: list[int]) -> list[int]:
    """`draft`: k proposed tokens; `target_best`: the target's most likely token after the prefix and each
    draft token (k + 1). Returns the tokens to append (between 1 and k + 1)."""
    out = []
    for j, d in enumerate(draft):
        if d != target_best[j]:
            break
        out.append(d)
    out.append(target_best[len(out)])
    return out


def accept_sampled(draft: list[int], q: torch.Tensor, p: torch.Tensor, seed: int, index: int) -> list[int]:
    """`q` [k, vocab]: the draft's distributions the k tokens were drawn from; `p` [k + 1, vocab]: the
    target's distributions at the same positions and the one after. `index`: the generated-token index of
    the first draft token (with `seed`, the key of every random number used). Returns the tokens to append."""
    out = []
    for j, d in enumerate(draft):
        pj, qj = float(p[j, d]), float(q[j, d])
        if uniform(seed, index + j, ACCEPT) * qj < pj:
            out.append(d)
            continue
        residual = (p[j] - q[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:          # p == q at this position: a rejection cannot happen
            residual = p[j].clone()
        out.append(_draw_one(residual, uniform(seed, index + j, RESIDUAL)))
        return out
    out.append(_draw_one(p[len(draft)], uniform(seed, index + len(draft), RESIDUAL)))
    return out


def _draw_one(weights: torch.Tensor, u: float) -> int:
    return int(draw(weights[None, :], torch.tensor([u], device=weights.device))[0])
