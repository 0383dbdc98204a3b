"""A pipeline checkpoint resumes with another stage count and another data-parallel width: saved with 2
stages x 1 replica, resumed as 1 stage x 2 replicas, trained on and saved, resumed with 2 stages again --
weights, Adam moments, step and learning rate equal at tolerance 0 (fp32) after each move. Weights are
saved per layer; the ZeRO-1 optimizer state moves through DeepSpeed's universal checkpoint (converted once
by spotfill's restore, from spotfill's own storage). DeepSpeed's own cross-topology test is disabled
upstream (tests/unit/checkpoint/test_pipeline.py)."""
from __future__ import annotations

import os
import pickle
import socket

import torch
import torch.multiprocessing as mp

from ds_pipe_reshard_worker import run


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(stages: int, world: int, mode: str, train_steps: int, uri: str, work: str) -> dict:
    mp.spawn(run, args=(world, _port(), stages, mode, train_steps, 0, uri, work), nprocs=world, join=True)
    with open(os.path.join(work, f"{mode}-s{stages}.pkl"), "rb") as f:
        return pickle.load(f)


def _assert_same(saved: dict, loaded: dict) -> None:
    assert loaded["global_steps"] == saved["global_steps"] and loaded["global_steps"] > 0
    assert loaded["lr"] == saved["lr"] and loaded["sched"] == saved["sched"]
    assert sorted(loaded["params"]) == sorted(saved["params"]) and len(saved["params"]) == 29
    for name, s in saved["params"].items():
        for key in ("param", "module", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(loaded["params"][name][key], s[key], rtol=0, atol=0,
                                       msg=f"{name}.{key} differs")


def test_pipeline_checkpoint_moves_from_2_stages_to_1_and_back(tmp_path):
    uri, work = str(tmp_path / "storage"), str(tmp_path)
    two = _spawn(2, 2, "save", 3, uri, work)                      # 2 stages x 1 replica, steps 1-3
    one = _spawn(1, 2, "load", 2, uri, work)                      # 1 stage x 2 replicas: load, steps 4-5
    assert one["universal"] and one["from_stages"] == 2 and one["step"] == 3
    _assert_same(two["state"], one["loaded"])
    back = _spawn(2, 2, "load", 0, uri, work)                     # 2 stages x 1 replica again
    assert back["universal"] and back["from_stages"] == 1 and back["step"] == 5
    _assert_same(one["state"], back["loaded"])
    assert back["loaded"]["global_steps"] == 5
