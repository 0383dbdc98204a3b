"""The package layout keeps its promises: pure decision modules load no Ray, torch, DeepSpeed or boto3
(checked in a fresh interpreter, so a transitive import counts too), and no stray flat modules return."""
import json
import pathlib
import subprocess
import sys

import pytest

import spotfill

PURE = [
    "spotfill.planning.planner", "spotfill.planning.hardware", "spotfill.planning.sizing", "spotfill.cli.plan",
    "spotfill.config.batching", "spotfill.train.capacity", "spotfill.train.spares", "spotfill.config.presets", "spotfill.sim.scenario",
    "spotfill.sim.outcomes", "spotfill.config", "spotfill.telemetry.ledger", "spotfill.telemetry.diagnosis",
    "spotfill.telemetry.html", "spotfill.telemetry.report", "spotfill.telemetry.live",
    "spotfill.telemetry.throughput", "spotfill.telemetry.progress", "spotfill.telemetry.liveview",
    "spotfill.telemetry.nvml", "spotfill.train.summary", "spotfill.cli.status",
    "spotfill.storage.lineage", "spotfill.train.preflight", "spotfill.train.step_policy",
    "spotfill.train.sample_ledger", "spotfill.train.restarts", "spotfill.ray_compat.opcache",
    "spotfill.fillin.policy", "spotfill.fillin.journal", "spotfill.fillin.lending", "spotfill.fillin.hosts",
    "spotfill.fillin.turns", "spotfill.fillin.tenant", "spotfill.config.tenant_kinds",
    "spotfill.fillin.let_go", "spotfill.fillin.busy", "spotfill.config.batch", "spotfill.fillin.batch_plan", "spotfill.sim.fillin_spec", "spotfill.sim.nodes", "spotfill.sim.autoscaler_config",
    "spotfill.fillin.sweep_policy", "spotfill.config.sweep", "spotfill.fillin.cpu_priority",
    "spotfill.devices", "spotfill.fillin.cluster_kind",
    "spotfill.config.pipe_layout", "spotfill.train.bubble", "spotfill.train.pipeline_summary",
    "spotfill.planning.pipeline_advice", "spotfill.config.failure_detection",
]
HEAVY = {"ray", "torch", "deepspeed", "boto3"}


@pytest.mark.parametrize("module", PURE)
def test_pure_module_loads_nothing_heavy(module):
    code = (f"import sys, json, {module}; "
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(HEAVY)!r}))))")
    import os
    here = str(pathlib.Path(spotfill.__file__).parent.parent)       # this checkout's spotfill, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert json.loads(out) == [], f"{module} pulls in {out.strip()}"


def test_one_subpackage_per_capability():
    root = pathlib.Path(spotfill.__file__).parent
    flat = sorted(p.name for p in root.glob("*.py") if p.name not in {"__init__.py", "__main__.py", "devices.py"})
    assert flat == [], f"modules outside a capability subpackage: {flat}"


def test_the_product_never_imports_the_cli_or_the_simulator():
    """Imports point one way: the CLI and the simulator (and tests) use the product, never the reverse; and
    ray_compat, which every fill-in module may import, imports no fill-in module."""
    import ast
    root = pathlib.Path(spotfill.__file__).parent
    wrong = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in ("cli", "sim", "testing") or rel in ("__main__.py", "__init__.py"):
            continue
        banned = ("spotfill.cli", "spotfill.sim") + (("spotfill.fillin",) if rel.startswith("ray_compat/") else ())
        try:
            source = path.read_text(encoding="utf-8")
        except FileNotFoundError:     # gone since the listing (an editor's or a tool's temporary file)
            continue
        for node in ast.walk(ast.parse(source, str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{rel} imports {n}" for n in names if n.startswith(banned)]
    assert wrong == [], wrong


def test_public_sdk_names_resolve():
    for name in spotfill.__all__:
        assert callable(getattr(spotfill, name)), name
    with pytest.raises(AttributeError):
        spotfill.no_such_thing  # noqa: B018


def _subpackage_imports() -> dict[tuple[str, str], str]:
    """(importer, imported) subpackage -> the first file:line of such an import, counting imports inside
    functions too (the same graph as ../shared/tools/import_cycles.py); spotfill/devices.py is its own unit."""
    import ast
    root = pathlib.Path(spotfill.__file__).parent
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        parts = ["spotfill", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) < 2:
            continue
        src = parts[1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ["spotfill", *path.relative_to(root).with_suffix("").parts]
                mod = ".".join(base[:len(base) - node.level] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                p = t.split(".")
                if p[0] == "spotfill" and len(p) > 1 and p[1] != src:
                    edges.setdefault((src, p[1]), f"{path.relative_to(root)}:{node.lineno}")
    return edges


def test_subpackages_import_down_only():
    """No two subpackages reach each other through imports (inside functions too): the layers stay a
    ladder -- config < ray_compat < spot < storage < planning < telemetry < train < generation < fillin
    < serving < testing < sim < cli (README.md, "Layout")."""
    edges = _subpackage_imports()
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    closure = {u: reaches(u) for u in graph}
    cycles = sorted(f"{a} -> {b} ({where}), and back" for (a, b), where in edges.items() if a in closure.get(b, ()))
    assert cycles == [], "subpackage import cycles:\n" + "\n".join(cycles)
