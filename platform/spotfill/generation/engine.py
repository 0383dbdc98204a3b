"""The generation engine: KV-cached decoding of many requests at once (continuous batching), with an optional
draft for speculative decoding.

A request joins the running batch at the next step (its prompt is prefilled into a free cache row and its
first token chosen), and leaves it the step it finishes (end of text, a stop sequence, max_tokens, the model's
context, or cancelled); the other requests never wait for it. Each step decodes one token for every running
request, or -- with a draft and when the policy (spec_policy.py) says it pays -- drafts k tokens per request
and verifies them in one target pass.

Rows: running requests occupy cache rows 0..n-1; when one leaves, the last row moves into its place, so a
step runs on a contiguous slice of the cache. Each row's cache holds every token of its request but the
last (the next step's input). A draft with a cache of its own (a run's URI, a Hugging Face model) falls
behind on plain steps, which run the target alone: each row counts the tokens the draft has seen, and a
speculative step first feeds it the rest, in one pass.

Threads: `submit` and `cancel` may be called from any thread; `step` runs on one (`start()` runs it in a
daemon thread until `stop()`). Updates go to each request's `sink(update)` on the engine's thread.

Busy time: given a `meter` (fillin/busy.py's reporter, or anything with `measure()`), the engine thread
measures each step it runs -- the time the device computes -- and nothing while it waits for requests.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from spotfill.generation import sampling
from spotfill.generation.spec_policy import SpecPolicy
from spotfill.generation.speculative import accept_greedy, accept_sampled
from spotfill.generation.text import IncrementalText

log = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: sampling.SamplingParams
    generated: list[int] = field(default_factory=list)   # tokens generated before (a continued request)
    emitted: int = 0                                     # characters of their text the client already has
    drafted: int = 0                                     # speculative counts carried over
    accepted: int = 0
    verify_steps: int = 0


@dataclass
class Update:
    request_id: str
    ids: list[int]                 # tokens generated this step
    text: str                      # text visible now beyond what was sent before
    finish_reason: str | None      # None while running; "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int         # all generated so far (a continued request's earlier ones included)
    emitted: int                   # characters of text sent so far, this update's included
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    error: str | None = None


class _Row:
    def __init__(self, req: GenerationRequest, sink, tokenizer):
        self.req, self.sink = req, sink
        self.params = req.params.with_seed()
        self.tokens = list(req.prompt_ids) + list(req.generated)
        self.generated = len(req.generated)
        self.text = IncrementalText(tokenizer, self.params.stop, req.generated, req.emitted)
        self.drafted, self.accepted, self.verify_steps = req.drafted, req.accepted, req.verify_steps
        self.draft_seen = 0      # leading tokens the draft's own cache holds (unused by a draft sharing the target's)
        self.finish: str | None = None
        self.new: list[int] = []
        self.delta = ""


class Engine:
    def __init__(self, target, tokenizer, max_batch: int = 8, draft=None, num_draft_tokens: int = 4,
                 policy: SpecPolicy | None = None, clock=time.perf_counter, meter=None):
        if max_batch < 1:
            raise ValueError(f"max_batch {max_batch}: accepted >= 1")
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) is not the target's "
                             f"({target.vocab_size}): a draft needs the same tokenizer")
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.max_batch, self.clock, self.meter = max_batch, clock, meter
        self.cache = target.new_cache(max_batch)
        self.shared = draft is not None and draft.shares_cache_with(target)
        self.draft_cache = None if draft is None else self.cache if self.shared else draft.new_cache(max_batch)
        self.policy = policy or (SpecPolicy(max_k=num_draft_tokens) if draft is not None else None)
        self.rows: list[_Row] = []
        self._pending: collections.deque = collections.deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = collections.Counter()

    # -- the outside ------------------------------------------------------------------------------------
    def submit(self, req: GenerationRequest, sink) -> None:
        """Queue a request; `sink(update)` gets its tokens as they come. A prompt that leaves no room for a
        token in the model's context is answered at once with finish_reason "error"."""
        total = len(req.prompt_ids) + len(req.generated)
        if req.generated and (len(req.generated) >= req.params.max_tokens or total >= self.target.context):
            # a continuation whose first replica generated the last token but was lost before saying so
            rest = IncrementalText(self.tokenizer, req.params.stop, req.generated, req.emitted).finish()
            sink(Update(req.request_id, [], rest, "length", len(req.prompt_ids), len(req.generated),
                        req.emitted + len(rest), req.drafted, req.accepted, req.verify_steps))
            return
        if not req.prompt_ids or total >= self.target.context:
            sink(Update(req.request_id, [], "", "error", len(req.prompt_ids), len(req.generated), req.emitted,
                        error=f"the prompt takes {total} of the model's {self.target.context} tokens of context: "
                              "no room to generate"))
            return
        with self._lock:
            if self._stop.is_set():        # never queued where no thread will ever take it
                sink(Update(req.request_id, [], "", "error", len(req.prompt_ids), len(req.generated), req.emitted,
                            error="the generation engine was stopped (its checkpoint was replaced)"))
                return
            self._pending.append((req, sink))
            self._lock.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    @property
    def busy(self) -> int:
        """Requests running or waiting to join."""
        with self._lock:
            return len(self.rows) + len(self._pending)

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._run, daemon=True, name="generation-engine")
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while not (self.rows or self._pending or self._cancelled or self._stop.is_set()):
                    self._lock.wait()
            try:
                if self.meter is None:
                    self.step()
                else:
                    with self.meter.measure():
                        self.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving others
                log.exception("generation step failed; failing %d running request(s)", len(self.rows))
                self._fail_all(f"{type(exc).__name__}: {exc}")

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit waiting requests, decode one step for every running one, retire finished ones. Returns
        False when there was nothing to do."""
        admitted = self._admit()
        for row in admitted:
            self._prefill(row)
        self._retire()
        if not self.rows:
            return bool(admitted)
        k = self._speculate_k()
        if k:
            self._speculative_step(k)
        else:
            self._plain_step()
        self._retire()
        return True

    def _admit(self) -> list[_Row]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            for row in self.rows:
                if row.req.request_id in cancelled:
                    row.finish = "cancelled"
            kept = collections.deque()
            for req, sink in self._pending:
                (kept.append((req, sink)) if req.request_id not in cancelled else
                 sink(Update(req.request_id, [], "", "cancelled", len(req.prompt_ids), len(req.generated),
                             req.emitted)))
            self._pending = kept
            admitted = []
            while self._pending and len(self.rows) + len(admitted) < self.max_batch:
                req, sink = self._pending.popleft()
                admitted.append(_Row(req, sink, self.tokenizer))
        self._retire()                  # cancelled rows leave before new ones take rows
        self.rows.extend(admitted)
        return admitted

    def _prefill(self, row: _Row) -> None:
        r = self.rows.index(row)
        ctx = row.tokens
        logits = self.target.forward(self.cache, r, [ctx], [0])[:, -1]
        if self.draft is not None and not self.shared:
            self.draft.forward(self.draft_cache, r, [ctx], [0])
            row.draft_seen = len(ctx)
        tokens, _ = sampling.choose(logits, [row.params], [row.generated])
        self.stats["prefill_tokens"] += len(ctx)
        self._append(row, tokens.tolist())
        self._emit(row)

    def _plain_step(self) -> None:
        rows = self.rows
        t0 = self.clock()
        logits = self.target.forward(self.cache, 0, [[r.tokens[-1]] for r in rows],
                                     [len(r.tokens) - 1 for r in rows])[:, -1]
        tokens, _ = sampling.choose(logits, [r.params for r in rows], [r.generated for r in rows])
        chosen = tokens.tolist()
        if self.policy is not None:
            self.policy.record_plain(len(rows), self.clock() - t0)
        self.stats["plain_steps"] += 1
        for row, tok in zip(rows, chosen):
            self._append(row, [tok])
            self._emit(row)

    def _speculate_k(self) -> int:
        if self.draft is None:
            return 0
        k = self.policy.decide(len(self.rows))
        room = min(self.target.context - len(r.tokens) for r in self.rows)   # positions up to len+k-1
        return max(0, min(k, room))

    def _speculative_step(self, k: int) -> None:
        rows, n = self.rows, len(self.rows)
        params = [r.params for r in rows]
        t0 = self.clock()
        drafts: list[list[int]] = [[] for _ in rows]
        q = []                                   # the draft's distributions, per drafted position
        for j in range(k):
            if j == 0 and not self.shared:
                logits = self._draft_catch_up(rows)
            else:
                inputs = [[r.tokens[-1]] if j == 0 else [d[-1]] for r, d in zip(rows, drafts)]
                starts = [len(r.tokens) - 1 + j for r in rows]
                logits = self.draft.forward(self.draft_cache, 0, inputs, starts)[:, -1]
            tokens, probs = sampling.choose(logits, params, [r.generated + j for r in rows], sampling.DRAFT)
            q.append(probs)
            for d, tok in zip(drafts, tokens.tolist()):
                d.append(tok)
        t1 = self.clock()
        logits = self.target.forward(self.cache, 0, [[r.tokens[-1]] + d for r, d in zip(rows, drafts)],
                                     [len(r.tokens) - 1 for r in rows])
        best = logits.argmax(dim=-1).tolist()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            temp, top_p = sampling.param_tensors(params, logits.device)
            p_all = sampling.probabilities(logits.reshape(n * (k + 1), -1), temp.repeat_interleave(k + 1),
                                           top_p.repeat_interleave(k + 1)).reshape(n, k + 1, -1)
        accepted_total = checked_total = 0
        for i, row in enumerate(rows):
            if row.params.greedy:
                out = accept_greedy(drafts[i], best[i])
            else:
                out = accept_sampled(drafts[i], sampling_q(q, i), p_all[i], row.params.seed, row.generated)
            accepted_total += len(out) - 1
            checked_total += min(k, len(out))       # a rejection ends the check: later drafts are not judged
            row.drafted += k
            row.accepted += len(out) - 1
            row.verify_steps += 1
            # the draft's own cache now holds the tokens before the drafts and the accepted drafts it was fed
            # (all but the k-th: drafting it needed no pass over it)
            row.draft_seen = len(row.tokens) + min(len(out) - 1, k - 1)
            self._append(row, out)
        t2 = self.clock()
        self.policy.record_speculative(n, k, t1 - t0, t2 - t1, checked_total, accepted_total)
        self.stats["speculative_steps"] += 1
        self.stats["verify_rows"] += n
        self.stats["drafted"] += n * k
        self.stats["checked"] += checked_total
        self.stats["accepted"] += accepted_total
        for row in rows:
            self._emit(row)

    def _draft_catch_up(self, rows: list[_Row]):
        """The draft's logits after each row's last token, its own cache first fed every token it has not
        seen: plain steps run the target alone, and a verify step that kept all k drafts leaves the k-th and
        the target's token unseen. One pass of t tokens per row (t: the most any row lacks); a row that
        lacks fewer starts earlier (tokens it has are computed again, giving the same keys and values), one
        shorter than t runs from position 0 and is padded after its last token (positions the next pass or
        verify step overwrites, which its own tokens never attend to)."""
        t = max(len(r.tokens) - r.draft_seen for r in rows)
        starts = [max(0, len(r.tokens) - t) for r in rows]
        inputs = [r.tokens[s:] + [r.tokens[-1]] * (t - len(r.tokens) + s) for r, s in zip(rows, starts)]
        logits = self.draft.forward(self.draft_cache, 0, inputs, starts)
        self.stats["draft_catch_up"] += sum(len(r.tokens) - 1 - r.draft_seen for r in rows)
        last = [len(r.tokens) - 1 - s for r, s in zip(rows, starts)]
        return logits[list(range(len(rows))), last]

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _append(self, row: _Row, tokens: list[int]) -> None:
        """Add chosen tokens to a running request until it finishes."""
        for tok in tokens:
            if row.finish:
                return
            if self.tokenizer.is_eos(tok) and not row.params.ignore_eos:
                row.finish = "stop"
                return
            row.tokens.append(tok)
            row.generated += 1
            row.new.append(tok)
            delta, stopped = row.text.add([tok])
            row.delta += delta
            if stopped:
                row.finish = "stop"
            elif row.generated >= row.params.max_tokens or len(row.tokens) >= self.target.context:
                row.finish = "length"

    def _emit(self, row: _Row) -> None:
        if not row.new and not row.finish and not row.delta:
            return
        if row.finish:
            row.delta += row.text.finish()
        update = Update(row.req.request_id, row.new, row.delta, row.finish, len(row.req.prompt_ids),
                        row.generated, row.text.emitted, row.drafted, row.accepted, row.verify_steps)
        row.new, row.delta = [], ""
        try:
            row.sink(update)
        except Exception as exc:  # noqa: BLE001 - a sink that fails (its client went away) ends the request
            log.warning("request %s: its sink failed (%s); cancelling it", row.req.request_id, exc)
            row.finish = row.finish or "cancelled"

    def _retire(self) -> None:
        """Finished rows leave; the last row moves into each freed row."""
        for r in range(len(self.rows) - 1, -1, -1):
            row = self.rows[r]
            if not row.finish:
                continue
            if row.finish == "cancelled":
                self._emit(row)
            last = len(self.rows) - 1
            if r != last:
                length = len(self.rows[last].tokens)
                self.target.move(self.cache, last, r, length)
                if self.draft is not None and not self.shared:
                    self.draft.move(self.draft_cache, last, r, length)
                self.rows[r] = self.rows[last]
            self.rows.pop()

    def _fail_all(self, message: str) -> None:
        for row in self.rows:
            row.finish = "error"
            update = Update(row.req.request_id, [], "", "error", len(row.req.prompt_ids), row.generated,
                            row.text.emitted, row.drafted, row.accepted, row.verify_steps, error=message)
            try:
                row.sink(update)
            except Exception:  # noqa: BLE001
                pass
        self.rows = []


def sampling_q(q: list, i: int):
    """Row i's draft distributions [k, vocab] from the per-position batches."""
    import torch
    return torch.stack([probs[i] for probs in q])
