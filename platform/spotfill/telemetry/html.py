"""report.html: one self-contained page (inline CSS, the timeline PNG as a data: URI, no scripts) (pure)."""
from __future__ import annotations

import base64
import html
import json

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#1f1f1f;max-width:1500px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px} th,td{border:1px solid #ddd;padding:4px 8px;text-align:right}
th{background:#f4f4f4} td.l,th.l{text-align:left} .ok{color:#1a7f37} .bad{color:#b42318}
.kpi{display:inline-block;margin:6px 18px 6px 0} .kpi b{display:block;font-size:22px}
.sw{display:inline-block;width:11px;height:11px;margin-right:5px;vertical-align:middle}
img{max-width:100%;border:1px solid #ddd} .muted{color:#666;font-size:12px}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _num(x, nd: int = 1) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return _e(x)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _no_peak(tr: dict) -> str:
    return "n/a (CPU)" if tr.get("devices") == ["cpu"] else "n/a (no known GPU peak)"


def _kpis(s: dict) -> str:
    tr = s.get("training") or {}
    items = [("goodput", _pct(s.get("goodput"))),
             ("time goodput", _pct(s.get("time_goodput"))),
             ("effective training time", _pct(s.get("effective_training_time_ratio"))),
             ("harvest ratio", _pct(s["harvest_ratio"]) if "harvest_ratio" in s else
              "no fill-in" if "harvest_ratio_reserved" not in s else "n/a (busy not measured)"),
             ("steps", f'{_e(tr.get("steps_completed", "?"))}/{_e(tr.get("steps_target", "?"))}'),
             ("final loss", _num(tr.get("final_loss"), 4)),
             ("tokens/s", _num(tr.get("tokens_per_s"))),
             ("MFU", _pct(tr.get("mfu")) if tr.get("mfu") is not None else _no_peak(tr)),
             ("HFU", _pct(tr.get("hfu")) if tr.get("hfu") is not None else _no_peak(tr)),
             ("GPU util (NVML)", _pct((tr.get("gpu_metrics") or {}).get("gpu_util_mean"))
              if tr.get("gpu_metrics") else "n/a (no NVML)"),
             ("wall time", f'{_num(s["ledger"]["wall_s"])} s')]
    ok = s.get("ok")
    verdict = "" if ok is None else (f'<p class="{"ok" if ok else "bad"}" id="verdict">'
                                     f'{"run ok" if ok else "run failed: " + _e(s.get("error", ""))}</p>')
    return verdict + "".join(f'<div class="kpi" data-kpi="{_e(k)}">{_e(k)}<b>{v}</b></div>' for k, v in items)


SPLIT_PARTS = ("data_wait", "forward_backward", "optimizer", "collective_wait", "checkpoint_stall")


def _step_split(s: dict) -> str:
    tr = s.get("training") or {}
    split = tr.get("step_time_split_s") or {}
    total = sum(split.get(k) or 0.0 for k in SPLIT_PARTS) or 1.0
    rows = [[_e(k), _num(split[k], 3), _pct(split[k] / total)] for k in SPLIT_PARTS if k in split]
    device = ", ".join(tr.get("devices") or []) or "unknown"
    peak = tr.get("peak_flops_per_gpu")
    fpt = tr.get("flops_per_token")
    return (_table(["phase", "seconds", "share"], rows) +
            f'<p class="muted">final lineage steps, timed by rank 0; device {_e(device)}, dense peak '
            f'{_e(f"{peak / 1e12:g} TFLOPS" if peak else "unknown (MFU/HFU n/a)")}, '
            f'{_e(f"{fpt:,.0f}" if fpt else "?")} model FLOPs/token</p>')


def _gpu_seconds(s: dict, colors: dict) -> str:
    gs = s["gpu_seconds"]
    total = gs["total"] or 1.0
    rows = []
    for state in ("training", "checkpoint_stall", "recovering", "fillin", "idle", "unaccounted"):
        if state not in gs:
            continue
        sw = f'<span class="sw" style="background:{colors.get(state, "#fff")}"></span>' if state in colors else ""
        rows.append([f"{sw}{_e(state)}", _num(gs[state]), _pct(gs[state] / total)])
        if state == "fillin":
            for w, v in sorted(gs.get("fillin_by_workload", {}).items()):
                sw = f'<span class="sw" style="background:{colors.get("fillin:" + w, "#fff")}"></span>'
                rows.append([f"&nbsp;&nbsp;{sw}{_e(w)}", _num(v), _pct(v / total)])
    rows.append(["<b>total</b>", f"<b>{_num(gs['total'])}</b>", "100.0%"])
    busy = ("not measured (no tenant reported its busy time)" if gs.get("fillin_busy") is None
            else f"{_num(gs['fillin_busy'])} GPU-s")
    bubble = "not measured" if gs.get("bubble") is None else f"{_num(gs['bubble'])} GPU-s"
    extra = (f'<p class="muted">of training: {_num(gs.get("training_rolled_back"))} GPU-s rolled back '
             f'(steps redone after a restart), pipeline bubbles {_e(bubble)}; recovering by cause: '
             f'{_e(json.dumps({k: round(v, 1) for k, v in gs.get("recovering_by_cause", {}).items()}))}; '
             f'fill-in held (reserved) {_num(gs.get("fillin_reserved", gs["fillin"]))} GPU-s, busy {_e(busy)}</p>')
    return _table(["state", "GPU-seconds", "share"], rows) + extra


def _per_node(s: dict) -> str:
    nodes = s.get("gpu_seconds_per_node") or {}
    cols = ["training", "checkpoint_stall", "recovering", "idle", "unaccounted", "free_observed"]
    rows = []
    for node, row in nodes.items():
        fill = ", ".join(f"{_e(w)} {v:,.1f}" for w, v in sorted((row.get("fillin") or {}).items())) or "0"
        rows.append([_e(node), _e(row["gpus"]), _num(row["total"])] + [_num(row.get(c)) for c in cols] + [fill])
    return _table(["node", "GPUs", "total"] + cols + ["fill-in"], rows)


def _diagnosis(s: dict) -> str:
    d = s["diagnosis"]
    rows = [[_e(f["cause"]), _num(f["gpu_seconds"]), _pct(f["share_of_lost"]), _e(f["remedy"]),
             f'<span class="muted">{_e(json.dumps(f["evidence"]))}</span>'] for f in d["findings"]]
    return (f'<p>{_num(d["lost_gpu_seconds"])} GPU-seconds did not advance the model (fill-in is not lost).</p>'
            + _table(["cause", "GPU-seconds", "share of lost", "remedy", "evidence"], rows))


def _recoveries(s: dict) -> str:
    recs = s.get("recoveries") or []
    if not recs:
        return "<p>No restart: the worker group ran once.</p>"
    phases = ["fault_to_workers_up_s", "detect_s", "decide_s", "workers_start_s", "state_load_s", "setup_s",
              "first_step_s", "total_s"]
    rows = []
    for r in recs:
        vals = {**r, "fault_to_workers_up_s": (r.get("detail") or {}).get("fault_to_workers_up_s")}
        rows.append([_e(r["attempt"]), _e(r["cause"]), _e(r["fault_source"])] +
                    [(f"<b>{_num(vals[p], 2)}</b>" if p == r.get("slowest") else _num(vals[p], 2)) for p in phases])
    return (_table(["attempt", "cause", "fault from"] + phases, rows, left=3) +
            '<p class="muted">seconds; bold = the slowest phase; n/a = the events do not show it '
            "(detect/decide/workers start need controller_state events; fault_to_workers_up_s is their sum)</p>")


def _checkpoints(s: dict) -> str:
    c = s.get("checkpoints")
    if not c:
        return "<p>No checkpoint section in report.json.</p>"
    rows = [[_e(k), _e(v if not isinstance(v, (list, dict)) else json.dumps(v))] for k, v in c.items()]
    return _table(["key", "value"], rows)


def render_html(summary: dict, png: bytes, colors: dict, title: str) -> str:
    """The page. `summary` holds report.json-style keys (ledger, diagnosis, recoveries, training...)."""
    img = base64.b64encode(png).decode()
    notes = "".join(f"<li>{_e(n)}</li>" for n in summary["ledger"].get("notes", []))
    sections = [
        ("summary", "Summary", _kpis(summary)),
        ("timeline", "Timeline",
         f'<img id="timeline-img" alt="GPUs over time by state, world size, markers; loss and tokens/s" '
         f'src="data:image/png;base64,{img}">'),
        ("step-split", "Where a step's time goes", _step_split(summary)),
        ("gpu-seconds", "GPU-seconds by state", _gpu_seconds(summary, colors)),
        ("per-node", "GPU-seconds per node", _per_node(summary)),
        ("diagnosis", "Where the lost time went", _diagnosis(summary)),
        ("recoveries", "Recovery breakdown", _recoveries(summary)),
        ("checkpoints", "Checkpoints", _checkpoints(summary)),
    ]
    if notes:
        sections.append(("notes", "Notes", f"<ul>{notes}</ul>"))
    body = "".join(f'<section id="{sid}"><h2>{_e(h)}</h2>{content}</section>' for sid, h, content in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>"
            f'<p class="muted">spotfill run report: every number comes from events.jsonl '
            f"(and report.json); see docs/metrics.md for how each is computed.</p>{body}</body></html>")
