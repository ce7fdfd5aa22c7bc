"""The OpenAI-compatible server: `python -m k3text.serve CONFIG [key=value ...]` (`k3text-serve`).

Listens on `server_host:server_port` at once (`GET /health` answers 503 meanwhile), loads the
weights, compiles the serving programs (prefill of one chunk into a one-row prefix, insert into
the pool, `serve_steps_per_call` decode steps over the `per_device_batch_size x data` slots),
then serves `POST /v1/completions` and `POST /v1/chat/completions` through the scheduler.

SIGTERM stops admitting, lets in-flight requests finish for up to `serve_shutdown_timeout`
seconds, cancels the rest and exits 0; Ctrl-C does the same and exits 130.

With several processes (`jax_distributed_initialize: true`), every process runs this command:
process 0 serves HTTP and schedules, and the others make its engine calls as it broadcasts them
(`k3text.serving.multihost`), returning when it stops; SIGTERM to one of them (platforms
signal every process of a job) leaves it following until process 0 has finished its requests.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # before jax starts, so CPU runs of multi-device configs just work
    from k3text.config import request_host_devices

    request_host_devices(sys.argv[1:])

import jax  # noqa: E402
import uvicorn  # noqa: E402

from k3text import files, sharding  # noqa: E402
from k3text.config import Config, ConfigError  # noqa: E402
from k3text.inference.engine import (  # noqa: E402
    Engine,
    build_engine,
    enable_compilation_cache,
)
from k3text.inference.pages import pool_size  # noqa: E402
from k3text.serving.api import ServerState, create_app  # noqa: E402
from k3text.serving.metrics import Metrics  # noqa: E402
from k3text.serving.multihost import LeaderEngine, PeersLost, follow, peers_lost  # noqa: E402
from k3text.serving.paged_scheduler import PagedScheduler  # noqa: E402
from k3text.serving.protocol import Protocol  # noqa: E402
from k3text.serving.scheduler import Scheduler, prefill_rows  # noqa: E402
from k3text.serving.text import ChatTemplate  # noqa: E402
from k3text.tokenizer import load_tokenizer, tokenizer_file  # noqa: E402
from k3text.tools import cli  # noqa: E402

log = logging.getLogger("k3text.serve")


def model_name(cfg: Config) -> str:
    """`served_model_name`, else the checkpoint directory's name (its parent's when it is
    called `checkpoint` or `export`), else "random"."""
    if cfg.served_model_name:
        return cfg.served_model_name
    if not cfg.load_parameters_path:
        return "random"
    path = Path(cfg.load_parameters_path).resolve()
    return path.parent.name if path.name in ("checkpoint", "export") else path.name


class _Server(uvicorn.Server):
    """uvicorn's server, with SIGTERM a clean stop: admission ends at the signal, and the
    process exits 0 instead of re-raising the signal after the graceful shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.scheduler is not None:
            self.state.scheduler.stop_accepting()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def _freeze_heap() -> None:
    """Exempt everything alive now (the model, jax's modules and caches, the compiled programs)
    from Python's cyclic garbage collector. Its full collections traverse every tracked object
    while holding the GIL: with the loaded process's heap one took over half a second, during
    which the scheduler could not dispatch a decode call. The objects serving allocates per
    request are still collected."""
    gc.collect()
    gc.freeze()
    log.info("%d objects frozen out of garbage collection", gc.get_freeze_count())


def xla_cpus(setting: str, available: set[int], processes: int,
             backend: str) -> set[int] | None:
    """The CPUs `serve_xla_cpus` confines XLA:CPU's threads to, or None to leave them be
    (see configs/base.yml). Only the CPU backend runs the model on them; with several processes
    a machine's CPUs may be shared out already, so ``auto`` leaves a multi-process job be."""
    if backend != "cpu" or setting == "all":
        return None
    if setting == "auto":
        return set(sorted(available)[1:]) if processes == 1 and len(available) > 1 else None
    cpus = {int(c) for c in setting.split(",")}
    if not cpus <= available:
        raise ConfigError(f"serve_xla_cpus={setting}: CPUs {sorted(cpus - available)} are not "
                          f"among this process's {sorted(available)}")
    return cpus


