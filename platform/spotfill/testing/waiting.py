"""Polling with a deadline, for tests and stand-ins that wait on a real cluster."""
from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Call `check` every `every` seconds until it returns something truthy (returned), or raise
    AssertionError naming `what` after `timeout` seconds."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
