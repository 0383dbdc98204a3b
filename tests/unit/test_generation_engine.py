"""The generation engine on tiny random models (CPU): the KV-cached forward gives the training forward's
logits, continuous batching gives every request what it would get alone, sampling is reproducible from the
seed and the token index (so a request continued elsewhere goes on identically), stop sequences, the
context limit, cancellation."""
from __future__ import annotations

import pytest
import torch

from spotfill.generation.decoders import GPTDecoder, RecomputeDecoder
from spotfill.generation.engine import Engine, GenerationRequest
from spotfill.generation.sampling import SamplingParams
from spotfill.generation.text import ByteTokenizer
from spotfill.train.model import GPT, preset


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(preset("tiny")).eval()


def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The reference: the whole context through the training forward for every token, argmax."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([prompt + out]))[0, -1].argmax())
            if tok >= 256:
                break
            out.append(tok)
    return out


def run(engine, requests, between=None):
    """Submit, step to the end; {id: [updates]}. `between(step_no)` runs before each step."""
    got: dict[str, list] = {}
    for req in requests:
        engine.submit(req, lambda u: got.setdefault(u.request_id, []).append(u))
    step = 0
    while True:
        if between:
            between(step, lambda req: engine.submit(req, lambda u: got.setdefault(u.request_id, []).append(u)))
        step += 1
        if not engine.step() and step > 50:
            break
    return got


def ids(updates) -> list[int]:
    return [t for u in updates for t in u.ids]


def req(rid, prompt, **params):
    return GenerationRequest(str(rid), list(prompt.encode()), SamplingParams(**params))


def test_cached_forward_gives_the_training_forwards_logits(model):
    x = torch.randint(0, 256, (3, 40))
    ref = model(x)
    dec = GPTDecoder(model)
    cache = dec.new_cache(4)
    whole = dec.forward(cache, 1, x.tolist(), [0, 0, 0])                 # prefill in rows 1..3
    assert torch.allclose(whole, ref, atol=1e-5)
    cache = dec.new_cache(3)
    one_by_one = torch.cat([dec.forward(cache, 0, x[:, i:i + 1].tolist(), [i] * 3) for i in range(40)], dim=1)
    assert torch.allclose(one_by_one, ref, atol=1e-5)
    # rows at different lengths in one step: each sees only its own positions
    cache = dec.new_cache(2)
    dec.forward(cache, 0, [x[0, :30].tolist()], [0])
    dec.forward(cache, 1, [x[1, :10].tolist()], [0])
    step = dec.forward(cache, 0, [[int(x[0, 30])], [int(x[1, 10])]], [30, 10])
    assert torch.allclose(step[0, 0], ref[0, 30], atol=1e-5) and torch.allclose(step[1, 0], ref[1, 10], atol=1e-5)


def test_continuous_batching_gives_each_request_its_solo_greedy_output(model):
    """Six requests on 3 rows, two more joining mid-run: rows leave and are refilled (compaction moves the
    last row), and each output equals the reference computed alone."""
    prompts = ["hello", "a", "the quick brown fox", "x" * 12, "zz", "abc def", "late one", "late two!"]
    limits = [5, 17, 9, 30, 3, 11, 8, 14]
    first = [req(i, p, max_tokens=n) for i, (p, n) in enumerate(zip(prompts[:6], limits[:6]))]

    def join(step, submit):
        if step == 4:
            for i in (6, 7):
                submit(req(i, prompts[i], max_tokens=limits[i]))
    got = run(Engine(GPTDecoder(model), ByteTokenizer(), max_batch=3), first, join)
    for i, (p, n) in enumerate(zip(prompts, limits)):
        assert ids(got[str(i)]) == naive_greedy(model, list(p.encode()), n), i
        assert got[str(i)][-1].finish_reason in ("length", "stop")
        assert sum(1 for u in got[str(i)] if u.finish_reason) == 1


