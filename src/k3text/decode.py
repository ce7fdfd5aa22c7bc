"""Offline decoding: `python -m k3text.decode CONFIG [key=value ...]`.

One token's path through the stack: config -> mesh -> parameters (an Orbax checkpoint from
tools/convert, or seeded random weights) -> prompts (text, ids, or a JSONL file batched by a
grain pipeline) -> `Engine.decode_batch` (chunked prefill, insert into a pool of slots,
on-device decode loop with per-slot sampling) -> JSONL results and a summary.

Prompt sources, in order of precedence: `prompts_file`, `prompt_ids`, `prompt`,
`builtin_prompts` (the corpus's fact prompts, scored; the shipped config sets it). With none
given, a single default prompt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # before jax starts, so CPU runs of multi-device configs just work
    from k3text.config import request_host_devices

    request_host_devices(sys.argv[1:])

import grain  # noqa: E402
import jax  # noqa: E402

from k3text import files, sharding  # noqa: E402
from k3text.config import Config, ConfigError  # noqa: E402
from k3text.inference.engine import (  # noqa: E402
    Generation,
    build_engine,
    check_prompts,
    enable_compilation_cache,
)
from k3text.inference.prefix_cache import PrefixCache  # noqa: E402
from k3text.tokenizer import Tokenizer, load_tokenizer, tokenizer_file  # noqa: E402
from k3text.tools import cli  # noqa: E402

log = logging.getLogger("k3text.decode")


@dataclasses.dataclass(frozen=True)
class Request:
    index: int  # position in the input, which is also the output order
    prompt_ids: tuple[int, ...]
    prompt: str | None = None  # the text, when the prompt came as text
    expected: str | None = None  # the known answer (built-in prompts, "expected" in a file)
    where: str = "prompt"  # where it came from, for errors ("prompts.jsonl:3", "prompt_ids")


# --------------------------------------------------------------------------------------------
# Prompts.
# --------------------------------------------------------------------------------------------


def parse_ids(text: str, where: str) -> tuple[int, ...]:
    """Token ids separated by commas and/or spaces ("1,2,3", "1, 2, 3", "1 2 3")."""
    try:
        ids = tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"{where}: expected token ids separated by commas or spaces, got "
                          f"{text!r}") from None
    if not ids:
        raise ConfigError(f"{where}: no token ids in {text!r}")
    return ids


def _encode(text: str, tokenizer: Tokenizer | None, cfg: Config, where: str) -> tuple[int, ...]:
    if tokenizer is None:
        raise ConfigError(f"{where} is text but tokenizer_type is 'none'; give prompt_ids or "
                          f"set tokenizer_type / tokenizer_path")
    ids = tokenizer.encode(text)
    if cfg.add_bos:
        bos = tokenizer.bos_id if tokenizer.bos_id is not None else cfg.bos_token_id
        ids = [bos, *ids]
    return tuple(ids)


PROMPT_FIELDS = frozenset({"prompt", "prompt_ids", "expected"})


def read_prompts_file(path: str, tokenizer: Tokenizer | None, cfg: Config) -> list[Request]:
    """Parse and validate every line of a JSONL prompts file before any decoding starts."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"prompts_file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"prompts_file {path} is a directory; give a JSONL file") from None
    except OSError as e:
        raise ConfigError(f"prompts_file {path} cannot be read ({e.strerror})") from None
    requests = []
    for number, data in enumerate(raw.split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:  # a byte-order mark (editors on Windows write one) is not part of the text
            line = data.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line is "
                              f"0x{data[e.start]:02x})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("prompt_ids" in record):
            raise ConfigError(f"{where}: each line must be an object with exactly one of "
                              f"\"prompt\" (string) or \"prompt_ids\" (list of int)")
        unknown = sorted(record.keys() - PROMPT_FIELDS)
        if unknown:  # a misspelt "expected" would leave the answer unscored
            raise ConfigError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; a "
                              f"line holds \"prompt\" or \"prompt_ids\", and \"expected\"")
        if "prompt_ids" in record:
            ids = record["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ConfigError(f"{where}: \"prompt_ids\" must be a non-empty list of int")
            request = Request(len(requests), tuple(ids), where=where)
        else:
            if not isinstance(record["prompt"], str):
                raise ConfigError(f"{where}: \"prompt\" must be a string")
            if not record["prompt"]:
                raise ConfigError(f"{where}: \"prompt\" is empty")
            request = Request(len(requests), _encode(record["prompt"], tokenizer, cfg, where),
                              record["prompt"], where=where)
        if "expected" in record:
            if not isinstance(record["expected"], str):
                raise ConfigError(f"{where}: \"expected\" must be a string")
            request = dataclasses.replace(request, expected=record["expected"])
        requests.append(request)
    if not requests:
        raise ConfigError(f"prompts_file {path} holds no prompts")
    return requests


