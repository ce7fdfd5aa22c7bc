"""Writing outputs so that nothing is half-written or silently replaced.

- `check_output_file`: before any work, that a file can be written where asked (so a decode
  never ends by losing its results to a bad path);
- `write_atomically`: a temporary file beside the target, renamed into place;
- `staged_directory`: the same for a directory (checkpoints, exports), with the existing
  target kept unless replacing it was asked for;
- `uninterrupted`: SIGINT and SIGTERM held off while cleanup runs, so a second signal (or the
  first arriving mid-cleanup) cannot leave a staging copy behind;
- `signals_deferred`: SIGINT and SIGTERM delivered only once a step that must not be cut in
  half (a checkpoint save) is over;
- `gc_safe`: a signal handler that never raises inside a garbage-collector callback;
- `progress_bar`: a command's progress bar, whose line a signal never leaves open;
- `exit_status`: 2 for an error in a command's input, 1 for the machine's;
- `quiet_from_here`: a command's way out, with nothing a library left pending printed after
  its last line; `exit_now`, a way out that skips the exit handlers.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

from tqdm import tqdm


class OutputError(ValueError):
    """An output path that cannot be written, or that exists and may not be replaced."""


def exit_status(error: BaseException) -> int:
    """A command's exit status when `error` stops it: 2 when the input is at fault (every
    k3text input error is a ValueError: ConfigError, CheckpointError, OutputError; and a path
    that does not exist, is not of the kind needed, or may not be read or written), 1 when the
    machine is (any other OSError: a full disk, a lost mount)."""
    return 2 if isinstance(error, ValueError | FileNotFoundError | PermissionError
                           | IsADirectoryError | NotADirectoryError) else 1


_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM for the block (from the main thread; elsewhere a no-op): the
    block is already the way out, and a signal landing in it would cut its cleanup short.
    Ignoring (not masking) holds for every thread: a signal the kernel hands to a worker
    thread would still run Python's handler in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM arriving during the block are delivered as it ends (from the main
    thread; elsewhere a no-op): for a step a signal must not cut in half (a checkpoint save
    whose writer threads a KeyboardInterrupt would abandon), while the signal still stops the
    command right after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append(signum))
                for s in _SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)


@contextlib.contextmanager
def progress_bar(**options: Any) -> Iterator[tqdm]:
    """A tqdm bar on stderr (`options` as tqdm takes them) for the block, drawn first and closed
    with SIGINT and SIGTERM deferred. A signal landing right after the bar's first drawing (the
    command preempted there) or inside its close would leave the bar's line unfinished, and the
    command's last line ("interrupted; ...") would be printed on the end of it."""
    bar = None
    try:
        with signals_deferred():  # what arrives here is raised once the bar exists
            bar = tqdm(file=sys.stderr, **options)
        yield bar
    finally:
        if bar is not None:
            with signals_deferred():
                bar.close()


