"""Text out of tokens for a request being served: incremental detokenization with stop strings,
and the chat template.

Byte-level BPE tokens can end inside a UTF-8 character; `TextStream` holds back text while the
decoded tail is an incomplete character (U+FFFD) and, while it could still be the start of a
stop string, so a stream never sends text it later has to take back. A stop string ends the
request and the returned text stops before it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3text.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class TextStream:
    """The text of one request's generated tokens, released piece by piece.

    Decoding is incremental: the tokens up to the last whole character are fixed (their text
    cannot change), and each `add` decodes only the tokens after them, so the work per token
    does not grow with the output (both tokenizers are byte-level, so the text of a run of
    tokens after a whole character is exactly what those tokens add).
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already released
        self.text = ""
        self.stopped = False  # a stop string was found; `text` ends before it
        self.kept = 0  # how many tokens of the last `add` were kept
        self._fixed = 0  # tokens whose text is final
        self._fixed_text = ""  # their text, ending on a whole character
        self._searched = 0  # characters of the text searched for stop strings, for good

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t for t in ids if t < self.tokenizer.vocab_size])

    def _text_of(self, end: int) -> str:
        """The text of the first `end` tokens (at least the fixed ones)."""
        return self._fixed_text + self._decode(self.ids[self._fixed:end])

    def _fix(self, tail: str) -> None:
        """Fix the tokens up to the last one that ends a whole character, given `tail`, the text
        of the unfixed ones. A character spans at most 4 bytes, so that token is among the last
        4 (a tail still ending in U+FFFD after them holds invalid bytes: it stays unfixed)."""
        end = len(self.ids)
        while tail.endswith(_INCOMPLETE):
            end -= 1
            if end < max(self._fixed, len(self.ids) - 4):
                return
            tail = self._decode(self.ids[self._fixed:end])
        self._fixed_text += tail
        self._fixed = end

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
        tail = self._decode(self.ids[self._fixed:])
        text = self._fixed_text + tail
        if self._first_stop(text) is not None:
            for k in range(1, len(ids) + 1):  # the token that completes the stop string
                text = self._text_of(before + k)
                if (at := self._first_stop(text)) is not None:
                    break
            del self.ids[before + k:]
            text, self.stopped, self.kept = text[:at], True, k
        else:
            self._fix(tail)
            self._searched = len(self._fixed_text)
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
        """Where the first stop string starts in `text`, looking only where one can begin that
        earlier searches have not ruled out."""
        hits = [at for stop in self.stop
                if (at := text.find(stop, max(0, self._searched - len(stop) + 1))) >= 0]
        return min(hits) if hits else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` not yet safe to send: an incomplete UTF-8 character, and
    before it the longest tail that begins some stop string (which the character, once whole,
    may continue)."""
    whole = text.rstrip(_INCOMPLETE)
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(whole)), hold, -1):
            if stop.startswith(whole[-n:]):
                hold = n
                break
    return hold + len(text) - len(whole)


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


def _simple_line(message: dict[str, Any]) -> str:
    """One message in the simple template: "role: content", or "role (name): content"."""
    name = f" ({message['name']})" if "name" in message else ""
    return f"{message['role']}{name}: {message['content']}\n"


class ChatTemplate:
    """Messages -> prompt text. The tokenizer's own Jinja template when its directory has a
    `tokenizer_config.json` with a `chat_template`; otherwise the simple documented one: each
    message as "role: content" (or "role (name): content" when it names its participant) on its
    own line, then "assistant:" (no space after it)."""

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
                # A token is a string, or Hugging Face's AddedToken form {"content": ...}.
                self.special = {k: v.get("content") if isinstance(v, dict) else v
                                for k, v in json.loads(config.read_text()).items()
                                if k in ("bos_token", "eos_token")}
                self.special = {k: v for k, v in self.special.items() if isinstance(v, str)}

    @property
    def special_tokens(self) -> bool:
        """Whether the rendered prompt's special-token text should become special ids."""
        return self.jinja is not None

    def render(self, messages: list[dict[str, Any]]) -> str:
        if self.jinja is not None:
            return self.jinja.render(messages=messages, add_generation_prompt=True,
                                     tools=None, **self.special)
        return "".join(_simple_line(m) for m in messages) + "assistant:"

    def content_spans(self, messages: list[dict[str, Any]], rendered: str,
                      ) -> list[tuple[int, int]] | None:
        """Where the messages' own text lies in `rendered` (their render): [start, end) spans,
        found by rendering each content as a marker; None when the template does more with a
        content than write it out whole (trims it, splits it), so its text cannot be told from
        the template's."""
        markers = [{**m, "content": _MARKER.format(i)} for i, m in enumerate(messages)]
        pieces = _MARKERS.split(self.render(markers))
        spans, text = [], pieces[0]
        for index, after in zip(pieces[1::2], pieces[2::2], strict=True):
            if int(index) >= len(messages):  # the template's own text looks like a marker
                return None
            content = messages[int(index)]["content"]
            spans.append((len(text), len(text) + len(content)))
            text += content + after
        return spans if text == rendered else None


# A message's content while `content_spans` renders: private-use characters around its index.
_MARKER = "\ue000{}\ue001"
_MARKERS = re.compile("\ue000(\\d+)\ue001")
