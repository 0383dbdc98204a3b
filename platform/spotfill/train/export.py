"""`spotfill export`: a run's committed checkpoint as a Hugging Face folder that `transformers` (and vLLM) load.

    export_run("s3://bucket/runs/my-job", "/models/my-job", step=None)

The folder: `config.json`, `model.safetensors` (fp32: the fp32 master weights DeepSpeed keeps),
`generation_config.json`, the tokenizer's files, and `spotfill_export.json` (where it came from and the
check below). What is written comes from the checkpoint's model card (train/model_card.py), never from
tensor shapes -- except for a checkpoint written before cards existed, whose GPT shape is guessed and logged.

* A Hugging Face model (`training.model: hf:/dir`) is saved as itself (the training adapter's inner model).
* spotfill's GPT presets map onto GPT-2 exactly (GPT2LMHeadModel): pre-LayerNorm blocks (eps 1e-5) with
  bias, exact-erf GELU (`activation_function: gelu`), learned positions, one fused qkv projection split
  q, k, v (GPT-2's c_attn), 4x MLP, a final LayerNorm, and an output head of its own
  (`tie_word_embeddings: false`). GPT-2's Conv1D stores weights transposed to nn.Linear; dropout is 0.
* The byte tokenizer becomes a `tokenizers` byte-level BPE without merges whose token for byte b has id b,
  with `<|endoftext|>` = 256 (spotfill's end-of-document) as bos/eos, kept out of text
  (`split_special_tokens`): encode(x) is x's UTF-8 bytes as spotfill encodes them, decode(encode(x)) == x.
  A Hugging Face tokenizer's files are copied from the checkpoint.

Before the folder is moved into place, it is loaded back with AutoModelForCausalLM and its logits on a probe
batch are compared with spotfill's own module on the same weights: the largest absolute difference must be
<= ATOL (both fp32); it is recorded in spotfill_export.json. Bad input (no committed checkpoint, no such
step, a non-empty `out`) raises ConfigError (CLI: exit 2, one line).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
import time

from spotfill.config.errors import ConfigError, JobFailed
from spotfill.train.model_card import MODEL_DIR, card_of, gpt_config, guess_card

log = logging.getLogger(__name__)
ATOL = 1e-4                # largest |logit difference| allowed between the export and spotfill's module (fp32)
EOS_TOKEN = "<|endoftext|>"
RUN_ACCEPTED = "a run's storage URI, <training storage>/<job name> (the folder holding checkpoints/)"


def consolidate(tag_dir: str, tag: str) -> dict:
    """One full fp32 state dict from a restored checkpoint tag folder (rank-*/ inside): DeepSpeed's
    zero_to_fp32 merges the fp32 master weights of every rank's ZeRO partition (stages 1-3, any world
    size); without ZeRO partitions, the module weights in mp_rank_00_model_states.pt."""
    import torch

    from spotfill.train.restore import flatten_ranks
    flat_root = tempfile.mkdtemp(prefix="spotfill-ds-flat-")
    try:
        flatten_ranks(tag_dir, os.path.join(flat_root, tag))
        files = os.listdir(os.path.join(flat_root, tag))
        if any(f.endswith("optim_states.pt") for f in files):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            state = get_fp32_state_dict_from_zero_checkpoint(flat_root, tag=tag)
        else:
            (path,) = glob.glob(os.path.join(flat_root, tag, "mp_rank_*_model_states.pt"))[:1] or [None]
            if path is None:
                raise ConfigError("checkpoint", tag_dir, reason="no DeepSpeed model states in it")
            state = torch.load(path, map_location="cpu", weights_only=False)["module"]
        return {k: v.float() for k, v in state.items()}
    finally:
        shutil.rmtree(flat_root, ignore_errors=True)


def check_out(out: str, field: str = "--out") -> str:
    """`out` as an absolute local path that is new or an empty folder; ConfigError otherwise."""
    if "://" in out and not out.startswith("file://"):
        raise ConfigError(field, out, reason="not a local folder", accepted="a local path (new or empty folder)")
    path = os.path.abspath(out[7:] if out.startswith("file://") else out)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(field, out, reason="exists and is not an empty folder",
                          accepted="a new or empty folder")
    return path


def pick_tag(store, run_uri: str, step: int | None) -> str | None:
    """The committed tag to export: at `step` (the live lineage's first, else any committed one), or None
    for the newest intact one (store.restore picks it). ConfigError when the run has no committed
    checkpoint or none at `step`."""
    from spotfill.storage.checkpoint_store import parse_tag
    committed = store.committed()
    if not committed:
        raise ConfigError("RUN_URI", run_uri, reason="no committed checkpoint in it", accepted=RUN_ACCEPTED)
    if step is None:
        return None
    at = [t for t in committed if (parse_tag(t) or (-1,))[0] == step]
    if not at:
        steps = sorted({p[0] for p in map(parse_tag, committed) if p})
        raise ConfigError("--step", step, reason="no committed checkpoint at that step",
                          accepted="one of " + ", ".join(map(str, steps)))
    live = [t for t in store.restore_candidates() if t in at]
    return (live or at)[0]


def export_run(run, out: str, step: int | None = None, verify: bool = True) -> dict:
    """Write the Hugging Face folder of the run's checkpoint at `step` (default: the newest intact) to
    `out`; returns what spotfill_export.json records. `run`: its storage URI or Storage."""
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore

    t0 = time.perf_counter()
    dest = check_out(out)
    storage = open_storage(run) if isinstance(run, str) else run
    run_uri = run if isinstance(run, str) else storage.uri
    store = CheckpointStore(storage)
    tag = pick_tag(store, run_uri, step)
    work = tempfile.mkdtemp(prefix="spotfill-export-")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".spotfill-export-", dir=os.path.dirname(dest) or ".")
    try:
        manifest = store.restore(work, tag=tag, resume=False)    # a reader: training's lineage is not its to move
        if manifest is None:
            raise ConfigError("RUN_URI", run_uri, reason="no intact committed checkpoint in it", accepted=RUN_ACCEPTED)
        meta = manifest.get("meta") or {}
        if int(meta.get("pipeline_stages") or 1) > 1:
            raise ConfigError("RUN_URI", run_uri, reason=f"checkpoint {manifest['tag']} was saved by "
                              f"{meta['pipeline_stages']} pipeline stages (layer files)",
                              accepted="checkpoints of runs with training.pipeline_stages: 1")
        state = consolidate(manifest["path"], manifest["tag"])
        card = card_of(meta) or guess_card(state, where=f"checkpoint {manifest['tag']}")
        record = write_folder(card, state, manifest["path"], staging, verify)
        record.update(run=run_uri, tag=manifest["tag"], step=int(manifest["step"]), out=dest,
                      card="guessed" if card.get("guessed") else "carried", seconds=round(time.perf_counter() - t0, 3))
        with open(os.path.join(staging, "spotfill_export.json"), "w") as f:
            json.dump(record, f, indent=1)
        if os.path.isdir(dest):
            os.rmdir(dest)            # empty (checked): the finished folder takes its place in one rename
        os.replace(staging, dest)
        log.info("exported %s %s (step %d) to %s: %s, max |logit diff| %s", run_uri, manifest["tag"],
                 record["step"], dest, record["architecture"], record["max_abs_diff"])
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


def write_folder(card: dict, state: dict, tag_dir: str, out: str, verify: bool = True) -> dict:
    """Model, generation config and tokenizer of `card` with weights `state` into the folder `out`."""
    from spotfill.train.model_card import build_module

    net = build_module(card)
    net.load_state_dict(state)
    net.eval()
    hf = hf_model(card, state) if card["kind"] == "gpt" else net.inner
    hf.generation_config = generation_config(card, hf.config)
    hf.save_pretrained(out, safe_serialization=True)
    hf.generation_config.save_pretrained(out)
    write_tokenizer(card, tag_dir, out, net.cfg.seq_len)
    record = {"architecture": hf.config.architectures[0] if hf.config.architectures else type(hf).__name__,
              "model_kind": card["kind"], "preset": card.get("preset"), "tokenizer": card["tokenizer"]["kind"],
              "files": sorted(os.listdir(out)), "max_abs_diff": None, "tolerance": ATOL}
    if verify:
        record["max_abs_diff"] = check_logits(net, out)
    return record


# -- spotfill's GPT as GPT-2 --------------------------------------------------------------------------
def gpt2_config(cfg) -> dict:
    """GPT2Config fields that make GPT2LMHeadModel compute exactly what train/model.py's GPT computes."""
    return {"vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": 4 * cfg.n_embd, "activation_function": "gelu",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5,
            "scale_attn_weights": True, "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 256,
            "architectures": ["GPT2LMHeadModel"]}


# (spotfill name, GPT-2 name, transposed: GPT-2's Conv1D keeps [in, out])
_BLOCK = (("ln1", "ln_1", False), ("ln2", "ln_2", False), ("attn.qkv", "attn.c_attn", True),
          ("attn.proj", "attn.c_proj", True), ("mlp.0", "mlp.c_fc", True), ("mlp.2", "mlp.c_proj", True))


def gpt2_state(state: dict, n_layer: int) -> dict:
    """GPT's state dict under GPT2LMHeadModel's names."""
    out = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"],
           "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"],
           "lm_head.weight": state["head.weight"]}
    for i in range(n_layer):
        for ours, theirs, transposed in _BLOCK:
            w = state[f"blocks.{i}.{ours}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if transposed else w
            out[f"transformer.h.{i}.{theirs}.bias"] = state[f"blocks.{i}.{ours}.bias"]
    return out


def hf_model(card: dict, state: dict):
    """The GPT2LMHeadModel holding a GPT card's weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = gpt_config(card)
    model = GPT2LMHeadModel(GPT2Config(**gpt2_config(cfg)))
    model.load_state_dict(gpt2_state(state, cfg.n_layer), strict=True)
    return model.eval()


def generation_config(card: dict, config):
    from transformers import GenerationConfig

    if card["kind"] == "gpt":
        return GenerationConfig(bos_token_id=256, eos_token_id=256, pad_token_id=256,
                                max_length=gpt_config(card).seq_len)
    if card.get("generation_config"):
        return GenerationConfig.from_dict(card["generation_config"])
    return GenerationConfig.from_model_config(config)


# -- tokenizers ----------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what `tokenizers`' ByteLevel pre-tokenizer emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer(seq_len: int):
    """spotfill's byte tokenizer as a transformers PreTrainedTokenizerFast (ids 0-255 = bytes, 256 = eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   model_max_length=seq_len, clean_up_tokenization_spaces=False,
                                   split_special_tokens=True)