def builtin_requests(cfg: Config, tokenizer: Tokenizer | None) -> list[Request]:
    from k3text import corpus

    return [Request(i, _encode(text, tokenizer, cfg, "built-in prompt"), text, expected,
                    where=f"built-in prompt {i}")
            for i, (text, expected) in enumerate(corpus.builtin_prompts(cfg.corpus_seed))]


def collect_requests(cfg: Config, tokenizer: Tokenizer | None) -> list[Request]:
    if cfg.prompts_file:
        return read_prompts_file(cfg.prompts_file, tokenizer, cfg)
    if cfg.prompt_ids:
        return [Request(0, parse_ids(cfg.prompt_ids, "prompt_ids"), where="prompt_ids")]
    if cfg.prompt:
        return [Request(0, _encode(cfg.prompt, tokenizer, cfg, "prompt"), cfg.prompt)]
    if cfg.builtin_prompts:
        return builtin_requests(cfg, tokenizer)
    # No prompt given: one fixed prompt that any model can run.
    ids = _encode("The capital of", tokenizer, cfg, "the default prompt") if tokenizer else (
        cfg.bos_token_id,)
    return [Request(0, ids, "The capital of" if tokenizer else None)]


def batches(requests: list[Request], batch: int) -> grain.MapDataset:
    """The grain pipeline over the prompts, in global batches of `batch`.

    Every process walks the same (small, already validated) request list; when several hosts
    decode one file, each host materialises only the rows of a batch that its own devices hold
    (the engine builds inputs with `make_array_from_callback`), so the work of feeding the
    batch is split across processes by the batch sharding itself.
    """
    return grain.MapDataset.source(requests).batch(batch, batch_fn=list)


# --------------------------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------------------------


def result_records(cfg: Config, requests: Sequence[Request], gen: Generation,
                   tokenizer: Tokenizer | None) -> list[dict[str, Any]]:
    records = []
    for i, request in enumerate(requests):
        record: dict[str, Any] = {"prompt_ids": list(request.prompt_ids)}
        if request.prompt is not None:
            record["prompt"] = request.prompt
        record["output_ids"] = gen.output_ids[i]
        if tokenizer is not None:
            # Models pad their vocabulary past the tokenizer's; padding ids have no text.
            known = [t for t in gen.output_ids[i] if t < tokenizer.vocab_size]
            record["output_text"] = tokenizer.decode(known)
        record["finish_reason"] = gen.finish_reasons[i]
        if cfg.return_log_prob:
            record["output_logprobs"] = gen.output_logprobs[i]
        if cfg.return_top_logprobs:
            record["output_top_logprobs"] = [
                [list(pair) for pair in zip(ids, lps, strict=True)]
                for ids, lps in zip(gen.output_top_ids[i], gen.output_top_logprobs[i],
                                    strict=True)]
        if request.expected is not None:
            from k3text import corpus

            record["expected"] = request.expected
            record["correct"] = corpus.score(request.expected, record.get("output_text", ""))
        records.append(record)
    return records


def write_jsonl(path: str, records: list[dict[str, Any]], replace: bool = True) -> None:
    """Write atomically (a temp file beside the target, renamed into place), one JSON object
    per line; a non-finite number (a NaN log-probability) is written as null, so every line
    stays valid JSON. Without `replace`, a file that appeared at `path` since the start is
    kept and the results go beside it (`files.write_atomically`)."""

    def write(f):
        for record in records:
            f.write(json.dumps(_finite(record), allow_nan=False) + "\n")

    files.write_atomically(path, write, replace=replace)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def print_results(records: list[dict[str, Any]], out: Any = None) -> None:
    out = out or sys.stdout
    for record in records:
        shown = record.get("prompt", record["prompt_ids"])
        completion = record.get("output_text", record["output_ids"])
        mark = ""
        if "correct" in record:
            mark = "  [correct]" if record["correct"] else f"  [wrong: expected " \
                                                           f"{record['expected']!r}]"
        print(f"> {shown!r}\n  {completion!r}{mark}", file=out)
    scored = [r["correct"] for r in records if "correct" in r]
    if scored:
        print(f"accuracy: {sum(scored)}/{len(scored)} = {sum(scored) / len(scored):.1%}",
              file=out)


