"""Every private Ray hook spotfill uses, in one place, resolved and checked at import.

Ray's public API covers almost everything spotfill needs; the few places it does not are listed here with
the Ray version they were read against (2.60.0). Importing this module resolves every hook and checks its
signature: if Ray moved one, the import fails at once with a message naming it -- never a silent
fallback deep inside a training run. tests/unit/test_ray_compat.py imports it.
"""
from __future__ import annotations

import inspect

import ray
import ray._private.services as _services
import ray._private.state as _state
import ray._private.worker as _worker
import ray._raylet as _raylet
from ray.train.torch import TorchTrainer as _TorchTrainer
from ray.train.v2._internal.execution import callback as _train_callback
from ray.train.v2._internal.execution import context as _train_context
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

RAY_VERSION_CHECKED = "2.60.0"


class RayCompatError(ImportError):
    """A private Ray hook spotfill relies on is missing or changed shape."""


def _require(owner, name: str, params: tuple[str, ...] | None = None):
    where = f"{getattr(owner, '__module__', owner)}.{getattr(owner, '__qualname__', '')}".rstrip(".")
    if not hasattr(owner, name):
        raise RayCompatError(f"spotfill needs {where}.{name} (checked against ray {RAY_VERSION_CHECKED}); "
                             f"installed ray {ray.__version__} does not have it")
    obj = getattr(owner, name)
    if params is not None:
        got = tuple(p for p in inspect.signature(obj).parameters if p != "self")
        if got[:len(params)] != params:
            raise RayCompatError(f"spotfill needs {where}.{name}{params} (checked against ray "
                                 f"{RAY_VERSION_CHECKED}); installed ray {ray.__version__} has {got}")
    return obj


# (owner, attribute, leading parameters) -- each one used below.
HOOKS = [
    (_train_context, "get_train_context", ()),
    (ElasticScalingPolicy, "_count_possible_workers", ("reserved_resources",)),
    (_TorchTrainer, "_initialize_and_run_controller", ("controller_init_kwargs",)),
    (_state.GlobalState, "get_draining_nodes", ()),
    (_state, "state", None),
    (_worker, "print_to_stdstream", ("data", "ignore_prefix")),
    (_services, "canonicalize_bootstrap_address_or_die", ("addr",)),
    (_raylet, "GcsClient", None),
    (_state, "available_resources_per_node", ()),                       # fill-in arbiter snapshot
    (_train_callback.ControllerCallback, "before_controller_execute_resize_decision", ("resize_decision",)),
]
for _owner, _name, _params in HOOKS:
    _require(_owner, _name, _params)


def local_preemption_info():
    """This worker's preemption notice (a PreemptionInfo or None), read locally: no collective.

    ray.train.get_preemption_info() reads this same field (train_fn_utils.DistributedTrainFnUtils) and then
    broadcasts rank 0's value through Ray Train's SynchronizationActor: an actor round trip per step. The
    step's flags all_reduce already makes every rank act on any rank's notice, so the local value is enough."""
    return _train_context.get_train_context().preemption_context.preemption_info


def draining_node_ids() -> dict:
    """Node id -> drain deadline (ms) of every draining node, as Ray Train's PreemptionWatcher reads it."""
    return _state.state.get_draining_nodes() or {}


def available_resources_per_node() -> dict:
    """Node id -> {resource: amount available now}: what no task, actor or placement group holds. Ray's
    public API gives cluster-wide totals only; the fill-in arbiter needs them per node."""
    return _state.available_resources_per_node() or {}


# Ray Train's controller callback (a DeveloperAPI with no public import path in 2.60): fill-in claims
# GPUs in `before_controller_execute_resize_decision`, before a group starts, restarts or grows.
ControllerCallback = _train_callback.ControllerCallback


def gcs_client(address: str | None):
    """(gcs_address, GcsClient) for `address` ("auto"/None = the cluster `ray start` joined here), as the
    `ray drain-node` CLI builds it. No ray.init: a daemon needs no driver. Blocks (~40 s) when the GCS is
    unreachable."""
    gcs_address = _services.canonicalize_bootstrap_address_or_die(address or "auto")
    return gcs_address, _raylet.GcsClient(address=gcs_address)


def wrap_driver_stdstream(wrapper) -> None:
    """Install `wrapper(original, data, ignore_prefix)` around the driver's printer of worker/raylet log
    lines (looked up per message by the error-listener thread). Idempotent."""
    original = _worker.print_to_stdstream
    if getattr(original, "_spotfill_wrapped", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        return wrapper(original, data, ignore_prefix)

    print_to_stdstream._spotfill_wrapped = True
    _worker.print_to_stdstream = print_to_stdstream


def use_scaling_policy(trainer_cls, make_policy):
    """A subclass of `trainer_cls` whose controller gets `make_policy(scaling_config)` instead of Ray's
    ElasticScalingPolicy (the policy is built on the driver and handed to the controller actor)."""

    class Trainer(trainer_cls):
        def _initialize_and_run_controller(self, **kwargs):
            if isinstance(kwargs.get("scaling_policy"), ElasticScalingPolicy):
                kwargs["scaling_policy"] = make_policy(self.scaling_config)
            return super()._initialize_and_run_controller(**kwargs)

    Trainer.__name__ = Trainer.__qualname__ = f"Spotfill{trainer_cls.__name__}"
    return Trainer
