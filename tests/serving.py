"""Test helpers for the server: start `python -m k3text.serve` on a free localhost port, wait
until it is ready, stop it; and the offline references it is compared with."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from helpers import ROOT, XLA_CACHE

CPU = str(ROOT / "configs" / "inference" / "cpu.yml")
# Four 16-token prefill chunks fit a 64-token prompt: long prompts take several chunks.
SHIPPED = ["kda_chunk_size=16", "prefill_chunk_size=16", "per_device_batch_size=8",
           "progress=false"]
# The prefix cache on, with room for about 26 blocks of 16 tokens: evictions under load.
CACHED = ["enable_prefix_caching=true", "prefix_cache_bytes=2000000"]


class Server:
    """A server process; its stderr is collected in `lines`."""

    def __init__(self, config: str, *overrides: str, cache: str | Path = XLA_CACHE,
                 ready: bool = True, timeout: float = 600, listens: bool = True):
        args = [sys.executable, "-m", "k3text.serve", config, "server_port=0",
                f"compilation_cache_dir={cache}", *overrides]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not listens:  # a follower process of a multi-process server
            return
        self.url = self._wait_for(r"listening on (http://\S+)", timeout).group(1)
        if ready:
            self.wait_ready(timeout)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def _wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                raise AssertionError("server exited:\n" + "\n".join(self.lines))
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + "\n".join(self.lines))

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("server exited:\n" + "\n".join(self.lines))
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("server not ready:\n" + "\n".join(self.lines))

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._reader.join(timeout=10)
        return rc


def offline_decode(tmp_path: Path, config: str, prompts: list[list[int]], max_steps: int,
                   *overrides: str, cache: str | Path = XLA_CACHE) -> list[dict]:
    """`python -m k3text.decode` on token-id prompts; its JSONL records in input order, with
    each token's log-probability and top two."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "offline.jsonl"
    args = [sys.executable, "-m", "k3text.decode", config, f"prompts_file={prompts_file}",
            f"output_file={out}", "return_log_prob=true", "return_top_logprobs=2",
            f"max_decode_steps={max_steps}",
            f"compilation_cache_dir={cache}", *overrides]
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ})
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def run_scheduler(scheduler, requests) -> list[dict]:
    """Every (prompt, SamplingParams) of `requests` through an in-process scheduler, all
    queued before its first iteration (so its groups never vary); per request its token ids,
    log-probabilities, top log-probabilities, finish reason and prompt scores (when asked).
    The scheduler is started here and stopped at the end."""
    from k3text.serving.scheduler import Finished, Request

    results = [dict(ids=[], lps=[], top=[], done=threading.Event(), reason=None,
                    greedy=params.temperature == 0.0) for _, params in requests]

    def sink(result):
        def receive(event):
            if isinstance(event, Finished):
                result["reason"] = event.reason
                result["done"].set()
            else:
                if event.prompt is not None:  # prompt_logprobs, with the first tokens
                    assert "prompt" not in result and not result["ids"]
                    result["prompt"] = event.prompt
                result["ids"] += event.ids
                result["lps"] += event.logprobs
                result["top"] += [[lp for _, lp in row] for row in event.top or []]
        return receive

    scheduler.start()
    try:
        with scheduler._cv:
            for (prompt, params), result in zip(requests, results, strict=True):
                scheduler.submit(Request(list(prompt), params, sink(result)))
        for result in results:
            assert result["done"].wait(600), "a request never finished"
    finally:
        scheduler.stop()
    return results
