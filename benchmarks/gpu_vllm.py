"""The GPU check's vLLM section (benchmarks/gpu_check.py `--only vllm`): on a machine where vLLM imports (the
`[llm]` extra), a tiny random Llama written here (a tokenizer trained here too: nothing downloads) is served by
Ray Serve LLM exactly as `spotfill serve --engine vllm` deploys it (serving/llm.py deploy_llm): the arbiter
lends the GPU (a replica starts), one chat completion is answered, a training claim reclaims the GPU (the
replica goes) and the device memory the replica held is freed. Where vLLM does not import: skipped, saying
why, in well under a second."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request

MODEL_ID = "gpu-check-llama"


def tiny_model(root: str) -> str:
    """A 2-layer Llama with head_dim 64 (vLLM's attention kernels' sizes), tokenizer files in the folder."""
    import torch
    import transformers

    from spotfill.testing.hf_tiny import tiny_tokenizer
    folder = os.path.join(root, MODEL_ID)
    fast = tiny_tokenizer(folder)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=fast.bos_token_id,
                                   eos_token_id=fast.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def gpu_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return float(out[0]) if out else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def replicas(names) -> int:
    from spotfill.ray_compat import gcs_actors
    cls = f"ServeReplica:{names.app}:{names.server}"
    return sum(1 for a in gcs_actors(("ALIVE",)) if a["class_name"] == cls)


def wait(pred, timeout_s: float, what: str) -> float:
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.5)
    return round(time.time() - t0, 2)


def chat(url: str, timeout_s: float = 120.0) -> dict:
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "the quick brown fox"}],
                       "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def run(dry: bool, deadline: float) -> dict:
    from spotfill.serving import llm
    missing = llm.vllm_missing()
    if missing:
        return {"skipped": f"{missing}: the vLLM section runs where `import vllm` works ({llm.EXTRA})"}
    import ray

    from spotfill.cli.serve import port_free
    from spotfill.fillin.wiring import get_arbiter, runtime_env
    root = os.environ.get("GPU_CHECK_SCRATCH") or "/tmp"
    folder = tiny_model(root)
    ray.init(runtime_env=runtime_env(), logging_level="WARNING")
    names = llm.deployment_names(MODEL_ID)
    out: dict = {"names": {"ingress": names.ingress, "server": names.server},
                 "gpu_used_mib_before": gpu_used_mib()}
    t0 = time.time()
    dep = llm.deploy_llm(folder, MODEL_ID, port=port_free(0), max_replicas=1, max_model_len=256)
    budget = max(30.0, deadline - time.time() - 60)
    out["lend_to_replica_s"] = wait(lambda: replicas(names) == 1, budget, "the arbiter to lend the GPU")
    t1 = time.time()
    answer = chat(dep["url"], timeout_s=max(30.0, deadline - time.time() - 45))
    out["first_answer_s"] = round(time.time() - t1, 2)
    out["deploy_to_answer_s"] = round(time.time() - t0, 2)
    out["answer"] = {"text": answer["choices"][0]["message"]["content"], "usage": answer.get("usage")}
    out["gpu_used_mib_serving"] = gpu_used_mib()
    arbiter = get_arbiter()
    t2 = time.time()
    claim = ray.get(arbiter.claim.remote("gpu-check-train", 1, 30.0, 1, 1, 1), timeout=60)
    out["claim"] = {"ok": claim.get("ok"), "reclaimed": len(claim.get("reclaimed") or [])}
    out["replica_gone_s"] = wait(lambda: replicas(names) == 0, 30, "the replica to go after the claim")
    before = out["gpu_used_mib_before"] or 0.0
    try:   # freed: back within 512 MiB of what the device held before the deploy
        out["memory_freed_s"] = wait(lambda: (gpu_used_mib() or 0.0) <= before + 512, 30, "device memory freed")
    except TimeoutError as exc:
        out["memory_freed_s"] = None
        out["memory_error"] = str(exc)
    out["gpu_used_mib_after"] = gpu_used_mib()
    out["reclaim_s"] = round(time.time() - t2, 2)
    ray.get(arbiter.release_job.remote("gpu-check-train"))
    out["ok"] = bool(out["answer"]["text"]) and bool(claim.get("ok")) and out["memory_freed_s"] is not None
    shutil.rmtree(folder, ignore_errors=True)
    return out
