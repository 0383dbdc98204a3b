"""`spotfill plan`: size memory, compute, time, cost and IO for a training run (math in planner.py)."""
from __future__ import annotations

import argparse
import json
import os

from spotfill.config.errors import ConfigError

# (flag, metavar, help); every value reaches planner.plan() as given, which validates it.
_VALUE_FLAGS = [
    ("--params", "N", "model parameters: 7e9, 7B, 7.5B, 350M (required unless --list-gpus)"),
    ("--gpus", "N", "GPU count (default: searched, powers of 2 x tp*pp up to --max-gpus)"),
    ("--gpu-type", "NAME", "GPU model, see --list-gpus (default a100-80gb)"),
    ("--zero", "{0,1,2,3}", "DeepSpeed ZeRO stage (default: searched)"),
    ("--offload", "{none,cpu,nvme}", "offload optimizer (and params with ZeRO-3) (default: searched)"),
    ("--method", "{full,lora,qlora}", "full training or (Q)LoRA fine-tuning (default full)"),
    ("--precision", "{bf16,fp16,fp32}", "training precision (default bf16)"),
    ("--tokens", "N", "training tokens: 300B, 2T (default: 20 x params for full, 1e8 for lora/qlora)"),
    ("--seq-len", "N", "sequence length (default 2048)"),
    ("--micro-batch", "N", "micro-batch per GPU, sequences (default: searched 1..64)"),
    ("--global-batch", "N", "global batch in sequences (default 256, rounded to micro x dp)"),
    ("--global-batch-tokens", "N", "global batch in tokens, e.g. 4M; converted to sequences (nearest "
     "multiple of dp with --gpus, else nearest power of two)"),
    ("--layers", "N", "transformer layers (default: from a table of known models or derived)"),
    ("--hidden", "N", "hidden size (default: from table or derived)"),
    ("--heads", "N", "attention heads (default: table, or hidden/128)"),
    ("--kv-heads", "N", "key/value heads for GQA (default: table, or --heads)"),
    ("--vocab", "N", "vocabulary size (default: table, or 32000)"),
    ("--tp", "N", "tensor-parallel degree (default 1)"),
    ("--pp", "N", "pipeline-parallel degree (default 1)"),
    ("--micro-batches", "M", "pipeline micro-batches per step = gradient accumulation steps"),
    ("--mfu", "F", "model FLOPs utilization before modelled overheads, in (0,1] (default 0.4)"),
    ("--headroom", "F", "fraction of GPU memory kept free (default 0.1)"),
    ("--price-spot", "USD", "spot $/GPU-hour (default: catalogue assumption)"),
    ("--price-on-demand", "USD", "on-demand $/GPU-hour (default: catalogue assumption)"),
    ("--bandwidth-gbps", "GBIT", "aggregate checkpoint upload bandwidth, Gbit/s (default 10)"),
    ("--bytes-per-token", "B", "bytes per stored token id (default 2, uint16)"),
    ("--lora-rank", "R", "LoRA rank (default 16)"),
    ("--lora-targets", "{attention,all}", "LoRA on q,k,v,o only, or on those + MLP (default all)"),
    ("--max-gpus", "N", "largest GPU count the search tries (default 1024)"),
    ("--max-hours", "H", "search ranks runs longer than this after those within it (default 720)"),
    ("--flops-formula", "{palm,6nd}", "6N + 12*L*h*s per token (PaLM, default) or 6N"),
    ("--nvme-path", "PATH", "NVMe offload path written into the DeepSpeed config (default /local_nvme)"),
]


def register(sub) -> None:
    p = sub.add_parser("plan", help="size memory, compute, time, cost and IO for a training run",
                       description="Plan a DeepSpeed training run: memory per GPU (ZeRO 0-3, offload, "
                       "LoRA/QLoRA), FLOPs, time, cost, pipeline bubble, checkpoint and data IO.")
    for flag, metavar, text in _VALUE_FLAGS:
        p.add_argument(flag, metavar=metavar, default=None, help=text)
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   metavar="{full,selective,none}", help="recompute activations (bare flag = full; "
                   "default: searched)")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="Megatron sequence parallelism (with --tp > 1)")
    p.add_argument("--flash-attention", action="store_true", default=None,
                   help="attention scores are not stored (drops the 5as/h activation term)")
    p.add_argument("--json", action="store_true", help="print the planner JSON")
    p.add_argument("--ds-config", metavar="PATH", help="write the DeepSpeed config JSON to PATH")
    p.add_argument("--list-gpus", action="store_true", help="print the GPU catalogue with sources")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotfill.planning import hardware
    from spotfill.planning import planner

    if args.list_gpus:
        if args.json:
            print(json.dumps([g.as_dict() for g in hardware.CATALOGUE.values()], indent=2))
        else:
            print(hardware.catalogue_table())
        return 0
    if args.params is None:
        raise ConfigError("--params", None, reason="required", accepted="a count such as 7B, 7e9, 350M")
    keys = [f.lstrip("-").replace("-", "_") for f, _, _ in _VALUE_FLAGS]
    keys += ["activation_checkpointing", "sequence_parallel", "flash_attention"]
    result = planner.plan(**{k: getattr(args, k) for k in keys})
    if args.ds_config:
        folder = os.path.dirname(os.path.abspath(args.ds_config))
        if not os.path.isdir(folder):
            raise ConfigError("--ds-config", args.ds_config, reason="folder does not exist")
        with open(args.ds_config, "w") as fh:
            json.dump(result["deepspeed_config"], fh, indent=2)
            fh.write("\n")
    print(json.dumps(result, indent=2) if args.json else format_plan(result, args.ds_config))
    return 0


