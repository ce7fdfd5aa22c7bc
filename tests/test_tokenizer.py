"""Tests for the byte and tiktoken tokenizers and the BPE trainer."""

import json
import random
from itertools import pairwise

import pytest
import tiktoken
import tiktoken.load

from k3text.tokenizer import (
    KIMI_PAT_STR,
    ByteTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    _split_long_runs,
    load_tokenizer,
    pretokenize,
    read_tiktoken_bpe,
    save_tiktoken_bpe,
    train_bpe,
)

_CORPUS = "\n".join(
    [
        "The quick brown fox jumps over the lazy dog. It's 2025, and the model's loss is 1.2345!",
        "Kimi Linear mixes linear attention with full attention; each layer has 64 heads.",
        "我们训练了一个小模型。模型的损失在下降，数学和中文都能处理。",
        "Numbers: 0 1 2 3 42 100 1000 65536 3.14159 -7 +8 1e-5, and dates like 2024-06-30.",
        "Punctuation: (a, b) [c; d] {e: f} \"quoted\" 'single' -- dash... really?!",
        "    indented code: for i in range(10):\r\n        print(i)\n\n",
    ]
)
_SAMPLES = [
    _CORPUS,
    "",
    "Unseen words: zymurgy, Quixotic; ÉCOLE élève naïve café.",
    "混合 text 和 English 123456789 的句子。",
    "Emoji 🙂🚀, Cyrillic привет, Greek Ωμέγα, Hangul 한국어, tabs\t\tand\r\nCRLF.",
    " " * 30_000 + "x" * 26_000 + "\n",  # long runs: encoded in pieces
]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tiktoken.model"
    save_tiktoken_bpe(train_bpe(_CORPUS * 4, vocab_size=450), path)
    return path


@pytest.fixture(scope="module")
def tokenizer(bpe_path):
    return TiktokenTokenizer.from_file(bpe_path)


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    for text in _SAMPLES:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *tok.encode("héllo"), tok.eos_id, tok.pad_id]) == "héllo"
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # a cut-off character decodes to U+FFFD
    with pytest.raises(ValueError, match=r"token ids \[259, -1\] are outside"):
        tok.decode([65, 259, -1])


def test_tiktoken_round_trip(tokenizer):
    assert isinstance(tokenizer, Tokenizer)
    for text in _SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("") == []
    # Trained on the corpus, BPE needs far fewer tokens than bytes for it.
    assert len(tokenizer.encode(_CORPUS)) < len(_CORPUS.encode()) / 2


def test_train_bpe_ranks():
    ranks = train_bpe(_CORPUS, vocab_size=300)
    assert sorted(ranks.values()) == list(range(300))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert ranks == train_bpe(_CORPUS, vocab_size=300)
    assert any(len(token) > 2 for token in ranks)
    # Merges never cross pre-token boundaries, e.g. between a word and following punctuation.
    assert b"dog." not in train_bpe(_CORPUS * 4, vocab_size=1000)


def test_train_bpe_stops_when_nothing_is_left_to_merge():
    assert len(train_bpe("ab ab", vocab_size=1000)) == 258  # "ab", then " ab"
    with pytest.raises(ValueError, match="vocab_size 255"):
        train_bpe("ab", vocab_size=255)


def test_saved_ranks_match_tiktoken_loader(bpe_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # its loader would otherwise cache by path
    assert read_tiktoken_bpe(bpe_path) == tiktoken.load.load_tiktoken_bpe(str(bpe_path))


def test_malformed_bpe_file(tmp_path):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(b"QQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"bad\.tiktoken:2: expected '<base64 token> <rank>'"):
        read_tiktoken_bpe(path)

    save_tiktoken_bpe({bytes([b]): b for b in range(255)}, path)
    with pytest.raises(ValueError, match=rf"{path}: BPE ranks lack single-byte tokens for "
                                         rf"bytes \[255\]"):
        TiktokenTokenizer.from_file(path)

    path.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"tiktoken BPE file {path} is empty"):
        TiktokenTokenizer.from_file(path)


def _tiktoken_pieces(text: str) -> list[bytes]:
    """How tiktoken's own regex engine splits `text` under KIMI_PAT_STR.

    The vocabulary holds every byte, every chunk of our split and every concatenation of two
    adjacent chunks. A piece equal to a chunk is then one token; a piece spanning several chunks
    merges two of them into one token; a piece inside a chunk cannot yield that chunk. So tokens
    spell exactly our chunks only when both engines split alike.
    """
    chunks = pretokenize(text)
    ranks = {bytes([b]): b for b in range(256)}
    for token in [*chunks, *(a + b for a, b in pairwise(chunks))]:
        ranks.setdefault(token.encode(), len(ranks))
    encoding = tiktoken.Encoding(
        "probe", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={}
    )
    return [encoding.decode_single_token_bytes(t) for t in encoding.encode_ordinary(text)]


def test_pretokenize_matches_tiktoken():
    alphabet = [
        *"aZ09 \t\r\n.,!?&'-_/\u00a0\u3000",  # ASCII and Unicode spaces
        *"数学中文東京",  # Han
        *"タワーかな한국어",  # other Lo scripts, which must not join Han runs
        *"éÉßſİǅʰΩωпривет\u0301\u0915\u093f",  # accents, titlecase, modifier, combining marks
        *"１²Ⅻ🙂",  # other digits and numbers, emoji
        "'s", "'T", "'re", "'VE", "'ll", "'D", "'m",
    ]  # fmt: skip
    rng = random.Random(0)
    for _ in range(60):
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 200)))
        assert _tiktoken_pieces(text) == [c.encode() for c in pretokenize(text)], repr(text)


