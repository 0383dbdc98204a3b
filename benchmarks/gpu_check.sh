#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU, from a checkout plus .whl/ (benchmarks/gpu_wheels.sh):
# installs the carried wheels into $GPU_CHECK_SITE (default /tmp/site), then runs benchmarks/gpu_check.py
# (pytest tests/gpu, benchmarks/gpu.py for 125m and 1b, a Ray Train run of the 1b preset on the GPU, the
# fill-in tenants on the GPU, the generation engine), each section in a process group of its own under its
# share of the budget. Writes $OUT/gpu_check.json (rewritten
# after every section: a section that fails or overruns leaves the others' numbers) and $OUT/gpu_check.log.
#
#   bash benchmarks/gpu_check.sh                     # on the lent machine ($OUT set there)
#   bash benchmarks/gpu_check.sh --only vllm         # vLLM via Ray Serve LLM, lent and reclaimed (docs/vllm.md):
#                                                    # where vLLM imports only, else recorded as skipped
#   GPU_CHECK_BUDGET_S=480 (default): seconds for the sections, the install not counted (~40 s): with the
#   machine's start, one device call of timeout_s 590 (docs/metrics.md)
#   bash benchmarks/gpu_dry_run.sh                   # here first: the carried wheels against the image
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
SITE=${GPU_CHECK_SITE:-/tmp/site}
WHL=${GPU_CHECK_WHEELS:-$REPO/.whl}
t0=$(date +%s)
echo "[gpu_check] $(date -u +%FT%TZ) install from $WHL into $SITE"
if [ -d "$WHL" ]; then
    timeout 180 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHL"/*.whl || echo "[gpu_check] wheel install FAILED (exit $?)"
else
    echo "[gpu_check] no $WHL: using what the machine has"
fi
export PYTHONPATH="$SITE:$REPO/platform:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
if ! python3 -c "import deepspeed" >/dev/null 2>&1 && ls "$WHL"/src/deepspeed-*.tar.gz >/dev/null 2>&1; then
    echo "[gpu_check] the deepspeed wheel does not import: building its sdist here"
    DS_BUILD_OPS=0 timeout 240 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        --upgrade --target "$SITE" "$WHL"/src/deepspeed-*.tar.gz || echo "[gpu_check] deepspeed build FAILED"
fi
export GPU_CHECK_INSTALL_S=$(( $(date +%s) - t0 ))
echo "[gpu_check] install took ${GPU_CHECK_INSTALL_S}s"
python3 -m benchmarks.gpu_check --out "$OUT/gpu_check.json" --budget-s "${GPU_CHECK_BUDGET_S:-480}" "$@"
rc=$?
if [ ! -s "$OUT/gpu_check.json" ]; then       # the driver itself could not start: still one JSON
    printf '{"ok": false, "error": "benchmarks/gpu_check.py exited %s before writing", "install_s": %s}\n' \
        "$rc" "$GPU_CHECK_INSTALL_S" > "$OUT/gpu_check.json"
fi
echo "[gpu_check] done in $(( $(date +%s) - t0 ))s: $OUT/gpu_check.json"
exit $rc