def write_tokenizer(card: dict, tag_dir: str, out: str, seq_len: int) -> None:
    tok = card["tokenizer"]
    if tok["kind"] == "bytes":
        byte_tokenizer(seq_len).save_pretrained(out)
        return
    src = os.path.join(tag_dir, "rank-0", MODEL_DIR)
    if tok["kind"] != "hf" or tok.get("missing") or not tok.get("files"):
        raise ConfigError("checkpoint tokenizer", tok.get("source"), reason="the checkpoint does not carry its "
                          f"files ({tok.get('missing') or 'none recorded'})",
                          accepted="checkpoints of runs whose tokenizer folder was readable on the training nodes")
    for name in tok["files"]:
        shutil.copyfile(os.path.join(src, name), os.path.join(out, name))


def check_logits(net, folder: str) -> float:
    """Load `folder` with AutoModelForCausalLM and compare its logits on a seeded probe batch with `net`'s
    (spotfill's module, same weights): the largest absolute difference; JobFailed above ATOL."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(folder)                     # the tokenizer loads too
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, net.cfg.vocab_size, (2, min(32, net.cfg.seq_len)), generator=gen)
    with torch.no_grad():
        diff = float((loaded(input_ids=ids).logits.float() - net(ids).float()).abs().max())
    if not diff <= ATOL:
        raise JobFailed(f"export check: the exported model's logits differ from spotfill's by {diff:.3g} "
                        f"(> {ATOL}); nothing written")
    return diff
