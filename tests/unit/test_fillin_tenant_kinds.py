"""A new fill-in tenant kind is one module plus one registry line (config/tenant_kinds.py): the real Arbiter
(its tick loop idle, Ray's node view a stand-in) lends to a tenant of a kind it has never heard of and
reclaims from it in the order the registry's ranks say, with no change to the arbiter; and the arbiter never
branches on a tenant's class (an AST check on fillin/arbiter.py, lending.py and policy.py)."""
from __future__ import annotations

import ast
import pathlib
from dataclasses import asdict, dataclass

import pytest

import spotfill
from spotfill.config import tenant_kinds
from spotfill.config.tenant_kinds import KINDS, KindInfo, colours, reclaim_order, resolve
from spotfill.fillin.arbiter import Arbiter
from spotfill.fillin.job_tenant import JobTenant, JobTenantSpec
from spotfill.fillin.policy import DEFAULT_ORDER, Holding, Node
from spotfill.fillin.serve_tenant import ServeTenant, ServeTenantSpec
from spotfill.fillin.tenant import Tenant, tenant_class

WAIT_S = 10.0        # a guard against a hang, not a measure


@dataclass(frozen=True)
class _EvalSpec:
    name: str
    kind: str = "eval"
    max_replicas: int = 1
    gpus_per_replica: int = 1
    grace_s: float = 5.0

    @property
    def tenant(self) -> str:
        return f"{self.kind}:{self.name}"

    def as_dict(self) -> dict:
        return asdict(self)


class _Eval:
    """The whole module of a new kind, as a test writes it: a tenant whose driver follows its target at once
    (a lower target lets go of its newest units, a higher one takes new ones on node n1)."""

    pulls_target = True
    forced_when_overdue = False
    pending_groups: frozenset = frozenset()

    def __init__(self, spec: _EvalSpec):
        self.spec, self.target, self.held, self.taken = spec, None, [], 0

    @classmethod
    def from_spec(cls, spec: dict) -> "_Eval":
        return cls(_EvalSpec(**spec))

    def kept(self, calls) -> "_Eval":
        return self

    @property
    def tenant(self) -> str:
        return self.spec.tenant

    @property
    def wanted_units(self) -> int:
        return self.spec.max_replicas

    def holdings(self) -> list[Holding]:
        return list(self.held)

    def shape(self, gpu_resource: str) -> dict[str, float]:
        return {gpu_resource: float(self.spec.gpus_per_replica)}

    def set_target(self, n: int, *, takeover: bool = False, again: bool = False) -> bool:
        self.target = max(0, min(int(n), self.spec.max_replicas))
        while len(self.held) > self.target:
            self.held.pop()
        while len(self.held) < self.target:
            self.taken += 1
            self.held.append(Holding(self.tenant, self.spec.kind, "n1", 1, key=f"{self.tenant}#{self.taken}"))
        return True

    def set_demand(self, demand: int, held: int) -> bool:
        return True

    def adopt_from(self, old) -> None:
        self.target = old.target if old is not None else None

    def force_release(self, dashboard_url: str | None) -> str:
        self.set_target(0)
        return "let go"


class _Batch(JobTenant):
    """A real batch JobTenant whose driver follows its target at once on node n1."""

    def __init__(self):
        super().__init__(JobTenantSpec("b", "batch", job_id="01000000", max_replicas=1, grace_s=5.0))
        self.held: list[Holding] = []

    def holdings(self):
        return list(self.held)

    def set_replicas(self, n: int) -> bool:
        super().set_replicas(n)
        self.held = self.held[:self.target] + [Holding(self.tenant, "batch", "n1", 1, key=f"{self.tenant}#1")
                                               for _ in range(self.target - len(self.held))]
        return True


def _register_eval(monkeypatch, rank: int) -> None:
    """The one registry line of the new kind."""
    monkeypatch.setitem(KINDS, "eval", KindInfo(rank, "#123456", f"{__name__}:_Eval", __name__))


