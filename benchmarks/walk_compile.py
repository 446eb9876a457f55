"""The walk of compile()'s cache parameter: which modules a compile() call enters with the chain in hand.

    python benchmarks/walk_compile.py

    python benchmarks/walk_compile.py [-v]

Every call of a library function that receives the chain (``self`` or any argument, on any
thread; properties count) is a step. A room is its module, or its function; consecutive
steps in one room are one stay; a return is a stay in a room already left. Three calls: a
cold miss on a ``file://`` remote (on this disk: ``R`` = 0, the lease case), a hit in memory,
and the same kernel from a new node's chain (a remote hit). ``-v`` prints each walk. Runs on
any tree with ``tiered_progcache.compile`` (``PYTHONPATH=<tree>``), to compare two. No
asserts: it reports.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from cuda.core import ProgramOptions

import tiered_progcache as tpc

SRC = 'extern "C" __global__ void walk(float* o) { o[threadIdx.x] = 3.0f * threadIdx.x; }\n'
LIB = os.path.dirname(tpc.__file__)


def _tracer(chain: Any, steps: list[tuple[str, str]]) -> Callable[..., None]:
    """A profile function that appends (module, function) for each library call given ``chain``."""

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(LIB):
            return
        loc = frame.f_locals
        for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            if loc.get(name) is chain:
                mod = os.path.relpath(code.co_filename, LIB)
                steps.append((mod, code.co_name))
                return

    return prof


def run(label: str, make_chain: Callable[[], Any]) -> Any:
    chain = make_chain()
    steps: list[tuple[str, str]] = []
    prof = _tracer(chain, steps)
    opts = ProgramOptions(arch="sm_90", std="c++17")
    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        tpc.compile(SRC, "c++", opts, cache=chain)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    out = [f"{label:26s} steps {len(steps):3d}"]
    for kind, room_of in (("modules", lambda s: s[0]), ("functions", lambda s: f"{s[0]}:{s[1]}")):
        stays = []
        for step in steps:
            room = room_of(step)
            if not stays or stays[-1] != room:
                stays.append(room)
        rooms = set(stays)
        out.append(f"{kind}: rooms {len(rooms):2d} stays {len(stays):2d} returns {len(stays) - len(rooms):2d}")
        if "-v" in sys.argv:
            print("   ", " > ".join(stays))
    print("   ".join(out))
    return chain


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="walk-")
    remote = os.path.join(tmp, "remote")
    os.makedirs(remote)
    a = run("cold miss, file:// remote", lambda: tpc.TieredProgramCache(os.path.join(tmp, "a"), remote="file://" + remote))
    run("hit in memory", lambda: a)
    a.close()
    run("remote hit, new node", lambda: tpc.TieredProgramCache(os.path.join(tmp, "b"), remote="file://" + remote))


if __name__ == "__main__":
    main()
