"""Every private Ray hook resolves against the installed Ray, and a moved one fails loudly at import."""
import pytest

from spotfill import ray_compat


def test_every_hook_resolves_with_its_signature():
    assert len(ray_compat.HOOKS) >= 8
    for owner, name, params in ray_compat.HOOKS:
        ray_compat._require(owner, name, params)


def test_serve_hooks_resolve_and_the_watch_reads_the_running_replicas():
    """The Ingress's replica watch (serving/app.py): Serve's long poll of DEPLOYMENT_TARGETS, whose update
    is a DeploymentTargetInfo; the watch reports the ids of the replicas it lists."""
    import asyncio
    from ray.serve._private.common import DeploymentID, DeploymentTargetInfo
    from ray.serve._private.long_poll import LongPollNamespace

    ray_compat.check_serve_hooks()
    assert len(ray_compat._serve_hooks()) >= 8
    seen, made = [], {}

    class FakeClient:
        def __init__(self, host_actor, key_listeners, call_in_event_loop, client_id):
            made.update(host=host_actor, listeners=key_listeners, loop=call_in_event_loop)

    loop = asyncio.new_event_loop()
    try:
        with pytest.MonkeyPatch.context() as mp:
            import ray
            import ray.serve._private.long_poll as long_poll
            mp.setattr(long_poll, "LongPollClient", FakeClient)
            mp.setattr(ray, "get_actor", lambda name, namespace: (name, namespace))
            ray_compat.watch_running_replicas("app", "Generator", seen.append, loop)
    finally:
        loop.close()
    assert made["host"] == ("SERVE_CONTROLLER_ACTOR", "serve") and made["loop"] is loop
    ((key, listener),) = made["listeners"].items()
    assert key == (LongPollNamespace.DEPLOYMENT_TARGETS, DeploymentID(name="Generator", app_name="app"))
    listener(DeploymentTargetInfo(is_available=True, running_replicas=["r1", "r2"]))
    listener(DeploymentTargetInfo(is_available=True, running_replicas=[]))
    assert seen == [["r1", "r2"], []]


def test_a_missing_hook_fails_loudly_naming_it():
    class Owner:
        def present(self, a, b):
            pass

    with pytest.raises(ray_compat.RayCompatError, match="absent"):
        ray_compat._require(Owner, "absent", ())
    with pytest.raises(ray_compat.RayCompatError, match=r"present\('b', 'a'\)"):
        ray_compat._require(Owner, "present", ("b", "a"))


def test_scaling_policy_swap_keeps_the_trainer_a_trainer():
    from ray.train.torch import TorchTrainer

    from spotfill.train.elastic import SpotfillTorchTrainer
    assert issubclass(SpotfillTorchTrainer, TorchTrainer)
    assert SpotfillTorchTrainer.__name__ == "SpotfillTorchTrainer"


def test_callbacks_marked_first_run_ahead_of_rays_own_order_kept():
    class Mark:
        spotfill_runs_first = True

    ray_backend, ray_pg, ours_restart, reaper = object(), object(), object(), Mark()
    assert ray_compat.callbacks_first([ray_backend, ray_pg, ours_restart, reaper]) == \
        [reaper, ray_backend, ray_pg, ours_restart]


_ENGINE_STEP = r"""
import os, sys
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo")
from spotfill.train.engine import build_engine
from spotfill.train.model import build_model
engine = build_engine(build_model("tiny", seq_len=16, vocab_size=64), {
    "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
    "steps_per_print": 10 ** 9})
x = torch.randint(0, 64, (2, 17))
before = [p.detach().clone() for p in engine.module.parameters()]
out = engine(x[:, :-1])
engine.backward(torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1)))
engine.step()
moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))
muon = sys.modules["deepspeed.runtime.zero.muon.original_muon"]
try:
    muon.MuonWithAuxAdam([])
    refused = False
except RuntimeError as exc:
    refused = "AdamW" in str(exc)
fused = engine.optimizer.optimizer.defaults.get("fused")    # torch's fused AdamW under ZeRO-2's wrapper
print("RESULT", moved, "torch._inductor.compile_fx" in sys.modules, refused, fused)
"""


def test_engine_builds_and_steps_without_loading_torch_inductor(tmp_path):
    """DeepSpeed's Muon modules (torch.compile at import: torch._inductor) stay out of a spotfill worker:
    a ZeRO-2 engine builds and takes a real step (its parameters move) without them, with torch's fused
    AdamW as its optimizer (train.engine.client_optimizer), and a Muon optimizer built anyway is refused
    with a clear message. Run in a fresh interpreter."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "step.py"
    script.write_text(_ENGINE_STEP)
    proc = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line == "RESULT True False True True", (proc.stdout[-2000:], proc.stderr[-3000:])
