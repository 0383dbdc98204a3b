"""The OpenAI-compatible surface, as data: request bodies to generation calls, results to response bodies,
server-sent-event chunks, errors in OpenAI's JSON shape. Pure (no torch, no Ray, no web framework).

Routes served with these shapes (spotfill/serving/app.py): POST /v1/completions and /v1/chat/completions (both with
`stream: true`), GET /v1/models. Supported request fields: model, prompt (a string, or a list of one),
messages, max_tokens (max_completion_tokens for chat), temperature, top_p, n (1 only), stop (a string or up
to 4), seed, stream, stream_options.include_usage, and the extension ignore_eos. Fields OpenAI defines that
change the output and are not supported (logprobs, echo, best_of > 1, n > 1, tools, response_format other
than text) are refused with 400 rather than ignored; fields that do not change the output (user, metadata,
presence/frequency penalties of 0...) are accepted.

Chat messages travel to the replica as messages: a model whose tokenizer has a chat template (a Hugging Face
run's own tokenizer) gets the template applied there; spotfill's presets (byte-level models trained on plain
text, no template) get "<role>: <content>\\n" per message, then "assistant:" (generation/text.plain_chat).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from spotfill.generation.text import plain_chat

DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
MAX_STOPS = 4


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass
class Call:
    """One generation call parsed from a request body."""
    chat: bool
    prompt: str
    max_tokens: int | None               # None: up to the model's context
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None
    ignore_eos: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    messages: list[dict] | None = None   # a chat's messages [{role, content}] (content: text)

    def params(self) -> dict:
        """The sampling parameters as the Generator takes them."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "stop": list(self.stop), "ignore_eos": self.ignore_eos}

    def job(self, params: dict | None = None) -> dict:
        """What a replica generates from (generation/replica.job_request): a chat's messages, which the
        replica's tokenizer turns into its prompt, or the prompt."""
        out = {"request_id": self.request_id, "prompt": self.prompt, "params": self.params() if params is None
               else params}
        if self.messages is not None:
            out["messages"] = self.messages
        return out


def _number(body: dict, name: str, default, lo: float, hi: float, kind=float):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise bad(name, f"{value!r} is not a{'n integer' if kind is int else ' number'}")
    if not lo <= value <= hi:
        raise bad(name, f"{value} is outside {lo:g}..{hi:g}")
    return kind(value)


def _refuse_unsupported(body: dict) -> None:
    if _number(body, "n", 1, 1, 128, int) != 1:
        raise bad("n", "only 1 choice per request is supported")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", "not supported")
    for name in ("logprobs", "top_logprobs", "echo", "tools", "functions", "logit_bias"):
        if body.get(name):
            raise bad(name, "not supported")
    fmt = body.get("response_format")
    if fmt and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format", "only {\"type\": \"text\"} is supported")


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad("stop", f"a string or a list of up to {MAX_STOPS} strings")
    return tuple(s for s in stops if s)


def _common(body: dict, chat: bool, prompt: str, max_tokens: int | None) -> Call:
    _refuse_unsupported(body)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "an object")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed", f"{seed!r} is not an integer")
    model = body.get("model")
    return Call(chat=chat, prompt=prompt, max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0, seed=seed, stop=_stops(body),
                stream=bool(body.get("stream")), include_usage=bool(options.get("include_usage")),
                model=str(model) if model is not None else None, ignore_eos=bool(body.get("ignore_eos")))


def parse_completion(body) -> Call:
    if not isinstance(body, dict):
        raise bad("body", "a JSON object")
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise bad("prompt", "a string (or a list of one string): one prompt per request")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "a string")
    return _common(body, False, prompt, _number(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, 1 << 31, int))


def chat_messages(messages) -> list[dict]:
    """The chat's messages as [{role, content: str}] (text parts joined), or 400 naming the bad one."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "a non-empty list of {role, content}")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "an object with a role and content")
        content = m.get("content")
        if isinstance(content, list):            # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad(f"messages[{i}].content", "only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content", "a string")
        lines.append({"role": m["role"], "content": content or ""})
    return lines


def chat_prompt(messages) -> str:
    """The plain prompt of a chat (a model without a chat template)."""
    return plain_chat(chat_messages(messages))


def parse_chat(body) -> Call:
    if not isinstance(body, dict):
        raise bad("body", "a JSON object")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = None if limit is None else _number({"max_tokens": limit}, "max_tokens", None, 1, 1 << 31, int)
    messages = chat_messages(body.get("messages"))
    call = _common(body, True, plain_chat(messages), max_tokens)
    call.messages = messages
    return call


def usage(result: dict) -> dict:
    """OpenAI's usage, plus spec_decode {drafted, accepted} when a draft was used."""
    out = {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
           "total_tokens": result["prompt_tokens"] + result["completion_tokens"]}
    if result.get("spec_decode"):
        out["spec_decode"] = dict(result["spec_decode"])
    return out


def response(call: Call, result: dict, created: int | None = None) -> dict:
    """The whole (non-streamed) answer. `result`: text, finish_reason, prompt_tokens, completion_tokens,
    model, checkpoint, spec_decode (optional)."""
    created = int(time.time()) if created is None else created
    if call.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]},
                  "finish_reason": result["finish_reason"], "logprobs": None}
        head = {"id": f"chatcmpl-{call.request_id}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": result["text"], "finish_reason": result["finish_reason"], "logprobs": None}
        head = {"id": f"cmpl-{call.request_id}", "object": "text_completion"}
    return {**head, "created": created, "model": call.model or result["model"], "choices": [choice],
            "usage": usage(result), "checkpoint": result.get("checkpoint"),
            **({"served_by": result["served_by"]} if result.get("served_by") else {})}


def chunk(call: Call, model: str, created: int, text: str | None = None, finish_reason: str | None = None,
          role: bool = False, usage_of: dict | None = None) -> dict:
    """One streamed chunk (OpenAI's `text_completion` / `chat.completion.chunk`); `usage_of`: the last chunk
    with usage and no choices (stream_options.include_usage)."""
    if call.chat:
        head = {"id": f"chatcmpl-{call.request_id}", "object": "chat.completion.chunk"}
        delta = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    else:
        head = {"id": f"cmpl-{call.request_id}", "object": "text_completion"}
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
    out = {**head, "created": created, "model": call.model or model, "choices": choices}
    if usage_of is not None:
        out["choices"], out["usage"] = [], usage(usage_of)
    elif call.include_usage:
        out["usage"] = None
    return out


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
