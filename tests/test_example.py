"""The README's first command runs this example: it must compile, cache and say which tier answered."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "persistent_program_cache.py"


def _run(*args: str) -> str:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], check=True, capture_output=True, text=True, cwd=REPO_ROOT
    ).stdout


def test_example_misses_then_hits_local_then_memory(tmp_path):
    first = _run("--cache-dir", str(tmp_path), "--tile-size", "32", "--epilogue", "relu")
    second = _run("--cache-dir", str(tmp_path), "--tile-size", "32", "--epilogue", "relu")
    assert "Cache status: MISS" in first
    assert "Cache status: LOCAL" in second
    assert "Compile     : 0.00 ms (skipped)" in second
    for out in (first, second):
        assert "Second lookup in this process: MEMORY" in out
        assert "No CUDA device" in out or "Validation  : PASSED" in out
    key_lines = {line for out in (first, second) for line in out.splitlines() if line.startswith("Key         :")}
    assert len(key_lines) == 1  # the same key both times


def test_example_clear_cache_forces_a_miss(tmp_path):
    _run("--cache-dir", str(tmp_path))
    assert "Cache status: MISS" in _run("--cache-dir", str(tmp_path), "--clear-cache")


def test_example_rejects_bad_sizes(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--cache-dir", str(tmp_path), "--m", "0"],
        capture_output=True, text=True, cwd=REPO_ROOT,
    )
    assert result.returncode == 2 and "must be positive" in result.stderr
