"""Text out of tokens for a request being served: incremental detokenization with stop strings,
and the chat template.

Byte-level BPE tokens can end inside a UTF-8 character; `TextStream` holds back text while the
decoded tail is an incomplete character (U+FFFD) and, while it could still be the start of a
stop string, so a stream never sends text it later has to take back. A stop string ends the
request and the returned text stops before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3text.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class TextStream:
    """The text of one request's generated tokens, released piece by piece."""

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already released
        self.text = ""
        self.stopped = False  # a stop string was found; `text` ends before it
        self.kept = 0  # how many tokens of the last `add` were kept

    def _decode(self) -> str:
        if self.tokenizer is None:
            return ""
        known = [t for t in self.ids if t < self.tokenizer.vocab_size]  # padding ids: no text
        return self.tokenizer.decode(known)

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; returns the text that is now safe to send. `final` releases the rest.
        When a stop string turns up, only the tokens up to the one completing it are kept:
        `kept` says how many of `ids` that is (all of them otherwise)."""
        self.kept = 0
        if self.stopped:
            return ""
        before = len(self.ids)
        self.ids += ids
        self.kept = len(ids)
        text = self._decode()
        if self._first_stop(text) is not None:
            full = self.ids
            for k in range(1, len(ids) + 1):  # the token that completes the stop string
                self.ids = full[: before + k]
                text = self._decode()
                if (at := self._first_stop(text)) is not None:
                    break
            text, self.stopped, self.kept = text[:at], True, k
        self.text = text
        if self.stopped or final:
            ready = len(text)
        else:
            ready = len(text) - _held_back(text, self.stop)
        ready = max(ready, self.sent)
        piece = text[self.sent:ready]
        self.sent = ready
        return piece

    def _first_stop(self, text: str) -> int | None:
        hits = [at for stop in self.stop if (at := text.find(stop)) >= 0]
        return min(hits) if hits else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` not yet safe to send: an incomplete UTF-8 character, or
    the longest tail that begins some stop string."""
    if text.endswith(_INCOMPLETE):
        return len(text) - len(text.rstrip(_INCOMPLETE))
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    """One token's own text (for log-probability entries); "" for ids with no text."""
    if tokenizer is None or token >= tokenizer.vocab_size:
        return ""
    return tokenizer.decode([token])


# --------------------------------------------------------------------------------------------
# Chat template.
# --------------------------------------------------------------------------------------------

def _raise(message: str) -> None:
    raise ValueError(message)


SIMPLE_TEMPLATE = "{role}: {content}\n"  # each message, then "assistant:" opens the reply


class ChatTemplate:
    """Messages -> prompt text. The tokenizer's own Jinja template when its directory has a
    `tokenizer_config.json` with a `chat_template`; otherwise the simple documented one: each
    message as "role: content" on its own line, then "assistant:" (no space after it)."""

    def __init__(self, tokenizer_file: str | None):
        self.jinja = None
        self.special: dict[str, str] = {}
        config = Path(tokenizer_file).parent / "tokenizer_config.json" if tokenizer_file else None
        if config is not None and config.is_file():
            source = json.loads(config.read_text()).get("chat_template")
            if isinstance(source, str):
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                # As Hugging Face renders templates: sandboxed, loop controls, trimmed blocks,
                # and the names templates expect besides the messages.
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
                env.globals["raise_exception"] = _raise
                self.jinja = env.from_string(source)
                self.special = {k: v for k, v in json.loads(config.read_text()).items()
                                if k in ("bos_token", "eos_token") and isinstance(v, str)}

    @property
    def special_tokens(self) -> bool:
        """Whether the rendered prompt's special-token text should become special ids."""
        return self.jinja is not None

    def render(self, messages: list[dict[str, Any]]) -> str:
        if self.jinja is not None:
            return self.jinja.render(messages=messages, add_generation_prompt=True,
                                     tools=None, **self.special)
        return "".join(SIMPLE_TEMPLATE.format(role=m["role"], content=m["content"])
                       for m in messages) + "assistant:"
