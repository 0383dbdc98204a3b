"""Serving a Hugging Face model as it was trained: a tiny random Llama (transformers, saved with
save_pretrained) with its own BPE tokenizer and chat template (spotfill.testing.hf_tiny), through the
generation engine. The KV-cached decoder (HFDecoder) gives the logits of the whole-context forward and the
greedy text `transformers` generates; a self-speculative draft (its first layer) leaves greedy output
unchanged; chat requests get the tokenizer's template; stop strings and EOS end a request."""
from __future__ import annotations

import pytest
import torch

from spotfill.generation.decoders import HFDecoder, decoder_for, self_draft
from spotfill.generation.engine import Engine, GenerationRequest
from spotfill.generation.replica import DraftSpec, build_engine, job_request
from spotfill.generation.sampling import SamplingParams
from spotfill.generation.text import HFTokenizer, IncrementalText

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from spotfill.testing.hf_tiny import tiny_llama
    from spotfill.train.model import build_model
    model_dir, tok_dir = tiny_llama(str(tmp_path_factory.mktemp("llama")), layers=3)
    return build_model(f"hf:{model_dir}").eval(), HFTokenizer(tok_dir)


def run(engine, requests) -> dict:
    got: dict[str, list] = {}
    for r in requests:
        engine.submit(r, lambda u: got.setdefault(u.request_id, []).append(u))
    steps = 0
    while engine.step() or steps < 3:
        steps += 1
    return got


def ids(updates) -> list[int]:
    return [t for u in updates for t in u.ids]


def hf_greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    """transformers' own greedy generation (its cache, its loop), the new tokens up to EOS."""
    with torch.no_grad():
        out = model.inner.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                   pad_token_id=eos, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    new = out[0, len(prompt):].tolist()
    return new[:new.index(eos)] if eos in new else new


def test_the_cached_decoder_gives_the_whole_context_logits(llama):
    model, _ = llama
    x = torch.randint(3, model.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        ref = model(x)
    dec = decoder_for(model)
    assert isinstance(dec, HFDecoder)
    cache = dec.new_cache(3)
    whole = dec.forward(cache, 1, x.tolist(), [0, 0])
    assert torch.allclose(whole, ref, atol=1e-4)
    # token by token, rows at different lengths, and a rolled-back position written again
    cache = dec.new_cache(2)
    dec.forward(cache, 0, [x[0, :20].tolist()], [0])
    dec.forward(cache, 1, [x[1, :7].tolist()], [0])
    dec.forward(cache, 0, [[5, 6, 7]], [20])                          # speculative tokens, then rolled back
    step = dec.forward(cache, 0, [[int(x[0, 20])], [int(x[1, 7])]], [20, 7])
    assert torch.allclose(step[0, 0], ref[0, 20], atol=1e-4) and torch.allclose(step[1, 0], ref[1, 7], atol=1e-4)
    dec.move(cache, 0, 1, 21)                                        # row 0's first 21 positions into row 1
    nxt = dec.forward(cache, 1, [[int(x[0, 21])]], [21])
    assert torch.allclose(nxt[0, 0], ref[0, 21], atol=1e-4)


def test_batched_greedy_generation_equals_transformers_generate(llama):
    model, tok = llama
    prompts = ["the quick brown fox", "spotfill lends", "naïve façade", "a"]
    reqs = [GenerationRequest(str(i), tok.encode(p), SamplingParams(max_tokens=12 + 3 * i))
            for i, p in enumerate(prompts)]
    got = run(build_engine(model, tokenizer=tok, max_batch=3), reqs)
    for i, p in enumerate(prompts):
        assert ids(got[str(i)]) == hf_greedy(model, tok.encode(p), 12 + 3 * i, tok.eos_id), p
        assert got[str(i)][-1].prompt_tokens == len(tok.encode(p))        # usage counts the model's tokens


def test_a_self_draft_of_the_first_layer_leaves_greedy_output_unchanged(llama):
    model, tok = llama
    draft = self_draft(model, 1)
    assert draft is not None and draft.layers == 1
    prompts = ["the lazy dog", "fill-in work", "un café"]
    reqs = lambda: [GenerationRequest(str(i), tok.encode(p), SamplingParams(max_tokens=20, ignore_eos=True))  # noqa: E731
                    for i, p in enumerate(prompts)]
    plain = run(build_engine(model, tokenizer=tok), reqs())
    eng = build_engine(model, DraftSpec.parse("self:1"), tokenizer=tok, num_draft_tokens=3)
    spec = run(eng, reqs())
    for i in range(len(prompts)):
        assert ids(spec[str(i)]) == ids(plain[str(i)])
    assert sum(u.drafted for us in spec.values() for u in us[-1:]) > 0       # the draft did run


def test_self_draft_is_refused_with_the_layers_it_accepts(llama):
    from spotfill.config.errors import ConfigError
    model, tok = llama
    with pytest.raises(ConfigError, match=r"draft.*self:L with 1 <= L < 3"):
        build_engine(model, DraftSpec.parse("self:3"), tokenizer=tok)


def test_a_chat_gets_the_tokenizers_template_and_a_completion_its_bos(llama):
    _, tok = llama
    job = {"request_id": "c", "prompt": "user: hi\nassistant:", "params": {"max_tokens": 4},
           "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    req = job_request(job, tok, 128)
    assert tok.tok.decode(req.prompt_ids) == "<s><|system|>\nbe brief</s><|user|>\nhi</s><|assistant|>\n"
    done = job_request({"request_id": "p", "prompt": "the dog", "params": {}}, tok, 128)
    assert done.prompt_ids[0] == tok.tok.bos_token_id and tok.decode(done.prompt_ids) == "the dog"


def test_stop_strings_and_eos_end_a_request_in_the_models_text(llama):
    model, tok = llama
    prompt = tok.encode("the quick brown")
    full = ids(run(build_engine(model, tokenizer=tok), [GenerationRequest(
        "f", prompt, SamplingParams(max_tokens=24, ignore_eos=True))])["f"])
    text = tok.decode(full)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    got = run(build_engine(model, tokenizer=tok), [GenerationRequest(
        "s", prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))])["s"]
    assert "".join(u.text for u in got) == text[:text.index(stop)] and got[-1].finish_reason == "stop"
    assert tok.is_eos(tok.eos_id) and not tok.is_eos(prompt[-1])
    t = IncrementalText(tok)
    assert "".join(t.add([i])[0] for i in full) + t.finish() == text
