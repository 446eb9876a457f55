"""GPU: CuPy kernels compiled by node A run on node B, from the shared tier, with no NVRTC kernel compile.

Two fresh processes (``tests/gpu/cupy_node.py``), each with its own empty
``CUPY_CACHE_DIR``, one ``file://`` remote, :func:`tiered_progcache.cupy.install`: an
``ElementwiseKernel``, a ``ReductionKernel`` and a ``RawModule`` with name expressions
and an ``-I`` header, checked against numpy. Times are printed (``pytest -s``), never asserted.
The same run without pytest: ``OUT=dir bash benchmarks/gpu_cupy.sh``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

NODE = Path(__file__).with_name("cupy_node.py")


def _device_or_skip() -> None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:
        pytest.skip(f"cupy or a CUDA device not usable: {type(exc).__name__}: {exc}")


def test_node_b_runs_node_a_s_cupy_kernels_without_compiling(tmp_path):
    _device_or_skip()
    spec = importlib.util.spec_from_file_location("cupy_node", NODE)
    assert spec is not None and spec.loader is not None
    cupy_node = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cupy_node)
    result = cupy_node.drive(tmp_path / "out")
    a, b = result["node_a"], result["node_b"]
    assert a["installed"] and b["installed"]
    assert all(a["matches"].values()) and all(b["matches"].values())
    assert a["saves"] == a["kernel_nvrtc_runs"] >= 3 and a["flushed"]  # 2 kernels + 1 module, each saved once
    assert b["kernel_nvrtc_runs"] == 0 and b["saves"] == 0
    assert b["remote"]["hits"] == a["saves"] and b["remote"]["writes"] == 0
    assert sorted(b["cache_files"]) == sorted(a["cache_files"])  # the same CuPy names, landed on B
    assert any("-h" in name for name in b["cache_files"])  # the -I module is header-keyed
