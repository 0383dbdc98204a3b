"""Text generation from a run's newest committed checkpoint (what the Serve fill-in tenant runs).

A run's checkpoints live under `<storage>/checkpoints/<tag>/rank-<r>/` (storage/checkpoint_store.py), each
rank folder holding that rank's DeepSpeed files. Loading consolidates them into one state dict:
  * ZeRO partitions (zero_pp_rank_*_optim_states.pt present): DeepSpeed's zero_to_fp32 merges the fp32
    master weights from every rank's shard (stages 1-3, any world size);
  * otherwise the module weights in mp_rank_00_model_states.pt.
The model is the one the checkpoint's manifest carries (train/model_card.py: a GPT preset's config or a
Hugging Face config); only a checkpoint written before manifests carried it has its GPT shape guessed from
the weights (logged; `model=` names the preset then). generate() uses the byte-level tokenizer of
spotfill's presets.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass

from spotfill.train.export import consolidate  # noqa: F401 - re-exported (fillin/batch.py, benchmarks)

log = logging.getLogger(__name__)
EOD = 256


@dataclass
class Loaded:
    model: object
    tag: str
    step: int
    load_s: float
    loaded_at: float
    card: dict | None = None      # the model card the checkpoint carries (train/model_card.py)
    tokenizer: object = None      # the run's tokenizer (generation/text.py): bytes, or its own HF one


def load_newest(store, work_dir: str, model: str = "auto", newer_than: str | None = None, device=None,
                dtype=None) -> Loaded | None:
    """The newest intact committed checkpoint as a ready model on `device` in `dtype` (default: the CPU,
    fp32); None when there is none (or none newer than `newer_than`)."""
    from spotfill.storage.checkpoint_store import tag_key
    from spotfill.train.model_card import model_from_state

    t0 = time.perf_counter()
    latest = store.latest_tag()
    if latest is None or (newer_than and tag_key(latest) <= tag_key(newer_than)):
        return None
    manifest = store.restore(work_dir, resume=False)   # a reader: training's lineage is not its to move
    if manifest is None or (newer_than and tag_key(manifest["tag"]) <= tag_key(newer_than)):
        return None
    try:
        state = consolidate(manifest["path"], manifest["tag"])
        net, card = model_from_state(state, manifest.get("meta"), model, where=f"checkpoint {manifest['tag']}")
        tokenizer = tokenizer_of(card, _keep_model_files(manifest["path"], os.path.join(
            work_dir, f"tokenizer-{manifest['tag']}")))
    finally:
        shutil.rmtree(manifest["path"], ignore_errors=True)
    net.to(device=device or "cpu", dtype=dtype).eval()          # no dropout in generation
    return Loaded(net, manifest["tag"], int(manifest["step"]), time.perf_counter() - t0, time.time(), card,
                  tokenizer)


def _keep_model_files(tag_dir: str, keep_dir: str) -> str | None:
    """The model files rank 0's part carries (rank-0/spotfill-model/: a tokenizer's), copied to `keep_dir`
    (the restored tag is deleted after loading); None when it carries none."""
    from spotfill.train.model_card import MODEL_DIR
    src = os.path.join(tag_dir, "rank-0", MODEL_DIR)
    if not os.path.isdir(src):
        return None
    shutil.rmtree(keep_dir, ignore_errors=True)
    shutil.copytree(src, keep_dir)
    return keep_dir


def tokenizer_of(card: dict | None, folder: str | None):
    """The tokenizer a checkpoint's card names: the byte tokenizer, or the run's own Hugging Face tokenizer
    from `folder` (the files the checkpoint carries, copied out of rank-0/spotfill-model/ by the caller). A
    card naming a Hugging Face tokenizer whose files are missing is refused (its text would be wrong)."""
    from spotfill.config.errors import ConfigError
    from spotfill.generation.text import ByteTokenizer, HFTokenizer
    tok = (card or {}).get("tokenizer") or {"kind": "bytes"}
    if tok.get("kind") != "hf":
        return ByteTokenizer()
    if not tok.get("files") or not folder or not os.path.isdir(folder) or not os.listdir(folder):
        raise ConfigError("checkpoint tokenizer", tok.get("source"), reason="the checkpoint does not carry its "
                          "tokenizer's files", accepted="checkpoints of runs whose tokenizer folder was readable "
                          "on the training nodes")
    return HFTokenizer(folder, eos_ids=((card.get("generation_config") or {}).get("eos_token_id")
                                        or (card.get("config") or {}).get("eos_token_id") or ()))


def generate(model, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int = 0,
             deadline_s: float | None = None) -> tuple[str, int, str]:
    """(text, tokens generated, finish_reason: "stop" | "length" | "time"). Byte-level tokens; stops at
    end-of-document, after `max_tokens`, or when `deadline_s` (seconds from now) runs out.

    No KV cache, one request at a time: the window of the last `seq_len` tokens slides as the text grows.
    The baseline `spotfill bench --only serve` compares spotfill/generation's engine (what the Serve app
    runs) with, and the batch job's path for a row that needs the sliding window (generate_rows)."""
    import torch

    t_end = None if deadline_s is None else time.monotonic() + deadline_s
    ids = list(prompt.encode("utf-8")) or [EOD]
    device = next(model.parameters()).device          # the model's device: the GPU its process was assigned
    gen = torch.Generator().manual_seed(seed)         # sampling on the CPU: the same draws on any device
    out: list[int] = []
    reason = "length"
    with torch.no_grad():
        for _ in range(max_tokens):
            if t_end is not None and time.monotonic() > t_end:
                reason = "time"
                break
            ctx = torch.tensor([(ids + out)[-model.cfg.seq_len:]], device=device)
            logits = model(ctx)[0, -1].float().cpu()
            if temperature > 0:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            else:
                nxt = int(logits.argmax())
            if nxt == EOD or nxt > 255:
                reason = "stop"
                break
            out.append(nxt)
    return bytes(out).decode("utf-8", errors="replace"), len(out), reason


