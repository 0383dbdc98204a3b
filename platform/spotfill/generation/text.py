"""Tokens to text for a request: the byte-level tokenizer of spotfill's presets, a Hugging Face tokenizer (a
run's own, carried in its checkpoints), and incremental text with stop sequences.

Every tokenizer here has encode(text) -> ids, decode(ids) -> text, eos_id, is_eos(id) and chat(messages)
-> the prompt of a chat: a Hugging Face tokenizer with a chat template applies it (with the generation
prompt, as `transformers` does); one without, and the byte tokenizer, use `plain_chat`.

`IncrementalText` turns the tokens generated so far into the text a client may see now: it holds back an
incomplete UTF-8 character at the end and any tail that could still become a stop sequence, and cuts the
text where a stop sequence appears (the stop sequence itself is not returned, as in OpenAI's API).
"""
from __future__ import annotations

EOD = 256          # end-of-document id of the byte-level tokenizer (spotfill/train/data.py)


def plain_chat(messages: list[dict]) -> str:
    """"<role>: <content>\\n" per message, then "assistant:" -- the chat prompt of a model without a chat
    template (spotfill's presets are byte-level models trained on plain text). `messages`: [{role, content}]
    with string contents (generation/protocol.py checks them)."""
    return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, end-of-document 256; ids above 255 have no text."""
    eos_id = EOD
    name = "bytes"

    def chat(self, messages: list[dict]) -> str:
        return plain_chat(messages)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.chat(messages))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def is_eos(self, token: int) -> bool:
        return token >= 256


class HFTokenizer:
    """A Hugging Face tokenizer (transformers' AutoTokenizer over a local folder) behind the same interface.
    encode adds the special tokens the tokenizer adds by default (a Llama tokenizer's BOS), as `transformers`
    does for a prompt; decode drops special tokens. The ends of generation: the tokenizer's EOS and the ids
    `eos_ids` names (a generation_config.json's eos_token_id, which may list several)."""

    def __init__(self, folder: str, eos_ids=()):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.name = f"hf:{folder}"
        ends = {i for i in ([eos_ids] if isinstance(eos_ids, int) else list(eos_ids or ())) if i is not None}
        if self.tok.eos_token_id is not None:
            ends.add(int(self.tok.eos_token_id))
        self.eos_ids = frozenset(int(i) for i in ends)
        self.eos_id = (int(self.tok.eos_token_id) if self.tok.eos_token_id is not None
                       else min(self.eos_ids) if self.eos_ids else 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def is_eos(self, token: int) -> bool:
        return int(token) in self.eos_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def chat(self, messages: list[dict]) -> str:
        if not self.has_chat_template:
            return plain_chat(messages)
        return self.tok.apply_chat_template([{"role": m["role"], "content": m.get("content") or ""}
                                             for m in messages], tokenize=False, add_generation_prompt=True)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The chat's prompt as ids: its template's text encoded without adding special tokens again (a
        template writes its own BOS)."""
        text = self.chat(messages)
        return list(self.tok(text, add_special_tokens=not self.has_chat_template)["input_ids"])


class IncrementalText:
    """The visible text of a growing list of generated tokens.

    `emitted`: characters of the text a client already has (a request continued on another replica starts
    with the tokens and the count of characters streamed before)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), ids: list[int] | None = None, emitted: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = list(ids or [])
        self.emitted = emitted
        self.stopped = False
        self._text = tokenizer.decode(self.ids)

    def _visible_end(self, final: bool) -> int:
        text = self._text
        end = len(text)
        if not final:
            while end > 0 and text[end - 1] == "\ufffd":      # perhaps an incomplete UTF-8 character
                end -= 1
            hold = 0
            for s in self.stop:                               # a tail that may still grow into a stop
                hold = max([hold] + [k for k in range(1, min(len(s), end + 1))
                                     if text.endswith(s[:k], 0, end)])
            end -= hold
        return max(end, self.emitted)

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """Append generated tokens; (text now visible beyond what was emitted, a stop sequence was hit).
        After a stop, the text ends before it and further tokens are ignored."""
        if self.stopped:
            return "", True
        self.ids.extend(ids)
        self._text = self.tokenizer.decode(self.ids)
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self._text = self._text[:min(hits)]
                self.stopped = True
                return self._take(True), True
        return self._take(False), False

    def finish(self) -> str:
        """The rest of the text (the request ended: nothing more is held back)."""
        return self._take(True)

    def _take(self, final: bool) -> str:
        end = self._visible_end(final)
        out = self._text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    @property
    def text(self) -> str:
        return self._text
