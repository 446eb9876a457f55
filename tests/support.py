"""What many test modules share: a clock the test moves by hand, kernel options and compiles, the CLI in a subprocess.

Import by name (pytest puts ``tests/`` on ``sys.path``)::

    from support import FakeClock, compile_matmul, options, run_cli

The ``cleanup`` fixture (tests/conftest.py) is a :class:`Cleanup`: what a test starts (a queue,
a chain, a thread, a gate it holds shut) is undone at teardown, whether or not its asserts held.

Helpers with fixtures tied to one concern stay in their own module
(``header_support``: settled header files and the header memo; ``triton_support``: a
real Triton kernel, also run as a script).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from cuda.core import Program, ProgramOptions
from cuda.core.utils import ProgramCacheResource

from tiered_progcache.samples import matmul_source
from tiered_progcache.testing.contract import BackDoor

__all__ = [
    "ARCH",
    "Cleanup",
    "FakeClock",
    "FileBackDoor",
    "FsspecBackDoor",
    "RedisBackDoor",
    "assert_one_line_error",
    "compile_matmul",
    "in_forked_child",
    "options",
    "run_cli",
]

#: The architecture the tests compile for (sm_90, as on the H200); NVRTC builds its cubin on the CPU.
ARCH = "sm_90"


_T = TypeVar("_T")

#: How long teardown waits for one thing to close or one thread to end.
CLEANUP_JOIN_S = 30



def wait_child(pid: int, limit_s: float = 60.0) -> int:
    """A forked child's exit code; one still running after ``limit_s`` is killed and the test fails.

    Bounded from the parent (a pidfd), so a child stuck anywhere, even in C code or in a fork
    handler before its first line, fails the test in ``limit_s`` instead of hanging the suite.
    """
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], limit_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"forked child {pid} hung for {limit_s} s")
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def in_forked_child(report: Callable[[], Any]) -> Any:
    """Fork; the child calls ``report()`` and writes its JSON to a pipe. The parent returns what it wrote.

    The fork is real, so every hook registered with :mod:`tiered_progcache.forks` has run in
    the child before ``report`` does, and nothing the child does reaches the parent's state.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 1
        try:
            os.close(read_end)
            with os.fdopen(write_end, "w") as out:
                out.write(json.dumps(report()))
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, text
    return json.loads(text)


class Cleanup:
    """Undoes what a test started, at teardown, whether or not its asserts held (a failing assert leaks nothing).

    Gates first (a worker held in a store is let go), then what has a ``close()`` (newest first),
    then the threads: those started through :meth:`thread` and every write-back worker started
    during the test. A thread still running after that fails the teardown: a leak is an error.
    """

    def __init__(self) -> None:
        self._opens: list[Callable[[], object]] = []
        self._closes: list[Callable[[], object]] = []
        self._threads: list[threading.Thread] = []
        self._before = set(threading.enumerate())

    def gate(self, gate: threading.Event | Callable[[], object]) -> None:
        """Open ``gate`` at teardown (an Event is set, a callable is called) before anything is closed."""
        self._opens.append(gate.set if isinstance(gate, threading.Event) else gate)

    def close(self, thing: _T, *args: Any) -> _T:
        """Call ``thing.close(*args)`` at teardown; returns ``thing``."""
        self._closes.append(lambda: thing.close(*args))  # type: ignore[attr-defined]
        return thing

    def thread(self, target: Callable[[], object], *, name: str | None = None) -> threading.Thread:
        """Start a daemon thread running ``target``; teardown joins it (after the gates and closes)."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def join(self, thread: threading.Thread) -> threading.Thread:
        """Join ``thread`` (started elsewhere: a ``Timer``, a process's helper) at teardown; returns it."""
        self._threads.append(thread)
        return thread

    def finish(self) -> None:
        """Open, close, join; re-raise the first error a close raised, then fail on a thread still running."""
        for open_ in self._opens:
            open_()
        errors: list[BaseException] = []
        for close in reversed(self._closes):
            try:
                close()
            except Exception as exc:
                errors.append(exc)
        workers = [t for t in threading.enumerate()
                   if t not in self._before and t.name.startswith("tiered-progcache-writeback-")]  # fmt: skip
        for thread in self._threads + workers:
            thread.join(CLEANUP_JOIN_S)
        if errors:
            raise errors[0]
        left = [t.name for t in self._threads + workers if t.is_alive()]
        assert not left, f"threads still running after teardown: {left}"


class FakeClock:
    """A clock that moves only when the test moves it: ``clock.now += 30`` instead of sleeping 30 s.

    Pass it wherever the code takes ``clock=`` (the breaker, the exit budget, the runner).
    Not synchronized: a test steps it from one thread.
    """

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (usable as an injected ``sleep``)."""
        self.now += seconds


def options(*include: str | os.PathLike[str], arch: str = ARCH, **extra: object) -> ProgramOptions:
    """``ProgramOptions`` for ``arch`` with ``include`` as the include path (left out when none given).

    >>> options(tmp_path / "inc", std="c++17")
    """
    if include:
        extra["include_path"] = [os.fspath(path) for path in include]
    return ProgramOptions(arch=arch, **extra)


def compile_matmul(cache: ProgramCacheResource, tile: int = 16, epilogue: str = "identity") -> bytes:
    """The sample matmul kernel's cubin, through cuda-core's own ``Program.compile(cache=...)`` (not ``compile()``)."""
    program = Program(matmul_source(tile, epilogue), "c++", options(std="c++17"))
    try:
        return bytes(program.compile("cubin", cache=cache).code)
    finally:
        program.close()


REPO_ROOT = Path(__file__).resolve().parents[1]


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a child Python: this checkout first, then what this process was given (packages
    installed with ``pip install --target`` are reached only that way, on the GPU host for one)."""
    return os.pathsep.join(part for part in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if part)


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real ``tiered-progcache`` command (``python -m tiered_progcache``) in a subprocess, with ``env`` added."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "tiered_progcache", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=120,
    )


