"""What the header-scan tests share: settled header files, a header memo cleared around each test, and a
well-formed direct-mode header set to alter."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support import options

from tiered_progcache.compiling import headermemo

#: mtimes an hour back: old enough for a stat to vouch for a file (headermemo.RACY_NS)
OLD = time.time() - 3600
SRC = '#include <a.h>\nextern "C" __global__ void k(int* out) { *out = A_VAL; }\n'
#: A kernel reading VAL, for a source made of include directives (``valdir``'s val.h defines it).
KERNEL = '\nextern "C" __global__ void k(int* out) { *out = VAL; }\n'


def write_header(path: Path, text: str, *, mtime: float | None = OLD) -> Path:
    """Write ``path``; ``mtime`` None leaves it just written (too fresh for a stat to vouch for it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


include_opts = options  # sm_90, ``inc`` the one include directory


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """inc/ with a reachable chain (a.h -> sub/b.h -> c.h by quoted-relative include) and bystanders."""
    inc = tmp_path / "inc"
    write_header(inc / "a.h", '#pragma once\n#include "sub/b.h"\n#define A_VAL (B_VAL + 1)\n')
    write_header(inc / "sub" / "b.h", '#pragma once\n#include "c.h"\n#define B_VAL (C_VAL * 2)\n')
    write_header(inc / "sub" / "c.h", "#pragma once\n#define C_VAL 3\n")
    write_header(inc / "unrelated.h", "#define NOT_USED 1\n")
    write_header(inc / "sub" / "also_unrelated.h", "#define ALSO_NOT_USED 1\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the source's own directory is the working directory
    return inc


@pytest.fixture
def valdir(tmp_path, monkeypatch):
    """inc/val.h defining VAL, the working directory elsewhere (work/)."""
    inc = tmp_path / "inc"
    write_header(inc / "val.h", "#define VAL 1\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return inc


@pytest.fixture(autouse=True)
def fresh_header_memo():
    """Every test starts and ends with no memoized scan (autouse where imported)."""
    headermemo.clear_memo()
    yield
    headermemo.clear_memo()


def direct_set(**fields) -> dict:
    """A well-formed direct-manifest header set of two roots (fields as ``direct.header_set`` writes them),
    with ``fields`` replaced."""
    one = {"n": 2, "keep": -1, "at": None, "files": [[0, "a.h", "ab" * 32, 1]], "absent": [[-3, "0\0b.h", 1]],
           "real": [[0, "", 1, -5, "", 1, "I0", ""]], "digest": "cd" * 32, "key": "ef" * 16, "missing": [],
           "path_free": True}
    one.update(fields)
    return one
