"""Restore: pick the newest intact committed checkpoint, bring it to this node, flatten it into DeepSpeed's
layout, and convert it to a universal checkpoint when the world size changed (ZeRO partitions differ)."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from spotfill.config import constants
from spotfill.storage.checkpoint_store import CheckpointStore

log = logging.getLogger(__name__)


@dataclass
class RestorePlan:
    """What to load before training starts; `None` tag means a fresh start."""
    tag: str | None = None
    step: int = 0
    world_size: int = 0
    load_dir: str = ""
    load_tag: str = ""
    universal: bool = False
    timings: dict = field(default_factory=dict)


def flatten_ranks(tag_dir: str, out_dir: str) -> None:
    """Hard-link (or copy) `tag_dir/rank-*/<file>` into `out_dir/<file>` (DeepSpeed's flat layout)."""
    os.makedirs(out_dir, exist_ok=True)
    for part in sorted(os.listdir(tag_dir)):
        src_dir = os.path.join(tag_dir, part)
        if not (part.startswith("rank-") and os.path.isdir(src_dir)):
            continue
        for name in os.listdir(src_dir):
            src, dst = os.path.join(src_dir, name), os.path.join(out_dir, name)
            if os.path.exists(dst):
                continue
            if os.path.isdir(src):
                shutil.copytree(src, dst)
                continue
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


def convert_to_universal(ds_dir: str, out_dir: str, nbytes: int = 0) -> float:
    """Convert with DeepSpeed's ds_to_universal; returns seconds.

    Small checkpoints convert in this process (no interpreter start-up: that dominates for them); large
    ones in a subprocess with parallel extract/merge workers (the converter forks a process pool)."""
    t0 = time.perf_counter()
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if nbytes < constants.UNIVERSAL_INPROCESS_MAX_BYTES:
        import argparse
        import contextlib
        import io

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
        args = argparse.Namespace(input_folder=ds_dir, output_folder=tmp, num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=False)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal(args)
    else:
        workers = str(max(1, min(8, (os.cpu_count() or 2) // 2)))
        proc = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", ds_dir,
             "--output_folder", tmp, "--num_extract_workers", workers, "--num_merge_workers", workers],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed ({proc.returncode}): {proc.stderr[-2000:]}")
    os.replace(tmp, out_dir)
    return time.perf_counter() - t0


def prepare_node_copy(store: CheckpointStore, tag: str | None, node_dir: str, world_size: int,
                      zero_stage: int, verify: bool = True) -> RestorePlan:
    """Download `tag` (None: the newest intact one) to this node, flatten it, and convert it to a
    universal checkpoint when the world size changed. A fresh start gives RestorePlan(tag=None)."""
    t0 = time.perf_counter()
    shutil.rmtree(node_dir, ignore_errors=True)
    manifest = store.restore(node_dir, tag=tag, verify=verify)
    if manifest is None:
        return RestorePlan()
    tag = manifest["tag"]
    download_s = time.perf_counter() - t0
    tag_dir = manifest["path"]
    ds_root = os.path.join(node_dir, "ds")
    flatten_ranks(tag_dir, os.path.join(ds_root, tag))
    saved_world = int(manifest["world_size"])
    universal = saved_world != world_size and zero_stage > 0
    convert_s = 0.0
    load_tag = tag
    if universal:
        load_tag = f"{tag}-universal"
        if not os.path.isdir(os.path.join(ds_root, load_tag)):
            convert_s = convert_to_universal(os.path.join(ds_root, tag), os.path.join(ds_root, load_tag),
                                             int(manifest.get("bytes") or 0))
    return RestorePlan(tag=tag, step=int(manifest["step"]), world_size=saved_world, load_dir=ds_root,
                       load_tag=load_tag, universal=universal,
                       timings={"download_s": round(download_s, 3), "convert_s": round(convert_s, 3),
                                "bytes": manifest.get("bytes")})


def restore_on_workers(store: CheckpointStore, comms, rank: int, world: int, node_id: str, node_dir: str,
                       zero_stage: int) -> RestorePlan:
    """Collective: every rank of a starting worker group calls it. Rank 0 chooses the newest intact
    checkpoint; one rank per node prepares that node's local copy. Returns the same plan on every rank."""
    plan = RestorePlan()
    if rank == 0:
        store.discard_uncommitted()
        plan = prepare_node_copy(store, None, node_dir, world, zero_stage)
    plan = comms.bcast(plan)
    # One rank per node prepares that node's copy: the lowest rank on each node (Ray's local_rank groups
    # by IP, and several raylets can share one IP).
    node_ids: list = [None] * world
    comms.dist.all_gather_object(node_ids, node_id)
    node_leader = node_ids.index(node_id) == rank
    if plan.tag and node_leader and rank != 0:
        prepare_node_copy(store, plan.tag, node_dir, world, zero_stage)
    comms.barrier()
    return plan
