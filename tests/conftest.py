from __future__ import annotations

import pytest

import sys as _sys
from pathlib import Path as _Path

# the support modules (cli_support, header_support, ...) live in tests/, the tests in its packages
_sys.path.insert(0, str(_Path(__file__).resolve().parent))
# tests that import helpers from another test module, across packages
_sys.path.extend(str(_d) for _d in sorted(_Path(__file__).resolve().parent.iterdir())
                 if _d.is_dir() and not _d.name.startswith((".", "_")))

# gcsfs picks its experimental (gRPC) filesystem class at its import, which the GCS emulator does not serve:
# whichever test imports gcsfs first, it sees this (the GCS fixture sets it too, too late for an earlier import).
__import__("os").environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import tiered_progcache
from tiered_progcache.compiling.compile import CompileEvent


@pytest.fixture(autouse=True)
def _isolated_user_cache(tmp_path_factory, monkeypatch):
    """No test may read or write the real ~/.cache: cuda-core's default dir goes to a temp dir.

    Nor the user's config file (~/.config/tiered-progcache/config): XDG_CONFIG_HOME goes to a temp dir too.
    """
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
    for name in list(__import__("os").environ):
        if name.startswith("TIERED_PROGCACHE_"):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _fresh_node_compile_times(monkeypatch):
    """Every test starts as a fresh node: no compile timed (the flight policy predicts nothing).

    And no CPU share measured in it (a loaded CI host would make its races look first): the tests of that
    measurement ask for :func:`measured_cpu`.
    """
    from tiered_progcache.cluster import singleflight
    from tiered_progcache.cluster.flightpolicy import compile_times

    monkeypatch.setattr(compile_times, "note_cpu", lambda code_type, seconds, cpu_seconds: False)
    compile_times.clear()
    singleflight._loaded.clear()
    singleflight._seeded.clear()
    yield
    compile_times.clear()
    singleflight._loaded.clear()
    singleflight._seeded.clear()


@pytest.fixture
def measured_cpu(monkeypatch):
    """The process's compile times measuring each compile's CPU share, as outside the tests."""
    from tiered_progcache.cluster.flightpolicy import CompileTimes, compile_times

    monkeypatch.setattr(compile_times, "note_cpu", CompileTimes.note_cpu.__get__(compile_times))
    return compile_times


@pytest.fixture
def cleanup():
    """A :class:`support.Cleanup`: gates opened, queues and chains closed, threads joined at teardown."""
    from support import Cleanup

    undo = Cleanup()
    yield undo
    undo.finish()


@pytest.fixture
def events():
    """Every compiler run of ``tiered_progcache.compile()`` in this process while the test runs."""
    seen: list[CompileEvent] = []
    stop = tiered_progcache.on_compile(seen.append)
    yield seen
    stop()
