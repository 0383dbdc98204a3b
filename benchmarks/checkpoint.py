"""Checkpoint stall: spotfill's snapshot + background upload vs a synchronous save + upload, same run.

    python benchmarks/checkpoint.py [--preset 50m] [--repeats 3] [--quick] [--json PATH]

One DeepSpeed engine (world size 1, gloo, ZeRO-2, fp32 AdamW, spotfill's own ds_config) of a model preset,
trained a few steps so Adam state exists, saving to a loopback S3 endpoint that runs in a child process
(`python -m spotfill.testing.s3local`; a real endpoint does not share the trainer's interpreter). After one untimed
warm-up save, each round runs, in this order:

  spotfill   `Checkpointer.save(kind="periodic")`: what the step loop waits for -- the local snapshot
             (engine.save_checkpoint); a periodic save never waits for an upload (one still running makes
             the new snapshot the pending one). The upload + sha256 + commit then run on the Checkpointer's
             background thread (`background_upload_s`; with --train-during-upload the loop keeps stepping
             meanwhile, else it waits idle).
  sync       engine.save_checkpoint + Storage.upload_dir of the same files to the same endpoint, in the
             step loop (spotfill's parallel uploader, so the baseline is not handicapped by a slow client).
  raw boto3  one `upload_file` (default TransferConfig) of a file holding the checkpoint's bytes
             (benchmarks/upload.py), the best case for plain boto3.

stall_ratio = median stall / median sync; upload_ratio = spotfill's background upload MB/s (the real path:
parallel upload, sha256, done marker, manifest, `latest`, retention) / raw boto3 MB/s. Finally the snapshot
is timed in disk-backed /tmp and in tmpfs /dev/shm (alternating, deleted after each) to say where
snapshots should go. A quick run takes the median of 3 rounds, a full one of 5.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
import uuid

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `spotfill` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (emit, median, quiet_deepspeed, rnd, s3_endpoint, scoped_env,  # noqa: E402
                                single_rank_dist)

SHM = "/dev/shm"


def _ds_config(preset: str) -> dict:
    """spotfill's DeepSpeed config (train.engine.ds_config) for micro-batch 1, fp32, ZeRO-2."""
    from spotfill.config.job import DataConfig, JobConfig, TrainingConfig
    from spotfill.train.engine import ds_config

    job = JobConfig(name="bench", storage="unused", data=DataConfig(path="unused"),
                    training=TrainingConfig(model=preset, global_batch=1, max_micro_batch=1, zero_stage=2))
    return ds_config(job, micro=1, accum=1, precision="fp32", universal=False)


def build_engine(preset: str):
    """(engine, step_fn, params): a ZeRO-2 fp32 AdamW engine; step_fn() runs one step, returns seconds."""
    import deepspeed
    import torch
    import torch.nn.functional as F

    from spotfill.train.model import build_model, count_params

    quiet_deepspeed()
    torch.manual_seed(0)
    model = build_model(preset)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=_ds_config(preset))
    vocab, seq = model.cfg.vocab_size, min(64, model.cfg.seq_len)
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        t0 = time.perf_counter()
        tokens = torch.randint(0, vocab, (1, seq + 1), generator=gen)
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t0

    return engine, step, count_params(model)


def snapshot_roots(nbytes_hint: int = 0) -> dict[str, str]:
    """Candidate snapshot parents: disk-backed /tmp, and /dev/shm when it is tmpfs with room to spare."""
    roots = {"tmp": tempfile.gettempdir()}
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK):
        st = os.statvfs(SHM)
        if st.f_bavail * st.f_frsize > 3 * nbytes_hint:
            roots["shm"] = SHM
    return roots


