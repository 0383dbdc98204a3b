"""One training step of the tiny model on a ZeRO-2 DeepSpeed engine on the CPU (gloo, world size 1), built
by spotfill.train.engine.build_engine, and its checkpoint saved and loaded back through spotfill's ZeRO
elastic load: what CI's smoke test (tests/smoke) and the ray_compat tests run, each in a fresh interpreter.
Building the engine loads DeepSpeed's CPU comm op through torch's JIT extension loader."""
from __future__ import annotations

import os

ZERO2 = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
         "zero_optimization": {"stage": 2, "elastic_checkpoint": True}, "steps_per_print": 10 ** 9}


def init_single_process(port: int) -> None:
    """torch.distributed on gloo, this process alone (rank 0 of 1), at 127.0.0.1:`port`."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")


def tiny_engine():
    from spotfill.train.engine import build_engine
    from spotfill.train.model import build_model
    return build_engine(build_model("tiny", seq_len=16, vocab_size=64), dict(ZERO2))


def take_step(engine) -> tuple[float, bool]:
    """(loss, whether any parameter moved) of one step on random tokens."""
    import torch

    x = torch.randint(0, 64, (2, 17))
    before = [p.detach().clone() for p in engine.module.parameters()]
    out = engine(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.item(), any(not torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))


def save_and_reload(engine, ckpt_dir: str, tag: str = "s1") -> bool:
    """Save `engine` (client state {"step": 1}), load it into a fresh engine through spotfill's ZeRO elastic
    load; whether the client state and every weight came back."""
    import torch

    from spotfill.train.engine import load_checkpoint

    engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"step": 1})
    fresh = tiny_engine()
    client = load_checkpoint(fresh, ckpt_dir, tag, elastic=True)
    return client.get("step") == 1 and all(torch.equal(a.detach(), b.detach()) for a, b in
                                           zip(engine.module.parameters(), fresh.module.parameters()))