@pytest.mark.parametrize("rank, first", [(-1, "eval:e"), (9, "batch:b")])
def test_a_new_kind_is_lent_to_and_reclaimed_in_the_registrys_order(tmp_path, monkeypatch, rank, first):
    _register_eval(monkeypatch, rank)
    arb = Arbiter("GPU", state_path=str(tmp_path / "state.json"), interval_s=3600, autoscaled=False)
    arb.records_read_at = float("inf")          # no training records in a GCS here: never read
    try:
        assert arb.order[0 if rank < 0 else -1] == "eval"
        batch = _Batch()
        arb.tenants[batch.tenant] = batch
        # Ray's view: n1's 2 GPUs, less what the tenants hold
        arb._nodes = lambda: [Node("n1", 2, 2 - sum(len(t.held) for t in arb.tenants.values()))]
        answer = arb.register_kind("eval", {"name": "e"})
        new = arb.tenants["eval:e"]
        assert isinstance(new, _Eval) and isinstance(new, Tenant) and answer["tenant"] == "eval:e"
        arb.tick()
        assert (new.target, batch.target) == (1, 1), "the new kind was not lent its GPU"
        assert sorted(le.tenant for le in arb.leases) == ["batch:b", "eval:e"]
        assert arb.tenant_target("eval:e") == {"target": 1, "known": True}
        got = arb.claim("train", 1, deadline_s=WAIT_S, gpus_per_worker=1, min_workers=1, max_workers=1)
        assert got["ok"], got
        (lease,) = got["reclaimed"]
        assert lease.startswith(first + "#"), f"reclaimed {lease}, the registry ranks {first} first"
    finally:
        arb._stop.set()


def test_a_new_kind_is_kept_across_an_arbiter_restart(tmp_path, monkeypatch):
    """The state file names each tenant by its kind: a restarted arbiter builds it with the registry's class."""
    _register_eval(monkeypatch, -1)
    path = str(tmp_path / "state.json")
    arb = Arbiter("GPU", state_path=path, interval_s=3600, autoscaled=False)
    arb.records_read_at = float("inf")
    arb._nodes = lambda: [Node("n1", 1, 1 - sum(len(t.held) for t in arb.tenants.values()))]
    try:
        arb.register_kind("eval", {"name": "e"})
        assert arb.tenants["eval:e"].target == 1
    finally:
        arb._stop.set()
    again = Arbiter("GPU", state_path=path, interval_s=3600, autoscaled=False)
    try:
        restored = again.tenants["eval:e"]
        assert isinstance(restored, _Eval) and restored.target == 1
    finally:
        again._stop.set()


def test_every_kind_in_the_registry_resolves_and_is_a_tenant(tmp_path):
    """Each line names a class that builds a `Tenant` the arbiter can keep, and a scenario driver that exists;
    the reclaim order and the timeline's colours are the registry's."""
    from spotfill.fillin.tenant_calls import TenantCalls
    from spotfill.telemetry.timeline import WORKLOAD_COLORS
    import threading
    specs = {"serve": {"app": "a", "deployment": "D", "dashboard_url": "127.0.0.1:1"},
             "batch": {"name": "b", "job_id": "01000000"}, "sweep": {"name": "s", "job_id": "01000000"}}
    stop = threading.Event()
    calls = TenantCalls(threading.RLock(), stop)
    try:
        for kind, info in KINDS.items():
            kept = tenant_class(kind).from_spec({**specs[kind], "kind": kind}).kept(calls)
            assert isinstance(kept, Tenant), kind
            assert kept.tenant.startswith(f"{kind}:") and kept.spec.kind == kind
            assert resolve(info.scenario_driver) is not None
    finally:
        stop.set()
    assert DEFAULT_ORDER == reclaim_order() == ("sweep", "batch", "serve")
    assert WORKLOAD_COLORS == colours() and set(WORKLOAD_COLORS) == set(KINDS)
    with pytest.raises(ValueError, match="accepted batch, serve, sweep"):
        tenant_kinds.info("nope")
    assert isinstance(ServeTenant(ServeTenantSpec()).kept(calls), Tenant)


BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "str", "bytes", "int", "float", "bool", "type",
            "Exception", "BaseException"}
NEVER_BRANCH = ("fillin/arbiter.py", "fillin/lending.py", "fillin/policy.py")


def _class_checks(path: pathlib.Path) -> list[str]:
    """isinstance / issubclass / type(x) comparisons naming anything but a builtin type."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                               "issubclass"):
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} | \
                {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names - BUILTINS:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq))
                                                   for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type" for s in sides) \
                    or any(isinstance(s, ast.Attribute) and s.attr == "__class__" for s in sides):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("rel", NEVER_BRANCH)
def test_the_arbiter_never_branches_on_a_tenants_class(rel):
    path = pathlib.Path(spotfill.__file__).parent / rel
    assert _class_checks(path) == [], "a branch on a tenant's class: give the Tenant protocol " \
                                      "(fillin/tenant.py) a member instead"
