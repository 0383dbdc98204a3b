"""Checkpoints carry their model, and `spotfill export` turns one into a Hugging Face folder: each checkpoint
here is written the way training writes it (a ZeRO-2 DeepSpeed engine, world size 1, gloo; the Checkpointer
with the card and files worker_loop hands it), one optimizer step taken so the weights are not the
initial ones. The folder loads with transformers' Auto classes and gives spotfill's logits on the same ids.

Two models: the `tiny` preset with the byte tokenizer (-> GPT2LMHeadModel), and a 2-layer random Llama made
with transformers and saved with save_pretrained, over a BPE tokenizer trained here with `tokenizers`."""
from __future__ import annotations

import json
import os

import pytest

from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import CheckpointStore
from spotfill.train.checkpointing import Checkpointer
from spotfill.train.model_card import for_checkpoints

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)
TEXT = ("the quick brown fox jumps over the lazy dog. " * 20 + "spotfill lends spare GPUs to fill-in work. " * 20
        + "un café, s'il vous plaît — naïve façade. " * 10)
PROBES = ["hello world", "the lazy dog", "naïve café — ünïcödé ✓ 日本語", "  spaces\tand\nnewlines  "]
ATOL = 1e-4          # train/export.py's check; both sides run in fp32


@pytest.fixture(scope="module")
def dist():
    """A fresh world of one rank: no process group or Ray connection an earlier module of the same pytest
    process left behind (the module passed alone and failed after the scenario modules in a full run)."""
    import ray

    from benchmarks._common import destroy_dist, single_rank_dist
    if ray.is_initialized():
        ray.shutdown()
    destroy_dist()
    with single_rank_dist():
        yield


def _engine(model):
    import torch

    from spotfill.testing.tiny_step import ZERO2
    from spotfill.train.engine import build_engine
    engine = build_engine(model, dict(ZERO2))
    x = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    out = engine(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return engine


def _train_and_save(tmp_path, model_spec: str, data_manifest: dict, model) -> tuple[str, object]:
    """A run folder with one committed final checkpoint at step 3, saved as worker_loop saves it."""
    run = str(tmp_path / "runs" / "job")
    store = CheckpointStore(open_storage(run))
    card, files = for_checkpoints(model_spec, data_manifest, rank=0)
    ckpt = Checkpointer(store, str(tmp_path / "local"), rank=0, world_size=1, attempt="0",
                        meta={"model": card}, part_files=files)
    engine = _engine(model)
    try:
        assert ckpt.save(engine, 3, {}, kind="final")["committed"]
    finally:
        ckpt.close()
    return run, engine


def _spotfill_logits(engine, ids):
    import torch
    engine.module.eval()
    with torch.no_grad():
        return engine.module(torch.tensor(ids)).float()


def _hf_logits(folder, ids):
    import torch
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.float(), model


def test_a_preset_exports_as_gpt2_with_the_byte_tokenizer_and_the_same_logits(dist, tmp_path):
    import torch

    from spotfill.train.export import export_run
    from spotfill.train.model import build_model
    torch.manual_seed(0)
    run, engine = _train_and_save(tmp_path, "tiny", {"seq_len": 64, "vocab_size": 257, "tokenizer": "bytes"},
                                  build_model("tiny", seq_len=64, vocab_size=257))
    manifest = CheckpointStore(open_storage(run)).manifest(CheckpointStore(open_storage(run)).latest_tag())
    assert manifest["meta"]["model"]["preset"] == "tiny" and manifest["meta"]["model"]["config"]["n_head"] == 2
    out = str(tmp_path / "hf")
    rec = export_run(run, out)
    assert rec["architecture"] == "GPT2LMHeadModel" and rec["card"] == "carried" and rec["step"] == 3
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))
    assert rec["max_abs_diff"] <= ATOL

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = [tok.encode(PROBES[0]) + tok.encode(PROBES[2])[:20]]
    theirs, model = _hf_logits(out, ids)
    diff = float((theirs - _spotfill_logits(engine, ids)).abs().max())
    print(f"preset tiny -> GPT-2: max |logit diff| {diff:.3g}")
    assert diff <= ATOL
    assert not model.config.tie_word_embeddings and model.config.activation_function == "gelu"
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen["eos_token_id"] == 256 and gen["max_length"] == 64
    for text in PROBES + ["<|endoftext|> stays text"]:
        assert tok.encode(text) == list(text.encode("utf-8"))       # the ids spotfill's data has
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 256


