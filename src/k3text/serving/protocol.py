"""The OpenAI wire format: request bodies checked field by field into a prompt and
`SamplingParams`, and the response, stream-chunk and error objects.

Every check names its field (`RequestError.param`), so a client sees which value is wrong. What
the server cannot do (best_of, tools, structured output, ...: the fields of `UNSUPPORTED`) is
refused when it is asked for, never silently ignored. A field that
nothing here reads at all (a misspelt `max_token`, another server's extension) is accepted, as
vLLM accepts it, and named in `Parsed.ignored`, which the server logs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from k3text.config import Config
from k3text.inference.engine import MAX_STOP_IDS
from k3text.inference.pages import pool_size
from k3text.inference.sampling import MAX_LOGIT_BIAS, PromptScores
from k3text.serving.scheduler import Delta, Finished, SamplingParams
from k3text.serving.text import ChatTemplate, token_text
from k3text.tokenizer import Tokenizer

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 1000  # each stop string is searched for in the text after every decode call


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.status)


def error_body(message: str, kind: str, param: str | None = None,
               status: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _absent_or(*neutral: Any) -> Callable[[Any], bool]:
    """A test that a field's value asks for nothing: null, or one of `neutral` (same type:
    JSON true is not 1)."""
    return lambda v: v is None or any(type(v) is type(n) and v == n for n in neutral)


# OpenAI and vLLM request fields this server does not implement, each with the test that its
# value asks for nothing (then it is accepted); any other value is a 400 naming the field. Fields
# that cannot change the output are accepted (`NO_EFFECT`).
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": _absent_or(1),
    "skip_special_tokens": _absent_or(True),  # special ids never have text here
    "use_beam_search": _absent_or(False),
    "allowed_token_ids": _absent_or(),
    "bad_words": _absent_or([]),
    "truncate_prompt_tokens": _absent_or(),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "structured_outputs": _absent_or(),
    "guided_json": _absent_or(),
    "guided_regex": _absent_or(),
    "guided_choice": _absent_or(),
    "guided_grammar": _absent_or(),
    "logits_processors": _absent_or(),
    "prompt_embeds": _absent_or(),
    "vllm_xargs": _absent_or({}),
    "reasoning_effort": _absent_or(),  # OpenAI's reasoning models; this model has no such mode
    "verbosity": _absent_or(),
    "web_search_options": _absent_or(),
}
UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {
    "suffix": _absent_or(""),
    "add_special_tokens": _absent_or(True),  # vLLM's default for completions: bos as configured
}
UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "echo": _absent_or(False),
    "add_special_tokens": _absent_or(False),  # the template places any special tokens
    "tools": _absent_or([]),
    "tool_choice": _absent_or("none", "auto"),
    "functions": _absent_or([]),
    "function_call": _absent_or("none", "auto"),
    "chat_template": _absent_or(),
    "chat_template_kwargs": _absent_or({}),
    "continue_final_message": _absent_or(False),
    "add_generation_prompt": _absent_or(True),
    "documents": _absent_or(),
    "modalities": _absent_or(["text"]),
    "audio": _absent_or(),
    "prediction": _absent_or(),
}


# Fields OpenAI's clients send that cannot change the output: accepted without a word.
# (`length_penalty` weighs beams, and beam search is refused.)
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                       "prompt_cache_key", "safety_identifier", "length_penalty"})


class _Read(dict):
    """A request body that remembers which of its fields were looked at (`get`, `[]`, `in`),
    so that a field nothing reads, a misspelt `max_token` say, can be reported instead of being
    dropped without a trace."""

    def __init__(self, body: dict):
        super().__init__(body)
        self.looked_at: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.looked_at.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.looked_at.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.looked_at.add(key)
        return super().__contains__(key)

    def unread(self) -> tuple[str, ...]:
        return tuple(sorted(k for k in self if k not in self.looked_at and k not in NO_EFFECT))


def _refuse_unsupported(body: dict, fields: dict[str, Callable[[Any], bool]]) -> None:
    for name, asks_nothing in fields.items():
        if name in body and not asks_nothing(body[name]):
            raise RequestError(f"'{name}' = {_short(body[name])} is not supported by this "
                               f"server", name)


@dataclasses.dataclass
class Parsed:
    """A checked request: one prompt, or (completions) a batch of them, each with its sampling
    (its own `max_tokens` default: the room its length leaves), and `n` choices of each."""

    prompts: list[list[int]]
    prompt_params: list[SamplingParams]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool
    tokens_as_ids: bool = False  # `return_tokens_as_token_ids`: log-probabilities name ids
    n: int = 1  # choices per prompt: each a request of its own (`choices`)
    prompt_logprobs: int | None = None  # as asked (`prompt_logprobs` in the response)
    echo: bool = False  # completions: the prompt before the output (text and logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token run, unsent)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    ignored: tuple[str, ...] = ()  # fields the request gave that nothing here reads (sorted)

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt's ids (a chat request's, or a completion's of one prompt)."""
        return self.prompts[0]

    @property
    def params(self) -> SamplingParams:
        """The first prompt's sampling."""
        return self.prompt_params[0]

    def choices(self) -> list[tuple[int, list[int], SamplingParams]]:
        """Every choice as (prompt index, prompt ids, sampling), in the response's `index`
        order: prompt i's choice j at i * n + j, as vLLM numbers them. Choice j is seeded with
        the request's seed (when given) plus j, as vLLM seeds the choices of `n`, so each is its
        prompt sent alone with that seed."""
        out = []
        for i, (ids, params) in enumerate(zip(self.prompts, self.prompt_params, strict=True)):
            for j in range(self.n):
                seeded = params if params.seed is None or j == 0 else \
                    dataclasses.replace(params, seed=params.seed + j)
                out.append((i, ids, seeded))
        return out


