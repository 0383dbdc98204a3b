#!/usr/bin/env bash
# The GPU check's packages against the lent machine's image, here, before device time is spent:
#
#   bash benchmarks/gpu_wheels.sh && bash benchmarks/gpu_dry_run.sh
#   GPU_DRY_RUN_CHECK=1 bash benchmarks/gpu_dry_run.sh     # then gpu_check.sh --cpu-dry-run in that image
#
# 1. requirements  every requirement of every carried wheel (.whl/, CPython 3.12) is carried or in the
#                  image's package list (benchmarks/gpu_image_packages.txt)
# 2. install       the carried 3.12 wheels into an empty target with the install gpu_check.sh runs there
#                  (here a cross-install: --python-version 3.12 and the manylinux platforms)
# 3. imports       this machine's Python (no torch for 3.12 is reachable here): the same wheels for it
#                  (benchmarks/gpu_wheels.sh with PY and DEST), a venv whose site-packages holds only the
#                  image's packages (linked from this machine's), the wheels into an empty target, then every
#                  module on the check's path and every private hook (benchmarks/gpu_dry_run.py imports)
# Needs PyPI for step 3's wheels unless HERE_WHEELS names a folder of them. Work folder: $DRY_RUN_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHL=${GPU_CHECK_WHEELS:-$REPO/.whl}
WORK=${DRY_RUN_DIR:-/tmp/gpu-dry-run}
HERE_PY=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
HERE_WHEELS=${HERE_WHEELS:-$WORK/whl-$HERE_PY}
mkdir -p "$WORK"

echo "== 1. requirements of the carried wheels ($WHL) against the image's list"
python3 -m benchmarks.gpu_dry_run requirements --wheels "$WHL" --python 3.12

echo "== 2. the carried 3.12 wheels into an empty target"
rm -rf "$WORK/site312" && mkdir -p "$WORK/site312"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site312" \
    --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$WHL"/*.whl
ls "$WORK/site312" | grep -c dist-info | xargs echo "installed distributions:"
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
whl=$(du -sb "$WHL" | cut -f1)
echo "what travels to the device: tracked files $((tree / 1000000)) MB + wheels $((whl / 1000000)) MB (limit 64 MiB)"
[ $((tree + whl)) -le $((64 * 1024 * 1024)) ] || { echo "over the device tool's 64 MiB"; exit 1; }

echo "== 3. imports with this machine's Python $HERE_PY, the image's packages only"
if [ ! -d "$HERE_WHEELS" ]; then
    PY=$HERE_PY DEST=$HERE_WHEELS bash benchmarks/gpu_wheels.sh >/dev/null
fi
python3 -m benchmarks.gpu_dry_run requirements --wheels "$HERE_WHEELS" --python "$HERE_PY" >/dev/null
python3 -m benchmarks.gpu_dry_run image-venv "$WORK/image-venv"
rm -rf "$WORK/site" && mkdir -p "$WORK/site"
"$WORK/image-venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" "$HERE_WHEELS"/*.whl
PYTHONPATH="$WORK/site:$REPO/platform:$REPO" "$WORK/image-venv/bin/python" -m benchmarks.gpu_dry_run imports \
    --json "$WORK/imports.json" > "$WORK/imports.log" 2>&1 || { tail -40 "$WORK/imports.log"; exit 1; }
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"modules imported: {d['modules']}, failed: \
{d['failed']}; hooks: {d['hooks']}, unresolved: {d['hooks_unresolved']}\")" "$WORK/imports.json"

if [ "${GPU_DRY_RUN_CHECK:-0}" = 1 ]; then
    echo "== 4. gpu_check.sh --cpu-dry-run in that image"
    PATH="$WORK/image-venv/bin:$PATH" GPU_CHECK_WHEELS=$HERE_WHEELS GPU_CHECK_SITE=$WORK/site-check \
        OUT=$WORK/check bash benchmarks/gpu_check.sh --cpu-dry-run
fi
echo "== dry run passed"
