"""Shared test helpers: configs, meshes and engines for the tiny models."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from k3text import sharding
from k3text.config import Config, load_config
from k3text.inference.engine import Engine, place_model
from k3text.layers.initializers import Init
from k3text.models.decoder import Decoder

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
# The run's compilation cache (conftest.py), for the commands tests start.
XLA_CACHE = os.environ["K3TEXT_TEST_XLA_CACHE"]


def tiny_config(name: str, *overrides: str) -> Config:
    """A tiny model config at full fp32 precision (references compare at `highest`)."""
    return load_config(MODELS / f"{name}.yml",
                       ["matmul_precision=highest", "weight_dtype=float32", "dtype=float32",
                        *overrides])


def mesh_context(cfg: Config, devices: int | None = None) -> sharding.MeshContext:
    devices = jax.devices()[: devices or cfg.num_devices]
    return sharding.MeshContext(sharding.make_mesh(cfg, devices), cfg.logical_axis_rules)


def engine_for(cfg: Config, model: Decoder | None = None, seed: int = 0) -> Engine:
    ctx = mesh_context(cfg)
    model = Decoder(cfg, Init(seed)) if model is None else model
    return Engine(cfg, place_model(model, ctx), ctx)


def coordinator_port() -> int:
    """A free localhost port for a `jax.distributed` coordinator, which the test's subprocesses
    bind seconds later. It is drawn at random from below the kernel's ephemeral range, where no
    port-0 bind lands (the servers other tests start, every outgoing connection), so nothing
    else takes it in between; checked free when drawn."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(low // 2, low) if low >= 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port below {low} for a jax.distributed coordinator")


# Two correct programs that sum in different orders (sharded or not, other batch shapes, other
# kernels) may rank two tokens differently where their log-probabilities are this close.
NEAR_TIE = 1e-3


def assert_same_greedy(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]],
                       tops: Sequence[Sequence[Sequence[float]]] | None,
                       got_logprobs: Sequence[Sequence[float]] | None = None,
                       want_logprobs: Sequence[Sequence[float]] | None = None,
                       atol: float = 1e-4, where: str = "") -> list[int]:
    """Two programs' greedy tokens for each prompt are the same, and so are their
    log-probabilities (within `atol`, where given), except from a near tie on: at the first
    token where the two part (where one stops and the other goes on, when it is a prefix of
    the other: a stop token chosen at a near tie and left out), `tops` (either program's
    highest log-probabilities per token, highest first: up to there both saw the same context)
    must show the top two within NEAR_TIE. A parting anywhere else, or without `tops` to judge
    it (None, or no entry at that token), fails. Returns how many tokens the two share per
    prompt (all of `want`'s where they never part)."""
    shared = []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a, b = list(a), list(b)
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b)))
        if at < max(len(a), len(b)):
            top = tops[i][at] if tops is not None and at < len(tops[i]) else []
            gap = top[0] - top[1] if len(top) > 1 else float("inf")
            assert gap < NEAR_TIE, (
                f"{where}prompt {i}: {a} != {b} from token {at}, where the two highest "
                f"log-probabilities are {gap:.3g} apart (a near tie: below {NEAR_TIE})")
        shared.append(at)
        if got_logprobs is not None and want_logprobs is not None:
            np.testing.assert_allclose(got_logprobs[i][:at], want_logprobs[i][:at], atol=atol,
                                       rtol=0, err_msg=f"{where}prompt {i}")
    return shared
