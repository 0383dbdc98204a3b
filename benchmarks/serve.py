"""Serving throughput, side by side in one run: the first serving loop (fillin/generate.py: no KV cache, one
request at a time per thread) against spotfill/generation's engine (KV cache, continuous batching), with and
without a speculative draft. No Ray, no Serve: the model on one device, the same prompts for every side.

    python -m benchmarks.serve [--quick] [--preset 50m] [--device cpu|cuda:0] [--draft self:2] [--json PATH]
    spotfill bench --only serve

Sides (tokens/s = generated tokens over wall time; every side once per round, 3 rounds (1 with --quick), the
median round reported; each engine is built once and warmed up at batch 1 and 8 first, as a replica's engine
lives on, so the adaptive policy has measured both batch sizes):
  toy_loop       batch1: one request; batch8: 8 requests on 8 threads, as the old replica ran them
  engine         batch1: one request; batch8: 8 requests submitted together
  specdec        the engine with the draft and the adaptive policy (what `draft:` gives users)
  specdec_fixed  the engine with the draft at a fixed k (acceptance and accepted length without the policy)
Acceptance rate (accepted / drafted tokens, as vLLM reports it) and mean accepted length (tokens per verify
step) come from the fixed-k run; beside them the expectation (1 - a^(k+1)) / (1 - a) with a the per-token
acceptance (accepted / drafted tokens that were judged: a rejection ends a step's check). Weights are random unless --checkpoint names a run:
acceptance depends on the weights, so numbers from random weights say how fast, not how often.
"""
from __future__ import annotations

import argparse
import threading
import time

from benchmarks._common import REPO, emit  # noqa: F401 - REPO: puts platform/ on sys.path

PROMPT = "def fibonacci(n):\n    "


def build_model(preset: str, device: str, dtype: str, seed: int = 0, checkpoint: str | None = None):
    import torch

    from spotfill.devices import compute_dtype
    from spotfill.train.model import GPT, preset as get_preset
    dev = torch.device(device)
    dt = compute_dtype(dev, dtype)
    if checkpoint:
        import tempfile

        from spotfill.fillin.generate import load_newest
        from spotfill.storage.base import open_storage
        from spotfill.storage.checkpoint_store import CheckpointStore
        loaded = load_newest(CheckpointStore(open_storage(checkpoint)), tempfile.mkdtemp(), "auto", device=dev, dtype=dt)
        return loaded.model
    torch.manual_seed(seed)
    return GPT(get_preset(preset)).to(device=dev, dtype=dt).eval()


class BytesOnly:
    """The model with ids above 255 (end-of-document, and a 32000-token preset's others) masked out, so the old
    loop generates as many tokens as asked, like the engine's ignore_eos (one masked_fill per step)."""

    def __init__(self, model):
        self.model, self.cfg = model, model.cfg

    def parameters(self):
        return self.model.parameters()

    def __call__(self, idx):
        logits = self.model(idx)
        logits[..., 256:] = float("-inf")
        return logits


def toy_loop(model, n_requests: int, new_tokens: int) -> dict:
    """The old loop: each request on its own thread (the old replica ran up to 8 with asyncio.to_thread)."""
    from spotfill.fillin.generate import generate
    model = BytesOnly(model)                 # the old loop stops at any id > 255: the engine sides use ignore_eos
    counts = [0] * n_requests

    def one(i: int) -> None:
        counts[i] = generate(model, PROMPT + str(i), new_tokens, 0.0, i)[1]
    generate(model, PROMPT, 2)                                        # warm-up
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens": sum(counts), "seconds": round(wall, 3), "tokens_per_s": round(sum(counts) / wall, 2)}


def make_engine(model, draft: str = "", k: int = 4, fixed: bool = False, max_batch: int = 8):
    """One engine, kept for the whole run like a replica's (the adaptive policy learns across requests)."""
    from spotfill.generation.replica import DraftSpec, build_engine
    from spotfill.generation.spec_policy import FixedK
    spec = DraftSpec.parse(draft) if draft else DraftSpec()
    return build_engine(model, spec, None, k, max_batch, policy=FixedK(k) if (fixed and draft) else None)


