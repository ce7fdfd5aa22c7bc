"""Command-line plumbing shared by the entry points: `python -m k3text.decode|serve|train
CONFIG [key=value ...]` (`main`) and the tools, `python -m k3text.tools.NAME CONFIG [key=value ...]
[--flags]`, all with the same config loading.

A tool may own a few integer `name=value` keys of its own (`batch=`, `context=`); they are
taken out before the rest go to `load_config` as config overrides.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k3text import files
from k3text.config import Config, ConfigError, load_config


def main(argv: Sequence[str] | None, prog: str, doc: str, body: Callable[[Config], Any]) -> int:
    """Run `body(config)` for `python -m PROG CONFIG [key=value ...]`: usage on -h, k3text's
    INFO log lines on stderr, and a user error (bad config, checkpoint, file or value) as one
    line on stderr with exit status 2 (an operating-system error, such as a full disk, the same
    with status 1)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = f"usage: python -m {prog} CONFIG [key=value ...]"
    if argv and argv[0] in ("-h", "--help"):
        print(doc.strip() + f"\n\n{usage}")
        return 0
    if not argv:
        print(f"{usage}\nerror: no CONFIG file given (-h for help)", file=sys.stderr)
        return 2
    options = [a for a in argv if a.startswith("-")]  # settings are key=value, never flags
    if options:
        print(f"{usage}\nerror: unknown option {options[0]!r}: settings are config keys, "
              f"given as key=value (-h for help)", file=sys.stderr)
        return 2
    # force: an imported library may already have given the root logger a handler of its own.
    logging.basicConfig(format="%(name)s: %(message)s", stream=sys.stderr, force=True)
    logging.getLogger("k3text").setLevel(logging.INFO)
    status = _run_body(argv, prog, body)
    files.quiet_from_here()  # the command has said how it ended: nothing may print after it
    if status != 0 and _in_distributed_job():
        # This process failed where its peers may not have (a port taken on process 0, a
        # peer that died): jax.distributed's exit handler would wait for them at its shutdown
        # barrier until the coordination service's heartbeat aborts the process (status 134,
        # heartbeat_timeout_seconds later).
        files.exit_now(status)
    return status


def _run_body(argv: list[str], prog: str, body: Callable[[Config], Any]) -> int:
    """`main` once it has a CONFIG: the exit status, with the one line that explains it."""
    try:
        with files.unwinding_signals(_terminate):
            body(load_config(argv[0], argv[1:]))
    except (ValueError, OSError) as e:  # ConfigError, CheckpointError and OutputError included
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _out_of_device_memory(e):
            raise
        print(f"error: the programs do not fit in device memory ({str(e).splitlines()[0]}); "
              f"lower per_device_batch_size, max_target_length or prefill_chunk_size "
              f"(python -m k3text.tools.memory CONFIG shows the trade-off)", file=sys.stderr)
        return 2
    except _Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    return 0


def _in_distributed_job() -> bool:
    """Whether `jax.distributed` was initialised (by name, as below)."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def _out_of_device_memory(error: BaseException) -> bool:
    """An XLA allocation failure (a compile's or a run's temporaries): the config asks for more
    than the device holds. By name: this module is imported before jax may be."""
    return type(error).__name__ == "JaxRuntimeError" and "RESOURCE_EXHAUSTED" in str(error)


class _Terminated(SystemExit):
    """SIGTERM, raised where the main thread is, so `finally` blocks and cleanup run. A
    SystemExit, because asyncio lets only SystemExit and KeyboardInterrupt out of a callback:
    any other exception raised while an event loop runs one (Orbax restores through asyncio) is
    logged and dropped, and the task it would have woken waits forever."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated


def parser(prog: str, doc: str, tool_keys: Mapping[str, str] | None = None,
           ) -> argparse.ArgumentParser:
    """An ArgumentParser taking CONFIG and key=value items; `tool_keys` maps the tool's own keys
    to their help text."""
    epilog = None
    if tool_keys:
        width = max(len(key) for key in tool_keys) + 2
        epilog = "tool keys (not config keys):\n" + "\n".join(
            f"  {(key + '=N').ljust(width)}  {text}" for key, text in tool_keys.items())
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=epilog)
    p.add_argument("config", help="config file (e.g. configs/models/kimi-k3.yml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


TOOL_KEY_MAX = 2 ** 53


def split_tool_keys(items: Sequence[str], names: Sequence[str],
                    ) -> tuple[list[str], dict[str, int]]:
    """(config overrides, {tool key: int}) from the key=value items."""
    overrides, values = [], {}
    for item in items:
        key, _, raw = item.partition("=")
        if key.strip() not in names:
            overrides.append(item)
            continue
        try:
            values[key.strip()] = int(raw)
        except ValueError:
            raise ConfigError(f"'{item}': {key.strip()} must be an integer") from None
        if values[key.strip()] < 0:
            raise ConfigError(f"'{item}': {key.strip()} must be >= 0")
        if values[key.strip()] > TOOL_KEY_MAX:  # the tools' arithmetic is in floats
            raise ConfigError(f"'{item}': {key.strip()} must be at most 2**53")
    return overrides, values


def run(p: argparse.ArgumentParser, argv: Sequence[str] | None,
        body: Callable[[argparse.Namespace, Config, dict[str, int]], str],
        tool_keys: Sequence[str] = ()) -> int:
    """Parse, load the config, print `body(args, cfg, tool values)`; a config, argument or file
    problem ends in one line on stderr and exit status 2 (an operating-system error 1)."""
    args = p.parse_intermixed_args(argv)
    try:
        overrides, values = split_tool_keys(args.overrides, tool_keys)
        cfg = load_config(args.config, overrides)
        print(body(args, cfg, values))
    except (ValueError, OSError) as e:  # ConfigError included; a file the tool writes or reads
        print(f"error: {e}", file=sys.stderr)
        return files.exit_status(e)
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted", file=sys.stderr)
        return 130
    return 0
