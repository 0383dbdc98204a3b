"""Warm spare worker processes warm up at idle CPU priority, and count against their node's memory (pure: the
os module only, no Ray).

A training worker asks its node's raylet for spare worker processes (train.spare_workers `prestart_spares`)
while its group trains. Their setup hook (train.warm) imports torch, DeepSpeed and Ray Train: seconds of CPU
that, at the priority of every other Ray worker, the running group's steps lost (a tiny model stepped at
0.72 of its speed while spares warmed). So the requester first leaves one token per spare in a node-local
directory, and a starting process that claims a token (`claim`) is a spare: it does its warm-up held back --
at nice 19 (`low_while`, the default: a bounded share of a CPU the steps saturate) or in the SCHED_IDLE class
(`idle_while`: only CPU time the group leaves unused) -- and puts every thread back once the warm-up ends,
before it can run a training worker; a watcher process (`start_wake_watcher`) puts it back the moment one
of its node's training workers is gone (a restart), so a restart never waits on a held-back warm-up, or once
it was held back for SPOTFILL_SPARE_HOLD_MAX_S (a hold without bound left spares on a saturated node still
importing when the next grow came).

A process started for an actor (no token left) warms up at normal priority, as before: that is a start or a
restart, with no group stepping on the node. A process that claims a token meant for another (the raylet
started both at once) only warms up later when the CPU is busy; nothing else changes.

A spare holds no Ray resource (no GPU, no CPU: a tenant may still take them) but it does hold host memory:
`spares_within_memory` caps how many a node gets so that its spares together stay within a fraction of its
memory (SPOTFILL_WARM_SPARE_MEMORY_FRACTION, each taken at SPOTFILL_WARM_SPARE_RSS_MB).

SCHED_IDLE is used only where this process may leave it again (Linux; an unprivileged thread may need
RLIMIT_NICE for that): `idle_while` tries the round trip on a throwaway thread first and, if refused, warms
up at normal priority rather than leave a training worker in SCHED_IDLE.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import uuid

TOKEN_TTL_S = 60.0        # a token no process claimed by then is stale (the raylet started none for it)


def spares_within_memory(asked: int, node_bytes: int, held: int, per_spare_bytes: int,
                         fraction: float) -> tuple[int, str]:
    """How many of `asked` spares a node of `node_bytes` memory gets when `held` spares (warming or ready)
    are already there, each taken at `per_spare_bytes` resident, all of them within `fraction` of the node's
    memory: (count, "" or the line saying why fewer). Where the node's memory is unknown (0) nothing caps them:
    a spare is a head start, and a cap on no number would take it away everywhere."""
    asked = max(0, int(asked))
    if node_bytes <= 0:
        return asked, ""
    budget = int(max(0, node_bytes) * max(0.0, fraction))
    room = max(0, budget // max(1, per_spare_bytes) - max(0, held))
    if asked <= room:
        return asked, ""
    return room, (f"{room} of {asked} spare(s): {held} already held and each taken at "
                  f"{per_spare_bytes / 2**20:.0f} MiB (SPOTFILL_WARM_SPARE_RSS_MB) within {fraction:g} of the "
                  f"node's {node_bytes / 2**30:.1f} GiB (SPOTFILL_WARM_SPARE_MEMORY_FRACTION)")


def host_memory_bytes() -> int:
    """This machine's physical memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def token_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "spotfill-spares")


def offer(node_id: str, count: int, now: float | None = None, directory: str | None = None) -> list[str]:
    """Leave `count` tokens for spare processes about to start on node `node_id`; returns their paths."""
    directory = directory or token_dir()
    os.makedirs(directory, exist_ok=True)
    now = time.time() if now is None else now
    paths = []
    for _ in range(max(0, int(count))):
        path = os.path.join(directory, f"{node_id}.{now:.3f}.{uuid.uuid4().hex[:8]}")
        with open(path, "w"):
            pass
        paths.append(path)
    return paths