def test_recompute_decoder_matches_the_cached_one(model):
    rec = RecomputeDecoder(model, model.cfg.seq_len, model.cfg.vocab_size)
    reqs = [req(i, p, max_tokens=12) for i, p in enumerate(["one", "two three"])]
    a = run(Engine(rec, ByteTokenizer(), max_batch=2), reqs)
    b = run(Engine(GPTDecoder(model), ByteTokenizer(), max_batch=2),
            [req(i, p, max_tokens=12) for i, p in enumerate(["one", "two three"])])
    assert {k: ids(v) for k, v in a.items()} == {k: ids(v) for k, v in b.items()}


def test_sampling_is_reproducible_from_seed_and_token_index(model):
    def sample(seed, companions=0, max_batch=4):
        reqs = [req("r", "prompt", max_tokens=20, temperature=0.9, top_p=0.9, seed=seed)]
        reqs += [req(f"c{i}", "other" * (i + 1), max_tokens=20, temperature=1.0, seed=100 + i)
                 for i in range(companions)]
        return ids(run(Engine(GPTDecoder(model), ByteTokenizer(), max_batch=max_batch, ), reqs)["r"])
    alone = sample(7)
    assert sample(7, companions=3) == alone               # whatever shares the batch
    assert sample(8) != alone
    greedy = naive_greedy(model, list(b"prompt"), 20)
    assert alone != greedy


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_continued_request_goes_on_as_if_uninterrupted(model, temperature):
    """What a replica does with a request continued from another: prompt + the tokens generated so far are
    prefilled, and the rest equals the uninterrupted run (same seed, token index keys the randomness)."""
    params = dict(max_tokens=24, temperature=temperature, seed=3, ignore_eos=True)
    whole = run(Engine(GPTDecoder(model), ByteTokenizer()), [req("r", "continue me", **params)])["r"]
    full = ids(whole)
    assert len(full) == 24
    for cut in (1, 9, 23):
        rest = GenerationRequest("r", list(b"continue me"), SamplingParams(**params), generated=full[:cut])
        assert full[:cut] + ids(run(Engine(GPTDecoder(model), ByteTokenizer()), [rest])["r"]) == full
    # text streamed across the cut concatenates to the uninterrupted text
    text = "".join(u.text for u in whole)
    cut = 9
    first = ByteTokenizer().decode(full[:cut])
    rest = GenerationRequest("r", list(b"continue me"), SamplingParams(**params), generated=full[:cut],
                             emitted=len(first.rstrip("\ufffd")))
    second = run(Engine(GPTDecoder(model), ByteTokenizer()), [rest])["r"]
    assert first.rstrip("\ufffd") + "".join(u.text for u in second) == text
    assert second[-1].completion_tokens == 24
    # lost right after its last token: the continuation only says it is finished (and sends the held-back rest)
    done = run(Engine(GPTDecoder(model), ByteTokenizer()), [GenerationRequest(
        "r", list(b"continue me"), SamplingParams(**params), generated=full, emitted=0)])["r"]
    assert [(u.ids, u.finish_reason, u.completion_tokens) for u in done] == [([], "length", 24)]
    assert done[0].text == ByteTokenizer().decode(full)


def test_stop_sequence_ends_the_request_and_is_not_returned(model):
    full = ids(run(Engine(GPTDecoder(model), ByteTokenizer()), [req("r", "stop here", max_tokens=30,
                                                                       ignore_eos=True)])["r"])
    text = ByteTokenizer().decode(full)
    stop = text[10:13]
    got = run(Engine(GPTDecoder(model), ByteTokenizer()), [req("r", "stop here", max_tokens=30, ignore_eos=True,
                                                               stop=(stop, "never-seen"))])["r"]
    out = "".join(u.text for u in got)
    assert out == text[:text.index(stop)] and got[-1].finish_reason == "stop"
    assert len(ids(got)) < 30


