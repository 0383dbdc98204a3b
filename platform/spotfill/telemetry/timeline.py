"""timeline.png: GPUs over time stacked by state and fill-in workload, the world size, preemption /
hand-back / checkpoint markers (top panel); loss and tokens/s (bottom panel). matplotlib, Agg backend.

Bands are drawn without anti-aliasing in the fixed colours below, so a test (or a reader) can find each
state in the picture by its exact colour.
"""
from __future__ import annotations

import io

from spotfill.config.tenant_kinds import colours
from spotfill.telemetry.ledger import Ledger, lineage_keys

STATE_COLORS = {            # RGB hex; fill-in workloads after training's states
    "training": "#2ca02c",
    "checkpoint_stall": "#ff7f0e",
    "recovering": "#d62728",
    "idle": "#c7c7c7",
    "unaccounted": "#fde68a",
}
WORKLOAD_COLORS = colours()      # each tenant kind's, from the registry (config/tenant_kinds.py)
EXTRA_WORKLOAD_COLORS = ("#8c564b", "#e377c2", "#bcbd22", "#7f7f7f")
MARKER_COLORS = {"preemption": "#000000", "handback": "#1f77b4", "checkpoint": "#8c564b"}
SIZE_PX = (1400, 800)
DPI = 100


def workload_colors(workloads) -> dict[str, str]:
    out, extra = {}, iter(EXTRA_WORKLOAD_COLORS * 4)
    for w in sorted(workloads):
        out[w] = WORKLOAD_COLORS.get(w) or next(extra)
    return out


def _bands(ledger: Ledger) -> tuple[list[float], dict[str, list[float]], dict[str, str]]:
    """Step-function series: x (two points per slice) and GPUs per band."""
    workloads = sorted({w for s in ledger.slices for w in s.fillin})
    wcolors = workload_colors(workloads)
    names = (["training", "checkpoint_stall", "recovering"] + [f"fillin:{w}" for w in workloads]
             + ["idle", "unaccounted"])
    xs: list[float] = []
    ys: dict[str, list[float]] = {n: [] for n in names}
    for s in ledger.slices:
        for x in (s.start, s.end):
            xs.append(x - ledger.start)
            for n in names:
                ys[n].append(s.fillin.get(n[7:], 0) if n.startswith("fillin:") else s.gpus.get(n, 0))
    colors = {**STATE_COLORS, **{f"fillin:{w}": c for w, c in wcolors.items()}}
    return xs, ys, colors


def render_timeline(ledger: Ledger, events: list[dict], preemptions: list[dict] | None = None) -> bytes:
    """The PNG's bytes (SIZE_PX pixels)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(SIZE_PX[0] / DPI, SIZE_PX[1] / DPI), dpi=DPI,
                                      sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    try:
        _gpu_panel(top, ledger, events, preemptions or [])
        _progress_panel(bottom, ledger, events)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        return buf.getvalue()
    finally:
        plt.close(fig)


def _gpu_panel(ax, ledger: Ledger, events: list[dict], preemptions: list[dict]) -> None:
    xs, ys, colors = _bands(ledger)
    base = [0.0] * len(xs)
    for name, series in ys.items():
        if not any(series):
            continue
        upper = [b + v for b, v in zip(base, series)]
        ax.fill_between(xs, base, upper, color=colors[name], linewidth=0, antialiased=False,
                        label=name.replace("_", " "))
        base = upper
    ws = [(e["t"] - ledger.start, e["world_size"]) for e in events if e["kind"] in ("start", "resume")]
    steps = [e for e in events if e["kind"] == "step"]
    if ws:
        pts = ws + ([(steps[-1]["t"] - ledger.start, steps[-1]["world_size"])] if steps else [])
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="black", linewidth=2,
                label="world size (workers)")
    for p in preemptions:
        if p.get("at") is not None:
            ax.axvline(p["at"] - ledger.start, color=MARKER_COLORS["preemption"], linestyle="--", linewidth=1.5)
            ax.annotate(f"{p.get('kind', 'preemption')} (node {p.get('node', '?')})",
                        (p["at"] - ledger.start, ax.get_ylim()[1]), fontsize=8, rotation=90, va="top")
    for e in events:
        if e["kind"] in ("reclaim", "release", "lease_end"):
            ax.axvline(e["t"] - ledger.start, color=MARKER_COLORS["handback"], linestyle=":", linewidth=1.5)
    cks = [e["t"] - ledger.start for e in events if e["kind"] == "checkpoint"]
    top_y = max((sum(v[i] for v in ys.values()) for i in range(len(xs))), default=1) or 1
    if cks:
        ax.plot(cks, [top_y * 1.04] * len(cks), linestyle="none", marker="v", color=MARKER_COLORS["checkpoint"],
                label="checkpoint committed")
    ax.set_ylim(0, top_y * 1.12)
    ax.set_ylabel("GPUs")
    ax.set_title("GPUs by state and workload (dashed: preemption, dotted: hand-back)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _progress_panel(ax, ledger: Ledger, events: list[dict]) -> None:
    keep = lineage_keys(events)
    steps = sorted((e for e in events if e["kind"] == "step" and (e["attempt"], e["step"]) in keep),
                   key=lambda e: e["t"])
    if steps:
        xs, loss, rate_ys = [], [], []
        for prev, e in zip([None] + steps[:-1], steps):
            if prev is not None and prev["attempt"] != e["attempt"]:   # a gap between worker groups
                xs.append(float("nan")), loss.append(float("nan")), rate_ys.append(float("nan"))
            xs.append(e["t"] - ledger.start)
            loss.append(e["loss"])
            rate_ys.append(e["tokens"] / e["step_s"] if e.get("step_s") else float("nan"))
        ax.plot(xs, loss, color="#1f1f1f", linewidth=1, label="loss")
        ax.set_ylabel("loss")
        rate = ax.twinx()
        rate.plot(xs, rate_ys, color="#e377c2", linewidth=0.8, alpha=0.8, label="tokens/s")
        rate.set_ylabel("tokens/s")
        lines = ax.get_legend_handles_labels()
        more = rate.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    ax.set_xlabel("seconds since the run started")