def _count(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:g}"


def format_plan(r: dict, ds_config_path: str | None = None) -> str:
    """Readable aligned plain-text report of a planner result."""
    i, m, rec = r["inputs"], r["memory_per_gpu_gb"], r["recommendation"]
    auto = set(i["auto_selected"])

    def mark(key: str, text: str) -> str:
        return text + (" *" if key in auto else "")

    rows = [
        ("model", f"{_count(i['params'])} params, {i['method']}, {i['precision']}; layers {i['layers']}, "
                  f"hidden {i['hidden']}, heads {i['heads']}, vocab {i['vocab']} ({i['architecture_source']})"),
        ("gpus", mark("gpus", f"{i['gpus']} x {i['gpu_type']} ({r['gpu_memory_gb']:g} GB, "
                              f"{r['peak_tflops_per_gpu']:g} dense TFLOPS {i['precision']})")),
        ("parallelism", f"tp {i['tp']}  pp {i['pp']}  dp {i['dp']}  " + mark("zero", f"ZeRO-{i['zero']}") + "  "
                        + mark("offload", f"offload {i['offload']}") + "  "
                        + mark("activation_checkpointing", f"recompute {i['activation_checkpointing']}")),
        ("batch", mark("micro_batch", f"global {i['global_batch']} seqs x {i['seq_len']} tokens = "
                                      f"micro {i['micro_batch']} x accum {i['gradient_accumulation_steps']} "
                                      f"x dp {i['dp']}")),
        ("", ""),
        ("memory per GPU", "GB"),
    ]
    rows += [(f"  {k.replace('_', ' ')}", f"{m[k]:.2f}") for k in
             ("params", "grads", "optimizer", "model_states", "activations", "buffers")]
    rows.append(("  total", f"{m['total']:.2f} of {r['usable_gpu_memory_gb']:.2f} usable "
                            f"({r['headroom_fraction']:.0%} headroom) -> {'FITS' if r['fits'] else 'DOES NOT FIT'}"))
    off = r["offload_memory_gb"]
    if off["host_per_gpu"] or off["nvme_per_gpu"]:
        rows.append(("  offloaded", f"host {off['host_per_gpu']:.2f} GB/GPU, nvme {off['nvme_per_gpu']:.2f} GB/GPU"))
    rows += [
        ("", ""),
        ("tokens", f"{_count(r['tokens'])} (Chinchilla-optimal {_count(r['chinchilla_tokens'])} = 20 x N)"),
        ("FLOPs", f"{r['total_flops']:.3e} [{r['flops_formula']}]; 6ND {r['flops_6nd']:.3e}"),
        ("hardware FLOPs", f"{r['hardware_flops']:.3e} (recompute x{r['slowdowns']['recompute']:.3f})"),
        ("utilization", f"MFU {i['mfu']:g} -> expected {r['expected_mfu']:.3f} after offload "
                        f"x{r['slowdowns']['offload']:g} and bubble x{r['slowdowns']['pipeline_bubble']:.3f}"),
        ("train time", f"{r['train_time_hours']:,.1f} h ({r['train_time_hours'] / 24:,.1f} days), "
                       f"{r['train_steps']:,} steps"),
        ("GPU-hours", f"{r['gpu_hours']:,.0f}"),
        ("cost", f"spot ${r['cost_usd']['spot']:,.0f} (${i['price_spot']:.2f}/h)  on-demand "
                 f"${r['cost_usd']['on_demand']:,.0f} (${i['price_on_demand']:.2f}/h)"),
        ("pipeline bubble", f"{r['pipeline_bubble_fraction']:.3f} = (p-1)/m"),
        *_pipeline_rows(r["pipeline"]),
        ("checkpoint", f"{r['checkpoint_size_gb']:,.2f} GB, upload {r['checkpoint_upload_seconds']:,.1f} s "
                       f"at {i['bandwidth_gbps']:g} Gbit/s"),
        ("data input", f"{r['data_bandwidth_mb_s']:.3f} MB/s ({r['tokens_per_second']:,.0f} tokens/s x "
                       f"{i['bytes_per_token']:g} B)"),
        ("", ""),
        ("recommendation", ("" if rec["found"] else "NOTHING FITS; least memory: ") + rec["flags"]),
        ("", f"{rec['memory_per_gpu_gb']:.2f} GB/GPU, {rec['train_time_hours']:,.1f} h, spot "
             f"${rec['cost_usd']['spot']:,.0f}" + (" (same as above)" if rec["matches_requested"] else "")),
    ]
    if ds_config_path:
        rows.append(("deepspeed config", f"written to {ds_config_path}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}".rstrip() for k, v in rows]
    if auto:
        lines.append("* chosen by the planner's search (cheapest fitting configuration)")
    lines.append("assumptions:")
    lines.extend(f"  - {a}" for a in r["assumptions"])
    return "\n".join(lines)


def _pipeline_rows(p: dict) -> list[tuple[str, str]]:
    """The pipeline advice: stages and micro-batches, and the fill work the bubbles carry."""
    rows = [("pipeline advice", p["why"])]
    if p.get("job_config"):
        rows.append(("", ", ".join(f"{k}: {v}" for k, v in p["job_config"].items())))
    fill = p.get("fill")
    if fill and fill["bubble_gpu_hours"]:
        rows.append(("bubble fill", f"{fill['bubble_step_fraction']:.1%} of each step, "
                                    f"{fill['bubble_gpu_hours']:,.0f} GPU-h; at {fill['assumed_fill_share']:.0%} use "
                                    f"~{_count(fill['fill_forward_tokens'])} forward tokens of this model"))
    return rows