def _confine_xla_threads(cpus: set[int]) -> int:
    """Pin this process's XLA:CPU threads (named ``tf_XLA...``: the intra-op workers, the
    executors) to `cpus`; the others keep theirs. Returns how many were pinned (0 without
    /proc)."""
    pinned = 0
    for task in Path("/proc/self/task").glob("*"):
        try:
            if (task / "comm").read_text().startswith("tf_XLA"):
                os.sched_setaffinity(int(task.name), cpus)
                pinned += 1
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return pinned


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} (server_host, server_port): "
                          f"{e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(cfg: Config) -> None:
    if jax.process_index() > 0:
        try:
            engine, _ = build_engine(cfg)
        except Exception as e:  # process 0 failed to start, most likely: say so in one line
            raise peers_lost(e, "loading the model") or e from None
        log.info("process %d of %d: following process 0's engine calls", jax.process_index(),
                 jax.process_count())
        with _sigterm_left_to_process_0():
            follow(engine, after_warm_up=_freeze_heap)
        return
    available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    cpus = xla_cpus(cfg.serve_xla_cpus, available, jax.process_count(), jax.default_backend())
    tokenizer = load_tokenizer(cfg.tokenizer_type, tokenizer_file(cfg))
    slots = cfg.global_batch_size
    metrics = Metrics(slots)
    protocol = Protocol(cfg, tokenizer, model_name(cfg), ChatTemplate(tokenizer_file(cfg)))
    state = ServerState(protocol, metrics, cfg.max_target_length)
    sock = _listen(cfg.server_host, cfg.server_port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=cfg.serve_shutdown_timeout,
                            lifespan="off")
    server = _Server(config, state)
    failure: list[BaseException] = []
    leaders: list[LeaderEngine] = []

    def lost(error: PeersLost) -> None:  # from the scheduler's thread or this one
        failure.append(error)
        server.should_exit = True

    def load() -> None:
        try:
            engine, _ = build_engine(cfg)
            prefill_engine = build_prefill_engine(cfg, engine)
            if jax.process_count() > 1:
                engine = LeaderEngine(engine, on_lost=lost)
                leaders.append(engine)
            if cfg.serve_engine == "paged":
                seconds = engine.warm_up_paged(slots, *pool_size(cfg), prefill_rows(cfg),
                                               cfg.serve_steps_per_call, cfg.serve_max_logprobs)
            else:
                seconds = engine.warm_up(slots, cfg.serve_steps_per_call,
                                         prefill_batch=prefill_rows(cfg),
                                         top_n=cfg.serve_max_logprobs, serving=True,
                                         prefill_engine=prefill_engine)
            _freeze_heap()
            if cpus is not None:
                log.info("XLA:CPU's %d threads confined to CPUs %s (serve_xla_cpus=%s)",
                         _confine_xla_threads(cpus), ",".join(map(str, sorted(cpus))),
                         cfg.serve_xla_cpus)
            if cfg.serve_engine == "paged":
                scheduler = PagedScheduler(cfg, engine, tokenizer, metrics,
                                           on_stuck=_exit_stuck)
            else:
                scheduler = Scheduler(cfg, engine, tokenizer, metrics, prefill_engine,
                                      on_stuck=_exit_stuck)
            scheduler.start()
            state.scheduler = scheduler
            log.info("ready: model %r, %d slots, compile %.1f s", protocol.model_name, slots,
                     seconds)
        except BaseException as e:  # reported by the main thread, which then exits
            if not failure:
                failure.append(peers_lost(e, "starting up") or e)
            server.should_exit = True

    log.info("listening on http://%s:%d (GET /health answers 503 until ready)", host, port)
    loader = threading.Thread(target=load, name="k3text-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if failure:  # the loader stopped the server and is on its way out
            loader.join(timeout=30)
        if loader.is_alive():
            _exit_during_start_up(sys.exc_info()[1])
        try:
            if state.scheduler is not None and not state.scheduler.stop(
                    cfg.serve_shutdown_timeout):
                _exit_stuck_at_stop()
        finally:  # a second signal cutting the drain short still releases the followers
            with files.uninterrupted():
                for leader in leaders:  # after the scheduler's last engine call
                    if not leader.close():
                        _exit_stuck_at_stop()
    if failure:
        raise failure[0]
    if not server.started:
        raise ConfigError(f"the server on {host}:{port} did not start")
    log.info("stopped")


@contextlib.contextmanager
def _sigterm_left_to_process_0() -> Iterator[None]:
    """A following process outlives its first SIGTERM. Platforms that stop a multi-host job
    signal every process at once, and process 0 then finishes its in-flight requests through
    engine calls this process must still make; it returns from `follow` when process 0 stops
    serving. A second SIGTERM ends it at once."""
    def deferred(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.info("SIGTERM: following process 0 until it stops serving (again to exit now)")

    previous = signal.signal(signal.SIGTERM, deferred)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_prefill_engine(cfg: Config, engine: Engine) -> Engine | None:
    """With `serve_prefill_apart`, `engine` on a second mesh of its mesh's shape, over the
    devices after it; else None."""
    if not cfg.serve_prefill_apart:
        return None
    taken = set(engine.ctx.mesh.devices.flat)
    rest = [d for d in jax.devices() if d not in taken]
    if len(rest) < len(taken):
        raise ConfigError(f"serve_prefill_apart needs a second mesh of {len(taken)} devices "
                          f"beside the decode mesh's, but only {len(rest)} more are available")
    mesh = sharding.make_mesh(cfg, rest[:len(taken)])
    log.info("prefill on its own mesh: devices %s", [d.id for d in mesh.devices.flat])
    return engine.on_mesh(sharding.MeshContext(mesh, cfg.logical_axis_rules))


def _exit_stuck(seconds: float) -> None:
    """The scheduler's watchdog: an iteration has run past `serve_iteration_timeout`. The call
    it waits in cannot be interrupted, so no request can be served again and no drain can
    finish; the process ends with status 1 at once (with several processes, process 0's end
    ends the job through jax's coordination service), for the platform to restart it."""
    print(f"error: a scheduler iteration has run {seconds:.0f} s, past "
          f"serve_iteration_timeout: a device, or another process of this job, is stuck; "
          f"the server exits", file=sys.stderr)
    files.exit_now(1)


def _exit_stuck_at_stop() -> None:
    """The drain is over but the scheduler thread is still inside a device call (or, with
    several processes, its collectives): finalising the interpreter underneath it would crash
    or wait at jax.distributed's shutdown barrier for peers inside that call. The process ends
    at once with status 1; the other processes stop when their collectives fail."""
    print("error: the scheduler is still inside a device call after the drain; the server "
          "exits without waiting for it", file=sys.stderr)
    files.exit_now(1)


def _exit_during_start_up(error: BaseException | None) -> None:
    """A signal (or an error of the HTTP server) during start-up: the loader thread is inside
    a compile no signal interrupts, and finalising the interpreter underneath it crashes the
    process (a segmentation fault after "stopped"). Nothing is written or held yet, so the
    process ends here: 0 after SIGTERM, 130 after Ctrl-C, 1 after an error (printed)."""
    if error is None or isinstance(error, KeyboardInterrupt | SystemExit):
        log.info("stopped during start-up")
        files.exit_now(130 if isinstance(error, KeyboardInterrupt) else 0)
    print(f"error: the HTTP server failed during start-up: {error!r}", file=sys.stderr)
    files.exit_now(1)


def main(argv: Sequence[str] | None = None) -> int:
    def body(cfg: Config) -> None:
        enable_compilation_cache(cfg)
        sharding.maybe_initialize_distributed(cfg)
        serve(cfg)

    return cli.main(argv, "k3text.serve", __doc__, body)


if __name__ == "__main__":
    sys.exit(main())
