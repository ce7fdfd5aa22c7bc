"""Serving from several processes (`jax.distributed`): process 0 answers HTTP and schedules; every
process runs the same programs on the same host inputs, in the same order.

Process 0's scheduler talks to a `LeaderEngine`: before each engine call that runs a program
(`DEVICE_CALLS`) it broadcasts the call — method, host arguments, and which pool or prefix it
acts on — to the other processes, then makes it. They run `follow`, which makes each call on
their own engine as it arrives, holding their shards of the same pool and prefix. Every
scheduling decision (admissions, prefill chunks, inserts with their sampling parameters and
seeds, releases, decode calls) is therefore taken once, on process 0, and only its effects are
replayed; nothing the other processes do depends on their own clocks or queues.

The scheduler keeps one pool, at most one prefix (a new prefix starts only when the previous
group is done) and at most one prefix-cache store alive at a time, so a call names them by
kind; `LeaderEngine` checks that a call's pool, prefix or store is the latest one it handed
out, so a broken assumption fails loudly instead of desynchronising the processes.

Messages go through `multihost_utils.broadcast_one_to_all` as a length and then the pickled
bytes, padded to a power of two so a few compiled broadcast programs serve every size.

A process that stops (a crash, a kill, a failed start) breaks the group for good: no
`jax.distributed` job runs programs again without it. A collective that fails because a peer
is gone is a `PeersLost`; the process that sees it stops at once with one line saying so (the
platform restarts the job), rather than serving 503s until the coordination service's
heartbeat aborts it.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from k3text.inference.engine import Engine, Later, Pool, Prefix, Tokens
from k3text.inference.prefix_cache import PrefixStore
from k3text.inference.sampling import PromptScores

log = logging.getLogger("k3text.serve")

DEVICE_CALLS = ("new_pool", "new_prefix", "prefill_chunk", "prefill_scored", "prefill_slices",
                "insert", "insert_prompts", "generate", "decode_and_prefill", "release",
                "warm_up", "new_store", "restore_prefix", "save_blocks",
                # The paged pool's (`serve_engine: paged`).
                "new_paged_pool", "paged_step", "paged_generate", "warm_up_paged")
_STOP = "stop"
_MIN_MESSAGE = 1 << 12


# How a collective or the coordination service reports a process that is gone: the CPU
# collectives' transport (Gloo) and the coordination service's RPCs.
_PEER_GONE = ("Gloo", "DEADLINE_EXCEEDED", "UNAVAILABLE", "Connection closed by peer",
              "Connection reset by peer", "coordination service")


class PeersLost(ConnectionError):
    """The processes of a multi-process server can no longer run programs together: another
    one stopped (its log says why) or cannot be reached."""


def peers_lost(error: BaseException, what: str) -> PeersLost | None:
    """`error` as a PeersLost naming `what` was under way, when it says a peer is gone; None
    for any other error."""
    if isinstance(error, PeersLost):
        return error
    text = str(error)
    if type(error).__name__ != "JaxRuntimeError" or not any(m in text for m in _PEER_GONE):
        return None
    return PeersLost(f"{what}: another process of this jax.distributed job stopped or cannot "
                     f"be reached ({text.splitlines()[0] if text else type(error).__name__}); "
                     f"its log says why")


class _Latest:
    """Names the latest pool or prefix in a broadcast call."""

    def __init__(self, kind: str):
        self.kind = kind


def _broadcast(payload: bytes | None) -> bytes:
    """`payload` from process 0 to every process (the others pass None)."""
    size = int(multihost_utils.broadcast_one_to_all(
        np.int64(0 if payload is None else len(payload))))
    buffer = np.zeros(max(_MIN_MESSAGE, 1 << (size - 1).bit_length()), np.uint8)
    if payload is not None:
        buffer[:size] = np.frombuffer(payload, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size])


def _kind(value: Any) -> str | None:
    if isinstance(value, Pool):
        return "pool"
    if isinstance(value, Prefix):
        return "prefix"
    if isinstance(value, PrefixStore):
        return "store"
    return None


def _returned(result: Any) -> list[tuple[str, Any]]:
    """The pools, prefixes and stores a call returns, by kind (insert and generate return the
    pool with tokens; decode_and_prefill the pool and the prefix)."""
    parts = result if isinstance(result, tuple) and _kind(result) is None else (result,)
    return [(kind, part) for part in parts if (kind := _kind(part)) is not None]


class LeaderEngine:
    """Process 0's engine: each program-running call is broadcast, then made; everything else
    (the config, `stop_ids`, ...) is the engine's own. Once a call finds a peer gone, every
    call raises the same PeersLost at once, and `on_lost` is told, once, after the lock below
    is released (so it may close the engine; the server then stops).

    A call and `close` hold one lock from the broadcast to the call's end, so the stop never
    goes out between another thread's broadcast and its call (the followers would take the
    stop's bytes for that call's, or wait in a collective process 0 never makes)."""

    def __init__(self, engine: Engine, on_lost: Callable[[PeersLost], None] = lambda e: None):
        self._engine = engine
        self._latest: dict[str, Any] = {}
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._closed = False
        self.lost: PeersLost | None = None

    def __getattr__(self, name: str) -> Any:
        if name in DEVICE_CALLS:
            return lambda *args, **kwargs: self._call(name, args, kwargs)
        return getattr(self._engine, name)

    def _encode(self, value: Any) -> Any:
        kind = _kind(value)
        if kind is None:
            return value
        if self._latest.get(kind) is not value:
            raise RuntimeError(f"multi-process serving: a call used a {kind} other than the "
                               f"latest one, which the other processes no longer hold")
        return _Latest(kind)

    def _call(self, method: str, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            seen = self.lost
            try:
                return self._locked_call(method, args, kwargs)
            except PeersLost:
                if seen is not None or self.lost is None:
                    raise
        # Told outside the lock, once: `on_lost` may close this engine (or call it, to raise).
        self._on_lost(self.lost)
        raise self.lost

    def _locked_call(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self.lost is not None:
            raise self.lost
        if self._closed:
            raise RuntimeError(f"multi-process serving has stopped: engine call {method} "
                               f"was not made")
        message = (method, [self._encode(a) for a in args],
                   {k: self._encode(v) for k, v in kwargs.items()})
        try:
            _broadcast(pickle.dumps(message))
            result = getattr(self._engine, method)(*args, **kwargs)
        except Exception as e:
            if (lost := peers_lost(e, f"multi-process serving stopped at engine call {method}")
                    ) is None:
                raise
            self.lost = lost
            raise lost from e
        self._latest.update(_returned(result))
        return result

    # Every process fetches a call's tokens as a collective, in the order of the calls: the
    # scheduler's dispatch-then-fetch calls are made whole, under their plain names.
    def dispatch_generate(self, *args: Any, **kwargs: Any) -> tuple[Pool, Later[Tokens]]:
        pool, tokens = self._call("generate", args, kwargs)
        return pool, Later.done(tokens)

    def dispatch_decode_and_prefill(self, *args: Any, **kwargs: Any,
                                    ) -> tuple[Pool, Prefix, Later[tuple]]:
        pool, prefix, *tokens = self._call("decode_and_prefill", args, kwargs)
        return pool, prefix, Later.done(tuple(tokens))

    def dispatch_prefill_scored(self, *args: Any, **kwargs: Any,
                                ) -> tuple[Prefix, Later[PromptScores]]:
        prefix, scores = self._call("prefill_scored", args, kwargs)
        return prefix, Later.done(scores)

    def close(self, timeout: float = 30.0) -> bool:
        """Tell the other processes to return from `follow` (unless they are gone), once no
        call is under way; later calls raise. Returns False, sending nothing, when a call is
        still under way after `timeout` seconds: this process must then end at once
        (`files.exit_now`: jax's exit handler would wait at a shutdown barrier the others,
        inside that call's collectives, never reach), and the others stop when its end fails
        the collective they wait in (a PeersLost there)."""
        if not self._lock.acquire(timeout=timeout):
            self._closed = True  # the call under way is the last
            return False
        try:
            if not self._closed and self.lost is None:
                _broadcast(pickle.dumps((_STOP, [], {})))
            self._closed = True
            return True
        finally:
            self._lock.release()


def follow(engine: Engine, after_warm_up: Callable[[], None] | None = None) -> int:
    """Make process 0's engine calls on this process's `engine` until it stops; returns the
    number of calls made. A call that fails here failed on process 0 as well (the same program
    on the same inputs): its scheduler fails the requests and starts again from a new pool,
    a call like any other, so this process logs the failure and follows on; a call that fails
    because process 0 (or another) is gone raises PeersLost. ``after_warm_up`` runs once each
    `warm_up` call has returned here (the programs are compiled)."""
    latest: dict[str, Any] = {}
    calls = 0

    def decode(value: Any) -> Any:
        return latest[value.kind] if isinstance(value, _Latest) else value

    while True:
        try:
            method, args, kwargs = pickle.loads(_broadcast(None))
        except Exception as e:
            lost = peers_lost(e, f"waiting for process 0's engine call {calls + 1}")
            if lost is None:
                raise
            raise lost from e
        if method == _STOP:
            log.info("process 0 stopped serving after %d engine calls", calls)
            return calls
        calls += 1
        try:
            result = getattr(engine, method)(*[decode(a) for a in args],
                                             **{k: decode(v) for k, v in kwargs.items()})
        except Exception as e:
            if (lost := peers_lost(e, f"following engine call {method}")) is not None:
                raise lost from e
            log.exception("engine call %s failed; following process 0's recovery", method)
            continue
        latest.update(_returned(result))
        if method in ("warm_up", "warm_up_paged") and after_warm_up is not None:
            after_warm_up()
