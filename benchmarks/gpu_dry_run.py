"""Will the GPU check's packages import on the lent machine? Checked here, before device time is spent.

    python3 -m benchmarks.gpu_dry_run requirements [--wheels .whl] [--python 3.12]
    python3 -m benchmarks.gpu_dry_run image-venv VENV     # a venv holding only the image's packages (links)
    python3 -m benchmarks.gpu_dry_run imports              # in that venv, after the wheels' install

`requirements`: every requirement of every carried wheel (Requires-Dist, its markers evaluated for CPython
on x86-64 Linux at --python, extras not taken) is carried or in the image's package list
(benchmarks/gpu_image_packages.txt) -- no network. `image-venv`: a venv without this machine's site-packages
whose site-packages holds links to the files of the installed distributions the image lists, and no others.
`imports`: imports every module on the check's path (`import_check`) and resolves every private hook
(spotfill.ray_compat); exit 1 when one fails. The GPU check's env section records `import_check` too.
benchmarks/gpu_dry_run.sh runs the three (see docs/metrics.md).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_LIST = os.path.join(REPO, "benchmarks", "gpu_image_packages.txt")
# what the sections import (benchmarks/gpu_check.py, the Ray Train worker, the tenants, serve), then every
# module of the spotfill packages the training and generation paths live in
CHECK_MODULES = ("torch", "numpy", "ray", "ray.train", "ray.train.torch", "ray.tune", "ray.serve", "ray.data",
                 "deepspeed", "deepspeed.runtime.zero.stage_1_and_2", "pydantic", "pyarrow", "pytest",
                 "benchmarks.gpu_check", "benchmarks.gpu", "benchmarks.gpu_sections", "benchmarks.gpu_tenants",
                 "benchmarks.serve", "benchmarks.serve_gpu_check", "benchmarks.gpu_vllm", "benchmarks.pipeline", "spotfill.devices")
CHECK_PACKAGES = ("spotfill.config", "spotfill.train", "spotfill.ray_compat", "spotfill.telemetry",
                  "spotfill.generation", "spotfill.fillin", "spotfill.planning")
NOT_ON_THE_PATH = ("spotfill.storage.s3", "spotfill.testing")   # boto3 / moto: S3 only, not in the check


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: str = IMAGE_LIST) -> set[str]:
    with open(path) as f:
        return {normalize(ln.strip()) for ln in f if ln.strip() and not ln.startswith("#")}


def wheel_metadata(path: str) -> tuple[str, list[str]]:
    """(distribution name, its Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode()
    head = text.split("\n\n", 1)[0]
    name = re.search(r"^Name: *(.+)$", head, re.M).group(1).strip()
    return name, [m.strip() for m in re.findall(r"^Requires-Dist: *(.+)$", head, re.M)]


def unmet(wheels: dict[str, list[str]], image: set[str], python: str = "3.12") -> dict[str, list[str]]:
    """{carried distribution: [its requirements neither carried nor in the image]}: each requirement's
    marker is evaluated for CPython `python` on x86-64 Linux with no extra asked for."""
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    have = image | {normalize(n) for n in wheels}
    out: dict[str, list[str]] = {}
    for name, reqs in wheels.items():
        missing = []
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if normalize(req.name) not in have:
                missing.append(str(req))
        if missing:
            out[name] = missing
    return out


def _modules() -> list[str]:
    import importlib
    import pkgutil

    names = list(CHECK_MODULES)
    for pkg in CHECK_PACKAGES:
        mod = importlib.import_module(pkg)
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, pkg + ".")]
    return [n for n in dict.fromkeys(names) if not n.startswith(NOT_ON_THE_PATH)]


def import_check() -> dict:
    """Import every module on the check's path and resolve every private hook: {"modules": how many
    imported, "failed": {module: error}, "hooks": how many, "hooks_unresolved": {hook: problem}}."""
    import importlib

    failed: dict[str, str] = {}
    try:
        names = _modules()
    except Exception as exc:  # noqa: BLE001 - a package that does not import is the finding
        names, failed["<walk>"] = list(CHECK_MODULES), f"{type(exc).__name__}: {exc}"[:300]
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a module is a failure too
            failed[name] = f"{type(exc).__name__}: {exc}"[:300]
    out: dict = {"modules": len(names) - len(failed), "failed": failed}
    try:
        from spotfill.ray_compat.hooks import status
        rows = status()
        out["hooks"] = len(rows)
        out["hooks_unresolved"] = {r["hook"]: r["problem"] for r in rows
                                   if r["problem"] is not None and not r["not_needed"]}
    except Exception as exc:  # noqa: BLE001
        out["hooks"], out["hooks_unresolved"] = 0, {"<status>": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def image_venv(venv: str, image: set[str]) -> dict:
    """A venv (no system site-packages) whose site-packages links to every file of each installed
    distribution the image lists (pip included: no venv pip or setuptools of its own), so it imports what
    the image has and nothing else (versions: this machine's). Returns {"linked": distributions, "absent": image packages not installed here}."""
    import subprocess
    import sysconfig
    from importlib.metadata import distributions

    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", venv], check=True)
    site = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    own = sysconfig.get_paths()["purelib"]
    linked, seen = [], set()
    for dist in distributions():
        name = normalize(dist.metadata["Name"] or "")
        if name not in image or name in seen or not dist.files:
            continue
        seen.add(name)
        root = os.path.realpath(str(dist.locate_file("")))
        if root != os.path.realpath(own):
            continue                     # an editable or user install: not the image's kind of package
        for f in dist.files:
            src = os.path.realpath(str(dist.locate_file(f)))
            rel = os.path.relpath(src, root)
            if rel.startswith("..") or not os.path.exists(src):
                continue                 # bin/ scripts and the like
            dst = os.path.join(site, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.lexists(dst):
                os.symlink(src, dst)
        linked.append(name)
    return {"site": site, "linked": sorted(linked), "absent": sorted(image - seen)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_dry_run.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("requirements")
    r.add_argument("--wheels", default=os.path.join(REPO, ".whl"))
    r.add_argument("--python", default="3.12")
    v = sub.add_parser("image-venv")
    v.add_argument("venv")
    i = sub.add_parser("imports")
    i.add_argument("--json", help="also write the result here (DeepSpeed prints to stdout at import)")
    args = parser.parse_args(argv)
    if args.cmd == "requirements":
        paths = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
        if not paths:
            print(f"--wheels: no *.whl in {args.wheels!r}; accepted: a folder benchmarks/gpu_wheels.sh filled",
                  file=sys.stderr)
            return 2
        wheels = dict(wheel_metadata(p) for p in paths)
        bad = unmet(wheels, image_packages(), args.python)
        print(json.dumps({"wheels": sorted(wheels), "unmet": bad}, indent=1))
        return 1 if bad else 0
    if args.cmd == "image-venv":
        res = image_venv(args.venv, image_packages())
        print(json.dumps({"site": res["site"], "linked": len(res["linked"]), "absent": res["absent"]}))
        return 0
    if REPO not in sys.path:
        sys.path[:0] = [os.path.join(REPO, "platform"), REPO]
    res = import_check()
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["failed"] or res["hooks_unresolved"] or not res["hooks"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
