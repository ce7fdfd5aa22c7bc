"""Text out of tokens for a request being served: incremental detokenization with stop strings,
and the chat template.

Byte-level BPE tokens can end inside a UTF-8 character. `TextStream` feeds each token's bytes to
an incremental UTF-8 decoder, which holds an incomplete character back until its last byte comes
and turns bytes that can never be valid into U+FFFD at once; text that may still be the start of
a stop string is held back too, so a stream never sends text it later has to take back. A stop
string ends the request and the returned text stops before it (or, with `include_stop`, right
after it); one completed by one of the first `min_tokens` tokens does not count (as in vLLM).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3text.config import ConfigError
from k3text.tokenizer import Tokenizer


class TextStream:
    """The text of one request's generated tokens, released piece by piece.

    The work per token is its own bytes and a search of the few characters a stop string
    ending in them can cover, whatever the output's length or contents; the text equals the
    tokenizer's decode of all the tokens (bytes that are not valid UTF-8 become U+FFFD) cut at
    the first stop string.
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = (),
                 min_tokens: int = 0, include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.stopped = False  # a stop string was found; `text` ends before it
        self.stopped_by: str | None = None  # which one
        self.kept = 0  # how many tokens of the last `add` were kept
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # The text, as the pieces already released and the rest. No stop string can begin in
        # the released text (`_held_back` keeps any tail that may begin one), so the search
        # for one and the text's growth touch only the rest, which stays short.
        self._sent: list[str] = []
        self._rest = ""

    @property
    def text(self) -> str:
        return "".join(self._sent) + self._rest

    def _bytes(self, token: int) -> bytes:
        if self.tokenizer is None or token >= self.tokenizer.vocab_size:
            return b""
        return self.tokenizer.token_bytes(token)

    def _extend(self, piece: str) -> None:
        """Append `piece` to the text and stop at the first stop string it completes (none
        while the tokens number `min_tokens` or fewer)."""
        searched = len(self._rest)
        self._rest += piece
        if len(self.ids) <= self.min_tokens:
            return
        hits = [(at, len(stop), stop) for stop in self.stop
                if (at := self._rest.find(stop, max(0, searched - len(stop) + 1))) >= 0]
        if hits:
            at, length, self.stopped_by = min(hits)  # the stop string that begins first
            self._rest = self._rest[:at + length if self.include_stop else at]
            self.stopped = True

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; returns the text that is now safe to send. `final` releases the rest.
        When a stop string turns up, only the tokens up to the one completing it are kept:
        `kept` says how many of `ids` that is (all of them otherwise)."""
        self.kept = 0
        if self.stopped:
            return ""
        for token in ids:
            self.ids.append(token)
            self.kept += 1
            self._extend(self._utf8.decode(self._bytes(token)))
            if self.stopped:
                break
        if final and not self.stopped:
            self._extend(self._utf8.decode(b"", final=True))  # an unfinished character
        ready = len(self._rest)
        if not (self.stopped or final):
            ready -= _held_back(self._rest, self.stop)
        piece, self._rest = self._rest[:ready], self._rest[ready:]
        if piece:
            self._sent.append(piece)
        return piece


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` not yet safe to send: the longest tail that begins some
    stop string."""
    for n in range(min(max(map(len, stops), default=1) - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-n:]) for stop in stops):
            return n
    return 0


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
        if config is None or not config.is_file():
            return
        try:
            settings = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
            raise ConfigError(f"{config}: cannot be read as JSON ({e})") from None
        if not isinstance(settings, dict):
            raise ConfigError(f"{config}: expected a JSON object, got {type(settings).__name__}")
        source = settings.get("chat_template")
        if not isinstance(source, str):
            return
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # As Hugging Face renders templates: sandboxed, loop controls, trimmed blocks, and the
        # names templates expect besides the messages.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        try:
            self.jinja = env.from_string(source)
        except TemplateError as e:
            raise ConfigError(f"{config}: chat_template is not a valid Jinja template "
                              f"({e})") from None
        # A token is a string, or Hugging Face's AddedToken form {"content": ...}.
        special = {k: v.get("content") if isinstance(v, dict) else v
                   for k, v in settings.items() if k in ("bos_token", "eos_token")}
        self.special = {k: v for k, v in special.items() if isinstance(v, str)}

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
