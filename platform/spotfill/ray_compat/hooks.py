"""The mechanism behind every private Ray/torch/DeepSpeed hook: resolved when first used, never at import.

A hook is a named set of private names (catalog.py) with a class:
- robustness: spotfill works without it, only less well. `usable(name)` answers False when an installed
  version lacks one of its names, and says so ONCE per process: one warning naming the hook, what is lost,
  the first missing name, the versions that have it and the version installed. The caller then takes the
  plain path (stock Ray, stock torch).
- required: a feature cannot work without it. `require(name)` raises RayCompatError -- a one-line message
  naming the feature, the missing name and the versions that have it -- when that feature is used; the CLI
  and the job scripts print it as one line and exit 1.
Nothing here imports Ray, torch or DeepSpeed until a hook is checked, so importing spotfill never fails
because a private name moved.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from spotfill.config.errors import SpotfillError

log = logging.getLogger("spotfill.ray_compat")

ROBUSTNESS, REQUIRED = "robustness", "required"
# The versions spotfill is tested with (pyproject.toml declares the same ranges; a unit test holds them equal).
TESTED = {"ray": ">=2.60,<2.61", "torch": ">=2.11,<2.15", "deepspeed": ">=0.19,<0.20"}


class RayCompatError(SpotfillError):
    """A feature needs a private Ray/torch/DeepSpeed name the installed version lacks (one line, exit 1)."""


@dataclass(frozen=True)
class Hook:
    """One use of private names. `names`: "module:Attr.attr" or "module:Attr.method(leading, params)";
    `checks`: callables returning a problem (str) or None, for what a name cannot say (a source file's
    content, a protobuf's fields); `not_needed`: for a robustness hook, a callable returning why the
    installed version needs no such hook (then it is off with an info line, not a warning)."""
    name: str
    kind: str
    package: str            # ray | torch | deepspeed: whose private names these are
    have: str               # the versions known to have them, e.g. "ray 2.60"
    feature: str            # what the hook does for spotfill
    lost: str               # robustness: what is lost without it; required: the feature that stops working
    why: str                # why this class: what its call sites do without it
    names: tuple[str, ...] = ()
    checks: tuple[Callable[[], str | None], ...] = ()
    not_needed: Callable[[], str | None] | None = None


_lock = threading.Lock()
_problems: dict[str, str | None] = {}
_announced: set[str] = set()


def _hook(name: str) -> Hook:
    from spotfill.ray_compat.catalog import HOOKS
    return HOOKS[name]


def resolve(spec: str):
    """The object a name spec points at; RayCompatError (the spec and why) when it is not there."""
    problem, obj = _resolve(spec)
    if problem:
        raise RayCompatError(problem)
    return obj


def _resolve(spec: str):
    path, _, params = spec.partition("(")
    module, _, attrs = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import is "not there"
        return f"{module} (cannot import it: {type(exc).__name__})", None
    parts = attrs.split(".") if attrs else []
    for i, attr in enumerate(parts):
        if not hasattr(obj, attr):
            return f"{module}.{'.'.join(parts[:i + 1])} (missing)", None
        obj = getattr(obj, attr)
    want = tuple(p.strip() for p in params.rstrip(")").split(",") if p.strip())
    if want:
        try:
            got = tuple(p for p in inspect.signature(obj).parameters if p != "self")
        except (TypeError, ValueError):
            return f"{module}.{attrs}({', '.join(want)}) (no signature to check)", None
        if got[:len(want)] != want:
            return f"{module}.{attrs}({', '.join(want)}) (it takes ({', '.join(got)}))", None
    return None, obj


def problem(name: str) -> str | None:
    """The first of hook `name`'s private names the installed versions lack (None: all there). Checked
    once per process."""
    with _lock:
        if name in _problems:
            return _problems[name]
    hook = _hook(name)
    found = None
    for spec in hook.names:
        found = _resolve(spec)[0]
        if found:
            break
    for check in () if found else hook.checks:
        try:
            found = check()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run finds the hook unusable
            found = f"{getattr(check, '__name__', 'check')} failed: {type(exc).__name__}: {exc}"
        if found:
            break
    with _lock:
        _problems.setdefault(name, found)
        return _problems[name]


def installed(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:
        return f"no {package}"


def degraded_message(hook: Hook, found: str) -> str:
    return (f"spotfill: {hook.name} is off ({installed(hook.package)} lacks {found}; {hook.have} has it). "
            f"Lost: {hook.lost}. Everything else works.")


def required_message(hook: Hook, found: str) -> str:
    return (f"{hook.lost} needs {hook.package}'s {found}, which {hook.have} has; installed: "
            f"{installed(hook.package)} (spotfill is tested with {hook.package}{TESTED[hook.package]})")


def usable(name: str) -> bool:
    """Whether robustness hook `name` can be applied here; False (and, the first time in this process,
    one warning saying what is lost) when an installed version lacks one of its names."""
    hook = _hook(name)
    if hook.kind != ROBUSTNESS:
        raise ValueError(f"{name} is a {hook.kind} hook: use require()")
    found = problem(name)
    if found is None:
        return True
    with _lock:
        first = name not in _announced
        _announced.add(name)
    if first:
        reason = hook.not_needed() if hook.not_needed else None
        if reason:
            log.info("spotfill: %s is not applied: %s", name, reason)
        else:
            log.warning(degraded_message(hook, found))
    return False


def require(name: str) -> None:
    """Raise RayCompatError (one line: the feature, the missing name, the versions that have it) when
    required hook `name` cannot work with the installed versions."""
    hook = _hook(name)
    if hook.kind != REQUIRED:
        raise ValueError(f"{name} is a {hook.kind} hook: use usable()")
    found = problem(name)
    if found:
        raise RayCompatError(required_message(hook, found))


def status() -> list[dict]:
    """Every hook with its class and, when the installed versions lack something it needs, what."""
    from spotfill.ray_compat.catalog import HOOKS
    return [{"hook": h.name, "kind": h.kind, "package": h.package, "have": h.have, "problem": problem(h.name),
             "not_needed": (h.not_needed() if h.not_needed and problem(h.name) else None)}
            for h in HOOKS.values()]


def stand_in_base(spec: str, hook: str) -> type:
    """The class `spec` names, to subclass at import; where it is missing, a stand-in with its name that
    can be subclassed but not instantiated: instantiating one raises the hook's RayCompatError (required)
    -- the feature was used -- or a RuntimeError (robustness: callers check usable() first)."""
    found, obj = _resolve(spec)
    if found is None:
        return obj

    def __new__(cls, *args, **kwargs):
        if _hook(hook).kind == REQUIRED:
            require(hook)
        raise RuntimeError(f"{cls.__name__}: {found}; spotfill checks usable({hook!r}) before building one")

    name = spec.partition(":")[2].rsplit(".", 1)[-1] or spec
    return type(name, (), {"__new__": __new__, "__doc__": f"Stand-in: {found}.", "__module__": __name__})
