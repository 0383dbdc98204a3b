"""Rank 0's timers for the phases of a step: forward+backward and optimizer, summed over micro-batches.

On a CPU the host clock is the device's. On a GPU the host only queues kernels and runs ahead, so each
boundary records a CUDA event on the compute stream instead; they are read after the step's gather, whose
host copy has synchronised that stream, so reading adds no sync of its own. Other ranks time nothing.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class HostTimer:
    def __init__(self):
        self.fb = self.opt = 0.0
        self._t = 0.0

    def begin(self) -> None:
        self.fb = self.opt = 0.0

    def mark(self) -> None:                     # before a micro-batch's forward
        self._t = time.perf_counter()

    def backward_done(self) -> None:
        t = time.perf_counter()
        self.fb += t - self._t
        self._t = t

    def step_done(self) -> None:
        self.opt += time.perf_counter() - self._t

    def read(self) -> tuple[float, float]:
        return self.fb, self.opt


class CudaTimer:
    def __init__(self, torch):
        self._torch = torch
        self._pool: list = []
        self._used = 0
        self._warned = False

    def _event(self):
        if self._used == len(self._pool):
            self._pool.append(self._torch.cuda.Event(enable_timing=True))
        e = self._pool[self._used]
        self._used += 1
        e.record()
        return e

    def begin(self) -> None:
        self._used = 0

    def mark(self) -> None:
        self._event()

    def backward_done(self) -> None:
        self._event()

    def step_done(self) -> None:
        self._event()

    def read(self) -> tuple[float | None, float | None]:
        """Seconds of device time in forward+backward and in optimizer steps (events in triples); (None,
        None) if CUDA cannot say -- telemetry never stops a step."""
        try:
            ev = self._pool[:self._used]
            if ev and not ev[-1].query():
                ev[-1].synchronize()    # not expected: the step's gather already synchronised the stream
            fb = sum(ev[i].elapsed_time(ev[i + 1]) for i in range(0, len(ev) - 2, 3))
            opt = sum(ev[i + 1].elapsed_time(ev[i + 2]) for i in range(0, len(ev) - 2, 3))
            return fb / 1e3, opt / 1e3
        except RuntimeError as exc:
            if not self._warned:
                self._warned = True
                log.warning("CUDA event timing failed (%s): the step split is not reported", exc)
            return None, None


def make_timer(device):
    """The timer for a device: CUDA events on a CUDA device, host clocks elsewhere."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch
        return CudaTimer(torch)
    return HostTimer()


def device_info(device, precision: str) -> dict:
    """What the device is and its dense peak for `precision` (None on CPU or a GPU the catalogue lacks)."""
    from spotfill.telemetry.throughput import catalogue_name, peak_flops_per_gpu

    if getattr(device, "type", str(device)) != "cuda":
        return {"device": "cpu", "gpu_type": None, "peak_flops_per_gpu": None}
    import torch
    name = torch.cuda.get_device_name(device)
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    return {"device": name, "gpu_type": catalogue_name(name),
            "peak_flops_per_gpu": peak_flops_per_gpu(name, precision, tf32)}