def _kimi_split_whitespaces_or_nonwhitespaces(s: str, max_len: int):
    """Kimi's reference implementation, which `_split_long_runs` must cut like."""
    current_slice_len = 0
    current_slice_is_space = s[0].isspace() if len(s) > 0 else False
    slice_start = 0
    for i in range(len(s)):
        is_now_space = s[i].isspace()
        if current_slice_is_space ^ is_now_space:
            current_slice_len = 1
            current_slice_is_space = is_now_space
        else:
            current_slice_len += 1
            if current_slice_len > max_len:
                yield s[slice_start:i]
                slice_start = i
                current_slice_len = 1
    yield s[slice_start:]


def test_long_runs_are_cut_like_kimi():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choices("ab \n\u3000", k=rng.randint(0, 40)))
        expected = list(_kimi_split_whitespaces_or_nonwhitespaces(text, 3))
        assert list(_split_long_runs(text, 3)) == expected, repr(text)


def test_default_special_tokens(tokenizer):
    n = tokenizer.num_ranks
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (n, n + 1, n + 2)
    assert tokenizer.vocab_size == n + 3
    assert tokenizer.special_tokens == {"[BOS]": n, "[EOS]": n + 1, "[PAD]": n + 2}

    text = "[BOS]hi[EOS]"
    assert n not in tokenizer.encode(text)  # user text cannot forge control tokens
    ids = tokenizer.encode(text, allow_special_tokens=True)
    assert ids[0] == n and ids[-1] == n + 1
    assert tokenizer.decode(ids) == "hi"
    with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {n + 3}\\)"):
        tokenizer.decode([n + 3])


def test_special_tokens_from_tokenizer_config(bpe_path, tmp_path):
    n = len(read_tiktoken_bpe(bpe_path))
    path = tmp_path / "tiktoken.model"
    path.write_bytes(bpe_path.read_bytes())
    names = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 9: "[PAD]"}
    config = {
        "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in names.items()}
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    tok = TiktokenTokenizer.from_file(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (n, n + 1, n + 9, n + 10)
    ids = tok.encode("<|im_end|>ok", allow_special_tokens=True)
    assert ids[0] == n + 2
    assert tok.decode([*ids, n + 5]) == "ok"  # n + 5 is an unnamed reserved slot

    with pytest.raises(ValueError, match=r"no special token '\[UNK\]' among"):
        TiktokenTokenizer.from_file(path, pad_token="[UNK]")
    assert TiktokenTokenizer.from_file(path, pad_token=None).pad_id is None


def test_load_tokenizer(bpe_path, tmp_path):
    assert load_tokenizer("none", "") is None
    assert isinstance(load_tokenizer("byte", ""), ByteTokenizer)
    assert isinstance(load_tokenizer("tiktoken", str(bpe_path)), TiktokenTokenizer)

    with pytest.raises(
        ValueError,
        match="unknown tokenizer_type 'sentencepiece'; expected one of 'byte', 'tiktoken', 'none'",
    ):
        load_tokenizer("sentencepiece", "")
    with pytest.raises(FileNotFoundError, match="tiktoken BPE file not found: .*missing.model"):
        load_tokenizer("tiktoken", str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="needs tokenizer_path"):
        load_tokenizer("tiktoken", "")
