"""What a serving replica does: build an engine for a loaded model (and its draft), and answer a job as an
async stream of chunks (the protocol relay.py describes). No Ray: spotfill/serving/app.py's Generator calls these."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from spotfill.generation.decoders import decoder_for, self_draft
from spotfill.generation.engine import Engine, GenerationRequest, Update
from spotfill.generation.sampling import SamplingParams
from spotfill.generation.text import ByteTokenizer


@dataclass(frozen=True)
class DraftSpec:
    """`self:L` (the target's first L layers and its head) or a storage URI of a run with the same
    tokenizer; "" for none."""
    kind: str = ""          # "" | "self" | "uri"
    layers: int = 0
    uri: str = ""

    @classmethod
    def parse(cls, value: str, field: str = "draft") -> "DraftSpec":
        from spotfill.config.errors import ConfigError
        value = (value or "").strip()
        if not value:
            return cls()
        if value.startswith("self:"):
            try:
                layers = int(value[5:])
            except ValueError:
                layers = 0
            if layers < 1:
                raise ConfigError(field, value, accepted="self:L with L >= 1 (the target's first L layers), "
                                  "or a run's storage URI")
            return cls("self", layers)
        from spotfill.storage.base import open_storage
        open_storage(value)                          # a bad scheme or path fails here, naming it
        return cls("uri", uri=value)

    def __str__(self) -> str:
        return {"": "", "self": f"self:{self.layers}", "uri": self.uri}[self.kind]


def replica_device():
    """(torch device, dtype) this process generates on: the GPU Ray assigned it (cuda:0 inside the process),
    else the CPU; bf16 where the device supports it (spotfill/devices.py)."""
    from spotfill.devices import assigned_device, compute_dtype
    device = assigned_device()
    return device, compute_dtype(device)


def build_engine(model, draft: DraftSpec = DraftSpec(), draft_model=None, num_draft_tokens: int = 4,
                 max_batch: int = 8, policy=None, meter=None, tokenizer=None) -> Engine:
    """An engine over `model` (spotfill's GPT, a Hugging Face causal LM, or any forward(idx) -> logits model
    with a .cfg), with the draft `draft` names (`draft_model`: the loaded model of a URI draft) and the run's
    `tokenizer` (default: the byte tokenizer of spotfill's presets); `meter` measures its steps (Engine)."""
    from spotfill.config.errors import ConfigError
    target = decoder_for(model)
    dec = None
    if draft.kind == "self":
        if not 1 <= draft.layers < model.cfg.n_layer:
            raise ConfigError("draft", str(draft), accepted=f"self:L with 1 <= L < {model.cfg.n_layer} (the "
                              "model's layers)")
        dec = self_draft(model, draft.layers)
        if dec is None:
            raise ConfigError("draft", str(draft), accepted="self:L on spotfill's GPT presets or a Hugging Face "
                              f"model whose layers run in order (not {type(getattr(model, 'inner', model)).__name__}"
                              "): or a smaller run's storage URI")
    elif draft.kind == "uri":
        dec = decoder_for(draft_model)
        if dec.vocab_size != target.vocab_size:
            raise ConfigError("draft", draft.uri, reason=f"its vocabulary has {dec.vocab_size} tokens, the "
                              f"model's {target.vocab_size}", accepted="a run with the same tokenizer")
    return Engine(target, tokenizer or ByteTokenizer(), max_batch=max_batch, draft=dec, num_draft_tokens=num_draft_tokens,
                  policy=policy, meter=meter)


def job_request(job: dict, tokenizer, context: int) -> GenerationRequest:
    """The engine request for a job {request_id, prompt, params, generated?, emitted?, drafted?, ...}."""
    p = dict(job.get("params") or {})
    limit = p.get("max_tokens")
    params = SamplingParams(max_tokens=int(limit) if limit else context, temperature=float(p.get("temperature") or 0.0),
                            top_p=float(p.get("top_p") or 1.0), seed=p.get("seed"),
                            stop=tuple(p.get("stop") or ()), ignore_eos=bool(p.get("ignore_eos")))
    if job.get("messages"):              # a chat: the tokenizer's chat template, or the plain prompt
        prompt = tokenizer.chat_ids(job["messages"]) or [tokenizer.eos_id]
    else:
        prompt = tokenizer.encode(job.get("prompt") or "") or [tokenizer.eos_id]
    return GenerationRequest(str(job["request_id"]), prompt, params, generated=list(job.get("generated") or []),
                             emitted=int(job.get("emitted") or 0), drafted=int(job.get("drafted") or 0),
                             accepted=int(job.get("accepted") or 0),
                             verify_steps=int(job.get("verify_steps") or 0))


def chunk_of(u: Update) -> dict:
    out = {"ids": u.ids, "text": u.text, "finish_reason": u.finish_reason, "prompt_tokens": u.prompt_tokens,
           "completion_tokens": u.completion_tokens, "emitted": u.emitted}
    if u.drafted or u.verify_steps:
        out.update(drafted=u.drafted, accepted=u.accepted, verify_steps=u.verify_steps)
    return out


async def stream_job(engine: Engine, req: GenerationRequest, on_finish=None):
    """The request's updates as chunks while the engine generates; cancelled in the engine when the caller
    stops listening (its client went away, or the Ingress moved it to another replica). An error update
    becomes {"error", "code"}; `on_finish(update)` sees the last update."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    engine.submit(req, lambda u: loop.call_soon_threadsafe(queue.put_nowait, u))
    done = False
    try:
        while not done:
            u = merged(await queue.get(), queue)
            if u.finish_reason == "error":
                done = True
                code = "context_length_exceeded" if "context" in (u.error or "") else "generation_failed"
                yield {"error": u.error, "code": code}
                return
            done = u.finish_reason is not None
            if done and on_finish is not None:
                on_finish(u)
            yield chunk_of(u)
    finally:
        if not done:
            engine.cancel(req.request_id)


def merged(u: Update, queue: asyncio.Queue) -> Update:
    """`u` and the updates already waiting behind it, as one (fewer, larger chunks when the reader lags)."""
    from dataclasses import replace
    while u.finish_reason is None and not queue.empty():
        nxt = queue.get_nowait()
        if nxt.finish_reason == "error":
            return nxt
        u = replace(nxt, ids=u.ids + nxt.ids, text=u.text + nxt.text)
    return u
