"""How many tokens to draft in the next step, or none: a pure policy over measured step times and the
measured acceptance rate (no torch, no clock of its own: the engine reports seconds).

With acceptance rate a, a verify step of k drafted tokens yields on average E(a, k) = (1 - a^(k+1)) / (1 - a)
tokens per request (k + 1 when a = 1). It costs k draft passes and one target pass over k + 1 tokens per
request, against one target pass over 1 token for a plain step. The policy predicts tokens/s for each k from
what it measured at this batch size, and picks the best -- plain decoding (k = 0) when no k beats it. So k
grows with the acceptance rate and falls with it, and speculation switches itself off when the verify pass
stops being cheap (a large batch makes the target compute-bound: k + 1 tokens cost about k + 1 times one).

While off, it still runs a speculative step now and then (a probe) to see whether that changed: the first
probe after `probe_every` plain steps, each further one after twice as many (up to `probe_max`), and never
sooner than the probe's predicted extra cost allows within `probe_budget` (a probe predicted to cost 5 plain
steps more than the tokens it yields waits for 5 / 0.03 = 167 plain steps) -- so probing costs at most about
3% from the first decision on, and less the longer speculation stays off.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """Tokens per verify step for acceptance rate a and k drafted tokens."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def bucket(batch: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, 9-16, ..."""
    return max(1, batch - 1).bit_length() if batch > 1 else 0


@dataclass
class _Bucket:
    plain_s: float | None = None           # one plain decode step
    draft_s: float | None = None           # one draft pass
    verify_s: dict[int, float] = field(default_factory=dict)    # k -> one verify pass
    plain_since_probe: int = 0
    probe_every: int = 0
    spec_since_plain: int = 0              # speculative steps since the last plain one (while on)


@dataclass
class SpecPolicy:
    max_k: int = 4                  # the most tokens drafted per step (num_draft_tokens)
    start_k: int | None = None      # k of the first speculative step (default max_k)
    probe_every: int = 16
    probe_max: int = 256
    probe_budget: float = 0.03      # the most a probe's predicted extra cost may add over the plain steps
    smoothing: float = 0.3          # weight of a new measurement in the running averages (a faster one
                                    # weighs more: a stall only ever makes a step slower)
    refresh_every: int = 32         # while on, one plain step after this many speculative ones: a plain
                                    # step's time measured during a stall must not keep speculation on
    decay: float = 0.9              # acceptance: accepted / judged tokens, older steps weighing less
    acceptance: float | None = None
    _accepted: float = 0.0
    _checked: float = 0.0
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    last_reason: str = ""

    def __post_init__(self):
        if self.max_k < 1:
            raise ValueError(f"max_k {self.max_k}: accepted >= 1")

    def _avg(self, old: float | None, new: float) -> float:
        if old is None:
            return new
        weight = self.smoothing if new >= old else min(1.0, 2.5 * self.smoothing)
        return old + weight * (new - old)

    def _bucket(self, batch: int) -> _Bucket:
        return self.buckets.setdefault(bucket(batch), _Bucket(probe_every=self.probe_every))

    def record_plain(self, batch: int, seconds: float) -> None:
        b = self._bucket(batch)
        b.plain_s = self._avg(b.plain_s, seconds)
        b.plain_since_probe += 1
        b.spec_since_plain = 0

    def record_speculative(self, batch: int, k: int, draft_s: float, verify_s: float, checked: int,
                           accepted: int) -> None:
        """One speculative step: its k, the seconds of all k draft passes and of the verify pass, how many
        drafted tokens (over all requests) were judged -- a rejection ends a request's check, so the drafts
        after it are not counted -- and how many of those were accepted. accepted / checked estimates the
        per-token acceptance rate a of the formula."""
        b = self._bucket(batch)
        b.draft_s = self._avg(b.draft_s, draft_s / max(1, k))
        b.verify_s[k] = self._avg(b.verify_s.get(k), verify_s)
        b.spec_since_plain += 1
        self._accepted = self.decay * self._accepted + accepted
        self._checked = self.decay * self._checked + checked
        if self._checked > 0:
            self.acceptance = self._accepted / self._checked

    def _verify_s(self, b: _Bucket, k: int) -> float:
        if k in b.verify_s:
            return b.verify_s[k]
        # the nearest measured k, scaled linearly in the drafted tokens from the plain step's time
        k0 = min(b.verify_s, key=lambda m: abs(m - k))
        return b.plain_s + (b.verify_s[k0] - b.plain_s) * k / k0

    def predicted(self, batch: int) -> dict[int, float]:
        """Predicted tokens per second per request for k = 0..max_k (empty until both kinds were measured)."""
        b = self._bucket(batch)
        if b.plain_s is None or b.draft_s is None or not b.verify_s or self.acceptance is None:
            return {}
        out = {0: 1.0 / b.plain_s}
        for k in range(1, self.max_k + 1):
            out[k] = expected_tokens(self.acceptance, k) / (k * b.draft_s + self._verify_s(b, k))
        return out

    def decide(self, batch: int) -> int:
        """k for the next step at this batch size (0: a plain step)."""
        b = self._bucket(batch)
        if b.plain_s is None:
            self.last_reason = "measuring a plain step"
            return 0
        rates = self.predicted(batch)
        if not rates:
            self.last_reason = "measuring a speculative step"
            return self.start_k or self.max_k
        best = max(rates, key=lambda k: (rates[k], -k))
        if best > 0 and b.spec_since_plain >= self.refresh_every:
            self.last_reason = "refreshing the plain step's time"
            return 0
        if best > 0:
            b.probe_every = self.probe_every
            b.plain_since_probe = 0
            self.last_reason = (f"k={best}: acceptance {self.acceptance:.2f}, predicted "
                                f"{rates[best] / rates[0]:.2f}x plain")
            return best
        k = max(range(1, self.max_k + 1), key=lambda m: rates[m])
        extra = rates[0] / rates[k] - 1.0                 # the probe's cost beyond its tokens, in plain steps
        gap = min(4096, max(b.probe_every, math.ceil(extra * expected_tokens(self.acceptance, k) / self.probe_budget)))
        if b.plain_since_probe >= gap:                    # off: look again now and then
            b.plain_since_probe = 0
            b.probe_every = min(self.probe_max, b.probe_every * 2)
            self.last_reason = f"probe k={k} (speculation off)"
            return k
        self.last_reason = (f"off: best k predicted {max(rates[k] for k in rates if k) / rates[0]:.2f}x "
                            f"plain at acceptance {self.acceptance:.2f}")
        return 0


@dataclass
class FixedK:
    """Always draft k tokens (tests, and measuring one k): the SpecPolicy interface without the choice."""
    k: int
    acceptance: float | None = None
    last_reason: str = "fixed k"

    def record_plain(self, batch: int, seconds: float) -> None:
        pass

    def record_speculative(self, batch: int, k: int, draft_s: float, verify_s: float, checked: int,
                           accepted: int) -> None:
        pass

    def decide(self, batch: int) -> int:
        return self.k
