"""GPU: a real ``@triton.jit`` kernel compiled on node A runs on node B, from the shared tier, without compiling.

Two processes (Triton keeps compiled kernels in memory per process), each with its own
empty ``TRITON_CACHE_DIR``, one ``file://`` remote, ``TRITON_CACHE_MANAGER`` set to
:class:`tiered_progcache.triton.TieredCacheManager`. Node A compiles and uploads; node B
loads the group and launches it; both outputs are checked against torch. The times to
first result are printed side by side (``pytest -s``), never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

NODE = Path(__file__).with_name("triton_node.py")
REPO = Path(__file__).resolve().parents[2]


def _device_or_skip() -> None:
    try:
        import torch
        import triton  # noqa: F401
    except Exception as exc:
        pytest.skip(f"triton or torch not importable: {type(exc).__name__}: {exc}")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def _run_node(tmp_path: Path, name: str, remote: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / name),
               TRITON_CACHE_MANAGER="tiered_progcache.triton:TieredCacheManager",
               TIERED_PROGCACHE_REMOTE=f"file://{remote}", TIERED_PROGCACHE_STRICT="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))  # fmt: skip
    done = subprocess.run([sys.executable, str(NODE)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_node_b_runs_node_a_s_triton_kernel_without_compiling(tmp_path):
    _device_or_skip()
    remote = tmp_path / "remote"
    remote.mkdir()
    a = _run_node(tmp_path, "node-a", remote)
    b = _run_node(tmp_path, "node-b", remote)
    print(f"\nnode A: {json.dumps(a)}\nnode B: {json.dumps(b)}")
    print(f"time to first result: node A {a['first_result_s']:.3f} s (compiled), node B {b['first_result_s']:.3f} s "
          f"(from the shared tier), B/A = {b['first_result_s'] / a['first_result_s']:.2f}; first launch to result: "
          f"node A {a['launch_to_result_s']:.3f} s, node B {b['launch_to_result_s']:.3f} s, "
          f"B/A = {b['launch_to_result_s'] / a['launch_to_result_s']:.2f}")  # fmt: skip
    assert a["matches"] and b["matches"]
    assert a["files_written"] > 0 and a["flushed"] and a["remote"]["writes"] == a["files_written"] + 1
    assert b["files_written"] == 0  # Triton writes compile outputs only when it compiles
    assert b["remote"]["hits"] >= 2 and b["remote"]["writes"] == 0  # a group record and its members at least
    if a["listener"]:
        assert a["compiles"] >= 1 and b["compiles"] == 0 and b["hits"] >= 1
