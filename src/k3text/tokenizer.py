"""Tokenizers: a byte-level one for small models and tiktoken BPE files in Kimi's format.

A small byte-level BPE trainer is included so that a small model can ship a tokenizer of its own
in the same file format as Kimi's.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from itertools import pairwise
from operator import itemgetter
from pathlib import Path
from typing import Protocol, runtime_checkable

import regex
import tiktoken

from k3text.config import Config
from k3text.files import write_atomically

# Kimi K2's pre-tokenisation regex (tokenization_kimi.py). `&&` intersects character classes:
# letters and marks other than Han, which the first alternative takes as whole runs.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

DEFAULT_SPECIAL_TOKENS = ("[BOS]", "[EOS]", "[PAD]")
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_TYPES = ("byte", "tiktoken", "none")

# tiktoken's regex engine overflows its stack on long runs of whitespace, so Kimi's tokenizer
# encodes text in pieces cut at these lengths; cutting in the same places keeps ids identical.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")  # `\s` matches exactly the characters str.isspace() accepts


@runtime_checkable
class Tokenizer(Protocol):
    """What the model stack needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int | None: ...

    @property
    def special_tokens(self) -> Mapping[str, int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...


def _check_ids(ids: Sequence[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then <bos>, <eos>, <pad>: no file needed, any text encodes."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    special_tokens = {"<bos>": bos_id, "<eos>": eos_id, "<pad>": pad_id}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Special ids are dropped; bytes that are not valid UTF-8 become U+FFFD."""
        _check_ids(ids, self.vocab_size)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` stands for (none for a special id)."""
        _check_ids([token], self.vocab_size)
        return bytes([token]) if token < 256 else b""


class TiktokenTokenizer:
    """Byte-level BPE run by tiktoken, with special tokens numbered after the mergeable ranks.

    `vocab_size` spans the ranks and every special id. Ids between the ranks and the largest
    special id that name no token (Kimi reserves 256 slots) decode to nothing, as special ids do.
    """

    def __init__(
        self,
        ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int] | None = None,
        *,
        pat_str: str = KIMI_PAT_STR,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        name: str = "k3text",
    ) -> None:
        _check_ranks(ranks)
        self.special_tokens = dict(special_tokens or {})
        clashes = {t: i for t, i in self.special_tokens.items() if i < len(ranks)}
        if clashes:
            raise ValueError(f"special token ids {clashes} collide with the {len(ranks)} BPE ranks")
        self.num_ranks = len(ranks)
        self.vocab_size = max([len(ranks) - 1, *self.special_tokens.values()]) + 1
        _check_ids([i for i in (bos_id, eos_id, pad_id) if i is not None], self.vocab_size)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self._encoding = tiktoken.Encoding(
            name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=self.special_tokens
        )

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
        bos_token: str | None = "[BOS]",
        eos_token: str | None = "[EOS]",
        pad_token: str | None = "[PAD]",
        pat_str: str = KIMI_PAT_STR,
    ) -> TiktokenTokenizer:
        """Load a tiktoken BPE file such as Kimi's `tiktoken.model`.

        Special tokens come from the "added_tokens_decoder" of a `tokenizer_config.json` beside
        the file when it has one; otherwise `special_tokens` are numbered after the ranks. The
        bos/eos/pad ids are those of the named tokens; pass None for a role with no token.
        """
        path = Path(path)
        if path.is_dir():
            raise FileNotFoundError(f"tiktoken BPE file {path} is a directory; give the file")
        if not path.is_file():
            raise FileNotFoundError(f"tiktoken BPE file not found: {path}")
        ranks = read_tiktoken_bpe(path)
        if not ranks:
            raise ValueError(f"tiktoken BPE file {path} is empty")
        specials = _config_special_tokens(path.parent / TOKENIZER_CONFIG) or {
            token: len(ranks) + i for i, token in enumerate(special_tokens)
        }

        def token_id(token: str | None) -> int | None:
            if token is not None and token not in specials:
                raise ValueError(f"{path}: no special token {token!r} among {sorted(specials)}")
            return None if token is None else specials[token]

        ids = {"bos_id": token_id(bos_token), "eos_id": token_id(eos_token),
               "pad_id": token_id(pad_token)}
        try:
            return cls(ranks, specials, pat_str=pat_str, name=path.stem, **ids)
        except ValueError as e:  # the ranks or ids the file holds: say which file
            raise ValueError(f"{path}: {e}") from None

    def encode(self, text: str, *, allow_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`, matching Kimi's reference tokenizer.

        By default the text of a special token (say "[BOS]") is encoded as ordinary text, so user
        input cannot forge control tokens; set `allow_special_tokens` to encode a rendered chat
        template, whose special tokens should become their ids.
        """
        ids: list[int] = []
        for piece in _encode_pieces(text):
            if allow_special_tokens:
                ids += self._encoding.encode(piece, allowed_special="all")
            else:
                ids += self._encoding.encode_ordinary(piece)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Special ids are dropped; bytes that are not valid UTF-8 become U+FFFD."""
        _check_ids(ids, self.vocab_size)
        return self._encoding.decode([i for i in ids if i < self.num_ranks], errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` stands for, which may end inside a UTF-8 character (none
        for a special or unnamed id)."""
        _check_ids([token], self.vocab_size)
        return self._encoding.decode_single_token_bytes(token) if token < self.num_ranks \
            else b""


def _check_ranks(ranks: Mapping[bytes, int]) -> None:
    # tiktoken needs every byte as a token of its own, and ids that leave no gaps.
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"BPE ranks must be 0..{len(ranks) - 1}, each used once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"BPE ranks lack single-byte tokens for bytes {missing[:8]}")


def _config_special_tokens(config: Path) -> dict[str, int]:
    """The special tokens named in a Hugging Face tokenizer config, or {} if it names none."""
    if not config.is_file():
        return {}
    try:
        decoder = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        return {entry["content"]: int(token_id) for token_id, entry in decoder.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{config}: unreadable added_tokens_decoder ({e!r})") from e


def _encode_pieces(text: str) -> Iterator[str]:
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[start : start + _MAX_ENCODE_CHARS], _MAX_RUN_CHARS)


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Cut `text` every `max_run` characters into any longer run of whitespace or non-whitespace.

    The cuts fall exactly where those of Kimi's `_split_whitespaces_or_nonwhitespaces` do.
    """
    start = 0
    for run in _RUNS.finditer(text):
        for cut in range(run.start() + max_run, run.end(), max_run):
            yield text[start:cut]
            start = cut
    yield text[start:]


def read_tiktoken_bpe(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """Read a tiktoken BPE file: one "<base64 token> <rank>" per line.

    This is the format of `tiktoken.load.load_tiktoken_bpe`, which is not used because it caches
    local files by path in a temporary directory: a file rewritten in place would load stale.
    """
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            message = f"expected '<base64 token> <rank>', got {line[:80]!r}"
            raise ValueError(f"{path}:{number}: {message}") from e
    return ranks


def save_tiktoken_bpe(ranks: Mapping[bytes, int], path: str | os.PathLike[str]) -> None:
    """Write `ranks` in the tiktoken BPE file format, in rank order (whole or not at all: a
    later run must never read a file a signal cut short)."""
    lines = (
        base64.b64encode(token) + b" " + str(rank).encode() + b"\n"
        for token, rank in sorted(ranks.items(), key=itemgetter(1))
    )
    write_atomically(path, lambda f: f.write(b"".join(lines)), binary=True)


@lru_cache(maxsize=8)
def _compile(pat_str: str) -> regex.Pattern[str]:
    # VERSION1 reads `[...&&[...]]` as a class intersection, as tiktoken's Rust engine does; by
    # default the `regex` module would take the `&&` literally.
    return regex.compile(pat_str, regex.VERSION1)


def pretokenize(text: str, pat_str: str = KIMI_PAT_STR) -> list[str]:
    """Split `text` into the chunks that BPE merges within, as tiktoken splits them."""
    return [match.group() for match in _compile(pat_str).finditer(text)]


def train_bpe(text: str, vocab_size: int, pat_str: str = KIMI_PAT_STR) -> dict[bytes, int]:
    """Train byte-level BPE ranks on `text`: ranks 0..255 are the single bytes, then merges.

    Each step merges the most frequent adjacent pair (ties go to the larger pair of byte
    strings, so training is deterministic). Training stops early when no pair is left to merge.
    Words are counted once per distinct pre-token, and a merge recounts only the words that
    contain the merged pair, which keeps a few hundred KB of text and ~1k merges quick.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size {vocab_size} cannot hold the 256 single-byte tokens")
    ranks = {bytes([b]): b for b in range(256)}
    word_counts = Counter(pretokenize(text, pat_str))
    words = [[bytes([b]) for b in word.encode("utf-8")] for word in word_counts]
    counts = list(word_counts.values())

    pair_counts: Counter[tuple[bytes, bytes]] = Counter()
    # Words that may hold each pair; stale entries are harmless, since merging skips them.
    pair_words: defaultdict[tuple[bytes, bytes], set[int]] = defaultdict(set)

    def count_pairs(i: int, sign: int) -> None:
        for pair in pairwise(words[i]):
            pair_counts[pair] += sign * counts[i]
            if sign > 0:
                pair_words[pair].add(i)
            elif pair_counts[pair] == 0:
                del pair_counts[pair]

    for i in range(len(words)):
        count_pairs(i, +1)
    while len(ranks) < vocab_size and pair_counts:
        best = max(pair_counts, key=lambda pair: (pair_counts[pair], pair))
        merged = best[0] + best[1]
        # Different merge orders can spell the same bytes; such a token keeps its first rank.
        ranks.setdefault(merged, len(ranks))
        for i in pair_words.pop(best):
            count_pairs(i, -1)
            words[i] = _merge(words[i], best, merged)
            count_pairs(i, +1)
    return ranks


def _merge(word: list[bytes], pair: tuple[bytes, bytes], merged: bytes) -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def load_tokenizer(
    tokenizer_type: str, tokenizer_path: str | os.PathLike[str] | None = None
) -> Tokenizer | None:
    """The tokenizer a config asks for: "byte", "tiktoken" (needs a path) or "none" (None)."""
    if tokenizer_type == "none":
        return None
    if tokenizer_type == "byte":
        return ByteTokenizer()
    if tokenizer_type == "tiktoken":
        if not tokenizer_path:
            raise ValueError("tokenizer_type 'tiktoken' needs tokenizer_path, the BPE file")
        return TiktokenTokenizer.from_file(tokenizer_path)
    raise ValueError(
        f"unknown tokenizer_type {tokenizer_type!r}; expected one of "
        + ", ".join(repr(t) for t in TOKENIZER_TYPES)
    )


def tokenizer_file(cfg: Config) -> str | None:
    """The configured tokenizer file (`tokenizer_path`), else the one a converted checkpoint
    ships with."""
    if cfg.tokenizer_path:
        return cfg.tokenizer_path
    shipped = Path(cfg.load_parameters_path or ".") / "tiktoken.model"
    if cfg.tokenizer_type == "tiktoken" and cfg.load_parameters_path and shipped.is_file():
        return str(shipped)
    return None
