"""The facts corpus: deterministic, unambiguous, exactly scorable, and tokenised so that every
prompt is a prefix of its training document."""

import collections
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3text import corpus
from k3text.config import load_config
from k3text.tokenizer import TiktokenTokenizer, read_tiktoken_bpe, train_bpe

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = ROOT / "configs" / "train" / "k3-small.yml"


def test_corpus_is_deterministic_per_seed():
    """The same facts in every process (string hashing, which orders sets, is randomised per
    process): the shipped model was trained on them, and its tests score it on them."""
    script = ("import hashlib; from k3text import corpus; "
              "print(hashlib.sha256(repr(corpus.facts(0)).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    assert len(digests) == 1
    assert corpus.facts.__wrapped__(0) == corpus.facts(0)  # not only the cache's copy
    assert corpus.make_world(0) != corpus.make_world(1)
    assert corpus.documents(0) == [fact.text for fact in corpus.facts(0)]


def test_every_prompt_has_one_answer():
    facts = corpus.facts(0)
    assert len({fact.prompt for fact in facts}) == len(facts)
    relations = collections.Counter(fact.relation for fact in facts)
    assert set(relations) == {"capital", "language", "home", "colour", "age", "plus", "minus",
                              "day", "month", "sequence"}
    assert 300 <= len(facts) <= 600
    for fact in facts:
        assert fact.answer and " " not in fact.answer and "." not in fact.answer
        assert fact.text == f"{fact.prompt} {fact.answer}."


def test_facts_are_true():
    world = corpus.make_world(0)
    assert set(world.homes.values()) <= set(world.capitals.values())
    for fact in corpus.facts(0):
        words = fact.prompt.replace(",", "").split()
        match fact.relation:
            case "plus":
                assert int(fact.answer) == int(words[0]) + int(words[2])
            case "minus":
                assert int(fact.answer) == int(words[0]) - int(words[2]) >= 0
            case "sequence":
                terms = [int(w) for w in words]
                step = terms[1] - terms[0]
                assert all(b - a == step for a, b in itertools.pairwise(terms))
                assert int(fact.answer) == terms[-1] + step
            case "capital":
                assert world.capitals[words[3]] == fact.answer
            case "day" | "month":
                names = corpus.DAYS if fact.relation == "day" else corpus.MONTHS
                assert names.index(fact.answer) == (names.index(words[-2]) + 1) % len(names)
            case "language":
                assert world.languages[words[1]] == fact.answer
            case "home":
                assert world.homes[words[0]] == fact.answer
            case "colour":
                assert world.colours[words[-2]] == fact.answer
            case "age":
                assert str(world.ages[words[-2]]) == fact.answer
            case _:
                pytest.fail(f"no check for the relation of {fact}")


def test_builtin_prompts_interleave_relations():
    prompts = corpus.builtin_prompts(0, 40)
    assert prompts == corpus.builtin_prompts(0, 40)
    by_prompt = {fact.prompt: fact for fact in corpus.facts(0)}
    first = [by_prompt[prompt].relation for prompt, _ in prompts[:10]]
    assert len(set(first)) == 10  # one of each relation before any repeats
    for prompt, expected in prompts:
        assert expected == f"{by_prompt[prompt].answer}."
    assert len(corpus.builtin_prompts(0)) == corpus.DEFAULT_BUILTIN_PROMPTS
    for bad in (0, len(corpus.facts(0)) + 1):
        with pytest.raises(ValueError, match="n must be in"):
            corpus.builtin_prompts(0, bad)


@pytest.mark.parametrize("completion, correct", [
    (" Olt.", True),
    ("Olt.", True),
    (" Olt.\nThe capital of", True),
    (" Olt.[EOS][BOS]The", True),
    (" Olt. ", True),
    (" Olt", False),
    (" Olt.The", False),
    (" Oltt.", False),
    ("", False),
    ("\n Olt.", False),
])
def test_score(completion, correct):
    assert corpus.score("Olt.", completion) is correct


def test_shipped_tokenizer_is_the_corpus_bpe():
    cfg = load_config(TRAIN_CONFIG)
    path = ROOT / cfg.tokenizer_path
    text = "\n".join(corpus.documents(cfg.corpus_seed))
    assert read_tiktoken_bpe(path) == train_bpe(text, cfg.vocab_size - 3)
    tokenizer = TiktokenTokenizer.from_file(path)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (
        cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    # A prompt's tokens are a prefix of its document's, so decoding continues where training did.
    for fact in corpus.facts(cfg.corpus_seed):
        prompt = tokenizer.encode(fact.prompt)
        assert tokenizer.encode(fact.text)[: len(prompt)] == prompt, fact.prompt
