"""A fact-checkable synthetic corpus: a small invented world, arithmetic and list continuations.

Everything is generated in code from a seed, so a model trained on it can be scored exactly:
every training document is one fact, written as a prompt followed by a one-word answer and a
full stop,

    "The capital of Varnia is" + " " + "Olt" + "."

and the same prompt, given to the model, must complete to exactly " Olt." (then end of
sequence). Answers never contain spaces or full stops, so the answer format is unambiguous, and a
prompt ends where the answer's leading space begins, so under Kimi's pre-tokeniser (which splits
before that space) the prompt's tokens are a prefix of the document's tokens.

Relations of the world (all facts are held in: the model is meant to learn every one):
- countries: capital, language; people: home city, favourite colour, age;
- small-number arithmetic: a plus b, a minus b (non-negative results);
- list continuations: the day or month after another, the next term of an arithmetic sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from collections.abc import Iterator

from k3text.tokenizer import DEFAULT_SPECIAL_TOKENS

NUM_COUNTRIES = 40
NUM_PEOPLE = 60
MAX_OPERAND = 9  # arithmetic operands are 0..MAX_OPERAND
DEFAULT_BUILTIN_PROMPTS = 20  # two per relation
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black",
           "white", "grey", "gold")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")

# Name parts: consonant-vowel syllables read as pronounceable invented words.
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kr", "st", "th", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "t", "nd", "rk")
_COUNTRY_ENDINGS = ("ria", "land", "mark", "via", "nea", "stan")
_LANGUAGE_ENDINGS = ("sh", "nic", "lese", "ri")

# Cut points of a completion: the first newline, or the text of the end-of-sequence token for
# decoders that print special tokens.
_END_MARKERS = ("\n", DEFAULT_SPECIAL_TOKENS[1])


@dataclasses.dataclass(frozen=True)
class Fact:
    """One held-in fact: the training document is `prompt + completion`."""

    relation: str
    prompt: str
    answer: str

    @property
    def completion(self) -> str:
        """What a model must generate after the prompt: " answer."."""
        return f" {self.answer}."

    @property
    def text(self) -> str:
        return self.prompt + self.completion


@dataclasses.dataclass(frozen=True)
class World:
    """The invented entities and their attributes."""

    capitals: dict[str, str]  # country -> capital city
    languages: dict[str, str]  # country -> language
    homes: dict[str, str]  # person -> city
    colours: dict[str, str]  # person -> favourite colour
    ages: dict[str, int]  # person -> age


def _syllables(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n))


def _word(rng: random.Random, syllables: int, endings: tuple[str, ...] = _CODAS) -> str:
    return (_syllables(rng, syllables) + rng.choice(endings)).capitalize()


def _unique_words(rng: random.Random, n: int, taken: set[str], make) -> list[str]:
    words: list[str] = []
    while len(words) < n:
        word = make(rng)
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


@functools.cache
def make_world(seed: int) -> World:
    """The world of `seed`: every name distinct, so no prompt has two answers."""
    rng = random.Random(seed)
    taken = set(COLOURS) | set(DAYS) | set(MONTHS)
    countries = _unique_words(rng, NUM_COUNTRIES, taken,
                              lambda r: _word(r, r.randint(1, 2), _COUNTRY_ENDINGS))
    cities = _unique_words(rng, NUM_COUNTRIES, taken, lambda r: _word(r, r.randint(1, 2)))
    languages = _unique_words(rng, NUM_COUNTRIES, taken,
                              lambda r: _word(r, 1, _LANGUAGE_ENDINGS))
    people = _unique_words(rng, NUM_PEOPLE, taken, lambda r: _word(r, 2))
    return World(
        capitals=dict(zip(countries, cities, strict=True)),
        languages=dict(zip(countries, languages, strict=True)),
        homes={p: rng.choice(cities) for p in people},
        colours={p: rng.choice(COLOURS) for p in people},
        ages={p: rng.randint(18, 90) for p in people},
    )


def _world_facts(world: World) -> Iterator[Fact]:
    for country, city in world.capitals.items():
        yield Fact("capital", f"The capital of {country} is", city)
    for country, language in world.languages.items():
        yield Fact("language", f"In {country} people speak", language)
    for person, city in world.homes.items():
        yield Fact("home", f"{person} lives in", city)
    for person, colour in world.colours.items():
        yield Fact("colour", f"The favourite colour of {person} is", colour)
    for person, age in world.ages.items():
        yield Fact("age", f"The age of {person} is", str(age))


def _arithmetic_facts() -> Iterator[Fact]:
    operands = range(MAX_OPERAND + 1)
    for a in operands:
        for b in operands:
            yield Fact("plus", f"{a} plus {b} is", str(a + b))
    for a in operands:
        for b in range(a + 1):
            yield Fact("minus", f"{a} minus {b} is", str(a - b))


def _continuation_facts() -> Iterator[Fact]:
    for names, what in ((DAYS, "day"), (MONTHS, "month")):
        for i, name in enumerate(names):
            yield Fact(what, f"The {what} after {name} is", names[(i + 1) % len(names)])
    for start in range(1, 13):
        for step in range(2, 6):
            terms = ", ".join(str(start + i * step) for i in range(4))
            yield Fact("sequence", f"{terms},", str(start + 4 * step))


@functools.cache
def facts(seed: int) -> tuple[Fact, ...]:
    """Every fact of the corpus of `seed`, in a fixed order (relation by relation)."""
    return (*_world_facts(make_world(seed)), *_arithmetic_facts(), *_continuation_facts())


def documents(seed: int) -> list[str]:
    """The training documents: one fact each. The data pipeline adds bos/eos and shuffles."""
    return [fact.text for fact in facts(seed)]


def builtin_prompts(seed: int, n: int = DEFAULT_BUILTIN_PROMPTS) -> list[tuple[str, str]]:
    """`n` held-in (prompt, expected completion) pairs, relations interleaved so that any prefix
    of the list samples every relation. Deterministic in `seed`."""
    by_relation: dict[str, list[Fact]] = {}
    for fact in facts(seed):
        by_relation.setdefault(fact.relation, []).append(fact)
    rng = random.Random(seed)
    for group in by_relation.values():
        rng.shuffle(group)
    rounds = itertools.zip_longest(*by_relation.values())
    interleaved = [fact for round_ in rounds for fact in round_ if fact is not None]
    if not 0 < n <= len(interleaved):
        raise ValueError(f"n must be in [1, {len(interleaved)}], got {n}")
    return [(fact.prompt, fact.completion.strip()) for fact in interleaved[:n]]


def score(expected: str, completion: str) -> bool:
    """Exact match: `completion`, cut at the first newline or end marker and stripped of
    surrounding whitespace, equals `expected` (stripped)."""
    for marker in _END_MARKERS:
        completion = completion.split(marker, 1)[0]
    return completion.strip() == expected.strip()
