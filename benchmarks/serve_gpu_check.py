"""GPU check of the generation engine (no Ray, no Serve): greedy output with and without a speculative draft
on the device, in bf16 and fp32, and the engine's cached logits against the training forward.

    python benchmarks/serve_gpu_check.py [--preset 125m] [--device cuda:0] [--json PATH]

Greedy decoding with a draft is the model's own output in exact arithmetic; on a GPU the verify pass (k + 1
tokens) and a plain step (1 token) run different kernels, so a near-tie between the two best tokens can
break differently. This counts such divergences instead of assuming there are none.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path[:0] = [p for p in (os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "platform"),
                            os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) if p not in sys.path]


def outputs(model, prompts, new_tokens, draft="", k=4):
    from spotfill.generation.engine import GenerationRequest
    from spotfill.generation.replica import DraftSpec, build_engine
    from spotfill.generation.sampling import SamplingParams
    from spotfill.generation.spec_policy import FixedK
    engine = build_engine(model, DraftSpec.parse(draft) if draft else DraftSpec(), None, k, 8,
                          policy=FixedK(k) if draft else None)
    got = {}
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(str(i), list(p.encode()), SamplingParams(max_tokens=new_tokens, ignore_eos=True)),
                      lambda u: got.setdefault(u.request_id, []).extend(u.ids))
    while engine.step():
        pass
    return [got[str(i)] for i in range(len(prompts))], dict(engine.stats)


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check(preset, device, dtype_name, new_tokens, drafts):
    import torch

    from spotfill.train.model import GPT, preset as get_preset
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    torch.manual_seed(0)
    model = GPT(get_preset(preset)).to(device=device, dtype=dtype).eval()
    x = torch.randint(0, 256, (2, 64), device=device)
    from spotfill.generation.decoders import GPTDecoder
    dec = GPTDecoder(model)
    with torch.no_grad():
        ref = model(x).float()
    cached = dec.forward(dec.new_cache(2), 0, x.tolist(), [0, 0])
    out = {"cached_vs_training_forward_max_abs_diff": float((cached - ref).abs().max())}
    prompts = ["def fibonacci(n):", "The quick brown fox", "import torch\n", "x" * 40, "Once upon a time", "1 2 3"]
    t0 = time.perf_counter()
    plain, _ = outputs(model, prompts, new_tokens)
    out["plain_s"] = round(time.perf_counter() - t0, 2)
    for draft, k in drafts:
        t0 = time.perf_counter()
        spec, stats = outputs(model, prompts, new_tokens, draft, k)
        div = [first_divergence(a, b) for a, b in zip(plain, spec)]
        out[f"{draft} k={k}"] = {"identical": sum(d is None for d in div), "of": len(prompts),
                                 "first_divergence_at": div, "acceptance": round(stats["accepted"] / max(1, stats["drafted"]), 3),
                                 "seconds": round(time.perf_counter() - t0, 2)}
    return out


def run(preset: str, device: str, new_tokens: int, say=lambda m: None) -> dict:
    """Greedy identity with self drafts (the model's first third of its layers, all but one) in fp32, and in
    bf16 on a GPU."""
    import torch

    from spotfill.config.presets import preset as get_preset
    result = {"torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"}
    n = get_preset(preset).n_layer
    drafts = [(f"self:{max(1, n // 3)}", 4), (f"self:{n - 1}", 4), (f"self:{n - 1}", 1)]
    for dtype in ("fp32", "bf16"):
        if dtype == "bf16" and not device.startswith("cuda"):
            continue
        result[dtype] = check(preset, device, dtype, new_tokens, drafts)
        say(f"{dtype} {json.dumps(result[dtype])}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="125m")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = run(a.preset, a.device, a.new_tokens, say=lambda m: print(m, flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