def _llama_and_tokenizer(tmp_path):
    from spotfill.testing.hf_tiny import tiny_llama
    llama_dir, tok_dir = tiny_llama(str(tmp_path), layers=2, text=TEXT)
    return llama_dir, tok_dir, transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_a_hf_llama_exports_as_itself_with_its_tokenizer_and_the_same_logits(dist, tmp_path):
    from spotfill.train.export import export_run
    from spotfill.train.model import build_model

    llama_dir, tok_dir, fast = _llama_and_tokenizer(tmp_path)
    run, engine = _train_and_save(tmp_path, f"hf:{llama_dir}",
                                  {"seq_len": 32, "vocab_size": len(fast), "tokenizer": f"hf:{tok_dir}"},
                                  build_model(f"hf:{llama_dir}"))
    store = CheckpointStore(open_storage(run))
    manifest = store.manifest(store.latest_tag())
    card = manifest["meta"]["model"]
    assert card["kind"] == "hf" and card["config"]["model_type"] == "llama"
    assert "rank-0/spotfill-model/tokenizer.json" in manifest["files"]      # the tokenizer travels, hashed

    out = str(tmp_path / "hf")
    rec = export_run(run, out, step=3)
    assert rec["architecture"] == "LlamaForCausalLM" and rec["tokenizer"] == "hf"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in PROBES:
        assert tok.encode(text) == fast.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    ids = [tok.encode(TEXT[:200])[:32]]
    theirs, model = _hf_logits(out, ids)
    diff = float((theirs - _spotfill_logits(engine, ids)).abs().max())
    print(f"hf llama: max |logit diff| {diff:.3g}")
    assert diff <= ATOL and rec["max_abs_diff"] <= ATOL
    assert type(model).__name__ == "LlamaForCausalLM"

    # what serving loads from the run -- the carried model and its own tokenizer -- generates, greedy, the
    # text transformers generates from the export (KV-cached engine, a batch of prompts at once)
    import torch

    from spotfill.fillin.generate import load_newest
    from spotfill.generation.offline import complete_all
    from spotfill.generation.replica import build_engine
    from spotfill.generation.sampling import SamplingParams
    loaded = load_newest(store, str(tmp_path / "work"))
    assert loaded.tokenizer.name.startswith("hf:") and loaded.tokenizer.encode(PROBES[2]) == fast.encode(PROBES[2])
    served = build_engine(loaded.model.eval(), tokenizer=loaded.tokenizer, max_batch=4)
    prompts = [tok.encode(p) for p in PROBES]
    done = complete_all(served, prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts))
    for p, c in zip(prompts, done):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
        assert c.ids == ref, (p, c.ids, ref)
        assert loaded.tokenizer.decode(c.ids) == tok.decode(ref, skip_special_tokens=True)

    # a batch job pins the checkpoint with its tokenizer's files, and its workers generate the same text
    from types import SimpleNamespace

    from spotfill.fillin import batch, batch_plan
    from spotfill.fillin.generate import generate_rows
    state, _, _, pinned_card, tok_files = batch._pinned_checkpoint(
        SimpleNamespace(checkpoint=run, checkpoint_tag=None, checkpoint_wait_s=0))
    assert "tokenizer.json" in tok_files and pinned_card == card
    out_store = open_storage(str(tmp_path / "batch-out"))
    for name, data in tok_files.items():
        out_store.put_bytes(f"{batch_plan.TOKENIZER_DIR}/{name}", data)
    worker_tok = batch.plan_tokenizer(out_store, {"model_card": pinned_card})
    rows = generate_rows(loaded.model, PROBES, 12, tokenizer=worker_tok)
    for text, (got, n, reason) in zip(PROBES, rows):
        p = tok.encode(text)
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
        ref = ref[:ref.index(tok.eos_token_id)] if tok.eos_token_id in ref else ref
        assert got == tok.decode(ref, skip_special_tokens=True) and n == len(ref), (text, got, ref)


def test_serving_loads_the_carried_model_not_a_guess(dist, tmp_path, caplog):
    """The loaders build what the card says: a preset whose shape matches no preset's width/depth pair
    would have had its heads guessed (width 64 -> 1 head) from the tensors; the card keeps its 4."""
    import logging

    from spotfill.fillin.generate import load_newest
    from spotfill.config import presets
    from spotfill.train.model import GPT

    odd = presets.GPTConfig(seq_len=32, n_layer=3, n_head=4, n_embd=64)
    presets.PRESETS["odd-test"] = odd
    try:
        run, engine = _train_and_save(tmp_path, "odd-test", {"seq_len": 32, "vocab_size": 257, "tokenizer": "bytes"},
                                      GPT(odd))
    finally:
        del presets.PRESETS["odd-test"]
    with caplog.at_level(logging.WARNING):
        loaded = load_newest(CheckpointStore(open_storage(run)), str(tmp_path / "work"))
    assert loaded.model.cfg == odd and loaded.card["preset"] == "odd-test"
    assert "guessed" not in caplog.text
    ids = [list(b"carried, not guessed")]
    import torch
    with torch.no_grad():
        assert torch.equal(loaded.model(torch.tensor(ids)), _spotfill_logits(engine, ids))
