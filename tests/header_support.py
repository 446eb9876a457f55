"""What the header-scan tests share: settled header files and a header memo cleared around each test."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tiered_progcache import headermemo

#: mtimes an hour back: old enough for a stat to vouch for a file (headermemo.RACY_NS)
OLD = time.time() - 3600
SRC = '#include <a.h>\nextern "C" __global__ void k(int* out) { *out = A_VAL; }\n'


def write_header(path: Path, text: str, *, mtime: float = OLD) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


@pytest.fixture(autouse=True)
def fresh_header_memo():
    """Every test starts and ends with no memoized scan (autouse where imported)."""
    headermemo.clear_memo()
    yield
    headermemo.clear_memo()