def run_cli_here(capsys: Any, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command's ``main`` in this process (no interpreter start: ~1 s less a run), as :func:`run_cli` returns it.

    ``env`` is added to the environment for the call only. For argument parsing and configuration;
    a test of what a real process does (at exit, with signals) uses :func:`run_cli`.
    """
    import logging

    from tiered_progcache.ops import cli

    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    package_logger = logging.getLogger("tiered_progcache")
    handlers, level = list(package_logger.handlers), package_logger.level
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    finally:
        package_logger.handlers[:] = handlers
        package_logger.setLevel(level)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["tiered-progcache", *args], code, out.out, out.err)


def assert_one_line_error(proc: subprocess.CompletedProcess, rc: int = 2) -> str:
    """The command failed with ``rc`` and said why in one line, with no traceback."""
    assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# -- back doors: each backend's medium, read without the store (EntryStoreTests' ``back_door``) -------


def _shard(name: str) -> str:
    """``<2 hex>/<62 hex>``: where an entry lives under ``entries/`` (cuda-core's layout, docs/remote-format.md)."""
    return f"{name[:2]}/{name[2:]}"


class FileBackDoor(BackDoor):
    """A cache directory read with ``os`` calls alone: a local directory, or a ``file://`` remote's root."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, name: str) -> Path:
        return self.root / "entries" / _shard(name)

    def read(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, raw: bytes) -> None:
        self._path(name).parent.mkdir(parents=True, exist_ok=True)
        self._path(name).write_bytes(raw)

    def delete(self, name: str) -> None:
        self._path(name).unlink()

    def objects(self) -> list[str]:
        found = []
        for directory, _, files in os.walk(self.root):
            found += [os.path.join(directory, f) for f in files]
        return sorted(found)


class FsspecBackDoor(BackDoor):
    """A remote's objects through a raw fsspec filesystem of their own (not the store's), under ``base``."""

    def __init__(self, fs: Any, base: str) -> None:
        self.fs = fs
        self.base = base.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.base}/entries/{_shard(name)}"

    def read(self, name: str) -> bytes | None:
        self.fs.invalidate_cache()
        try:
            return bytes(self.fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None

    def write(self, name: str, raw: bytes) -> None:
        self.fs.pipe_file(self._path(name), raw)
        self.fs.invalidate_cache()

    def delete(self, name: str) -> None:
        self.fs.rm_file(self._path(name))
        self.fs.invalidate_cache()

    def objects(self) -> list[str]:
        self.fs.invalidate_cache()
        with contextlib.suppress(FileNotFoundError):
            return sorted(self.fs.find(self.base))
        return []


class RedisBackDoor(BackDoor):
    """A Redis tier's keys through a raw redis-py client: entries at ``<prefix>:entries:<name>``."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def _key(self, name: str) -> str:
        return f"{self.prefix}:entries:{name}"

    def read(self, name: str) -> bytes | None:
        value = self.client.get(self._key(name))
        return None if value is None else bytes(value)

    def write(self, name: str, raw: bytes) -> None:
        self.client.set(self._key(name), raw)

    def delete(self, name: str) -> None:
        assert self.client.delete(self._key(name)) == 1

    def objects(self) -> list[str]:
        return sorted(key.decode() for key in self.client.scan_iter(match=f"{self.prefix}:*"))


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port bound and never listening for the block's length: every connect to it is refused."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        yield closed.getsockname()[1]