# ---- field checks -----------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(body: dict, name: str, default: Any, lo: int | None = None,
         hi: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {_type_name(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], "
                           f"got {value}", name)
    return value


def _float(body: dict, name: str, default: float, lo: float, hi: float,
           open_low: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        raise RequestError(f"'{name}' must be a finite number, got {_short(value)}", name)
    if value < lo or value > hi or (open_low and value == lo):
        side = "(" if open_low else "["
        raise RequestError(f"'{name}' must be in {side}{lo}, {hi}], got {value}", name)
    return float(value)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond float range
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean, got {_type_name(value)}", name)
    return value


def _check_ids(ids: list[Any], name: str, vocab: int,
               expected: str = "a string or a list of token ids") -> list[int]:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"'{name}' must be {expected}; item {i} is {_type_name(t)}", name)
        if not 0 <= t < vocab:
            raise RequestError(f"'{name}' item {i} = {t} is outside the vocabulary "
                               f"[0, {vocab})", name)
    return list(ids)


# The fields whose check depends on the prompt (its ids, its length, the room it leaves).
_PER_PROMPT = ("prompt", "max_tokens", "max_completion_tokens", "min_tokens")


@contextlib.contextmanager
def _batch_item(index: int, size: int) -> Iterator[None]:
    """A `RequestError` raised inside about the prompt (`_PER_PROMPT`) names prompt `index` of
    a batch of `size` prompts; one about a field of the whole request names none."""
    try:
        yield
    except RequestError as e:
        if size == 1 or e.param not in _PER_PROMPT:
            raise
        raise RequestError(f"prompt {index} of the batch: {e.message}", e.param, e.status,
                           e.kind) from None


