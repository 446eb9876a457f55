from __future__ import annotations

import pytest

import tiered_progcache
from tiered_progcache.compile import CompileEvent


@pytest.fixture(autouse=True)
def _isolated_user_cache(tmp_path_factory, monkeypatch):
    """No test may read or write the real ~/.cache: cuda-core's default dir goes to a temp dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    for name in list(__import__("os").environ):
        if name.startswith("TIERED_PROGCACHE_"):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _fresh_node_compile_times():
    """Every test starts as a fresh node: no compile timed (the flight policy predicts nothing)."""
    compile_module = __import__("importlib").import_module("tiered_progcache.compile")
    from tiered_progcache.flightpolicy import compile_times

    compile_times.clear()
    compile_module._times_loaded.clear()
    yield
    compile_times.clear()
    compile_module._times_loaded.clear()


@pytest.fixture
def events():
    """Every compiler run of ``tiered_progcache.compile()`` in this process while the test runs."""
    seen: list[CompileEvent] = []
    stop = tiered_progcache.on_compile(seen.append)
    yield seen
    stop()