def claim(node_id: str, now: float | None = None, directory: str | None = None) -> bool:
    """Take one token left for node `node_id` (True: this process is a spare). Stale tokens are removed.
    Each token is taken by one process at most (the unlink that succeeds)."""
    directory = directory or token_dir()
    now = time.time() if now is None else now
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return False
    for name in names:
        node, _, rest = name.partition(".")
        try:
            offered = float(rest.rsplit(".", 1)[0])
        except ValueError:
            continue
        stale = now - offered > TOKEN_TTL_S
        if node != node_id and not stale:
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            continue              # another process took it first
        if not stale:
            return True
    return False


# Tokens for a node that is not the requester's (a node new to the run, warmed before a grow: train.elastic)
# live in the GCS key-value store, where the spares starting there find them; each is taken by the one process
# whose delete removed it. `put`, `keys` and `take` are the store's operations (spotfill.ray_compat kv_*).
KV_TOKEN_PREFIX = "spotfill:spare-token:"


RESERVE_MARK = "r"        # a reserve spare's token (train.readiness.GrowPlanner.reserve): its id starts so


def offer_kv(node_id: str, count: int, put, now: float | None = None, reserve: bool = False) -> list[str]:
    """Leave `count` tokens for spares about to start on `node_id`; `reserve`: tokens of a reserve (spares for
    a restart that may come, not for a grow waiting on them: they warm in SCHED_IDLE, held back until a
    restart wakes them -- only CPU time the node leaves unused, train.warm)."""
    now = time.time() if now is None else now
    mark = RESERVE_MARK if reserve else ""
    keys = [f"{KV_TOKEN_PREFIX}{node_id}:{now:.3f}:{mark}{uuid.uuid4().hex[:8]}" for _ in range(max(0, int(count)))]
    for key in keys:
        put(key, "1")
    return keys


def claim_kv(node_id: str, keys, take, now: float | None = None) -> str:
    """Take one of node `node_id`'s tokens (`keys`: the store's keys under its prefix); stale ones removed.
    Returns "spare", "reserve" (a reserve's token) or "" (none taken)."""
    now = time.time() if now is None else now
    for key in sorted(keys(f"{KV_TOKEN_PREFIX}{node_id}:")):
        try:
            _, offered_s, ident = key.rsplit(":", 2)
            offered = float(offered_s)
        except (ValueError, IndexError):
            continue
        if take(key) and now - offered <= TOKEN_TTL_S:
            return "reserve" if ident.startswith(RESERVE_MARK) else "spare"
    return ""