def bench_checkpoint(quick: bool = True, preset: str = "50m", repeats: int | None = None, s3=None,
                     snapshot_root: str | None = None, compare_dirs: bool = True,
                     train_during_upload: bool = False, progress=None) -> dict:
    """The CONTRACTS "checkpoint" section (plus details). `s3`: None starts a loopback endpoint in a
    child process; or a LocalS3/S3Process, or an s3:// URI. `snapshot_root`: where snapshots go (default
    spotfill's node-local dir, constants.LOCAL_DIR). `train_during_upload`: keep stepping until each
    background upload is done (else one step, then wait: on a CPU-only box the steps and the upload fight
    for the same cores, which a GPU node does not do, and each 50m step costs seconds)."""
    from spotfill.config import constants
    from spotfill.train.checkpointing import Checkpointer
    from spotfill.storage.checkpoint_store import CheckpointStore
    from spotfill.storage.base import open_storage

    from benchmarks.upload import flatten, raw_client, raw_upload

    say = progress or (lambda msg: None)
    repeats = repeats or (3 if quick else 5)
    base = os.path.join(snapshot_root or constants.LOCAL_DIR, f"bench-ckpt-{uuid.uuid4().hex[:8]}")
    t_start = time.perf_counter()
    with single_rank_dist(), s3_endpoint(s3) as (server, aws_env), scoped_env(**aws_env):
        engine, step, params = build_engine(preset)
        warm = [step() for _ in range(2 if quick else 3)]        # Adam state exists after the first
        step_no = len(warm)
        say(f"engine ready: {params / 1e6:.1f}M params, step {warm[-1]:.2f}s")
        uri = server.uri(f"bench-ckpt-{uuid.uuid4().hex[:8]}") if hasattr(server, "uri") else server
        storage = open_storage(uri)
        raw = raw_client(storage)
        store = CheckpointStore(storage.child("spotfill"), keep_last=1)
        ckpt = Checkpointer(store, base, rank=0, world_size=1, attempt="bench")
        sync_root = os.path.join(base, "sync")
        flat = os.path.join(base, "flat", "flat.bin")
        saves, syncs, uploads, raws, busy_steps = [], [], [], [], []
        by_dir: dict[str, list[float]] = {}
        nbytes = 0
        try:
            # one untimed save first: the first save of a process pays one-time costs (fresh buffers,
            # folders) that neither side should carry
            warm_dir = os.path.join(base, "warm")
            engine.save_checkpoint(warm_dir, tag="w", client_state={}, save_latest=False)
            shutil.rmtree(warm_dir, ignore_errors=True)
            for r in range(repeats):
                # spotfill: what the step loop waits for; the upload + commit run in the background
                step_no += 1
                res = ckpt.save(engine, step_no, {"attempt": 0}, kind="periodic")
                saves.append(res)
                while train_during_upload and ckpt.uploader.busy:
                    busy_steps.append(step())
                    step_no += 1
                ckpt.uploader.wait()
                uploads += ckpt.pop_committed()
                # sync: save and upload in the step loop, as a plain loop would
                tag = f"sync-{r}"
                t0 = time.perf_counter()
                engine.save_checkpoint(sync_root, tag=tag, client_state={"step": step_no},
                                       save_latest=False)
                t1 = time.perf_counter()
                storage.upload_dir(os.path.join(sync_root, tag), f"sync/{tag}")
                t2 = time.perf_counter()
                syncs.append({"save_s": t1 - t0, "upload_s": t2 - t1, "total_s": t2 - t0})
                storage.delete_prefix(f"sync/{tag}")
                # raw boto3: one upload_file of a file holding the same bytes (benchmarks/upload.py)
                if r == 0:
                    os.makedirs(os.path.dirname(flat), exist_ok=True)
                    nbytes = flatten(os.path.join(sync_root, tag), flat)
                shutil.rmtree(os.path.join(sync_root, tag), ignore_errors=True)
                raws.append(raw_upload(raw, storage, flat, f"raw/{r}.bin"))
                storage.delete_prefix("raw")
                say(f"round {r + 1}/{repeats}: spotfill stall {res['stall_s']:.2f}s (upload "
                    f"{uploads[-1]['upload_s']:.2f}s in the background), sync {syncs[-1]['total_s']:.2f}s, "
                    f"raw boto3 upload {raws[-1]:.2f}s")
            os.unlink(flat)

            # where snapshots should live: the same save into /tmp and /dev/shm, alternating
            if compare_dirs:
                roots = snapshot_roots(nbytes)
                for r in range(max(3, repeats)):
                    for kind, root in (roots.items() if r % 2 == 0 else reversed(roots.items())):
                        d = tempfile.mkdtemp(prefix="spotfill-bench-snap-", dir=root)
                        try:
                            t0 = time.perf_counter()
                            engine.save_checkpoint(d, tag="t", client_state={}, save_latest=False)
                            by_dir.setdefault(kind, []).append(time.perf_counter() - t0)
                        finally:
                            shutil.rmtree(d, ignore_errors=True)
                say("snapshot by dir: " + ", ".join(f"{k} {median(v):.2f}s" for k, v in by_dir.items()))
        finally:
            ckpt.close(wait=False)
            raw.close()
            shutil.rmtree(base, ignore_errors=True)
            storage.delete_prefix("")
    stall = median(s["stall_s"] for s in saves)
    sync = median(s["total_s"] for s in syncs)
    upload_mb_s = median(u["bytes"] / 1e6 / u["upload_s"] for u in uploads)
    raw_mb_s = nbytes / 1e6 / median(raws)
    out = {
        "params": params, "preset": preset, "bytes": nbytes, "repeats": repeats,
        "stall_s": rnd(stall, 6), "sync_save_upload_s": rnd(sync, 6),
        "stall_ratio": rnd(stall / sync, 4),
        "upload_mb_s": rnd(upload_mb_s, 1), "raw_boto3_mb_s": rnd(raw_mb_s, 1),
        "upload_ratio": rnd(upload_mb_s / raw_mb_s, 3),
        "snapshot_s": rnd(median(s["snapshot_s"] for s in saves), 6),
        "blocked_s": rnd(median(s["blocked_s"] for s in saves), 6),
        "sync_save_s": rnd(median(s["save_s"] for s in syncs), 6),
        "sync_upload_s": rnd(median(s["upload_s"] for s in syncs), 6),
        "background_upload_s": rnd(median(u["upload_s"] for u in uploads), 6),
        "steps_to_hide_upload": math.ceil(median(u["upload_s"] for u in uploads) / median(warm[1:])),
        "step_s": rnd(median(warm[1:]), 6),
        "step_s_during_upload": rnd(median(busy_steps), 6) if busy_steps else None,
        "snapshot_dir": os.path.dirname(ckpt.snap_root),
        "snapshot_s_by_dir": {k: rnd(median(v), 6) for k, v in by_dir.items()},
        "samples": {"stall_s": [rnd(s["stall_s"], 6) for s in saves],
                    "sync_save_upload_s": [rnd(s["total_s"], 6) for s in syncs],
                    "background_upload_s": [rnd(u["upload_s"], 6) for u in uploads],
                    "raw_boto3_upload_s": [rnd(x, 6) for x in raws],
                    "snapshot_s_by_dir": {k: [rnd(x, 6) for x in v] for k, v in by_dir.items()}},
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/checkpoint.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="50m")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--snapshot-root", help="parent folder of the snapshots (default: spotfill's)")
    parser.add_argument("--train-during-upload", action="store_true",
                        help="keep stepping until each background upload is done (slow on CPU)")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    result = bench_checkpoint(args.quick, args.preset, args.repeats, snapshot_root=args.snapshot_root,
                              train_during_upload=args.train_during_upload,
                              progress=lambda m: print(f"checkpoint: {m}", file=sys.stderr, flush=True))
    return emit(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