def test_max_tokens_up_to_the_context(model):
    ctx = model.cfg.seq_len
    got = run(Engine(GPTDecoder(model), ByteTokenizer()), [req("r", "abcd", max_tokens=10_000, ignore_eos=True)])["r"]
    assert len(ids(got)) == ctx - 4 and got[-1].finish_reason == "length"
    too_long = run(Engine(GPTDecoder(model), ByteTokenizer()), [req("r", "y" * ctx, max_tokens=4)])["r"]
    assert too_long[-1].finish_reason == "error" and "context" in too_long[-1].error


def test_cancel_frees_the_row_for_a_waiting_request(model):
    eng = Engine(GPTDecoder(model), ByteTokenizer(), max_batch=1)
    got: dict = {}
    sink = lambda u: got.setdefault(u.request_id, []).append(u)  # noqa: E731
    eng.submit(req("long", "a", max_tokens=50, ignore_eos=True), sink)
    eng.submit(req("next", "b", max_tokens=3, ignore_eos=True), sink)
    eng.step()
    eng.step()
    eng.cancel("long")
    for _ in range(10):
        eng.step()
    assert got["long"][-1].finish_reason == "cancelled" and len(ids(got["long"])) == 3     # prefill + a step, then a step
    assert ids(got["next"]) and got["next"][-1].finish_reason == "length"


def test_the_engine_thread_serves_requests_submitted_from_elsewhere(model):
    import threading
    eng = Engine(GPTDecoder(model), ByteTokenizer(), max_batch=2).start()
    try:
        done, got = threading.Event(), []

        def sink(u):
            got.append(u)
            if u.finish_reason:
                done.set()
        eng.submit(req("t", "thread", max_tokens=6, ignore_eos=True), sink)
        assert done.wait(30)
        assert ids(got) == naive_greedy(model, list(b"thread"), 6)
    finally:
        eng.stop()


def test_a_request_submitted_to_a_stopped_engine_is_answered_with_an_error_not_left_waiting(model):
    """A replica swaps engines on a checkpoint reload; a request that reaches the old one after it stopped
    must end (an error update at once), not wait forever on a queue no thread takes from."""
    eng = Engine(GPTDecoder(model), ByteTokenizer(), max_batch=2).start()
    eng.stop()
    got = []
    eng.submit(req("late", "late", max_tokens=4), got.append)
    assert [u.finish_reason for u in got] == ["error"] and "stopped" in got[0].error, got
    assert eng.busy == 0


def test_the_engine_thread_measures_its_steps_as_busy_time_not_its_waits(model):
    """With a busy meter (fillin/busy.py, as the Serve replica passes its reporter), every step the engine
    thread runs is measured and the time it waits for requests is not: two requests with a 1 s pause between
    them give at least the decoder's own forward time (timed here, around each call) as busy, and not the
    pause."""
    import threading
    import time

    from spotfill.fillin.busy import BusyMeter

    forwards: list[float] = []

    class TimedDecoder(GPTDecoder):
        def forward(self, *args, **kwargs):
            t0 = time.time()
            try:
                return super().forward(*args, **kwargs)
            finally:
                forwards.append(time.time() - t0)

    meter = BusyMeter("serve:app/Generator", "serve")
    eng = Engine(TimedDecoder(model), ByteTokenizer(), max_batch=2, meter=meter).start()
    try:
        for rid in ("a", "b"):
            done = threading.Event()
            eng.submit(req(rid, "busy", max_tokens=6, ignore_eos=True),
                       lambda u, done=done: u.finish_reason and done.set())
            assert done.wait(30)
            if rid == "a":
                time.sleep(1.0)                     # the engine thread waits: not busy
    finally:
        eng.stop()
    event = meter.take()
    assert event is not None and len(forwards) == 12            # per request: the prefill and 5 decode steps
    assert event["busy_s"] >= sum(forwards) - 0.01, (event, forwards)
    assert event["busy_s"] <= event["t1"] - event["t0"] - 0.95, (event, forwards)