def group_worker_pids(job_id: str | None, title: str, proc: str = "/proc") -> list[int]:
    """Pids of this host's training worker processes of Ray job `job_id`: a process title starting with
    `title` (Ray names an actor's process after its class) and RAY_JOB_ID=`job_id` in its environment.
    [] where /proc cannot be read or `job_id` is unknown."""
    if not job_id:
        return []
    want, found = f"RAY_JOB_ID={job_id}".encode(), []
    try:
        entries = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(os.path.join(proc, entry, "cmdline"), "rb") as f:
                if not f.read(len(title) + 1).startswith(title.encode()):
                    continue
            with open(os.path.join(proc, entry, "environ"), "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return sorted(found)


# The wake watcher: a separate process (so that no GIL is between it and the spare's starved threads), `os` only
# and no site (`python -S -I`: milliseconds to start). Argv: the spare's pid, the poll interval (s), the nice to
# give back (-1: the spare warms in SCHED_IDLE), the longest hold-back (s; 0: none), the pids of the node's
# training workers. Once the spare has threads held back (SCHED_IDLE, or nice 19), and as soon as one of those
# workers is gone (a zombie counts as gone: "restart") or the spare was held back for the longest hold-back
# ("hold_max"), it moves every such thread of the spare back (SCHED_OTHER / the nice), prints "<unix time>
# <threads moved> <why>" and exits; it exits quietly when the spare is gone or its warm-up ended.
WAKE_WATCHER = r"""
import os, sys, time
spare, poll, nice, hold_max = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
watched = [int(a) for a in sys.argv[5:]]
try:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
except OSError:
    pass
def held(t):
    if nice < 0:
        return os.sched_getscheduler(t) == os.SCHED_IDLE
    return os.getpriority(os.PRIO_PROCESS, t) == 19
def wake(t):
    if nice < 0:
        os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
    else:
        os.setpriority(os.PRIO_PROCESS, t, nice)
def idle():
    try:
        tids = os.listdir("/proc/%d/task" % spare)
    except OSError:
        return None
    out = []
    for t in tids:
        try:
            if held(int(t)):
                out.append(int(t))
        except OSError:
            pass
    return out
def gone(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True
seen, t0 = False, time.time()
while True:
    tids = idle()
    if tids is None or (not tids and (seen or time.time() - t0 > 30)):
        break
    seen = seen or bool(tids)
    why = None
    if tids and any(gone(p) for p in watched):
        why = "restart"
    elif tids and hold_max > 0 and time.time() - t0 >= hold_max:
        why = "hold_max"
    if why:
        moved = 0
        for t in idle() or ():
            try:
                wake(t)
                moved += 1
            except OSError:
                pass
        print("%.3f %d %s" % (time.time(), moved, why), flush=True)
        break
    time.sleep(poll)
"""


def start_wake_watcher(watched: list[int], poll_s: float, spare_pid: int | None = None, nice: int | None = None,
                       hold_max_s: float = 0.0):
    """Start the wake watcher (WAKE_WATCHER) of this process (or `spare_pid`) over the training workers
    `watched` (none: only the bound ends the hold -- a fill-in standby's); returns its Popen, or None when
    there is nothing to watch or bound, or it cannot start. The spare
    warms in SCHED_IDLE, or with `nice` at LOW_NICE: woken, its threads go back to that nice -- when a
    watched worker is gone, or after `hold_max_s` held back (0: only then)."""
    if (not watched and hold_max_s <= 0) or not hasattr(os, "SCHED_IDLE"):
        return None
    import subprocess
    import sys
    try:
        return subprocess.Popen([sys.executable, "-S", "-I", "-c", WAKE_WATCHER, str(spare_pid or os.getpid()),
                                 repr(float(poll_s)), str(-1 if nice is None else int(nice)),
                                 repr(max(0.0, float(hold_max_s))), *map(str, watched)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                close_fds=True)
    except OSError:
        return None


def end_wake_watcher(proc) -> tuple[float, int, str] | None:
    """Stop the watcher (the warm-up ended) and return when it woke this process, how many threads it
    moved and why ("restart": a training worker of its node was gone; "hold_max": held back long enough),
    or None when it did not."""
    if proc is None:
        return None
    try:
        if proc.poll() is None:
            proc.terminate()
        out, _ = proc.communicate(timeout=5)
        when, moved, why = out.decode().split()
        return float(when), int(moved), why
    except Exception:  # noqa: BLE001 -- nothing woke it (no line), or it could not be read
        return None


def _round_trip_allowed() -> bool:
    """Can a thread of this process enter SCHED_IDLE and leave it again? Tried on a throwaway thread."""
    if not hasattr(os, "SCHED_IDLE"):
        return False

    def probe() -> bool:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        return os.sched_getscheduler(0) == os.SCHED_OTHER
    return _on_a_throwaway_thread(probe)


def _on_a_throwaway_thread(probe) -> bool:
    """`probe()` run on a thread of its own (a change of its scheduling stays there); False if it raised
    OSError (not allowed)."""
    ok: list[bool] = []

    def run():
        try:
            ok.append(bool(probe()))
        except OSError:
            ok.append(False)
    t = threading.Thread(target=run, name="spotfill-sched-probe")
    t.start()
    t.join()
    return bool(ok and ok[0])


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]                # no /proc: the calling thread


def idle_threads() -> int:
    """How many threads of this process are in SCHED_IDLE (a training worker must have none)."""
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    n = 0
    for tid in _threads():
        with contextlib.suppress(OSError):
            n += os.sched_getscheduler(tid) == os.SCHED_IDLE
    return n


def normal_scheduling() -> int:
    """Put every SCHED_IDLE thread of this process back in SCHED_OTHER; returns how many were moved."""
    moved = 0
    for tid in _threads():
        with contextlib.suppress(OSError):
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                moved += 1
    return moved


LOW_NICE = 19


def _nice_round_trip_allowed(nice: int) -> bool:
    """Can a thread of this process go to nice LOW_NICE and back to `nice`? Tried on a throwaway thread."""
    def probe() -> bool:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, LOW_NICE)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return os.getpriority(os.PRIO_PROCESS, tid) == nice
    return _on_a_throwaway_thread(probe)


