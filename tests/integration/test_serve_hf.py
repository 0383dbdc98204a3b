"""`spotfill serve` on a run trained from a Hugging Face model: a tiny random Llama with its own BPE tokenizer
and chat template (spotfill.testing.hf_tiny), its checkpoint carrying the model card and the tokenizer's
files as training writes them (train/model_card.py). Driven by the official `openai` client: a streamed chat
completion gets the tokenizer's chat template and equals `transformers`' greedy generation on the same
weights, usage counts the model's tokens, a stop string ends the text."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from test_serve_openai import ROOT, free_port, ready_state, stop_serve

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


def hf_checkpoint(folder: str, uri: str, step: int) -> tuple[str, str]:
    """A committed checkpoint of a random Llama (module states only) with its card and tokenizer files."""
    import torch

    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
    from spotfill.testing.hf_tiny import tiny_llama
    from spotfill.train.model import build_model
    from spotfill.train.model_card import for_checkpoints
    model_dir, tok_dir = tiny_llama(folder, layers=2)
    model = build_model(f"hf:{model_dir}")
    card, files = for_checkpoints(f"hf:{model_dir}", {"seq_len": 64, "vocab_size": model.cfg.vocab_size,
                                                      "tokenizer": f"hf:{tok_dir}"}, rank=0)
    local = os.path.join(folder, "part")
    os.makedirs(local)
    torch.save({"module": model.state_dict()}, os.path.join(local, "mp_rank_00_model_states.pt"))
    for rel, path in files.items():
        os.makedirs(os.path.dirname(os.path.join(local, rel)), exist_ok=True)
        with open(path, "rb") as src, open(os.path.join(local, rel), "wb") as dst:
            dst.write(src.read())
    store = CheckpointStore(open_storage(uri))
    store.upload_part(tag_for(step), 0, 1, local)
    store.commit(tag_for(step), step, 1, meta={"model": card})
    return model_dir, tok_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hfrun"))
    uri = f"file://{folder}/run"
    model_dir, tok_dir = hf_checkpoint(folder, uri, 7)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "platform")}
    proc = subprocess.Popen([sys.executable, "-m", "spotfill", "serve", "--checkpoint", uri, "--port", str(port),
                             "--nodes", "1", "--max-queue-wait-s", "90"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("spotfill serve:"):
                break
        else:
            raise AssertionError("spotfill serve did not start:\n" + "".join(seen[-30:]))
        url = f"http://127.0.0.1:{port}"
        t_end = time.monotonic() + 150
        while ready_state(url) != "ready" and time.monotonic() < t_end:
            time.sleep(0.5)
        yield {"url": url, "model_dir": model_dir, "tok_dir": tok_dir}
    finally:
        stop_serve(proc)


def greedy(model_dir: str, tok, prompt_ids: list[int], n: int) -> list[int]:
    import torch
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    new = out[0, len(prompt_ids):].tolist()
    return new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new


def test_a_streamed_chat_gets_the_template_and_transformers_greedy_text(served):
    from openai import OpenAI

    tok = transformers.AutoTokenizer.from_pretrained(served["tok_dir"])
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<s><|system|>")                         # the tokenizer's own template
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ref = greedy(served["model_dir"], tok, ids, 16)
    client = OpenAI(base_url=served["url"] + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="spotfill", messages=MESSAGES, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        pieces += [c.delta.content or "" for c in chunk.choices]
    text = "".join(pieces)
    assert text == tok.decode(ref, skip_special_tokens=True), (text, ref)
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == len(ref)


def test_a_completion_counts_the_models_tokens_and_a_stop_string_ends_it(served):
    from openai import OpenAI

    tok = transformers.AutoTokenizer.from_pretrained(served["tok_dir"])
    client = OpenAI(base_url=served["url"] + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    full = client.completions.create(model="spotfill", prompt="spotfill lends", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.usage.prompt_tokens == len(tok("spotfill lends")["input_ids"])     # BOS included, as HF counts
    text = full.choices[0].text
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    cut = client.completions.create(model="spotfill", prompt="spotfill lends", max_tokens=20, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
