"""Running one command under ``stats --run`` and collecting the cache reports of every process it starts.

The command runs with ``$TIERED_PROGCACHE_STATS_FILE`` set to a fresh file (see
:mod:`tiered_progcache.ops.runstats`) and with the settings given on the command line as
their ``TIERED_PROGCACHE_*`` variables, so it builds the cache the flags describe.
Ctrl-C reaches the command too (same process group); this process ignores it while the
command runs, lets the command decide, and reports after it exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from . import runstats
from .. import settings
from ..chain.stats import CacheStats

__all__ = ["CommandNotStarted", "RunReport", "child_env", "run_command", "signal_name"]

logger = logging.getLogger(__name__)


class CommandNotStarted(Exception):
    """The command could not be started; ``exit_code`` is the shell's (127 not found, 126 not executable)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class RunReport:
    """One run of a command and the cache activity of its processes. Immutable."""

    argv: tuple[str, ...]
    returncode: int  # as subprocess gives it: negative when a signal killed the command
    seconds: float
    reports: tuple[Mapping[str, Any], ...]  # one per cache, as runstats read them

    @property
    def exit_code(self) -> int:
        """The command's exit code, or 128 + the signal that killed it (as a shell reports it)."""
        return self.returncode if self.returncode >= 0 else 128 - self.returncode

    @property
    def killed_by(self) -> str | None:
        """The name of the signal that killed the command, or None if it exited."""
        return signal_name(-self.returncode) if self.returncode < 0 else None

    @property
    def processes(self) -> int:
        return len(list(runstats.pids(self.reports)))

    @property
    def totals(self) -> CacheStats:
        return runstats.sum_reports(self.reports)


def signal_name(number: int) -> str:
    """``15`` -> ``"SIGTERM"``; a number with no name -> ``"signal 99"``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def child_env(overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) plus each setting in ``overrides`` as its ``TIERED_PROGCACHE_*`` variable."""
    env = dict(os.environ if environ is None else environ)
    for setting in settings.SETTINGS:
        if setting.name in overrides and setting.variable is not None:
            env[setting.variable] = setting.text(overrides[setting.name])
    return env


def run_command(argv: Sequence[str], env: Mapping[str, str]) -> RunReport:
    """Run ``argv`` with ``env`` to its end and read the reports its caches left.

    Raises :class:`CommandNotStarted` if it cannot be started.
    """
    fd, path = tempfile.mkstemp(prefix="tiered-progcache-stats-", suffix=".jsonl")
    os.close(fd)
    try:
        started = time.perf_counter()
        try:
            child = subprocess.Popen(list(argv), env={**env, runstats.STATS_FILE_ENV: path})
        except FileNotFoundError:
            raise CommandNotStarted(f"command not found: {argv[0]}", 127) from None
        except PermissionError:
            raise CommandNotStarted(f"command not executable: {argv[0]}", 126) from None
        with _sigint_ignored():
            returncode = child.wait()
        seconds = time.perf_counter() - started
        reports = runstats.read_reports(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return RunReport(tuple(argv), returncode, seconds, tuple(reports))


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore Ctrl-C in this process while the child runs; the child gets it too and decides what to do."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
