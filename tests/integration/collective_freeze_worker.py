"""Child process body for test_collective_timeout: one gloo rank set up as a spotfill training worker is.

The process group comes from Ray Train's own setup function with the TorchConfig spotfill builds
(train/job.py: timeout_s = SPOTFILL_COLLECTIVE_TIMEOUT_S), the engine from train.engine.build_engine
(DeepSpeed ZeRO-2, whose data-parallel group is DeepSpeed's own clone of the world group). Rank 1 then
stops itself (SIGSTOP: its sockets stay open, nothing answers); rank 0 times two collectives that need it --
the step's flags all_gather on the default group, and a training step (ZeRO's gradient reduction on
DeepSpeed's group) -- and writes what each raised, and when, to `out`.
"""
from __future__ import annotations

import json
import os
import signal
import time


def run(rank: int, world: int, port: int, timeout_s: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      SPOTFILL_COLLECTIVE_TIMEOUT_S=str(timeout_s))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _setup_torch_process_group

    from spotfill.config import constants
    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.train.engine import build_engine, ds_config
    from spotfill.train.model import build_model

    cfg = TorchConfig(backend="gloo", timeout_s=constants.COLLECTIVE_TIMEOUT_S)      # as train/job.py builds it
    assert cfg.init_method == "env"            # Ray Train's backend passes it on as the URL "env://"
    _setup_torch_process_group(cfg.backend, rank, world, "env://", cfg.timeout_s)   # as Ray Train's backend
    job = from_mapping(JobConfig, {"storage": "/unused", "data": {"path": "/unused"},
                                   "training": {"workers": [1, 2], "global_batch": 2, "zero_stage": 2,
                                                "steps": 10, "warmup_steps": 1, "max_micro_batch": 1}})
    torch.manual_seed(0)
    engine = build_engine(build_model("tiny", seq_len=16, vocab_size=64), ds_config(job, 1, 1, "fp32", False))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)     # frozen until the parent kills it
        return
    time.sleep(0.5)
    results = {}
    flags = torch.zeros(4, dtype=torch.float64)
    x = torch.randint(0, 64, (1, 16))

    def step():
        loss = F.cross_entropy(engine(x).reshape(-1, 64), x.reshape(-1))
        engine.backward(loss)
        engine.step()

    for name, call in (("flags_all_gather", lambda: dist.all_gather([torch.empty_like(flags)] * world, flags)),
                       ("zero_step", step)):
        t0 = time.monotonic()
        try:
            call()
            results[name] = {"raised": None, "after_s": time.monotonic() - t0}
        except Exception as exc:  # noqa: BLE001 -- what the collective raised is the result
            results[name] = {"raised": f"{type(exc).__name__}: {str(exc)[:300]}", "after_s": time.monotonic() - t0}
    with open(out, "w") as f:
        json.dump(results, f)