def engine_run(engine, n_requests: int, new_tokens: int, outputs: dict | None = None) -> dict:
    """Requests submitted together to the engine (prompts in the engine's tokenizer); tokens/s and the
    speculative counts. `outputs` gets each request's generated ids."""
    from spotfill.generation.engine import GenerationRequest
    from spotfill.generation.sampling import SamplingParams

    finished, tokens = [], [0]

    def sink(u):
        tokens[0] += len(u.ids)
        if outputs is not None:
            outputs.setdefault(u.request_id, []).extend(u.ids)
        if u.finish_reason:
            finished.append(u)

    engine.stats.clear()
    t0 = time.perf_counter()
    for i in range(n_requests):
        engine.submit(GenerationRequest(str(i), engine.tokenizer.encode(PROMPT + str(i)),
                                        SamplingParams(max_tokens=new_tokens, ignore_eos=True)), sink)
    while len(finished) < n_requests and engine.step():
        pass
    wall = time.perf_counter() - t0
    st = engine.stats
    out = {"tokens": tokens[0], "seconds": round(wall, 3), "tokens_per_s": round(tokens[0] / wall, 2)}
    if engine.draft is not None:
        steps = sum(u.verify_steps for u in finished)
        accepted = sum(u.accepted for u in finished)
        out.update(drafted=st["drafted"], checked=st["checked"], accepted=st["accepted"],
                   speculative_steps=st["speculative_steps"], plain_steps=st["plain_steps"],
                   acceptance_rate=round(st["accepted"] / st["drafted"], 4) if st["drafted"] else None,
                   per_token_acceptance=round(st["accepted"] / st["checked"], 4) if st["checked"] else None,
                   mean_accepted_length=round((accepted + steps) / steps, 3) if steps else None,
                   policy=getattr(engine.policy, "last_reason", ""))
    return out


def median_run(results: list[dict]) -> dict:
    """The run with the median tokens/s, with every round's tokens/s beside it."""
    ordered = sorted(results, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "rounds_tokens_per_s": [r["tokens_per_s"] for r in results]}


def expected_tokens(a: float | None, k: int) -> float | None:
    from spotfill.generation.spec_policy import expected_tokens as e
    return None if a is None else round(e(a, k), 3)


def bench_serve(quick: bool, progress=None, preset: str | None = None, device: str = "cpu", dtype: str = "auto",
                draft: str | None = None, k: int = 4, new_tokens: int | None = None,
                checkpoint: str | None = None, threads: int | None = None) -> dict:
    say = progress or (lambda msg: None)
    import torch
    before = torch.get_num_threads()
    if threads or device == "cpu":
        # one intra-op thread on the CPU by default: on a shared, loaded machine torch's OpenMP threads
        # wait on each other (a LayerNorm over 8 rows took 3-15 ms with 2 threads, 0.01 ms with 1)
        torch.set_num_threads(threads or 1)
    try:
        return _bench(say, quick, preset, device, dtype, draft, k, new_tokens, checkpoint)
    finally:
        torch.set_num_threads(before)


def _bench(say, quick, preset, device, dtype, draft, k, new_tokens, checkpoint) -> dict:
    import torch
    preset = preset or ("tiny" if quick else "50m")
    new_tokens = new_tokens or (24 if quick else 64)
    draft = draft if draft is not None else "self:1" if preset == "tiny" else "self:2"
    model = build_model(preset, device, dtype, checkpoint=checkpoint) if preset != "tiny" else _tiny_long(device)
    cfg = model.cfg
    params = sum(p.numel() for p in model.parameters())
    say(f"model {preset} ({params / 1e6:.1f}M params, {cfg.n_layer} layers) on {device}, {new_tokens} new tokens")
    out: dict = {"model": preset, "params": params, "device": str(next(model.parameters()).device),
                 "torch_threads": torch.get_num_threads(),
                 "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "new_tokens": new_tokens,
                 "weights": "checkpoint" if checkpoint else "random"}
    engines = {"engine": make_engine(model), "specdec": make_engine(model, draft, k),
               "specdec_fixed": make_engine(model, draft, k, fixed=True)}
    for name, eng in engines.items():        # warm-up: the adaptive policy measures both batch sizes
        for batch in (1, 8):
            engine_run(eng, batch, new_tokens)
    say("warm-up done: " + ", ".join(f"{n} {getattr(e.policy, 'last_reason', '')}" for n, e in engines.items()))
    runs = [("toy_loop", b, lambda b=b: toy_loop(model, b, new_tokens)) for b in (1, 8)]
    runs += [(name, b, lambda b=b, e=eng: engine_run(e, b, new_tokens)) for name, eng in engines.items() for b in (1, 8)]
    rounds = 1 if quick else 3
    seen: dict = {}
    for r in range(rounds):                  # every side once per round: drift on a shared machine hits all
        for side, batch, fn in runs:
            seen.setdefault((side, batch), []).append(fn())
        say(f"round {r + 1}/{rounds}: " + ", ".join(f"{side} b{batch} {seen[(side, batch)][-1]['tokens_per_s']}"
                                                    for side, batch, _ in runs))
    sides = {key: median_run(v) for key, v in seen.items()}

    def rates(side):
        return {f"batch{b}": sides[(side, b)]["tokens_per_s"] for b in (1, 8)}
    fixed1 = sides[("specdec_fixed", 1)]
    out.update({
        "tokens_per_s": rates("engine"),
        "toy_loop_tokens_per_s": rates("toy_loop"),
        "speedup_vs_toy_loop": {f"batch{b}": round(sides[("engine", b)]["tokens_per_s"] /
                                                   sides[("toy_loop", b)]["tokens_per_s"], 2) for b in (1, 8)},
        "specdec": {"tokens_per_s": rates("specdec"), "acceptance_rate": fixed1["acceptance_rate"],
                    "mean_accepted_length": fixed1["mean_accepted_length"], "num_draft_tokens": k, "draft": draft,
                    "per_token_acceptance": fixed1["per_token_acceptance"],
                    "expected_tokens_per_step": expected_tokens(fixed1["per_token_acceptance"], k),
                    "speedup": {f"batch{b}": round(sides[("specdec", b)]["tokens_per_s"] /
                                                   sides[("engine", b)]["tokens_per_s"], 3) for b in (1, 8)},
                    "policy": {f"batch{b}": sides[("specdec", b)]["policy"] for b in (1, 8)},
                    "fixed_k": {"tokens_per_s": rates("specdec_fixed"),
                                "acceptance_rate_batch8": sides[("specdec_fixed", 8)]["acceptance_rate"],
                                "mean_accepted_length_batch8": sides[("specdec_fixed", 8)]["mean_accepted_length"]}},
        "runs": {f"{side}_batch{b}": v for (side, b), v in sides.items()}})
    if not checkpoint:           # a Hugging Face model served the same way, beside the preset
        out["hf_llama"] = hf_llama(say, rounds, new_tokens, k, device)
    return out


