"""Running the real ``tiered-progcache`` command in a subprocess, shared by the CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
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


def assert_one_line_error(proc: subprocess.CompletedProcess, rc: int = 2) -> str:
    """The command failed with ``rc`` and said why in one line, with no traceback."""
    assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]