def restore_nice(nice: int) -> int:
    """Put every thread of this process at nice LOW_NICE back to `nice`; returns how many were moved."""
    moved = 0
    for tid in _threads():
        with contextlib.suppress(OSError):
            if os.getpriority(os.PRIO_PROCESS, tid) == LOW_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                moved += 1
    return moved


def held_back(held) -> bool:
    """Whether `low_while` / `idle_while` held the block back, from what it yielded: idle_while a bool,
    low_while the nice it had -- 0 too, which a truth test (or `in (None, False)`) takes for False -- or None."""
    return held is not None and held is not False


@contextlib.contextmanager
def bounded_hold(enabled: bool, low: bool, hold_max_s: float, watched: list[int], poll_s: float):
    """Hold the block back -- nice LOW_NICE (`low`) or SCHED_IDLE -- when `enabled`, with a wake watcher
    (WAKE_WATCHER, started first at this process's own priority: a child inherits SCHED_IDLE and nice) that
    puts its threads back when one of the `watched` training workers is gone or after `hold_max_s` (0: only
    then; no watcher without either). Yields a dict: "idle" (held back at all) and "class" ("low", "idle" or
    "normal"); once the block ends, when the watcher woke it, "woken_t", "woken_moved" and "woken_by". A
    training worker's spare (train.warm) and a fill-in tenant's standby (fillin.standby) warm up in it."""
    watcher = start_wake_watcher(watched, poll_s, nice=os.getpriority(os.PRIO_PROCESS, 0) if low else None,
                                 hold_max_s=hold_max_s) if enabled else None
    out: dict = {}
    with (low_while if low else idle_while)(enabled) as held:
        out["idle"] = held_back(held)
        out["class"] = ("low" if low else "idle") if out["idle"] else "normal"
        if not out["idle"]:
            watcher = end_wake_watcher(watcher) and None
        try:
            yield out
        finally:
            woke = end_wake_watcher(watcher)
            if woke:
                out["woken_t"], out["woken_moved"], out["woken_by"] = round(woke[0], 3), *woke[1:]


@contextlib.contextmanager
def low_while(enabled: bool):
    """Run the block with the calling thread (and the threads it starts) at nice LOW_NICE, in the normal
    scheduling class, when `enabled` and the way back is allowed; afterwards every thread at LOW_NICE is back
    at the calling thread's nice. Yields the nice it had (None: not lowered). Unlike SCHED_IDLE a thread at
    nice 19 still gets a share of a CPU its node's training saturates (15 to 36 per nice-15 worker: Ray's
    workers run at nice 15), so a spare warms up while the group steps, at a bounded cost to the steps."""
    tid = threading.get_native_id()
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        nice = LOW_NICE
    use = bool(enabled) and nice < LOW_NICE and _nice_round_trip_allowed(nice)
    if use:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, LOW_NICE)
        except OSError:
            use = False
    try:
        yield nice if use else None
    finally:
        if use:
            restore_nice(nice)


@contextlib.contextmanager
def idle_while(enabled: bool):
    """Run the block with the calling thread (and the threads it starts) in SCHED_IDLE when `enabled` and
    the round trip is allowed; afterwards every SCHED_IDLE thread of the process is back in SCHED_OTHER.
    Yields whether SCHED_IDLE was used."""
    use = bool(enabled) and _round_trip_allowed()
    if use:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            use = False
    try:
        yield use
    finally:
        if use:
            normal_scheduling()
