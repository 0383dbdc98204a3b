"""What a checkpoint carries about its model: the architecture and the tokenizer (its "model card").

Every manifest's `meta.model` (written by rank 0's Checkpointer, worker_loop hands it the card):

    {"format": "spotfill-model/1",
     "kind": "gpt", "preset": "tiny", "config": {GPTConfig's fields}}             spotfill's own decoder
     "kind": "hf", "source": "hf:/dir", "config": {config.json}, "generation_config": {...} or null
     "tokenizer": {"kind": "bytes", "eod": 256, "vocab_size": 257}                   train/data.py's bytes
                | {"kind": "hf", "source": "hf:/dir", "files": ["tokenizer.json", ...]}

The tokenizer is the one the dataset was prepared with (the data manifest's `tokenizer`). A Hugging Face
tokenizer's files travel as files of rank 0's part, `rank-0/spotfill-model/<name>`, listed, sized and hashed
by the manifest like every other file; no rank loads them, so a restore brings them to no node
(train/checkpoint_files.py). Loaders build the model from the card (`model_from_state`); only a checkpoint
written before cards existed has its GPT shape guessed from its tensors, and the guess is logged.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, fields, replace

from spotfill.config.errors import ConfigError
from spotfill.config.presets import PRESETS, GPTConfig, preset

log = logging.getLogger(__name__)

FORMAT = "spotfill-model/1"
MODEL_DIR = "spotfill-model"        # rank 0's part: rank-0/spotfill-model/<tokenizer file>
EOD, BYTE_VOCAB = 256, 257          # the byte tokenizer (train/data.py)
# A Hugging Face tokenizer folder's files (what save_pretrained writes, for the fast and the slow kinds)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json")


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def tokenizer_card(spec: str | None) -> tuple[dict, dict[str, str]]:
    """(the card's tokenizer entry, {file name: local path} of the files that travel) for the data
    manifest's `tokenizer` ("bytes", "hf:/dir"; None or "" from datasets that did not record one: bytes).
    A folder that is not readable here is recorded with `missing` (training goes on; export says so)."""
    if spec in (None, "", "bytes"):
        return {"kind": "bytes", "eod": EOD, "vocab_size": BYTE_VOCAB}, {}
    if not spec.startswith("hf:"):
        return {"kind": "other", "source": spec, "missing": "not a tokenizer spotfill can carry"}, {}
    path = spec[3:]
    found = {name: os.path.join(path, name) for name in TOKENIZER_FILES if os.path.isfile(os.path.join(path, name))}
    if not found:
        log.warning("tokenizer %s: no tokenizer files readable on this node; checkpoints carry its name only", spec)
        return {"kind": "hf", "source": spec, "files": [], "missing": "no tokenizer files at that path"}, {}
    return {"kind": "hf", "source": spec, "files": sorted(found)}, found


def describe(model: str, seq_len: int, vocab_size: int, tokenizer: str | None) -> tuple[dict, dict[str, str]]:
    """(card, {name: local path} of the files rank 0 adds to its part) of the model `training.model`
    builds for a dataset of `seq_len` / `vocab_size` (as worker_loop builds it) with `tokenizer`."""
    tok, files = tokenizer_card(tokenizer)
    if model.startswith("hf:"):
        path = model[3:]
        config = _read_json(os.path.join(path, "config.json"))
        if config is None:
            raise ConfigError("training.model", model, reason="no config.json", accepted="a save_pretrained() folder")
        card = {"format": FORMAT, "kind": "hf", "source": model, "config": config,
                "generation_config": _read_json(os.path.join(path, "generation_config.json"))}
    else:
        card = {"format": FORMAT, "kind": "gpt", "preset": model,
                "config": asdict(preset(model, seq_len=seq_len, vocab_size=vocab_size))}
    return {**card, "tokenizer": tok}, files


def for_checkpoints(model: str, data_manifest: dict, rank: int) -> tuple[dict, dict[str, str]]:
    """(card, {path inside the part: local file}) for a training rank's Checkpointer: the card of
    `training.model` over the prepared dataset (its seq_len, vocab_size and tokenizer); rank 0's part
    carries the tokenizer's files (other ranks: none)."""
    card, files = describe(model, int(data_manifest["seq_len"]), int(data_manifest["vocab_size"]),
                           data_manifest.get("tokenizer"))
    return card, ({f"{MODEL_DIR}/{name}": path for name, path in files.items()} if rank == 0 else {})


def card_of(meta: dict | None) -> dict | None:
    """The card a manifest's meta carries (None: written before checkpoints carried their model)."""
    card = (meta or {}).get("model")
    return card if isinstance(card, dict) and card.get("format") == FORMAT else None


def gpt_config(card: dict) -> GPTConfig:
    names = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in card["config"].items() if k in names})


def guess_card(state: dict, model: str = "auto", where: str = "checkpoint") -> dict:
    """The card of a checkpoint written before cards existed: a GPT whose shape is read from the tensors
    (vocabulary, width, depth, context); heads from the preset of that shape, or `model` names the preset.
    Logged: a guess is not a record."""
    vocab, width = state["wte.weight"].shape
    seq_len = state["wpe.weight"].shape[0]
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    name = model if model != "auto" else next(
        (n for n, cfg in PRESETS.items() if (cfg.n_embd, cfg.n_layer) == (width, layers)), None)
    if name is not None:
        cfg = replace(preset(name), seq_len=seq_len, vocab_size=vocab)
    else:
        heads = next(h for h in (width // 64, 8, 4, 2, 1) if h and width % h == 0)
        cfg = GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=layers, n_head=heads, n_embd=width)
    log.warning("%s carries no model card (written before spotfill-model/1): GPT shape guessed from its "
                "tensors as preset %s, %d layers, %d heads, width %d (model=%s)", where, name or "none", cfg.n_layer,
                cfg.n_head, cfg.n_embd, model)
    return {"format": FORMAT, "kind": "gpt", "preset": name, "config": asdict(cfg), "guessed": True,
            "tokenizer": tokenizer_card("bytes")[0]}


def build_module(card: dict):
    """The untrained module a card describes: spotfill's GPT, or the Hugging Face causal LM of its config
    (in train/model.py's adapter, so it has `.cfg` and `forward(idx) -> logits` like GPT)."""
    from spotfill.train.model import GPT, HFCausalLM

    if card["kind"] == "gpt":
        return GPT(gpt_config(card))
    if card["kind"] == "hf":
        return HFCausalLM.from_config(card["config"])
    raise ConfigError("checkpoint model", card.get("kind"), accepted="gpt, hf")


def model_from_state(state: dict, meta: dict | None, model: str = "auto", where: str = "checkpoint"):
    """(module in eval mode with `state` loaded, its card) from a consolidated state dict and its
    manifest's meta: the carried card, or (older checkpoints) the logged guess."""
    card = card_of(meta) or guess_card(state, model, where)
    net = build_module(card)
    net.load_state_dict(state)
    return net.eval(), card
