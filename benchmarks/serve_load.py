"""Load against the server, and the same requests through the offline engine.

    python benchmarks/serve_load.py [CONFIG] [key=value ...] [--requests N] [--rates 2,8,32]
                                    [--concurrency C] [--rounds R] [--seed S] [--out DIR]
                                    [--force]
                                    [--workload mixed|decode-heavy] [--shared-prefix]
                                    [--baseline key=value,...]

1. Compiles the offline engine on the same config in this process, then starts
   `python -m k3text.serve CONFIG` (default: the shipped model, configs/inference/cpu.yml,
   8 slots) on a free port and waits for /health.
2. A workload of N requests (`--workload`, greedy, `ignore_eos`: each request generates exactly
   its drawn length; the cache is raised to 256 positions for them):
   - `mixed` (the default): prompt lengths mixed (half a short fact prompt, half random ids of
     16 to `max_prefill_predict_length` tokens), output lengths 8 to 32 tokens for 75% of them
     and 96 to 192 for the rest;
   - `decode-heavy`: short fact prompts (7 to 12 tokens) and 64 to 192 output tokens, so that
     prefill is a small share of the work and the saturation ratio measures what serving itself
     costs beside the decode-only loop (on this CPU a prompt token costs about what an output
     token does, and the mixed workload's prompts alone hold its ratio near 0.7).
3. Poisson arrivals at each rate. Every request streams; the client times its first token
   (TTFT) and its tokens after the first (TPOT = (last - first) / (tokens - 1)); output
   tokens/s = all tokens / wall time.
4. R rounds (default 3) of: the offline engine's steady-state decode (every slot busy for as
   many steps as the longest request, in one call: tokens/s and the per-step time); the server
   at a fixed concurrency (C clients, each sending its next request when the last one ends;
   C = 2 x slots keeps every slot busy: saturation, its tokens/s counted while at least as many
   requests are outstanding as there are slots, before the run drains; the whole run's too);
   the offline engine on the same workload in
   static batches of the slot count, in arrival order (each batch runs until its longest
   request ends). The offline runs happen while the server idles, so each round's ratios come
   from runs seconds apart; the median round is reported with the spread.

With --baseline (e.g. `--baseline serve_overlap=false`) a second server runs with those
overrides on top, and each round also saturates it, right before or after the first (the order
alternating by round): prints the server's tokens/s, TPOT p50 and decode step against the
baseline server's, measured minutes apart at most.

With --shared-prefix it runs the prefix-cache workloads instead, on a server with
`enable_prefix_caching` false and then true (the cache raised to 2,688 positions): N requests of a
2,048-token system prompt plus a distinct short question, at a concurrency of the slot count;
then N / 4 conversations of 4 turns at once, each turn's prompt the conversation so far (the
server's answers included). Prints TTFT and throughput for both, the cache's hit rate, and the
median-TTFT ratio; writes prefix_cache.jsonl and prefix_cache.csv to --out.

Prints the table and the three ratios the serving issue set (saturation tokens/s vs the
offline loop, TPOT p50 with all slots busy vs the offline per-step time, continuous vs static
batching), and at saturation how many cores the server's threads kept busy and the host's share
of that CPU time (its HTTP, scheduler and Python threads against XLA:CPU's, from /proc), the
cores the load generator itself kept busy (`client_cores`), and the range of the cores' round
trip probed before each run (`core_round_trip_ns`, benchlib.core_round_trip_ns); writes
serve_load.jsonl (line 1 the machine), serve_load.csv and serve_load.png to --out (default
benchmarks/results/serve_load/). Flags, configs and the output files are checked
before anything runs: existing results are replaced only with --force. The servers it starts are
stopped on every way out (an error, Ctrl-C, SIGTERM). Ctrl-C writes the rows measured so far
(the Poisson rates and the rounds completed; the header says `"interrupted": true`) and exits
130, and so does a `--shared-prefix` run (its rows measured: each workload with the cache off,
then on); a run interrupted before its first row writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib
import httpx
import numpy as np

from k3text import corpus, files
from k3text.config import CONFIG_DIR, Config, ConfigError, load_config
from k3text.tools.tables import table

FIELDS = ("mode", "round", "rate_rps", "concurrency", "requests", "output_tokens", "seconds",
          "output_tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms",
          "tpot_p90_ms", "tpot_p99_ms", "saturated_tokens_per_s", "saturated_seconds",
          "server_ms_per_step", "decode_share", "prefill_share",
          "slot_occupancy", "server_cores", "host_cpu_share", "client_cores",
          "core_round_trip_ns", "prefill_s", "decode_s", "ceiling", "prefill_steps_per_prompt",
          "prefill_ceiling")
# A 256-position cache: room for the long answers after a 64-token prompt.
DEFAULT_OVERRIDES = ["per_device_batch_size=8", "max_target_length=256", "progress=false"]


# ---- the workload -----------------------------------------------------------------------------


WORKLOADS = ("mixed", "decode-heavy")


def text_tokenizer(cfg: Config) -> Any:
    """The config's tokenizer: the workloads are the fact corpus's text prompts."""
    from k3text.tokenizer import load_tokenizer, tokenizer_file

    tokenizer = load_tokenizer(cfg.tokenizer_type, tokenizer_file(cfg))
    if tokenizer is None:
        raise ConfigError("serve_load needs a config with a tokenizer (its prompts are text), "
                          "got tokenizer_type none")
    return tokenizer


def workload(cfg: Any, tokenizer: Any, n: int, seed: int,
             kind: str = "mixed") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    facts = corpus.facts(cfg.corpus_seed)
    room = cfg.max_target_length
    requests = []
    for _ in range(n):
        if kind == "decode-heavy" or rng.random() < 0.5:
            prompt = [cfg.bos_token_id, *tokenizer.encode(rng.choice(facts).prompt)]
        else:
            length = rng.randint(16, cfg.max_prefill_predict_length)
            prompt = [cfg.bos_token_id] + [rng.randrange(3, tokenizer.vocab_size)
                                           for _ in range(length - 1)]
        if kind == "decode-heavy":
            out = rng.randint(64, 192)
        else:  # most answers short, a quarter long: the mix static batching handles worst
            out = rng.randint(8, 32) if rng.random() < 0.75 else rng.randint(96, 192)
        out = min(out, room - len(prompt))
        requests.append({"prompt": prompt, "max_tokens": out})
    return requests


# ---- the server -------------------------------------------------------------------------------


class ServerProcess:
    def __init__(self, config: str, overrides: list[str]):
        # In this process's directory, so a relative config path or override names the file
        # it names here.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "k3text.serve", config, "server_port=0", *overrides],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        try:  # a server that fails to start, or a signal meanwhile, leaves no process behind
            self.url = self._listening()
            while httpx.get(self.url + "/health", timeout=10).status_code != 200:
                self._alive()
                time.sleep(0.5)
        except BaseException:
            with files.uninterrupted():
                self.stop()
            raise

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            print("  server:", line.rstrip(), file=sys.stderr)

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            said = next((line for line in reversed(self.lines) if line.startswith("error:")),
                        f"exit status {self.proc.returncode}")
            raise RuntimeError(f"the server stopped during start-up: {said}")

    def _listening(self) -> str:
        while True:
            self._alive()
            for line in list(self.lines):
                if m := re.search(r"listening on (http://\S+)", line):
                    return m.group(1)
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within a minute: never left running."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.wait(120)


async def _one(client: httpx.AsyncClient, model: str, request: dict[str, Any],
               ) -> dict[str, Any]:
    body = {"model": model, "prompt": request["prompt"], "max_tokens": request["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    first = last = None
    ids: list[int] = []
    arrivals: list[tuple[float, int]] = []  # (time, tokens) per chunk
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            new = json.loads(line[6:])["choices"][0].get("token_ids", [])
            if new:
                last = time.perf_counter()
                first = first or last
                ids += new
                arrivals.append((last, len(new)))
    tokens = len(ids)
    return {"ttft": first - sent, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens, "end": last, "ids": ids, "arrivals": arrivals}


def _summary(mode: str, results: list[dict[str, float]], seconds: float,
             **extra: Any) -> dict[str, Any]:
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["tpot"] * 1e3 for r in results if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in results)
    row = {"mode": mode, "requests": len(results), "output_tokens": tokens, "seconds": seconds,
           "output_tokens_per_s": tokens / seconds, **extra}
    for name, samples in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = benchlib.percentile(samples, q) if samples else None
    return row


async def poisson(url: str, model: str, requests: list[dict], rate: float,
                  seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def later(delay: float, request: dict) -> dict:
            await asyncio.sleep(delay)
            return await _one(client, model, request)

        delays, at = [], 0.0
        for _ in requests:
            at += rng.expovariate(rate)
            delays.append(at)
        results = await asyncio.gather(*(later(d, r) for d, r in zip(delays, requests,
                                                                      strict=True)))
    return _summary("poisson", results, time.perf_counter() - start, rate_rps=rate)


def server_counters(url: str) -> dict[str, float]:
    names = ("k3text_decode_steps_total", "k3text_decode_seconds_total",
             "k3text_prefill_seconds_total")
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds process `pid`'s threads have run, split into XLA:CPU's (its worker and
    execution threads, named `tf_XLA...`) and the host's (every other: HTTP, the scheduler,
    Python's own), read from /proc; {} where there is none."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {"xla": 0.0, "host": 0.0}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:]
        user, system = (int(x) for x in rest.split()[11:13])  # utime, stime (fields 14, 15)
        seconds["xla" if name.startswith("tf_XLA") else "host"] += (user + system) / tick
    return seconds


def probed(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`'s row, with the cores' round trip measured just before it."""
    trip = benchlib.core_round_trip_ns()
    return run() | {"core_round_trip_ns": trip}