@functools.cache
def _special_pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """Any of `tokens`, longest first (as tiktoken matches them)."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


class Protocol:
    """Request checking and response building for one served model."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer | None, model_name: str,
                 chat_template: ChatTemplate):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.template = chat_template
        # The most positions (prompt + max_tokens) one request may take, and what holds them.
        self.max_positions = cfg.max_target_length
        self.cache_text = f"the cache of max_target_length={cfg.max_target_length} tokens"
        if cfg.serve_engine == "paged":
            pages, page = pool_size(cfg)
            alone = (pages - 1) * page + 1  # its last token is never cached
            if alone < self.max_positions:
                self.max_positions = alone
                self.cache_text = (f"the page pool's {alone} tokens (pagedattn_num_pages={pages}"
                                   f" of pagedattn_tokens_per_page={page}, one the null page)")

    # ---- requests -------------------------------------------------------------------------

    def _encode(self, text: str, name: str) -> list[int]:
        """`text` as ordinary text (a special token's text is not its id), bos first when the
        config adds one."""
        ids = self._encode_text(text, name)
        if self.cfg.add_bos:
            bos = self.tokenizer.bos_id if self.tokenizer.bos_id is not None \
                else self.cfg.bos_token_id
            ids = [bos, *ids]
        return ids

    def _encode_text(self, text: str, name: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"'{name}' is text but the server has no tokenizer "
                               f"(tokenizer_type: none); send token ids", name)
        try:
            return self.tokenizer.encode(text)
        except UnicodeError as e:  # a lone surrogate (JSON "\ud800") is not encodable text
            raise RequestError(f"'{name}' is not valid Unicode text ({e.reason})", name) from None

    def _encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The rendered conversation's ids. A Jinja template's markup may hold special tokens
        (its own bos, role markers), which become their ids; the messages' text never does, so
        a user cannot forge a turn. The simple template is all ordinary text."""
        try:
            rendered = self.template.render(messages)
            spans = self.template.content_spans(messages, rendered) \
                if self.template.special_tokens else None
        except Exception as e:  # the template's own checks (raise_exception) and its errors
            raise RequestError(f"the chat template cannot render these messages: {e}",
                               "messages") from None
        if not self.template.special_tokens:
            return self._encode(rendered, "messages")
        if self.tokenizer is None:
            self._encode_text(rendered, "messages")  # the error that says so
        specials = self.tokenizer.special_tokens
        for i, m in enumerate(messages):  # a name is written as the template's own text
            if any(token in m.get("name", "") for token in specials):
                raise RequestError(f"messages[{i}].name holds the text of a special token",
                                   "messages")
        markup = [(m.start(), m.end()) for m in _special_pattern(tuple(specials)).finditer(
            rendered)] if specials else []
        if spans is None:  # the template rewrites message text: only its own markup may match
            for i, m in enumerate(messages):
                if any(token in m["content"] for token in specials):
                    raise RequestError(
                        f"messages[{i}].content holds the text of a special token, which this "
                        f"chat template would turn into a control token", "messages")
        else:
            markup = [(a, b) for a, b in markup
                      if not any(a < end and start < b for start, end in spans)]
        ids, at = [], 0
        for a, b in markup:
            ids += self._encode_text(rendered[at:a], "messages")
            ids.append(specials[rendered[a:b]])
            at = b
        return ids + self._encode_text(rendered[at:], "messages")

    def _body(self, body: Any, model_required: bool = True) -> _Read:
        """A request's JSON object, recording the fields read from it, whose `model` is this
        server's (optional for `/tokenize` and `/detokenize`, as in vLLM)."""
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got "
                               f"{_type_name(body)}")
        body = _Read(body)
        model = body.get("model")
        if model is None:
            if model_required:
                raise RequestError("'model' is required", "model")
        elif not isinstance(model, str):
            raise RequestError(f"'model' must be a string, got {_type_name(model)}", "model")
        elif model != self.model_name:
            raise self.unknown_model(model)
        return body

    def _common(self, body: Any) -> _Read:
        """The checks every generation request gets; the body, recording the fields read."""
        body = self._body(body)
        _refuse_unsupported(body, UNSUPPORTED)
        return body

    def unknown_model(self, model: str) -> RequestError:
        """The 404 for a model this server does not serve (OpenAI's status for it)."""
        return RequestError(f"model '{model}' does not exist; this server serves "
                            f"'{self.model_name}'", "model", status=404, kind="model_not_found")

    def _sampling(self, body: dict, prompt_len: int, logprobs: int | None,
                  prompt_name: str, echo: bool = False) -> SamplingParams:
        """The sampling of one prompt of `prompt_len` tokens; with `echo`, `max_tokens` 0 (the
        prompt alone) runs one token, which the response leaves out."""
        cfg = self.cfg
        room = self.max_positions - prompt_len
        # max_completion_tokens is the newer name; a null one leaves max_tokens in force.
        given = {n: _int(body, n, None, 0 if echo else 1)
                 for n in ("max_completion_tokens", "max_tokens")}
        name = next((n for n, v in given.items() if v is not None), None)
        if name is None:
            if room < 1:
                raise RequestError(f"'{prompt_name}' ({prompt_len} tokens) leaves no room in "
                                   f"{self.cache_text}", prompt_name)
            max_tokens = min(cfg.serve_default_max_tokens, room)
        else:
            max_tokens = max(given[name], 1)
        if prompt_len + max_tokens > self.max_positions:
            raise RequestError(f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) exceeds "
                               f"{self.cache_text}" if given.get(name) != 0 else
                               f"prompt ({prompt_len} tokens) leaves no room in "
                               f"{self.cache_text} for the one token echo with {name} 0 runs "
                               f"after it", name)
        top_k = _int(body, "top_k", 0, -1, cfg.vocab_size)
        seed = _int(body, "seed", None, -(2**63), 2**64 - 1)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise RequestError("'stop' must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise RequestError(f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings of "
                               f"at most {MAX_STOP_CHARS} characters", "stop")
        stop_ids = body.get("stop_token_ids")
        stop_ids = [] if stop_ids is None else stop_ids
        if not isinstance(stop_ids, list):
            raise RequestError("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        stop_ids = _check_ids(stop_ids, "stop_token_ids", cfg.vocab_size, "a list of token ids")
        ignore_eos = _bool(body, "ignore_eos", False)
        eos = set() if ignore_eos or cfg.ignore_eos else {cfg.eos_token_id}
        if len(set(stop_ids) | eos) > MAX_STOP_IDS:
            raise RequestError(f"'stop_token_ids' takes at most {MAX_STOP_IDS - len(eos)} "
                               f"distinct ids besides eos" if eos else
                               f"'stop_token_ids' takes at most {MAX_STOP_IDS} distinct ids",
                               "stop_token_ids")
        if stop and self.tokenizer is None:
            raise RequestError("'stop' strings need a tokenizer; use stop_token_ids", "stop")
        min_tokens = _int(body, "min_tokens", 0, 0)
        if min_tokens > max_tokens or (min_tokens and name and given[name] == 0):
            raise RequestError(f"'min_tokens' ({min_tokens}) exceeds {name or 'max_tokens'} "
                               f"({given[name] if name else max_tokens})", "min_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
            top_k=max(top_k, 0), top_p=_float(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
            min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
            presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, math.inf,
                                      open_low=True),
            seed=seed, stop=tuple(stop),
            stop_token_ids=tuple(stop_ids), logprobs=logprobs, ignore_eos=ignore_eos,
            min_tokens=min_tokens, logit_bias=self._logit_bias(body),
            include_stop_str=_bool(body, "include_stop_str_in_output", False),
            prompt_logprobs=self._prompt_scores(body, logprobs if echo else None))

    def _prompt_scores(self, body: dict, echoed: int | None) -> int | None:
        """vLLM's `prompt_logprobs` (each prompt token's log-probability and rank, and the top
        N at its place); `echoed`: the `logprobs` an echoed prompt shows, which need them too."""
        asked = _int(body, "prompt_logprobs", None, 0, self.cfg.serve_max_logprobs)
        if asked is not None and _bool(body, "stream", False):
            if asked:  # no streamed chunk carries them (vLLM refuses them too)
                raise RequestError("'prompt_logprobs' is not available with stream=true",
                                   "prompt_logprobs")
            asked = None  # 0, as vLLM takes it: nothing to score
        return asked if echoed is None else echoed if asked is None else max(asked, echoed)

    def _logit_bias(self, body: dict) -> tuple[tuple[int, float], ...]:
        """`logit_bias`: {token id (as a JSON key, a string): bias in [-100, 100]}."""
        bias = body.get("logit_bias")
        if bias is None:
            return ()
        if not isinstance(bias, dict):
            raise RequestError(f"'logit_bias' must be an object mapping token ids to biases, "
                               f"got {_type_name(bias)}", "logit_bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"'logit_bias' holds {len(bias)} entries, more than "
                               f"{MAX_LOGIT_BIAS}", "logit_bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            if not re.fullmatch(r"-?[0-9]{1,12}", key):
                raise RequestError(f"'logit_bias' key {_short(key)} is not a token id",
                                   "logit_bias")
            token = int(key)
            if not 0 <= token < self.cfg.vocab_size:
                raise RequestError(f"'logit_bias' token {token} is outside the vocabulary "
                                   f"[0, {self.cfg.vocab_size})", "logit_bias")
            if token in out:
                raise RequestError(f"'logit_bias' names token {token} twice", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not _finite(value) or not -100 <= value <= 100:
                raise RequestError(f"'logit_bias' of token {token} must be a number in "
                                   f"[-100, 100], got {_short(value)}", "logit_bias")
            out[token] = float(value)
        return tuple(out.items())

    def _check_prompt(self, ids: list[int], name: str) -> list[int]:
        if not ids:
            raise RequestError(f"'{name}' is empty", name)
        limit = self.cfg.max_prefill_predict_length
        if len(ids) > limit:
            raise RequestError(f"'{name}' has {len(ids)} tokens, more than "
                               f"max_prefill_predict_length={limit}", name)
        return ids

    def _stream_options(self, body: dict, stream: bool) -> tuple[bool, tuple[str, ...]]:
        """`include_usage`, and the option names nothing reads (as ``stream_options.name``)."""
        options = body.get("stream_options")
        if options is None:
            return False, ()
        if not isinstance(options, dict):
            raise RequestError("'stream_options' must be an object", "stream_options")
        if not stream:
            raise RequestError("'stream_options' needs stream=true", "stream_options")
        options = _Read(options)
        for name in ("continuous_usage_stats",):  # vLLM's: usage in every chunk
            if _bool(options, name, False):
                raise RequestError(f"'stream_options.{name}' is not supported",
                                   "stream_options")
        include_usage = _bool(options, "include_usage", False)
        return include_usage, tuple(f"stream_options.{k}" for k in options.unread())

    def _parsed(self, body: _Read, prompts: list[list[int]], params: list[SamplingParams],
                stream: bool, chat: bool) -> Parsed:
        include_usage, unread_options = self._stream_options(body, stream)
        # Each choice waits in the queue as a request of its own, so all must fit it at once.
        n = _int(body, "n", 1, 1)
        queue = self.cfg.max_queued_requests
        if n * len(prompts) > queue:
            raise RequestError(f"'n' = {n} choices do not fit the queue of "
                               f"max_queued_requests={queue}" if len(prompts) == 1 else
                               f"{len(prompts)} prompts x n = {n} choices do not fit the queue "
                               f"of max_queued_requests={queue}",
                               "n" if len(prompts) == 1 else "prompt")
        return Parsed(prompts, params, stream, include_usage,
                      _bool(body, "return_token_ids", False), chat=chat,
                      tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False), n=n,
                      prompt_logprobs=body.get("prompt_logprobs"),
                      ignored=body.unread() + unread_options)

    def completion(self, body: Any) -> Parsed:
        body = self._common(body)
        _refuse_unsupported(body, UNSUPPORTED_COMPLETION)
        prompts = self._completion_prompts(body)
        logprobs = _int(body, "logprobs", None, 0, self.cfg.serve_max_logprobs)
        echo = _bool(body, "echo", False)
        params = []
        for i, ids in enumerate(prompts):
            with _batch_item(i, len(prompts)):
                self._check_prompt(ids, "prompt")
                params.append(self._sampling(body, len(ids), logprobs, "prompt", echo))
        stream = _bool(body, "stream", False)
        parsed = self._parsed(body, prompts, params, stream, chat=False)
        parsed.echo = echo
        limit = next((v for v in (body.get("max_completion_tokens"), body.get("max_tokens"))
                      if v is not None), None)
        parsed.echo_only = echo and limit == 0
        return parsed

    def _completion_prompts(self, body: _Read) -> list[list[int]]:
        """A completions request's prompts' ids (bos first for text when the config adds one):
        a string, a list of token ids, or a batch (a list) of either."""
        prompt = body.get("prompt")
        batch = isinstance(prompt, list) and [isinstance(p, list | str) for p in prompt]
        if batch and any(batch) and not all(batch):  # the odd item is of the fewer kind
            if 2 * sum(batch) >= len(batch):
                odd = batch.index(False)
                raise RequestError(f"'prompt' is a batch of strings or token-id lists; item "
                                   f"{odd} is {_type_name(prompt[odd])}", "prompt")
            odd = batch.index(True)
            raise RequestError(f"'prompt' is a list of token ids; item {odd} is "
                               f"{_type_name(prompt[odd])}", "prompt")
        if batch and all(batch):
            batch = []
            for i, item in enumerate(prompt):
                with _batch_item(i, len(prompt)):
                    batch.append(self._one_prompt(item))
            return batch
        return [self._one_prompt(prompt)]

    def _one_prompt(self, prompt: Any) -> list[int]:
        if prompt == "":  # refused before bos is put in front of it
            raise RequestError("'prompt' is empty", "prompt")
        if isinstance(prompt, str):
            return self._encode(prompt, "prompt")
        if isinstance(prompt, list):
            return _check_ids(prompt, "prompt", self.cfg.vocab_size)
        if prompt is None:
            raise RequestError("'prompt' is required", "prompt")
        raise RequestError(f"'prompt' must be a string, a list of token ids or a batch (a list) "
                           f"of either, got {_type_name(prompt)}", "prompt")

    def chat(self, body: Any) -> Parsed:
        body = self._common(body)
        _refuse_unsupported(body, UNSUPPORTED_CHAT)
        ids = self._check_prompt(self._chat_prompt(body), "messages")
        want = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, 0, self.cfg.serve_max_logprobs)
        if top is not None and not want:
            raise RequestError("'top_logprobs' needs logprobs=true", "top_logprobs")
        stream = _bool(body, "stream", False)
        return self._parsed(body, [ids], [self._sampling(
            body, len(ids), (top or 0) if want else None, "messages")], stream, chat=True)

    def _chat_prompt(self, body: _Read) -> list[int]:
        """A chat request's `messages`, checked and rendered by the chat template, as ids."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list", "messages")
        checked = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'",
                                   "messages")
            if m["role"] not in ("system", "user", "assistant", "developer", "tool"):
                raise RequestError(f"messages[{i}].role '{m['role']}' is not one of system, "
                                   f"user, assistant, developer, tool", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text ones, one per line
                if not all(isinstance(p, dict) and p.get("type") == "text"
                           and isinstance(p.get("text"), str) for p in content):
                    raise RequestError(f"messages[{i}].content parts must be text parts",
                                       "messages")
                content = "\n".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be a string", "messages")
            message = {"role": m["role"], "content": content}
            if m.get("name") is not None:  # a participant's name: the template shows it
                if not isinstance(m["name"], str) or not m["name"]:
                    raise RequestError(f"messages[{i}].name must be a non-empty string",
                                       "messages")
                message["name"] = m["name"]
            checked.append(message)
        return self._encode_chat(checked)

    def tokenize(self, body: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
        """vLLM's `/tokenize`: the prompt ids a completions request (`prompt`) or a chat
        request (`messages`) would run, past `max_prefill_predict_length` too, so a client can
        tell that a prompt is too long before sending it; with `return_token_strs` each id's
        text. The fields the generation endpoints refuse are refused here too. Returns the
        response (`max_model_len` added by the caller) and the fields nothing read."""
        body = self._body(body, model_required=False)
        chat = "messages" in body
        _refuse_unsupported(body, UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETION)
        if chat:
            ids = self._chat_prompt(body)
        else:
            batch = self._completion_prompts(body)
            if len(batch) > 1:
                raise RequestError("'prompt' is a batch; /tokenize takes one prompt", "prompt")
            ids = batch[0]
        out: dict[str, Any] = {"count": len(ids), "tokens": ids}
        if _bool(body, "return_token_strs", False):
            out["token_strs"] = [self._text(t) for t in ids]
        return out, body.unread()

    def detokenize(self, body: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
        """vLLM's `/detokenize`: the text of `tokens`, as the generation endpoints' text has
        it (special ids such as bos, and padding ids past the tokenizer's vocabulary, have
        none). Returns the response and the fields nothing read."""
        body = self._body(body, model_required=False)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise RequestError(f"'tokens' must be a list of token ids, got "
                               f"{_type_name(tokens)}", "tokens")
        ids = _check_ids(tokens, "tokens", self.cfg.vocab_size, "a list of token ids")
        if self.tokenizer is None:
            raise RequestError("the server has no tokenizer (tokenizer_type: none)", "tokens")
        text = self.tokenizer.decode([t for t in ids if t < self.tokenizer.vocab_size])
        return {"prompt": text}, body.unread()

    # ---- responses ------------------------------------------------------------------------

    def new_id(self, chat: bool) -> str:
        return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def _text(self, token: int) -> str:
        return token_text(self.tokenizer, token)

    def _bytes(self, token: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token)) if self.tokenizer is not None and \
            token < self.tokenizer.vocab_size else []

    def text_length(self, parsed: Parsed, delta: Delta | None, index: int = 0,
                    first: bool = False) -> int:
        """Characters a stream chunk of choice `index` (`delta`'s tokens, and on its `first`
        chunk an echoed prompt's) adds to the completions log-probabilities' `text_offset`
        (each token's own text, as `tokens` lists it)."""
        ids = [] if delta is None or parsed.echo_only else delta.ids
        if first and parsed.echo:
            ids = [*parsed.prompts[index // parsed.n], *ids]
        return sum(len(self._text(t)) for t in ids)

    def _echo_text(self, ids: list[int]) -> str:
        """An echoed prompt's text (special ids have none)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t for t in ids if t < self.tokenizer.vocab_size])

    def _logprobs(self, deltas: list[Delta], parsed: Parsed, offset: int = 0,
                  echoed: tuple[list[int], PromptScores] | None = None,
                  ) -> dict[str, Any] | None:
        """The choice's `logprobs` for `deltas`; `offset`: the characters before them (a
        stream's earlier chunks); `echoed`: an echoed prompt's ids and scores, which come
        first (its first token has no log-probability, as in OpenAI's). Tokens are named by
        their text, or with `return_tokens_as_token_ids` (vLLM's) as "token_id:N", which tells
        apart ids whose text is the same (special ids, bytes that end inside a character)."""
        n_top = parsed.params.logprobs
        if n_top is None or (not deltas and echoed is None):
            return None
        ids = [t for d in deltas for t in d.ids]
        lps: list[float | None] = [x for d in deltas for x in d.logprobs]
        tops: list[list[tuple[int, float]] | None] = [t for d in deltas for t in d.top]
        if echoed is not None:
            prompt, scores = echoed
            ids = [*prompt, *ids]
            lps = [None, *scores.logprobs.tolist(), *lps]
            tops = [None, *(list(zip(t[:n_top], b[:n_top], strict=True)) for t, b in zip(
                scores.top_ids.tolist(), scores.top_logprobs.tolist(), strict=True)), *tops]
        name = (lambda t: f"token_id:{t}") if parsed.tokens_as_ids else self._text
        if parsed.chat:
            return {"content": [
                {"token": name(t), "logprob": lp, "bytes": self._bytes(t),
                 "top_logprobs": [{"token": name(a), "logprob": b, "bytes": self._bytes(a)}
                                  for a, b in top]}
                for t, lp, top in zip(ids, lps, tops, strict=True)]}
        offsets = []
        for t in ids:
            offsets.append(offset)
            offset += len(self._text(t))

        def top_entries(top: list[tuple[int, float]] | None, chosen: int, lp: float | None,
                        ) -> dict | None:
            # Most likely first, so where two ids share a name the likelier one's value stays;
            # then the chosen token, as OpenAI's completions list it (N + 1 entries at most).
            if top is None:  # an echoed prompt's first token
                return None
            entries: dict[str, float] = {}
            for a, b in [*top, (chosen, lp)]:
                entries.setdefault(name(a), b)
            return entries

        return {"tokens": [name(t) for t in ids], "token_logprobs": lps,
                "top_logprobs": [top_entries(top, t, lp)
                                 for t, lp, top in zip(ids, lps, tops, strict=True)],
                "text_offset": offsets}

    def _prompt_logprobs(self, ids: list[int], scores: PromptScores, n_top: int,
                         ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (none for the first) its id and the top
        `n_top` ids at its place, each with its log-probability, rank and text."""
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for token, lp, rank, top_ids, top_lps in zip(
                ids[1:], scores.logprobs.tolist(), scores.ranks.tolist(),
                scores.top_ids.tolist(), scores.top_logprobs.tolist(), strict=True):
            entries = {str(token): {"logprob": lp, "rank": rank,
                                    "decoded_token": self._text(token)}}
            for r, (t, b) in enumerate(zip(top_ids[:n_top], top_lps[:n_top], strict=True),
                                       start=1):
                entries.setdefault(str(t), {"logprob": b, "rank": r,
                                            "decoded_token": self._text(t)})
            out.append(entries)
        return out

    def usage(self, parsed: Parsed, finished: list[Finished]) -> dict[str, int]:
        """Usage of a request's choices: each prompt once, every choice's tokens (none for an
        echoed prompt alone, whose one token run is not sent)."""
        prompt = sum(len(ids) for ids in parsed.prompts)
        completion = 0 if parsed.echo_only else sum(f.completion_tokens for f in finished)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def response(self, rid: str, parsed: Parsed, choices: list[tuple[list[Delta], Finished]],
                 ) -> dict[str, Any]:
        """The whole response; `choices`: each choice's deltas and finish, in index order.
        With `return_token_ids`, a completion choice holds its prompt's ids
        (`prompt_token_ids`, as vLLM places them: a batch's prompts differ), a chat response
        holds them once; `prompt_logprobs` likewise. With `echo` the prompt comes first in a
        choice's text and log-probabilities; with `max_tokens` 0 it is all there is."""
        return_choices = []
        prompt_logprobs = None
        for index, (deltas, finished) in enumerate(choices):
            prompt = parsed.prompts[index // parsed.n]
            scores = deltas[0].prompt if deltas else None
            out = [] if parsed.echo_only else deltas
            text = "".join(d.text for d in out)
            if parsed.echo:
                text = self._echo_text(prompt) + text
            choice: dict[str, Any] = {
                "index": index, "finish_reason": "length" if parsed.echo_only
                else finished.reason,
                "stop_reason": None if parsed.echo_only else finished.stop_reason,
                "logprobs": self._logprobs(out, parsed,
                                           echoed=(prompt, scores) if parsed.echo else None)}
            if parsed.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if parsed.prompt_logprobs is not None:
                prompt_logprobs = self._prompt_logprobs(prompt, scores, parsed.prompt_logprobs)
                if not parsed.chat:
                    choice["prompt_logprobs"] = prompt_logprobs
            if parsed.return_token_ids:
                if not parsed.chat:
                    choice["prompt_token_ids"] = prompt
                choice["token_ids"] = [t for d in out for t in d.ids]
            return_choices.append(choice)
        body = {"id": rid, "object": "chat.completion" if parsed.chat else "text_completion",
                "created": parsed.created, "model": self.model_name, "choices": return_choices,
                "usage": self.usage(parsed, [f for _, f in choices])}
        if parsed.chat and parsed.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if parsed.return_token_ids and parsed.chat:
            body["prompt_token_ids"] = parsed.prompt_ids
        return body

    def _chunk(self, rid: str, parsed: Parsed, choices: list[dict[str, Any]],
               usage: dict[str, int] | None = None) -> dict[str, Any]:
        body = {"id": rid, "object": "chat.completion.chunk" if parsed.chat
                else "text_completion", "created": parsed.created, "model": self.model_name,
                "choices": choices}
        if parsed.include_usage:  # null in every chunk but the last, as OpenAI sends it
            body["usage"] = usage
        return body

    def chunk(self, rid: str, parsed: Parsed, delta: Delta | None, finish: str | None,
              offset: int = 0, index: int = 0, first: bool = False,
              stop_reason: str | int | None = None) -> dict[str, Any]:
        """A stream chunk of choice `index`: `delta`'s tokens (`offset`: the characters that
        choice streamed before them), or its finish with no tokens. A completion choice's
        `first` chunk holds its prompt's ids with `return_token_ids` (vLLM's placement), and
        with `echo` the prompt's text and log-probabilities before its own."""
        out = [delta] if delta is not None and not parsed.echo_only else []
        echoed = first and parsed.echo
        prompt = parsed.prompts[index // parsed.n]
        if finish is not None and parsed.echo_only:
            finish, stop_reason = "length", None  # the prompt alone: what ran after is unsent
        choice: dict[str, Any] = {
            "index": index, "finish_reason": finish, "stop_reason": stop_reason,
            "logprobs": self._logprobs(out, parsed, offset, echoed=(
                prompt, delta.prompt if delta else None) if echoed else None)}
        text = "".join(d.text for d in out)
        if echoed:
            text = self._echo_text(prompt) + text
        if parsed.chat:
            choice["delta"] = {"content": text} if delta else {}
        else:
            choice["text"] = text
        if parsed.return_token_ids:
            if first and not parsed.chat:
                choice["prompt_token_ids"] = prompt
            choice["token_ids"] = [t for d in out for t in d.ids]
        return self._chunk(rid, parsed, [choice])

    def role_chunk(self, rid: str, parsed: Parsed, index: int = 0) -> dict[str, Any]:
        """A chat stream's first chunk of choice `index`: the assistant's role, before any
        token (and with `return_token_ids` the prompt's ids, as vLLM's first chunk has them)."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None, "stop_reason": None}
        body = self._chunk(rid, parsed, [choice])
        if parsed.return_token_ids:
            body["prompt_token_ids"] = parsed.prompt_ids
        return body

    def usage_chunk(self, rid: str, parsed: Parsed, finished: list[Finished]
                    ) -> dict[str, Any]:
        return self._chunk(rid, parsed, [], self.usage(parsed, finished))