def hf_llama(say, rounds: int, new_tokens: int, k: int, device: str) -> dict:
    """A Hugging Face model served as spotfill serves one (spotfill.testing.hf_tiny: a random 4-layer Llama
    with its own BPE tokenizer, built here): the engine on its per-row KV cache (HFDecoder), with and without
    the self:1 draft, beside the same engine recomputing the whole context each token (RecomputeDecoder: the
    path before); greedy output identical with and without the draft."""
    import tempfile

    from spotfill.generation.decoders import RecomputeDecoder
    from spotfill.generation.engine import Engine
    from spotfill.generation.replica import DraftSpec, build_engine
    from spotfill.generation.text import HFTokenizer
    from spotfill.testing.hf_tiny import tiny_llama
    from spotfill.train.model import build_model
    model_dir, tok_dir = tiny_llama(tempfile.mkdtemp(prefix="spotfill-bench-llama-"), layers=4, context=256)
    model = build_model(f"hf:{model_dir}").to(device).eval()
    tok = HFTokenizer(tok_dir)
    engines = {"engine": build_engine(model, tokenizer=tok),
               "specdec": build_engine(model, DraftSpec.parse("self:1"), tokenizer=tok, num_draft_tokens=k),
               "recompute": Engine(RecomputeDecoder(model, model.cfg.seq_len, model.cfg.vocab_size), tok)}
    for eng in engines.values():
        for batch in (1, 8):
            engine_run(eng, batch, new_tokens)
    seen: dict = {}
    outputs: dict = {name: {} for name in engines}
    for _ in range(rounds):
        for name, eng in engines.items():
            for b in (1, 8):
                seen.setdefault((name, b), []).append(engine_run(eng, b, new_tokens, outputs[name] if b == 8 else None))
    sides = {key: median_run(v) for key, v in seen.items()}
    rates = {name: {f"batch{b}": sides[(name, b)]["tokens_per_s"] for b in (1, 8)} for name in engines}
    same = outputs["specdec"] == outputs["engine"] == outputs["recompute"]
    say(f"hf llama: engine {rates['engine']}, self:1 draft {rates['specdec']}, recompute {rates['recompute']}, "
        f"greedy identical: {same}")
    return {"model": "tiny Llama (4 layers, 64 wide, random)", "params": sum(p.numel() for p in model.parameters()),
            "tokenizer": "BPE (hf_tiny)", "tokens_per_s": rates["engine"],
            "specdec": {"draft": "self:1", "tokens_per_s": rates["specdec"],
                        "acceptance_rate": sides[("specdec", 8)].get("acceptance_rate")},
            "recompute_tokens_per_s": rates["recompute"],
            "speedup_vs_recompute": {f"batch{b}": round(sides[("engine", b)]["tokens_per_s"] /
                                                        sides[("recompute", b)]["tokens_per_s"], 2) for b in (1, 8)},
            "greedy_identical": same}


def _tiny_long(device: str):
    """The tiny preset with a 256-token context (its 64 leave no room for a prompt and the new tokens)."""
    import torch

    from spotfill.train.model import GPT, preset
    torch.manual_seed(0)
    return GPT(preset("tiny", seq_len=256)).to(device).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--preset", default=None, help="model preset (default 50m; tiny with --quick)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:0")
    p.add_argument("--dtype", default="auto", help="auto (bf16 where supported), bf16, fp16, fp32")
    p.add_argument("--draft", default=None, help="self:L or a run's storage URI (default self:2; self:1 for tiny)")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--checkpoint", default=None, help="a run's storage URI: its weights instead of random ones")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default 1 on the CPU)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = bench_serve(a.quick, progress=lambda m: print(m, flush=True), preset=a.preset, device=a.device,
                         dtype=a.dtype, draft=a.draft, k=a.num_draft_tokens, new_tokens=a.new_tokens,
                         checkpoint=a.checkpoint, threads=a.threads)
    return emit(result, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