def summary(gens: list[Generation], prompts: int) -> str:
    prefill = sum(g.prefill_seconds for g in gens)
    decode = sum(g.decode_seconds for g in gens)
    tokens = sum(g.generated_tokens for g in gens)
    steps = sum(g.decode_steps for g in gens)
    # The first token of each sequence comes from prefill; the loop produces the rest.
    loop_tokens = tokens - sum(len(g.output_ids) for g in gens)
    return (f"prompts {prompts} | generated tokens {tokens} | time to first token "
            f"{prefill / max(len(gens), 1) * 1e3:.1f} ms/batch | decode "
            f"{loop_tokens / decode if decode else 0.0:.1f} tokens/s | per step "
            f"{decode / max(steps - len(gens), 1) * 1e3:.2f} ms")


# --------------------------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------------------------


def check_output_file(cfg: Config) -> None:
    """Before any work: `output_file` can be written, replaces an existing file only with
    `output_overwrite`, and is never the prompts file it would replace with results."""
    path = files.check_output_file(cfg.output_file)
    if cfg.prompts_file and path.exists() and path.samefile(cfg.prompts_file):
        raise ConfigError(f"output_file {cfg.output_file} is the prompts_file; writing the "
                          f"results there would replace the prompts")
    if path.exists() and not cfg.output_overwrite:
        raise ConfigError(f"output_file {cfg.output_file} already exists; set "
                          f"output_overwrite=true to replace it, or give another output_file")


def run(cfg: Config) -> list[dict[str, Any]]:
    if cfg.output_file and jax.process_index() == 0:  # before any work, not after all of it
        check_output_file(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer_type, tokenizer_file(cfg))
    requests = collect_requests(cfg, tokenizer)
    # Before the weights load (for K3, a long restore): the config alone decides.
    check_prompts(cfg, [r.prompt_ids for r in requests], cfg.max_decode_steps,
                  [r.where for r in requests])
    engine, ctx = build_engine(cfg)
    batch = cfg.global_batch_size
    groups = [[r.prompt_ids for r in group] for group in batches(requests, batch)]
    # A group holding a context-parallel prompt, and every group with a prefix cache, is
    # prefilled and inserted one prompt at a time (`decode_batch`), at the batch axes' rows.
    alone = [cfg.enable_prefix_caching or any(engine.context_parallel([p]) for p in group)
             for group in groups]
    # Only the prefill widths these prompts run, where the driver can tell them in advance.
    widths = None if any(alone) else \
        set().union(*(engine.prefill_widths(group) for group in groups))
    # Reported apart: the throughput below is without it.
    top_n = cfg.return_top_logprobs
    compile_seconds = sum(engine.warm_up(batch, widths=widths, prefill_batch=rows, top_n=top_n)
                          for rows in {engine.ctx.size("batch") if a else batch for a in alone})
    records: list[dict[str, Any]] = []
    gens = []
    cache = PrefixCache(cfg, engine) if cfg.enable_prefix_caching else None
    with files.progress_bar(total=len(requests), desc="decode", unit="prompt",
                            disable=not cfg.progress or jax.process_index() != 0) as bar:
        for group in batches(requests, batch):
            # Request i samples with seed `seed + i` whatever batch it falls in (the engine
            # numbers rows from the seed it is given).
            gen = engine.decode_batch([r.prompt_ids for r in group], batch=batch, cache=cache,
                                      seed=cfg.seed + group[0].index, top_n=top_n)
            gens.append(gen)
            records += result_records(cfg, group, gen, tokenizer)
            bar.update(len(group))
    broken = sum(not all(map(math.isfinite, lps)) for g in gens for lps in g.output_logprobs)
    if broken:  # the sampler still picks a token from NaN logits; it is not an answer
        log.warning("%d of %d sequences hold tokens sampled from non-finite logits (NaN or "
                    "inf): the model's weights or activations are broken", broken, len(records))
    if jax.process_index() == 0:
        print_results(records)
        print(f"compile {compile_seconds:.1f} s (prefill chunk and decode loop at batch {batch}; "
              f"from the compilation cache when a run compiled them before)")
        print(summary(gens, len(records)))
        if cache is not None:
            print(cache.summary())
        if cfg.output_file:
            write_jsonl(cfg.output_file, records, replace=cfg.output_overwrite)
    return records


def refuse_empty_prompt_keys(overrides: Sequence[str]) -> None:
    """`prompt=""` on the command line is a mistake, not "no prompt": without this check it
    would silently decode the built-in set (an empty key means unset in a config file)."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key in ("prompt", "prompt_ids", "prompts_file") and not value.strip():
            raise ConfigError(f"{key} is empty on the command line; give a value or leave the "
                              f"key out")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)

    def body(cfg: Config) -> None:
        refuse_empty_prompt_keys(argv[1:])
        enable_compilation_cache(cfg)
        sharding.maybe_initialize_distributed(cfg)
        run(cfg)

    return cli.main(argv, "k3text.decode", __doc__, body)


if __name__ == "__main__":
    sys.exit(main())
