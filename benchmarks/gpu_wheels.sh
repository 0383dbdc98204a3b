#!/usr/bin/env bash
# Fetch what the GPU check needs and the lent GPU machine lacks into .whl/ (git ignores it), on a machine
# that reaches PyPI; benchmarks/gpu_check.sh installs them there (`run` with carry [".whl"]).
#
#   bash benchmarks/gpu_wheels.sh             # wheels for the GPU image's Python 3.12
#   bash benchmarks/gpu_dry_run.sh            # then, here: install them into an empty target beside only the
#                                             # image's packages and import every module on the check's path
#
# The GPU image's packages are listed in benchmarks/gpu_image_packages.txt (copied from the device tool's
# KINDS.md): torch 2.11, numpy, pandas, pyarrow, fsspec, pyyaml, psutil, requests, click, filelock, msgpack,
# protobuf, packaging, aiohttp, grpcio, attrs, einops, ninja, py-cpuinfo, tqdm, setuptools, wheel, rich,
# jinja2, prometheus-client, nvidia-ml-py, pytest ... -- but NOT jsonschema nor its own needs. Carried:
#   ray 2.60.0            repacked without ray/jars (Java, 32 MB) and ray/rllib: 79 MB -> ~45 MB
#   jsonschema (+ referencing, jsonschema-specifications, rpds-py)    `import ray` needs it
#   pydantic (+ pydantic-core, annotated-types, typing-inspection, typing-extensions)   Ray Train/Tune, DeepSpeed
#   hjson                 DeepSpeed's config reader
#   tensorboardX          Ray Tune's default loggers
#   starlette, fastapi, uvicorn, opentelemetry-api, grpcio-reflection
#                         Ray Serve's import chain: spotfill.ray_compat (which every training worker imports)
#                         resolves ray.serve.handle, and serving/app.py is a Serve app
#   deepspeed 0.19.8      a wheel built here from its sdist with no ops (DS_BUILD_OPS=0: pure Python; every
#                         op is JIT-built where used, and spotfill's GPU path uses none); the sdist rides
#                         along in .whl/src/ in case the wheel does not import there
# benchmarks/gpu_dry_run.py checks that every requirement of every carried wheel is carried or in the image.
# Versions are the ones this project's own environment runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
DEST=${DEST:-.whl}
PYTHON=${PYTHON:-python3}
PKGS="ray==2.60.0 jsonschema==4.26.0 referencing==0.37.0 jsonschema-specifications==2025.9.1 rpds-py==0.30.0
      pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
      typing-extensions==4.16.0 hjson==3.1.0 tensorboardX==2.6.5
      starlette==1.10.0 fastapi==0.165.0 uvicorn==0.55.0 opentelemetry-api==1.45.2 grpcio-reflection==1.85.1"
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
rm -rf "$DEST"
mkdir -p "$DEST/src"
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp $PLAT \
    -d "$DEST" $PKGS

"$PYTHON" - "$DEST" <<'EOF'
"""Repack Ray's wheel without ray/jars and ray/rllib; RECORD lists what is left."""
import glob, os, sys, zipfile
src = glob.glob(os.path.join(sys.argv[1], "ray-*.whl"))[0]
tmp = src + ".tmp"
drop = ("ray/jars/", "ray/rllib/")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if info.filename.startswith(drop):
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            gone = tuple(d.encode() for d in drop)
            data = b"".join(ln for ln in data.splitlines(keepends=True) if not ln.startswith(gone))
        zout.writestr(info, data)
os.replace(tmp, src)
print(f"ray wheel repacked: {os.path.getsize(src) / 1e6:.1f} MB")
EOF

"$PYTHON" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$DEST/src" deepspeed==0.19.8
# DeepSpeed's setup.py reads the local torch (its version goes into the wheel's torch_info), so the build is
# not isolated; setuptools < 70.1 has no bdist_wheel of its own and needs the `wheel` package ("invalid
# command 'bdist_wheel'" with an old system Python): then the build runs in a throwaway venv that sees this
# Python's packages (torch) and has a current setuptools.
BUILD_PY=$PYTHON
if ! "$PYTHON" -c "import setuptools.command.bdist_wheel" >/dev/null 2>&1 && ! "$PYTHON" -c "import wheel" >/dev/null 2>&1; then
    BUILD_VENV=$(mktemp -d /tmp/gpu-wheels-build.XXXXXX)
    trap 'rm -rf "$BUILD_VENV"' EXIT
    "$PYTHON" -m venv --system-site-packages "$BUILD_VENV"
    "$BUILD_VENV/bin/python" -m pip install -q --upgrade "setuptools>=70.1" wheel
    BUILD_PY=$BUILD_VENV/bin/python
    echo "setuptools without bdist_wheel: building deepspeed with $("$BUILD_PY" -c 'import setuptools; print(setuptools.__version__)') in $BUILD_VENV"
fi
DS_BUILD_OPS=0 "$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$DEST"/src/deepspeed-0.19.8.tar.gz
ls -la "$DEST" "$DEST/src"
du -sh "$DEST"
