"""report.json's `training.pipeline`: the pipeline's bubbles over the final lineage's steps, and the part of
them fill work used -- harvested bubble GPU-seconds, apart from whole-GPU fill-in (`gpu_seconds.fillin`)
(pure: from step events; fields in docs/report.md)."""
from __future__ import annotations

from statistics import median

from spotfill.train.bubble import theory_fraction


def pipeline_section(lineage: list[dict]) -> dict | None:
    """None when no step ran a pipeline."""
    steps = [e for e in lineage if e.get("stages")]
    if not steps:
        return None
    stages = max(e["stages"] for e in steps)
    widths = sorted({int(e["micro_batches"]) for e in steps if e.get("micro_batches")})
    fractions = [e["bubble_fraction"] for e in steps if e.get("bubble_fraction") is not None]
    rows: dict = {}
    for e in steps:          # rows filled so far, per attempt (each attempt's filler counts from 0)
        rows[e.get("attempt")] = max(rows.get(e.get("attempt"), 0), int(e.get("bubble_fill_rows") or 0))
    bubble = sum(e.get("bubble_s") or 0.0 for e in steps)
    fill = sum(e.get("bubble_fill_s") or 0.0 for e in steps)
    return {"stages": stages, "micro_batches": widths,
            "bubble_fraction": round(median(fractions), 4) if fractions else None,
            "bubble_fraction_theory": [round(theory_fraction(stages, m), 4) for m in widths],
            "bubble_gpu_s": round(bubble, 3), "bubble_fill_gpu_s": round(fill, 3),
            "bubble_fill_share": round(fill / bubble, 4) if bubble > 0 else None,
            "bubble_fill_rows": sum(rows.values())}
