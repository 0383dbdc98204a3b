"""DeepSpeed's private names: the Muon optimizer modules spotfill keeps out of its workers, the ZeRO-1/2
internals of the elastic (no conversion) resharding load, and the pipeline engine's instruction map.
"""
from __future__ import annotations

import os
import sys
import types

from spotfill.ray_compat.catalog import MUON_MODULES, PIPE_DISPATCH, deepspeed_source
from spotfill.ray_compat.hooks import RayCompatError, require, required_message, usable

ZERO_ELASTIC_KEYS = ("BASE_OPTIMIZER_STATE", "SINGLE_PARTITION_OF_FP32_GROUPS")


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
    from spotfill.ray_compat.catalog import HOOKS
    from spotfill.ray_compat.hooks import _resolve

    opt = type(engine.optimizer)
    specs = [f"deepspeed.checkpoint.constants:{key}" for key in ZERO_ELASTIC_KEYS] + [
        f"{type(engine).__module__}:{type(engine).__qualname__}._get_all_zero_checkpoints(load_dir, tag)",
        f"{opt.__module__}:{opt.__qualname__}._partition_base_optimizer_state(state_key, all_partition_states, "
"group_id)",
        f"{opt.__module__}:{opt.__qualname__}._restore_from_elastic_fp32_weights(all_state_dict)",
        f"{opt.__module__}:{opt.__qualname__}._load_global_state(sd)",
        f"{opt.__module__}:{opt.__qualname__}._link_all_hp_params"]
    for spec in specs:
        found = _resolve(spec)[0]
        if found:
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
    fp32 weights, and the learning rate from the restored scheduler -- at the saved size read from its own file, at another size merged from every saved rank's
    file and re-partitioned with DeepSpeed's own helpers. Returns the client state."""
    require("zero_elastic_load")
    if not zero_elastic_supported(engine):
        raise RuntimeError("zero_load_elastic needs a ZeRO-1/2 engine built with "
                           "zero_optimization.elastic_checkpoint: true")
    _check_live_signatures(engine)
    import torch
    import torch.distributed as dist
    from deepspeed.checkpoint import constants as ds_keys

    opt, zc = engine.optimizer, engine._config.zero_config
    _, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=False,
                                             load_lr_scheduler_states=True)
    if client_state is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {load_dir}")
    dp_rank, dp_world = dist.get_rank(group=opt.dp_process_group), dist.get_world_size(group=opt.dp_process_group)
    same = int(engine.loaded_checkpoint_dp_world_size) == dp_world
    zc.elastic_checkpoint = not same          # DeepSpeed reads every rank's file only when elastic is set
    try:
        saved = engine._get_all_zero_checkpoints(load_dir, tag)
    finally:
        zc.elastic_checkpoint = True
    if not saved or (same and saved[dp_rank] is None) or (not same and any(sd is None for sd in saved)):
        raise FileNotFoundError(f"ZeRO partitions of {tag!r} missing under {load_dir}")
    base, fp32 = ds_keys.BASE_OPTIMIZER_STATE, ds_keys.SINGLE_PARTITION_OF_FP32_GROUPS
    own = saved[dp_rank] if same else saved[0]
    if isinstance(own[base], dict):
        raise RuntimeError(f"checkpoint {tag!r} holds a rigid (non-elastic) ZeRO optimizer state")
    opt._load_global_state(own)

    def put(dst, value):                      # this rank's share, zero-padded to the live partition
        value = value.reshape(-1)
        if value.numel() < dst.numel():
            value = torch.cat([value, value.new_zeros(dst.numel() - value.numel())])
        dst.data.copy_(value.reshape(dst.shape).to(dtype=dst.dtype, device=dst.device))

    for i, group in enumerate(opt.optimizer.param_groups):
        p = group["params"][0]
        for key in own[base][i]:
            if same:
                mine = own[base][i][key]
            else:
                values = [sd[base][i][key] for sd in saved]
                partitioned = all(torch.is_tensor(v) and v.shape == sd[fp32][i].shape for v, sd in zip(values, saved))
                mine = opt._partition_base_optimizer_state(key, values, i, is_partition_state=partitioned)
            dst = opt.optimizer.state[p].get(key)
            if torch.is_tensor(mine) and torch.is_tensor(dst):
                put(dst, mine)
            else:
                opt.optimizer.state[p][key] = mine.clone() if torch.is_tensor(mine) else mine
    if same:
        for current, part in zip(opt.single_partition_of_fp32_groups, own[fp32]):
            put(current, part)
    else:
        opt._restore_from_elastic_fp32_weights(saved)
    opt._link_all_hp_params()
    # The elastic layout keeps optimizer states, not param groups: the learning rate the saved optimizer
    # held is the one the restored scheduler gives at its iteration (DeepSpeed's schedulers set it so).
    sched = engine.lr_scheduler
    if sched is not None and hasattr(sched, "last_batch_iteration"):
        sched.step(sched.last_batch_iteration)
    return client_state


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