async def closed_loop(url: str, model: str, requests: list[dict], concurrency: int,
                      slots: int, pid: int | None = None) -> dict[str, Any]:
    """`requests` from `concurrency` clients, each sending its next when the last one ends;
    `pid`: the server's process, whose threads' CPU time the row reports."""
    queue = list(reversed(requests))
    results: list[dict] = []
    cpu_before = thread_cpu(pid) if pid is not None else {}
    client_before = time.process_time()
    before = server_counters(url)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()

        async def worker() -> None:
            while queue:
                results.append(await _one(client, model, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    client_seconds = time.process_time() - client_before
    after = server_counters(url)
    cpu = {k: v - cpu_before[k] for k, v in thread_cpu(pid).items()} if cpu_before else {}
    delta = {k: after[k] - before[k] for k in after}
    # Where the server's time went: its own per-step time, the shares spent in decode calls
    # and in separate prefill calls, and how full its slots were (output tokens per slot per
    # decode step; first tokens come from inserts, so a full pool reads slightly above 1).
    steps = delta["k3text_decode_steps_total"]
    tokens = sum(r["tokens"] for r in results)
    # Saturated: until fewer requests are outstanding than there are slots. After that the
    # run drains (slots empty one by one for want of requests, which the offline loop's steady
    # state never sees), so the whole run's rate understates the server's at saturation.
    saturated_until = sorted(r["end"] for r in results)[max(0, len(results) - slots)]
    saturated_tokens = sum(n for r in results for t, n in r["arrivals"] if t <= saturated_until)
    return _summary("fixed concurrency", results, seconds, concurrency=concurrency,
                    saturated_tokens_per_s=saturated_tokens / (saturated_until - start),
                    saturated_seconds=saturated_until - start,
                    server_ms_per_step=1e3 * delta["k3text_decode_seconds_total"] / steps,
                    decode_share=delta["k3text_decode_seconds_total"] / seconds,
                    prefill_share=delta["k3text_prefill_seconds_total"] / seconds,
                    slot_occupancy=tokens / (steps * slots),
                    # Cores the server kept busy, and the host's share of them: on a CPU the
                    # host's threads take cores from XLA:CPU's workers (None without /proc).
                    server_cores=sum(cpu.values()) / seconds if cpu else None,
                    host_cpu_share=cpu["host"] / sum(cpu.values()) if cpu else None,
                    # The load generator's own (this process's) cores, on the same machine.
                    client_cores=client_seconds / seconds)


# ---- shared prefixes: the prefix cache off and on ---------------------------------------------

PREFIX_FIELDS = ("workload", "prefix_cache", "requests", "output_tokens", "seconds",
                 "output_tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "hit_rate")
# Room for a 2,048-token system prompt and a few turns of conversation after it.
PREFIX_OVERRIDES = ["max_prefill_predict_length=2560", "max_target_length=2688"]


def shared_prefix_workloads(cfg: Any, tokenizer: Any, n: int, seed: int,
                            ) -> tuple[list[int], list[dict], list[list[dict]]]:
    """A 2,048-token system prompt (the facts corpus as text); `n` requests of it plus a short
    distinct question; and n // 4 conversations of 4 turns, each turn's prompt the whole
    conversation so far (the server's own answers included) plus a new question."""
    rng = random.Random(seed)
    facts = corpus.facts(cfg.corpus_seed)
    text = " ".join(f.prompt + f.completion for f in facts)
    system = [cfg.bos_token_id, *tokenizer.encode(text)]
    while len(system) < 2048:
        system += system[1:]
    system = system[:2048]
    question = lambda: tokenizer.encode(" " + rng.choice(facts).prompt)  # noqa: E731
    suffixed = [{"prompt": system + question(), "max_tokens": rng.randint(8, 24)}
                for _ in range(n)]
    conversations = [[{"question": question(), "max_tokens": rng.randint(8, 24)}
                      for _ in range(4)] for _ in range(max(1, n // 4))]
    return system, suffixed, conversations


async def conversations(url: str, model: str, system: list[int], talks: list[list[dict]],
                        ) -> dict[str, Any]:
    """Every conversation at once, its turns in order."""
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()

        async def talk(turns: list[dict]) -> None:
            history = list(system)
            for turn in turns:
                history += turn["question"]
                out = await _one(client, model, {"prompt": history,
                                                 "max_tokens": turn["max_tokens"]})
                history += out["ids"]
                results.append(out)

        await asyncio.gather(*(talk(t) for t in talks))
    return _summary("multi-turn", results, time.perf_counter() - start)


def cache_counts(url: str) -> np.ndarray:
    """The server's (prompt tokens restored from the cache, prompt tokens looked up)."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return np.asarray([float(values.get(f"k3text_prefix_cache_{n}_tokens_total", 0))
                       for n in ("hit", "queried")])


def hit_rate(before: np.ndarray, after: np.ndarray) -> float | None:
    hits, queried = after - before
    return hits / queried if queried else None


def shared_prefix(args: argparse.Namespace) -> str:
    """Measure, write and print; "interrupted" when Ctrl-C cut it short after a first row (the
    rows measured are written), else "done"."""
    from k3text.serve import model_name

    overrides = [*DEFAULT_OVERRIDES, *args.overrides, *PREFIX_OVERRIDES]
    cfg = load_config(args.config, overrides)
    benchlib.check_outputs([args.out / "prefix_cache.jsonl", args.out / "prefix_cache.csv"],
                           args.force)
    tokenizer = text_tokenizer(cfg)
    system, suffixed, talks = shared_prefix_workloads(cfg, tokenizer, args.requests, args.seed)
    slots = cfg.global_batch_size
    model = model_name(cfg)
    rows = []
    interrupted = False
    try:
        for cached in (False, True):
            server = ServerProcess(args.config, [*overrides, f"enable_prefix_caching={cached}"])
            try:
                warm = [{"prompt": [cfg.bos_token_id, 5, 6], "max_tokens": 2}] * slots
                asyncio.run(closed_loop(server.url, model, warm, slots, slots))
                start = cache_counts(server.url)
                shared = asyncio.run(closed_loop(server.url, model, suffixed, slots, slots))
                middle = cache_counts(server.url)
                shared.update(workload="2,048-token system prompt + question",
                              prefix_cache=cached, hit_rate=hit_rate(start, middle))
                rows.append(shared)
                talk = asyncio.run(conversations(server.url, model, system, talks))
                talk.update(workload=f"{len(talks)} conversations x 4 turns",
                            prefix_cache=cached,
                            hit_rate=hit_rate(middle, cache_counts(server.url)))
                rows.append(talk)
            finally:
                with files.uninterrupted():
                    server.stop()
            print(f"prefix cache {'on' if cached else 'off'}: done", file=sys.stderr)
    except KeyboardInterrupt:
        if not rows:
            raise
        interrupted = True
        print(f"interrupted: writing the {len(rows)} rows measured", file=sys.stderr)
    m = benchlib.machine(config=args.config, overrides=overrides, slots=slots,
                         requests=len(suffixed), conversations=len(talks),
                         **({"interrupted": True} if interrupted else {}))
    with files.uninterrupted():  # the measurements are done: both files, whatever arrives
        benchlib.write_jsonl(args.out / "prefix_cache.jsonl", m, rows)
        benchlib.write_csv(args.out / "prefix_cache.csv", m, PREFIX_FIELDS, rows)
    print(benchlib.machine_line(m))
    shown = [[r["workload"], "on" if r["prefix_cache"] else "off", str(r["requests"]),
              f"{r['output_tokens_per_s']:.1f}", f"{r['ttft_p50_ms']:.1f}",
              f"{r['ttft_p90_ms']:.1f}",
              "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"] for r in rows]
    print(table(["workload", "prefix cache", "requests", "out tok/s", "TTFT p50 ms",
                 "TTFT p90 ms", "hit rate"], shown))
    for i, name in ((0, "2,048-token shared prefix"), (1, "multi-turn")):
        if i + 2 >= len(rows):  # interrupted before the cache-on run of this workload
            continue
        off, on = rows[i], rows[i + 2]
        target = " (target >= 3)" if i == 0 else ""
        print(f"{name}: median TTFT {off['ttft_p50_ms']:.1f} -> {on['ttft_p50_ms']:.1f} ms, "
              f"{off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x lower{target}; throughput "
              f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x")
    return "interrupted" if interrupted else "done"


# ---- the offline engine -----------------------------------------------------------------------


class Offline:
    """The offline engine on the server's config, in this process (compiled before the server
    starts): its steady-state decode and static batches of the slot count. Each run is made
    while the server idles between load runs, so a ratio compares runs seconds apart."""

    def __init__(self, config: str, overrides: list[str], requests: list[dict]):
        from k3text.inference.engine import build_engine, enable_compilation_cache

        cfg = load_config(config, [*overrides, "ignore_eos=true"])
        enable_compilation_cache(cfg)
        self.engine, _ = build_engine(cfg)
        self.requests = requests
        self.slots = cfg.global_batch_size
        self.steps = max(r["max_tokens"] for r in requests)
        self.engine.warm_up(self.slots, self.steps - 1)
        self.steady()  # warm

    def steady(self) -> dict[str, Any]:
        """Every slot busy for as many steps as the longest request, in one decode call."""
        prompts = [r["prompt"] for r in self.requests[: self.slots]]
        gen = self.engine.decode_batch(prompts, batch=self.slots, max_steps=self.steps)
        per_step = gen.decode_seconds / (gen.decode_steps - 1)
        return {"mode": "offline steady state", "concurrency": self.slots,
                "requests": self.slots, "output_tokens": gen.generated_tokens,
                "seconds": gen.decode_seconds,
                "output_tokens_per_s": self.slots * (gen.decode_steps - 1) / gen.decode_seconds,
                "tpot_p50_ms": per_step * 1e3}

    def prefill_ceiling(self, steady: dict[str, Any]) -> dict[str, float]:
        """What the workload's prompts cost beside its decode steps, and the saturation ratio
        that leaves at best. The offline steady state only decodes; a server must also prefill
        every prompt, and on a small model a prompt costs several decode steps. Each prompt's
        chunks ride one-step decode calls on a full pool (as the server runs them), timed
        against plain one-step calls on the same pool, interleaved; a prompt that skips prefill
        (`serve_decode_prompt_tokens`) costs its slot a decode step per token instead; the
        decode work is the workload's output tokens at the steady state's per-step time with
        every slot busy. `ceiling`: decode / (decode + prefill), the saturation ratio with every
        slot always busy and no cost but the work itself."""
        from k3text.inference import sampling
        from k3text.serving.scheduler import prefill_rows

        engine, cfg, slots = self.engine, self.engine.cfg, self.slots
        chunk = cfg.prefill_chunk_size
        rows = prefill_rows(cfg)
        stop = np.tile(engine.stop_ids(), (rows, 1))
        params = sampling.config_sampling(cfg, rows, list(range(rows)))
        fill = [r["prompt"] for r in self.requests[:slots]]

        def busy_pool():  # every slot decoding, with room for the calls below
            pool, _ = engine.insert(engine.new_pool(slots), engine.prefill(fill, slots),
                                    list(range(slots)), [cfg.max_target_length] * slots,
                                    np.tile(engine.stop_ids(), (slots, 1)),
                                    sampling.config_sampling(cfg, slots, list(range(slots))))
            return pool

        pool, calls = busy_pool(), 0
        room = cfg.max_target_length - max(len(p) for p in fill) - 2

        def ride(prompt: list[int]) -> tuple[float, float]:
            """Seconds of `prompt`'s chunks riding one-step decode calls, and of as many plain
            one-step calls, interleaved."""
            nonlocal pool, calls
            tokens = np.full((rows, -(-len(prompt) // chunk) * chunk), cfg.pad_token_id,
                             np.int32)
            valid = np.zeros(tokens.shape, bool)
            tokens[0, :len(prompt)], valid[0, :len(prompt)] = prompt, True
            prefix, start, riding, plain = engine.new_prefix(rows), 0, 0.0, 0.0
            while start < len(prompt):
                if calls + 2 > room:
                    pool, calls = busy_pool(), 0
                width = engine.chunk_width(len(prompt) - start)
                began = time.perf_counter()
                pool, prefix, *_ = engine.decode_and_prefill(
                    pool, prefix, tokens[:, start:start + width], valid[:, start:start + width],
                    start, [-1] * rows, [1] * rows, stop, params)
                middle = time.perf_counter()
                pool, _ = engine.generate(pool, 1)
                riding += middle - began
                plain += time.perf_counter() - middle
                start, calls = start + width, calls + 2
            return riding, plain

        for width in (*engine.buckets, chunk):  # compile every width's one-step programs
            ride(fill[0][:1] * width)
        step = steady["tpot_p50_ms"] / 1e3
        fed = [] if cfg.serve_prefill_apart else \
            [r for r in self.requests if len(r["prompt"]) <= cfg.serve_decode_prompt_tokens]
        riders = [r for r in self.requests if r not in fed]
        riding, plain = (sum(t) for t in zip(*(ride(r["prompt"]) for r in riders),
                                               strict=True)) if riders else (0.0, 0.0)
        prefill = riding - plain + sum(len(r["prompt"]) for r in fed) / slots * step
        decode = sum(r["max_tokens"] for r in self.requests) / slots * step
        return {"prefill_s": prefill, "decode_s": decode, "ceiling": decode / (decode + prefill),
                "prefill_steps_per_prompt": prefill / len(self.requests) / step}

    def static(self) -> dict[str, Any]:
        """The workload in static batches of the slot count, in arrival order (each batch runs
        until its longest request ends)."""
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(self.requests), self.slots):
            group = self.requests[i: i + self.slots]
            out = self.engine.decode_batch([r["prompt"] for r in group], batch=self.slots,
                                           max_steps=self.steps,
                                           limits=[r["max_tokens"] for r in group])
            tokens += out.generated_tokens
        seconds = time.perf_counter() - start
        return {"mode": "offline static batches", "concurrency": self.slots,
                "requests": len(self.requests), "output_tokens": tokens, "seconds": seconds,
                "output_tokens_per_s": tokens / seconds}


def ratios(saturated: dict[str, Any], steady: dict[str, Any],
           static: dict[str, Any]) -> dict[str, float]:
    """The serving targets' three ratios, and the server's own decode step against offline's."""
    return {"saturation": saturated["saturated_tokens_per_s"] / steady["output_tokens_per_s"],
            "whole_run": saturated["output_tokens_per_s"] / steady["output_tokens_per_s"],
            "tpot": saturated["tpot_p50_ms"] / steady["tpot_p50_ms"],
            "continuous": saturated["output_tokens_per_s"] / static["output_tokens_per_s"],
            "server_step": saturated["server_ms_per_step"] / steady["tpot_p50_ms"]}


# ---- main -------------------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], m: dict[str, Any], path: Path) -> None:
    plt = benchlib.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    poisson_rows = [r for r in rows if r["mode"] == "poisson"]
    rates = [r["rate_rps"] for r in poisson_rows]
    for name in ("ttft", "tpot"):
        for q, style in ((50, "-"), (99, "--")):
            a.plot(rates, [r[f"{name}_p{q}_ms"] for r in poisson_rows], style, marker="o",
                   label=f"{name.upper()} p{q}")
    a.set_xscale("log")
    a.set_xticks(rates, [f"{r:g}" for r in rates])
    a.minorticks_off()
    a.set_yscale("log")
    a.set_xlabel("arrival rate (requests/s, Poisson)")
    a.set_ylabel("ms")
    a.legend()
    a.set_title("latency vs load")
    labels = [r["mode"] if r["mode"] != "poisson" else f"poisson {r['rate_rps']:g}/s"
              for r in rows]
    b.barh(labels, [r["output_tokens_per_s"] for r in rows])
    b.set_xlabel("output tokens/s")
    b.set_title("throughput")
    fig.tight_layout()
    benchlib.save_figure(fig, path, m)


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"expected requests/s > 0 separated by commas, got "
                                         f"{text!r}")
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default=str(CONFIG_DIR / "inference" / "cpu.yml"))
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--requests", type=_positive_int, default=96)
    p.add_argument("--rates", type=_rates, default=[2.0, 8.0, 32.0],
                   help="Poisson arrival rates, requests/s, separated by commas (default 2,8,32)")
    p.add_argument("--concurrency", type=_positive_int, default=None, help="default 2 x slots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=_positive_int, default=3,
                   help="interleaved rounds of offline steady state, saturation, static batches")
    p.add_argument("--out", type=Path, default=benchlib.RESULTS / "serve_load")
    p.add_argument("--force", action="store_true",
                   help="replace the results files of an earlier run in --out")
    p.add_argument("--baseline", default="",
                   help="comma-separated key=value overrides of a baseline server saturated in "
                        "every round beside the server")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed",
                   help="prompt and output lengths (see the module docstring)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="the shared-prefix workloads, with the prefix cache off then on")
    args = p.parse_args()
    if args.shared_prefix:  # its workloads and rows are its own
        ignored = [f"--{name}" for name in ("rates", "concurrency", "rounds", "baseline",
                                            "workload")
                   if getattr(args, name) != p.get_default(name)]
        if ignored:
            p.error(f"--shared-prefix does not take {', '.join(ignored)}")
    default_config = p.get_default("config")
    if "=" in args.config and not Path(args.config).exists():  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = default_config
    try:  # SIGTERM unwinds like Ctrl-C, so the servers are stopped
        with files.unwinding_signals():
            run = shared_prefix if args.shared_prefix else load_test
            if run(args) == "interrupted":
                return 130
    except (ValueError, OSError) as e:  # ConfigError and OutputError included
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    except (RuntimeError, httpx.HTTPError) as e:  # a server that did not start, or failed
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no results written", file=sys.stderr)
        return 130
    return 0


def load_test(args: argparse.Namespace) -> str:
    """Measure, write and print; "interrupted" when Ctrl-C cut it short after a first row (the
    rows measured are written), else "done"."""
    overrides = [*DEFAULT_OVERRIDES, *args.overrides]
    cfg = load_config(args.config, overrides)
    baseline_overrides = [o for o in args.baseline.split(",") if o]
    if baseline_overrides:  # checked now, not once the first server is up
        load_config(args.config, [*overrides, *baseline_overrides])
    benchlib.check_outputs([args.out / f"serve_load.{ext}" for ext in ("jsonl", "csv", "png")],
                           args.force)
    from k3text.serve import model_name

    tokenizer = text_tokenizer(cfg)
    requests = workload(cfg, tokenizer, args.requests, args.seed, args.workload)
    slots = cfg.global_batch_size
    concurrency = args.concurrency or 2 * slots
    model = model_name(cfg)
    offline = Offline(args.config, overrides, requests)
    baseline_mode = f"fixed concurrency, baseline {' '.join(baseline_overrides)}"
    rows, rounds = [], []
    server = baseline = None
    interrupted = False
    try:
        server = ServerProcess(args.config, overrides)
        if baseline_overrides:
            baseline = ServerProcess(args.config, [*overrides, *baseline_overrides])
        asyncio.run(closed_loop(server.url, model, requests[:slots], slots, slots))  # warm
        for rate in args.rates:
            rows.append(asyncio.run(poisson(server.url, model, requests, rate, args.seed)))
            print(f"poisson {rate:g}/s: {rows[-1]['output_tokens_per_s']:.1f} tok/s",
                  file=sys.stderr)
        # Saturation and the offline baselines, interleaved: this machine's speed drifts by up
        # to 2x over minutes, so each round's ratios come from runs seconds apart.
        # Each run also records the cores' round trip just before it (`core_round_trip_ns`):
        # the host moves this machine's two cores apart and back, which slows every program
        # here that hands data between threads.
        for i in range(args.rounds):
            steady = probed(offline.steady)
            runs = [server, baseline] if baseline and i % 2 else [baseline, server]
            for run in filter(None, runs):
                result = probed(lambda run=run: asyncio.run(closed_loop(
                    run.url, model, requests, concurrency, slots, run.proc.pid)))
                if run is server:
                    saturated = result
                else:
                    base = result
                    base["mode"] = baseline_mode
            static = probed(offline.static)
            ceiling = offline.prefill_ceiling(steady)
            saturated["prefill_ceiling"] = ceiling["ceiling"]
            steady.update(ceiling)
            this_round = ratios(saturated, steady, static) | {"ceiling": ceiling["ceiling"]}
            if baseline:
                this_round |= {
                    "vs_baseline": saturated["output_tokens_per_s"] / base["output_tokens_per_s"],
                    "tpot_vs_baseline": saturated["tpot_p50_ms"] / base["tpot_p50_ms"],
                    "step_vs_baseline": saturated["server_ms_per_step"]
                    / base["server_ms_per_step"]}
            for row in (saturated, steady, static, *([base] if baseline else [])):
                row["round"] = i + 1
            # A round counts once it is whole: Ctrl-C keeps the rounds completed.
            rows += [saturated, steady, static, *([base] if baseline else [])]
            rounds.append(this_round)
            trips = " / ".join(benchlib.round_trip_text(r["core_round_trip_ns"])
                               for r in (saturated, steady))
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.2f}x" for k, v in this_round.items())
                  + f"; the cores' round trip {trips} (server, offline)", file=sys.stderr)
    except KeyboardInterrupt:
        if not rows:
            raise
        interrupted = True
        print(f"interrupted: writing the {len(rows)} rows measured", file=sys.stderr)
    finally:
        with files.uninterrupted():
            for running in (server, baseline):
                if running is not None:
                    running.stop()
    m = benchlib.machine(config=args.config, overrides=overrides, slots=slots,
                         requests=len(requests), rounds=len(rounds), workload=args.workload,
                         baseline=baseline_overrides, **({"interrupted": True} if interrupted
                                                         else {}))
    with files.uninterrupted():  # the measurements are done: all three files, whatever arrives
        benchlib.write_jsonl(args.out / "serve_load.jsonl", m, rows)
        benchlib.write_csv(args.out / "serve_load.csv", m, FIELDS, rows)
        plot(rows, m, args.out / "serve_load.png")
    shown = [[r["mode"], f"{r.get('rate_rps') or r.get('concurrency'):g}",
              str(r.get("round", "-")), str(r["requests"]), f"{r['output_tokens_per_s']:.1f}",
              *(f"{r[k]:.1f}" if r.get(k) is not None else "-"
                for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"))]
             for r in rows]
    print(benchlib.machine_line(m))
    print(table(["mode", "rate/conc", "round", "requests", "out tok/s", "TTFT p50", "TTFT p99",
                 "TPOT p50", "TPOT p99"], shown))
    if not rounds:  # interrupted before the first round was complete
        return "interrupted"
    median = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
    spread = {k: (min(r[k] for r in rounds), max(r[k] for r in rounds)) for k in rounds[0]}

    def show(key: str) -> str:
        return f"{median[key]:.2f}x (rounds {spread[key][0]:.2f}-{spread[key][1]:.2f})"

    saturated = [r for r in rows if r["mode"] == "fixed concurrency"]
    share = {k: float(np.median([r[k] for r in saturated]))
             for k in ("decode_share", "prefill_share", "slot_occupancy")}
    cores = [r for r in saturated if r.get("server_cores") is not None]
    print(f"median of {len(rounds)} rounds, {args.workload} workload:")
    print(f"saturation vs offline steady-state decode: {show('saturation')} (target >= 0.8; "
          f"while at least {slots} requests were outstanding)")
    print(f"  the whole run, its drain included: {show('whole_run')}")
    steadies = [r for r in rows if r["mode"] == "offline steady state"]
    per_prompt = float(np.median([r["prefill_steps_per_prompt"] for r in steadies]))
    fed = f" or, up to {cfg.serve_decode_prompt_tokens} tokens, fed through decode steps" \
        if cfg.serve_decode_prompt_tokens and not cfg.serve_prefill_apart else ""
    print(f"  ceiling for this workload: {show('ceiling')}: its prompts, riding decode calls{fed}, "
          f"cost {per_prompt:.2f} offline decode steps each; decode / (decode + prefill) with "
          f"all {slots} slots busy every step and nothing else spent")
    if cfg.serve_prefill_apart:
        print("  (the ceiling is the riding scheduler's: with serve_prefill_apart no prompt rides "
              "a decode call, and its prefill runs beside the decode on a second mesh)")
    print(f"TPOT p50, all slots busy, vs offline per step: {show('tpot')} (target <= 1.5)")
    print(f"the server's own decode step at saturation vs offline's: {show('server_step')}; "
          f"its time {share['decode_share']:.0%} in decode calls, {share['prefill_share']:.0%} "
          f"in separate prefill calls; slots {share['slot_occupancy']:.0%} full")
    if cores:
        print(f"  its threads kept {np.median([r['server_cores'] for r in cores]):.2f} cores "
              f"busy, {np.median([r['host_cpu_share'] for r in cores]):.0%} of that CPU time "
              f"the host's (HTTP, scheduler, Python) and the rest XLA:CPU's; the load "
              f"generator kept {np.median([r['client_cores'] for r in cores]):.2f} cores busy "
              f"({os.cpu_count()} cores here)")
    trips = [r["core_round_trip_ns"] for r in rows if r.get("core_round_trip_ns") is not None]
    if trips:
        print(f"  the cores' round trip before each run: {min(trips):.0f}-{max(trips):.0f} ns "
              f"(benchlib.core_round_trip_ns; benchmarks/README.md: how far apart the host "
              f"placed the two cores, and what that costs)")
    print(f"continuous vs static batching: {show('continuous')} (target >= 1.5)")
    if baseline:
        print(f"vs the baseline server ({' '.join(baseline_overrides)}) at saturation: tokens/s "
              f"{show('vs_baseline')}, TPOT p50 {show('tpot_vs_baseline')}, decode step "
              f"{show('step_vs_baseline')}")
    return "interrupted" if interrupted else "done"


if __name__ == "__main__":
    sys.exit(main())
