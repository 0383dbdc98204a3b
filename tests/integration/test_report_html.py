"""report.html in a real headless Chromium (Debian's package): the DOM has every section and the run's
numbers, and the rendered page shows the embedded timeline (its state colours appear in the screenshot).
No Ray. Skipped, with the reason, where no chromium binary is installed (.ci/run installs it)."""
import os
import re
import shutil
import subprocess
import sys

import pytest
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from test_telemetry_report import write_run  # noqa: E402

from spotfill.telemetry.report import write_report  # noqa: E402
from spotfill.telemetry.timeline import STATE_COLORS, WORKLOAD_COLORS  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH "
                                "(Debian: apt-get install -y chromium; .ci/run installs it)")


def chromium(*args, tmp):
    cmd = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp}/profile", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp)})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = write_run(tmp_path_factory.mktemp("report") / "run")
    out = write_report(run_dir)
    return run_dir, out["summary"]


def test_dom_has_sections_and_numbers(run, tmp_path):
    run_dir, summary = run
    res = chromium("--dump-dom", f"file://{run_dir}/report.html", tmp=tmp_path)
    dom = res.stdout
    assert res.returncode == 0 and "<body" in dom, res.stderr[-2000:]
    for sid in ("summary", "timeline", "gpu-seconds", "per-node", "diagnosis", "recoveries", "checkpoints"):
        assert re.search(rf'<section id="{sid}"', dom), f"section {sid} missing from the rendered DOM"
    goodput = f"{100 * summary['goodput']:.1f}%"
    assert re.search(rf'data-kpi="goodput">goodput<b>{re.escape(goodput)}</b>', dom)
    assert f"{summary['gpu_seconds']['total']:,.1f}" in dom                        # 220.0 GPU-seconds
    assert f"{summary['gpu_seconds']['recovering']:,.1f}" in dom
    harvest = f"{100 * summary['harvest_ratio']:.1f}%"
    assert f'harvest ratio<b>{harvest}</b>' in dom
    for cause in ("recovery", "idle_capacity", "rolled_back", "checkpoint_stall", "data_stall"):
        assert f"<td class=\"l\">{cause}</td>" in dom
    assert "<script" not in dom


def test_screenshot_shows_the_embedded_timeline(run, tmp_path):
    run_dir, _ = run
    shot = tmp_path / "shot.png"
    res = chromium("--window-size=1400,2000", f"--screenshot={shot}", f"file://{run_dir}/report.html", tmp=tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 2000)
    counts = {c: n for n, c in img.getcolors(maxcolors=1 << 22)}

    def near(hex_, tol=6):
        want = tuple(int(hex_[i:i + 2], 16) for i in (1, 3, 5))
        return sum(n for c, n in counts.items() if all(abs(a - b) <= tol for a, b in zip(c, want)))
    # the page's own colour swatches are 11x11 px; a band of the embedded timeline covers thousands
    for name, hex_ in {**STATE_COLORS, "serve": WORKLOAD_COLORS["serve"]}.items():
        assert near(hex_) > 2000, f"{name} ({hex_}) band of the timeline not visible in the rendered page"
