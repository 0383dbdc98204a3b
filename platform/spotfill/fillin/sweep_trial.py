"""One sweep trial (fillin/sweep.py runs them with Ray Tune): a small GPT trained `steps` steps on the
prepared shards with the trial's configuration, as a `tune.Trainable`.

It computes on the device Ray assigned it (spotfill.devices: cuda:0 when its placement group's `GPU` bundle
gave it a GPU and CUDA sees one, else the CPU -- a logical resource such as GPU_SLOT, or the embedded
cluster's GPU resource on a CPU machine), with the precision that device supports: fp32 weights and AdamW
state, the forward under autocast in bf16 (fp16 with a gradient scaler on a pre-Ampere GPU); fp32 on the
CPU. Every result says where it ran (`device`, `dtype`, `gpu_ids`).

`save_checkpoint` writes the model, optimizer, step and the list of steps applied to these weights
(`history`), so a pause checkpoint is exact and the history proves that a resumed trial continued rather
than restarted, and that no step was applied twice. A checkpoint loads on whatever device the resumed
trial was given.

`save` also hands those exact bytes to the sweep's state keeper (fillin/sweep_keeper.py: host memory that
outlives the trial actor) once the storage checkpoint is written, and records their checksum in Tune's
record of the checkpoint; `restore` takes the kept bytes when they are exactly that checkpoint's state
(fillin/sweep_memory.py: trial, step, checkpoint path, checksum) and reads no storage then, else restores
from storage. Every result says where the last restore came from (`restored_via`: memory | storage), how
long it took (`restore_s`) and, from storage, why (`restore_why`).
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import uuid

METRIC, MODE = "eval_loss", "min"
STATE_FILE = "state.pt"
log = logging.getLogger("spotfill.fillin.sweep_trial")


def lr_at(step: int, lr: float, warmup_steps: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_ratio * lr` at `total` (step counts from 0)."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total - warmup_steps)
    frac = min(1.0, (step - warmup_steps) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def trainable_class():
    from ray import tune

    class SweepTrainable(tune.Trainable):
        """One trial: the tiny GPT trained `steps` steps on the prepared shards with this trial's config."""

        def setup(self, config: dict, job: dict | None = None):
            t_init = time.time()
            from spotfill.fillin.sweep_standby import take
            standby = take()                 # a warm standby's process: its imports are done
            import numpy as np
            import torch

            from spotfill.devices import assigned_device, compute_dtype, ray_gpu_ids
            from spotfill.fillin.busy import BusyReporter
            from spotfill.fillin.cpu_priority import lower_cpu_priority
            from spotfill.storage.base import open_storage
            from spotfill.train.data import ShardReader
            from spotfill.train.model import GPT
            from spotfill.config.presets import preset

            lower_cpu_priority()     # fill-in: lowest CPU priority ($SPOTFILL_FILLIN_CPU_NICE, default 19)
            torch.set_num_threads(1)
            self.job = dict(job or {})
            self.cfg = dict(config)
            # its compute time (the optimizer steps and the final evaluation), sent to the arbiter
            # (gpu_seconds.fillin_busy: fillin/busy.py)
            self.busy = BusyReporter(self.job.get("tenant", "sweep"), "sweep", 1, self.job.get("gpu_resource", "GPU"))
            self.device = assigned_device()
            self.dtype = compute_dtype(self.device)
            self.where = {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                          "gpu_ids": [str(g) for g in ray_gpu_ids()]}
            on_gpu = self.device.type == "cuda"
            self.reader = ShardReader(open_storage(self.job["data"]),
                                      os.path.join(tempfile.gettempdir(), "spotfill-sweep-data"))
            model_cfg = preset(self.job["model"], seq_len=self.reader.seq_len,
                               vocab_size=self.reader.manifest.get("vocab_size"))
            torch.manual_seed(int(self.job["seed"]))
            self.model = GPT(model_cfg).to(self.device)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=float(self.cfg["lr"]),
                                         weight_decay=float(self.cfg.get("weight_decay", 0.0)),
                                         **({"fused": True} if on_gpu else {}))
            self.scaler = torch.amp.GradScaler("cuda") if self.dtype == torch.float16 else None
            self.step_n, self.history, self.restored_from = 0, [], None
            self.restore_info = {"restored_via": None, "restore_s": None, "restore_why": None}
            self.incarnation = uuid.uuid4().hex[:8]
            n = self.reader.num_samples
            self.eval_rows = np.arange(max(0, n - int(self.job["eval_rows"])), n)
            self.train_rows = max(1, n - len(self.eval_rows))
            self.first_step = None
            if self.job.get("setup_sleep_s"):
                time.sleep(float(self.job["setup_sleep_s"]))     # tests: a setup as slow as a CPU-starved one
            from spotfill.fillin.standby import start_event
            self.start = start_event(self.busy.meter.tenant, "sweep", self.busy.meter, t_init, standby,
                                     {"wake_s": round(time.time() - t_init, 3)} if standby else
                                     {"load_s": round(time.time() - t_init, 3)})
            self.busy.send([self.start])

        def _batch(self, step: int):
            import numpy as np
            import torch
            rng = np.random.default_rng([int(self.job["seed"]), step])
            rows = rng.integers(0, self.train_rows, int(self.cfg.get("batch", self.job["batch"])))
            t = torch.from_numpy(self.reader.rows(np.sort(rows)).astype("int64")).to(self.device)
            return t[:, :-1], t[:, 1:]

        def _loss(self, x, y):
            import torch
            import torch.nn.functional as F
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                logits = self.model(x)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

        def step(self):
            import torch
            total = int(self.job["steps"])
            if self.first_step is None:
                self.first_step = self.step_n + 1
            losses = []
            for _ in range(int(self.job["steps_per_report"])):
                if self.step_n >= total:
                    break
                for g in self.opt.param_groups:
                    g["lr"] = lr_at(self.step_n, float(self.cfg["lr"]), int(self.cfg.get("warmup_steps", 0)), total)
                with self.busy.measure():
                    losses.append(self._train_step())
                self.step_n += 1
                self.history.append(self.step_n)
            if self.job.get("step_sleep_s"):
                time.sleep(float(self.job["step_sleep_s"]))      # tests: a trial long enough to reclaim
            out = {"step": self.step_n, "loss": sum(losses) / max(1, len(losses)),
                   "restored_from": self.restored_from, "first_step": self.first_step,
                   "incarnation": self.incarnation, "pid": os.getpid(), **self.where, **self.restore_info}
            if self.step_n >= total:
                with torch.no_grad(), self.busy.measure():
                    rows = self.reader.rows(self.eval_rows)
                    t = torch.from_numpy(rows.astype("int64")).to(self.device)
                    out[METRIC] = float(self._loss(t[:, :-1], t[:, 1:]))
                out["history_len"] = len(self.history)
                out["history_unique"] = len(set(self.history))
                out["history_ok"] = self.history == list(range(1, total + 1))
                out["done"] = True
            return out

        def _train_step(self) -> float:
            x, y = self._batch(self.step_n)
            loss = self._loss(x, y)
            self.opt.zero_grad(set_to_none=True)
            if self.scaler is None:
                loss.backward()
                self.opt.step()
            else:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            return float(loss)

        def cleanup(self):
            self.busy.flush()          # stopped (done, paused, reclaimed): what it measured last

        def save_checkpoint(self, checkpoint_dir: str):
            import io

            import torch
            self.busy.flush()
            buf = io.BytesIO()
            torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step_n,
                        "history": list(self.history), "incarnation": self.incarnation,
                        **({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})}, buf)
            data = buf.getvalue()
            with open(os.path.join(checkpoint_dir, STATE_FILE), "wb") as f:    # the storage checkpoint
                f.write(data)
            self._saved = (self.step_n, data)       # save() hands these same bytes to the state keeper
            return None

        def save(self, checkpoint_dir: str | None = None):
            """Tune's save (the checkpoint written and persisted to storage), then the same bytes to the
            sweep's state keeper; their checksum goes into Tune's record of the checkpoint."""
            from spotfill import ray_compat
            from spotfill.fillin import sweep_keeper
            from spotfill.fillin.sweep_memory import SHA_KEY, StateId, digest

            result = super().save(checkpoint_dir)
            saved, self._saved = getattr(self, "_saved", None), None
            path, metrics = ray_compat.tune_checkpoint_parts(result)
            if saved is None or not self.job.get("keeper") or not path or metrics.get("step") != saved[0]:
                return result
            sid = StateId(self.trial_id, saved[0], path, digest(saved[1]))
            kept = sweep_keeper.keep(self.job["keeper"], sid, saved[1])
            if kept.get("kept"):
                metrics[SHA_KEY] = sid.sha256       # a restore of this checkpoint asks for exactly this state
            else:
                log.warning("trial %s: state at step %d not kept in memory (%s); its resume reads storage",
                            self.trial_id, saved[0], kept.get("why"))
            return result

        def restore(self, checkpoint_path):
            """Restore the checkpoint Tune hands in: from the state keeper when it holds exactly that
            checkpoint's state (no storage read), else from storage; `restore_info` says which, and why."""
            import shutil

            from spotfill import ray_compat
            from spotfill.fillin import sweep_keeper
            from spotfill.fillin.sweep_memory import MEMORY, STORAGE, wanted_state

            t0 = time.perf_counter()
            path, metrics = ray_compat.tune_checkpoint_parts(checkpoint_path)
            data, why = None, "no state keeper (sweep.keep_in_memory_mb: 0)"
            if self.job.get("keeper"):
                wanted, why = wanted_state(self.trial_id, path, metrics)
                if wanted is not None:
                    data, why = sweep_keeper.fetch(self.job["keeper"], wanted)
            stand_in = here = None
            if data is not None:
                here = tempfile.mkdtemp(prefix="spotfill-sweep-restore-")
                stand_in = ray_compat.tune_result_on_local_dir(checkpoint_path, here)
                if stand_in is None:
                    why = "this Ray's checkpoint result cannot stand in (hook tune_restore_from_memory off)"
            try:
                if stand_in is not None:
                    self._memory_state = data
                    out = super().restore(stand_in)
                else:
                    out = super().restore(checkpoint_path)
            finally:
                self._memory_state = None
                if here:
                    shutil.rmtree(here, ignore_errors=True)
            via = MEMORY if stand_in is not None else STORAGE
            self.restore_info = {"restored_via": via, "restore_s": round(time.perf_counter() - t0, 4),
                                 "restore_why": None if via == MEMORY else why}
            if via == STORAGE:
                log.info("trial %s restored step %s from storage: %s", self.trial_id, self.step_n, why)
            return out

        def load_checkpoint(self, checkpoint_dir: str):
            import io

            import torch
            data = getattr(self, "_memory_state", None)
            if data is not None:                    # restore(): the kept bytes of exactly this checkpoint
                source = io.BytesIO(data)
            else:
                source = os.path.join(checkpoint_dir, STATE_FILE)
            state = torch.load(source, map_location=self.device, weights_only=False)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            if self.scaler is not None and "scaler" in state:
                self.scaler.load_state_dict(state["scaler"])
            self.step_n, self.history = int(state["step"]), list(state["history"])
            self.restored_from = self.step_n
            self.first_step = None

    return SweepTrainable