@contextlib.contextmanager
def unwinding_signals(terminate: Callable[[int, Any], Any] | None = None) -> Iterator[None]:
    """For the block (from the main thread; elsewhere a no-op): SIGINT raises KeyboardInterrupt
    and SIGTERM `terminate` (default: SystemExit(128 + signal)), both `gc_safe`, so a signal
    unwinds the command like Ctrl-C and its cleanup (`staged_directory`, temporary files) runs.
    The handlers before it are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, gc_safe(terminate or _exit)),
                signal.SIGINT: signal.signal(signal.SIGINT, gc_safe(signal.default_int_handler))}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler not installed from Python
                signal.signal(signum, handler)


def quiet_from_here() -> None:
    """The command ends on the error or signal just printed. Work a library left pending
    (Orbax's other reads after a damaged chunk, an event loop a signal cut short and the
    collector finalises at exit) fails again in its threads and at exit, with tracebacks that
    add nothing: from here on the process drops unraisable and thread errors, and, when
    sys.stderr is the process's own, all further stderr output (a signal landing in jax's exit
    handlers after a command finished included). Only the way out of a command's `main` calls
    this; a caller that redirected sys.stderr keeps its stream."""
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda args: None
    if sys.stderr is sys.__stderr__:  # file descriptor 2 itself: native threads write there too
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


def exit_now(status: int) -> NoReturn:
    """End the process with `status` once the logs and the standard streams are out, without
    finalising the interpreter: for a way out on which exit handlers would wait for work that
    can no longer finish (a compile in another thread; peers that will never reach
    jax.distributed's shutdown barrier)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _in_gc_callback(frame: Any) -> bool:
    codes = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def gc_safe(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """`handler` (one that raises: KeyboardInterrupt, SystemExit), except that a signal landing
    inside a garbage-collector callback (jax registers one) is delivered again a moment later:
    an exception raised there is printed as "Exception ignored" with a traceback and dropped,
    and the signal would be lost."""

    def deliver(signum: int, frame: Any) -> Any:
        if _in_gc_callback(frame):
            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return None
        return handler(signum, frame)

    return deliver


def check_output_file(path: str | os.PathLike, what: str = "output_file") -> Path:
    """`path` as a file this process can create or replace: its parent is (or can be made) a
    writable directory and the path itself is not a directory. Raises OutputError naming `what`
    and the path; nothing is left behind."""
    target = Path(path)
    if target.is_symlink():  # written through: the file it points to is what is replaced
        target = target.resolve()
    if target.is_dir():
        raise OutputError(f"{what} {str(path)!r} is a directory; give a file path")
    parent = target.parent
    missing = []
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{what} {str(path)!r}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {str(path)!r}: cannot write in {parent}")
    if not missing:  # probe the directory itself: access() can be wrong (e.g. /proc, ro mounts)
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        except OSError as e:
            raise OutputError(f"{what} {str(path)!r}: cannot write in {target.parent} "
                              f"({e.strerror})") from None
        os.close(fd)
        os.unlink(probe)
    return target


def write_atomically(path: str | os.PathLike, write: Callable[[IO[Any]], None], *,
                     binary: bool = False, replace: bool = True) -> None:
    """Write a file through `write(f)` (text, or bytes when `binary`) into a temporary file
    beside `path`, flushed to disk, then rename it into place: readers see the old file or the
    whole new one, never a part. A file replaced keeps its permissions, a new one gets those the
    umask allows (as `open` would give it); a symbolic link stays, and the file it points to is
    what is replaced.

    With `replace` false a file that appeared at `path` meanwhile (the caller checked there was
    none before its work) is kept: what was written stays beside it under a name of its own,
    which the OutputError raised names."""
    target = Path(path)
    if target.is_symlink():
        target = target.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with (os.fdopen(fd, "wb") if binary
              else os.fdopen(fd, "w", encoding="utf-8", newline="")) as f:
            os.fchmod(f.fileno(), mode)  # mkstemp makes 0600
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, target)
        else:
            _rename_unless_taken(Path(tmp), target)
    except BaseException:
        with uninterrupted():
            Path(tmp).unlink(missing_ok=True)
        raise


def _rename_unless_taken(tmp: Path, target: Path) -> None:
    """`tmp` becomes `target` unless a file took that name; then `tmp` is kept, visible, under a
    name of its own (an OutputError says which)."""
    try:
        os.link(tmp, target)  # fails, atomically, where `target` exists
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links: the check and the rename are apart
        if not target.exists():
            os.replace(tmp, target)
            return
    else:
        tmp.unlink()
        return
    kept = target.with_name(f"{target.name}.{secrets.token_hex(4)}")
    os.replace(tmp, kept)
    raise OutputError(f"{target} appeared while this command ran and is kept; the output was "
                      f"written to {kept} instead")


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (setting and restoring
    it would race with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class Staged:
    """What `staged_directory` did: `completed` once the staging directory became the target."""

    completed = False


@contextlib.contextmanager
def staged_directory(out: str | os.PathLike, replace: bool = False,
                     how_to_replace: str = "--force") -> Iterator[tuple[Path, Staged]]:
    """A temporary directory beside `out` that becomes `out` when the block succeeds.

    An existing `out` is an error unless `replace` (the message names `how_to_replace`); it is
    replaced only once the new one is complete. On any exception (KeyboardInterrupt and
    SystemExit included) the temporary directory is removed, with signals held off so cleanup
    finishes, and `out` is left as it was. The returned `Staged` says whether the rename
    happened, so an interrupt that lands after it can be reported as what it is. When `out` is
    a symbolic link, the directory it points to is what is replaced: the link stays.
    """
    out = Path(out)
    if out.is_symlink():
        out = out.resolve()
    if out.exists() and not out.is_dir():  # not replaced even when asked: a mistyped path
        raise OutputError(f"{out} is a file, not a directory; give a directory path")
    if out.exists() and not replace:
        raise OutputError(f"{out} already exists; use {how_to_replace} to replace it")
    staging = out.parent / f".{out.name}.{secrets.token_hex(4)}.partial"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except (FileExistsError, NotADirectoryError):  # a file where a directory would go
        blocker = next(p for p in out.parents if p.exists())
        raise OutputError(f"cannot create {out}: {blocker} is not a directory") from None
    except OSError as e:
        raise OutputError(f"cannot create {out} in {out.parent} ({e.strerror})") from None
    staged = Staged()
    try:
        yield staging, staged
        with uninterrupted():
            if out.exists():
                old = staging.with_suffix(".replaced")
                os.replace(out, old)
                try:
                    os.replace(staging, out)
                except BaseException:
                    os.replace(old, out)  # the old output back where it was, not hidden
                    raise
                staged.completed = True
                shutil.rmtree(old)
            else:
                os.replace(staging, out)
                staged.completed = True
    except BaseException:
        with uninterrupted():
            shutil.rmtree(staging, ignore_errors=True)
        raise
