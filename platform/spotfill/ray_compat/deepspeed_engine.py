"""DeepSpeed's private names: the Muon optimizer modules and the shared-memory comm op spotfill keeps out of
its workers, the ZeRO-1/2
internals of the elastic (no conversion) resharding load, its checkpoint file names (which rank's partition
a file holds) and the pipeline engine's instruction map.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
import types

from spotfill.ray_compat.catalog import MUON_MODULES, PIPE_DISPATCH, deepspeed_source
from spotfill.ray_compat.hooks import RayCompatError, require, required_message, usable

# DeepSpeed 0.19's checkpoint file names (catalog.DS_CHECKPOINT_NAMES; hook restore_node_files): the module
# file of model-parallel rank 00, and data-parallel rank <d>'s ZeRO partition (optimizer state, or ZeRO-3
# parameters; bf16_ from the bf16 optimizer without ZeRO). Group 1 of DS_PARTITION_FILE: <d>.
DS_MODEL_FILE = re.compile(r"^mp_rank_00_model_states\.pt$")
DS_PARTITION_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_(?:optim|model)_states\.pt$")

ZERO_ELASTIC_KEYS = ("BASE_OPTIMIZER_STATE", "SINGLE_PARTITION_OF_FP32_GROUPS", "OPTIMIZER_STATE_DICT")


def skip_deepspeed_muon() -> bool:
    """Stand in for DeepSpeed's Muon optimizer modules with ones that define the names DeepSpeed imports
    from them (its isinstance checks answer False; the update functions are only reached for parameters
    marked use_muon) and apply no torch.compile: the engine is built and steps without importing
    torch._inductor. Building a Muon optimizer afterwards fails with a clear message. Returns False when a
    real module is already imported (then nothing is replaced), or where the installed DeepSpeed's modules
    are not the ones checked (hook deepspeed_muon_stand_in: one warning, the real modules load)."""
    if any(m in sys.modules and not isinstance(sys.modules[m], _MuonStandIn) for m in MUON_MODULES):
        return False
    if not usable("deepspeed_muon_stand_in"):
        return False
    for module, names in MUON_MODULES.items():
        sys.modules.setdefault(module, _MuonStandIn(module, names))
    return True


def skip_deepspeed_shm_comm() -> bool:
    """Have DeepSpeed's comm backend start without its shared-memory all-reduce op (`deepspeed_shm_comm`):
    on a CPU accelerator its TorchBackend JIT-builds that C++ op as it starts (g++: 31.7 s on this 2-core
    machine, the first start of every fresh machine -- the default demo's first group waited 32.5 s in
    `deepspeed.initialize`), then loads it from the cache at every later start (a ninja check per worker).
    Only DeepSpeed's `inference_all_reduce` uses the op; training's collectives (ZeRO's all-reduce,
    reduce-scatter, all-gather) go through torch.distributed either way, and TorchBackend handles a missing
    op (None: its own fallback). Call before DeepSpeed's comm starts (deepspeed.init_distributed or
    deepspeed.initialize); idempotent. Returns whether the op is skipped (False: hook
    deepspeed_shm_comm_skip is off -- one warning -- and DeepSpeed builds it as before)."""
    if not usable("deepspeed_shm_comm_skip"):
        return False
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    if not getattr(ds_torch.build_shm_op, "spotfill_skipped", False):
        def build_shm_op():
            return None
        build_shm_op.spotfill_skipped = True
        ds_torch.build_shm_op = build_shm_op
    return True


class _MuonStandIn(types.ModuleType):
    def __init__(self, name: str, names: tuple[str, ...]):
        path = deepspeed_source(os.path.join(*name.split(".")[1:]) + ".py")[0]
        super().__init__(name, f"spotfill's stand-in for {name} (real file: {path})")
        why = "DeepSpeed's Muon optimizer is not loaded in spotfill workers: spotfill trains with AdamW"

        class MuonWithAuxAdam:
            def __init__(self, *args, **kwargs):
                raise RuntimeError(why)

        def refuse(*args, **kwargs):
            raise RuntimeError(why)

        for n in names:
            setattr(self, n, MuonWithAuxAdam if n == "MuonWithAuxAdam" else refuse)


def _check_live_signatures(engine) -> None:
    """The DeepSpeed internals zero_load_elastic calls, checked on the live engine by signature (the
    hook's own check reads the source by name, without importing DeepSpeed)."""
    from spotfill.ray_compat.catalog import HOOKS, ZERO_ELASTIC_ATTRS
    from spotfill.ray_compat.hooks import _resolve

    opt = type(engine.optimizer)
    specs = [f"deepspeed.checkpoint.constants:{key}" for key in ZERO_ELASTIC_KEYS] + [
        f"{type(engine).__module__}:{type(engine).__qualname__}._get_all_zero_checkpoint_names(load_dir, tag, "
        "bf16_mode)",
        f"{opt.__module__}:{opt.__qualname__}._load_global_state(sd)",
        f"{opt.__module__}:{opt.__qualname__}._link_all_hp_params"]
    for spec in specs:
        found = _resolve(spec)[0]
        if found:
            raise RayCompatError(required_message(HOOKS["zero_elastic_load"], found))
    for attr in (a for names in ZERO_ELASTIC_ATTRS.values() for a in names):
        if not hasattr(engine.optimizer, attr):      # set by the optimizer's __init__: checked on the instance
            found = f"{opt.__module__}.{opt.__qualname__}.{attr} (missing on the live optimizer)"
            raise RayCompatError(required_message(HOOKS["zero_elastic_load"], found))


def zero_elastic_supported(engine) -> bool:
    """Whether `engine` (built with zero_optimization.elastic_checkpoint) saves ZeRO-1/2 optimizer state
    in DeepSpeed's elastic layout, which zero_load_elastic loads at any data-parallel size."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return isinstance(engine.optimizer, DeepSpeedZeroOptimizer) and bool(engine.optimizer.elastic_checkpoint)


def zero_load_elastic(engine, load_dir: str, tag: str) -> dict:
    """Load a ZeRO-1/2 checkpoint saved in DeepSpeed's elastic layout, at the saved data-parallel size or
    any other, exactly (fp32 master weights and every optimizer state), without universal conversion.

    DeepSpeed 0.19 has the pieces but not the path: engine._load_zero_checkpoint raises when the
    data-parallel size changed, its legacy loader indexes the saved ranks by the current rank (fails when
    growing), and both of its elastic-layout restores read a param-group "step" that torch's AdamW (the
    client optimizer spotfill uses) does not keep. So: the module, LR scheduler and client state through
    the public load (optimizer states off); then this rank's partition of every optimizer state and of the
    fp32 weights, and the learning rate from the restored scheduler. At the saved size a rank reads its own
    file; at another size its part of the merge of every saved partition (ray_compat/zero_merge.py), cut from
    the saved files memory-mapped, so it reads only the pages of its part and never holds the merge.
    Returns the client state."""
    require("zero_elastic_load")
    if not zero_elastic_supported(engine):
        raise RuntimeError("zero_load_elastic needs a ZeRO-1/2 engine built with "
                           "zero_optimization.elastic_checkpoint: true")
    _check_live_signatures(engine)
    import torch
    import torch.distributed as dist
    from deepspeed.checkpoint import constants as ds_keys

    from spotfill.ray_compat.zero_merge import copy_window, merged_part_bounds, zero_past

    opt = engine.optimizer
    _, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=False,
                                             load_lr_scheduler_states=True)
    if client_state is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {load_dir}")
    dp_rank, dp_world = dist.get_rank(group=opt.dp_process_group), dist.get_world_size(group=opt.dp_process_group)
    same = int(engine.loaded_checkpoint_dp_world_size) == dp_world
    # memory-mapped: a file's pages are read when touched and let go with its last tensor
    saved = [torch.load(name, map_location="cpu", mmap=True, weights_only=False)[ds_keys.OPTIMIZER_STATE_DICT]
             for name in _zero_partition_files(engine, load_dir, tag, dp_rank if same else None)]
    base, fp32 = ds_keys.BASE_OPTIMIZER_STATE, ds_keys.SINGLE_PARTITION_OF_FP32_GROUPS
    if isinstance(saved[0][base], dict):
        raise RuntimeError(f"checkpoint {tag!r} holds a rigid (non-elastic) ZeRO optimizer state")
    opt._load_global_state(saved[0])

    def put(dst, value):                      # this rank's share, zero-padded to the live partition
        value = value.reshape(-1)
        if value.numel() < dst.numel():
            value = torch.cat([value, value.new_zeros(dst.numel() - value.numel())])
        dst.data.copy_(value.reshape(dst.shape).to(dtype=dst.dtype, device=dst.device))

    merged: list[tuple[int, str | None, object]] = []   # (group, state key or None for the fp32 weights, live)
    for i, group in enumerate(opt.optimizer.param_groups):
        p, live = group["params"][0], opt.single_partition_of_fp32_groups[i]
        for key in saved[0][base][i]:
            value = saved[0][base][i][key]
            partitioned = all(torch.is_tensor(sd[base][i][key]) and sd[base][i][key].shape == sd[fp32][i].shape
                              for sd in saved)
            dst = opt.optimizer.state[p].get(key)
            if not same and partitioned:      # filled from every saved file below
                if not torch.is_tensor(dst):
                    opt.optimizer.state[p][key] = dst = torch.zeros_like(live)
                merged.append((i, key, dst))
            elif torch.is_tensor(value) and torch.is_tensor(dst):
                put(dst, value)
            else:
                opt.optimizer.state[p][key] = value.clone() if torch.is_tensor(value) else value
        if same:
            put(live, saved[0][fp32][i])
        else:
            merged.append((i, None, live))
    if merged:    # another world size: this rank's window of the merge, one saved file at a time
        lengths = [[sd[fp32][i].numel() for sd in saved] for i in range(len(opt.single_partition_of_fp32_groups))]
        bounds = []
        for i, key, dst in merged:
            start, size = merged_part_bounds(lengths[i], opt.nccl_start_alignment_factor * dp_world, dp_world, dp_rank)
            if size != dst.numel():
                raise RuntimeError(f"checkpoint {tag!r}: a merged partition of {size} elements for a live one of "
                                   f"{dst.numel()} (DeepSpeed's ZeRO partitioning changed?)")
            zero_past(dst.data, sum(lengths[i]), start)
            bounds.append(start)
        for r in range(len(saved)):
            for (i, key, dst), start in zip(merged, bounds):
                part = saved[r][fp32][i] if key is None else saved[r][base][i][key]
                copy_window(dst.data, part, sum(lengths[i][:r]), start)
            saved[r] = None                   # unmapped: its pages leave this process
    del saved
    opt._link_all_hp_params()
    # The elastic layout keeps optimizer states, not param groups: the learning rate the saved optimizer
    # held is the one the restored scheduler gives at its iteration (DeepSpeed's schedulers set it so).
    sched = engine.lr_scheduler
    if sched is not None and hasattr(sched, "last_batch_iteration"):
        sched.step(sched.last_batch_iteration)
    return client_state


def _zero_partition_files(engine, load_dir: str, tag: str, only: int | None) -> list[str]:
    """The saved ZeRO partition files of `tag` this rank reads: saved dp rank `only`'s, or (None) every
    saved rank's -- the engine's precision's names, else the other precision's, as DeepSpeed tries them."""
    bf16 = bool(engine.bfloat16_enabled())
    for mode in (bf16, not bf16):
        names = engine._get_all_zero_checkpoint_names(load_dir, tag, mode) or []
        names = names[only:only + 1] if only is not None else names
        if names and all(os.path.isfile(n) for n in names):
            return names
    raise FileNotFoundError(f"ZeRO partitions of {tag!r} missing under {load_dir}")


def pipe_instruction_map(engine) -> dict:
    """Give this PipelineEngine instance its own copy of the class's instruction map (type -> function
    taking (engine, **kwargs)) and return it: what the caller puts in it runs in place of DeepSpeed's
    functions for this engine only. RayCompatError (one line) where DeepSpeed dispatches otherwise."""
    import inspect

    from spotfill.ray_compat.catalog import HOOKS

    require("pipe_bubble_probe")
    cls = type(engine)
    table, run = getattr(cls, "_INSTRUCTION_MAP", None), getattr(cls, "_exec_schedule", None)
    try:
        dispatches = run is not None and PIPE_DISPATCH in inspect.getsource(run)
    except (OSError, TypeError):
        dispatches = False
    found = (f"{cls.__name__}._INSTRUCTION_MAP (missing)" if not isinstance(table, dict) else
             None if dispatches else f"{cls.__name__}._exec_schedule dispatching through {PIPE_DISPATCH}")
    if found:
        raise RayCompatError(required_message(HOOKS["pipe_bubble_probe"], found))
    engine._INSTRUCTION_MAP = dict(table)
    return engine._INSTRUCTION_MAP


def pipe_stage_layers(module) -> tuple[int, int]:
    """[first, last + 1) global layer indices a PipelineModule's stage holds (its private _local_start and
    _local_stop, set in its __init__: DeepSpeed has no public read of them). Part of pipe_bubble_probe."""
    return int(module._local_start), int(module._local_stop)