def fits_engine(prompt_ids: list[int], max_tokens: int, context: int) -> bool:
    """Whether a prompt and its max_tokens fit the model's context without sliding the window: then the
    KV-cached engine computes exactly what `generate` does (a cache holds absolute positions, so a sliding
    window cannot reuse it)."""
    return len(prompt_ids) + max_tokens <= context


def generate_rows(model, prompts: list[str], max_tokens: int, temperature: float = 0.0,
                  seeds: list[int] | None = None, engine=None, tokenizer=None) -> list[tuple[str, int, str]]:
    """`generate` for many prompts at once: (text, tokens generated, finish_reason) per prompt, in order.
    The prompts that fit the context with max_tokens run together on `engine` (spotfill/generation: KV
    cache, continuous batching; default: a new one over `model`, a row per prompt), greedy giving exactly
    `generate`'s tokens; sampled rows draw from (seed, token index) as the engine does. A prompt that needs
    the sliding window runs alone through `generate` (its seed seeding its generator as there).

    `tokenizer`: the run's own (generation/text.py; default: bytes). With a Hugging Face tokenizer a prompt
    that does not fit keeps its last tokens (the context minus max_tokens, at least half the context) and
    runs on the engine too: `generate`'s sliding window is byte-level."""
    from spotfill.generation.offline import complete_all
    from spotfill.generation.sampling import SamplingParams
    from spotfill.generation.text import ByteTokenizer
    tokenizer = tokenizer or ByteTokenizer()
    byte_level = isinstance(tokenizer, ByteTokenizer)
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    ctx = model.cfg.seq_len
    ids = [tokenizer.encode(p) or [tokenizer.eos_id] for p in prompts]
    if not byte_level:
        ids = [p if fits_engine(p, max_tokens, ctx) else p[-max(ctx - max_tokens, ctx // 2):] for p in ids]
    out: list[tuple[str, int, str] | None] = [None] * len(prompts)
    fit = [i for i, p in enumerate(ids) if fits_engine(p, max_tokens, ctx) or not byte_level]
    if fit and max_tokens > 0:
        if engine is None:
            engine = batch_engine(model, len(fit), tokenizer)
        done = complete_all(engine, [ids[i] for i in fit],
                            [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seeds[i])
                             for i in fit])
        for i, c in zip(fit, done):
            if c.finish_reason == "error":
                raise RuntimeError(f"generation of prompt {i} failed: {c.error}")
            out[i] = (tokenizer.decode(c.ids), len(c.ids), c.finish_reason)
    for i in range(len(prompts)):
        if out[i] is None:
            out[i] = generate(model, prompts[i], max_tokens, temperature, seed=seeds[i])
    return out


def batch_engine(model, max_batch: int, tokenizer=None):
    """A KV-cached engine over a loaded model for offline batches (no draft; stepped by its caller), with
    the run's `tokenizer` (default: bytes)."""
    from spotfill.generation.decoders import decoder_for
    from spotfill.generation.engine import Engine
    from spotfill.generation.text import ByteTokenizer
    return Engine(decoder_for(model), tokenizer or ByteTokenizer(), max_batch=max(1, int(max_batch)))
