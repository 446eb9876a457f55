"""A real Triton kernel compiled on the CPU (no device: Triton's bundled ptxas), and a node that runs it.

``python tests/triton_support.py`` is one "node": it compiles :data:`add_kernel` with
``triton.compile`` under the environment it is given (``TRITON_CACHE_DIR``,
``TRITON_CACHE_MANAGER``, ``TIERED_PROGCACHE_*``) and prints one JSON line: how many
compiles Triton ran (its own compilation listener says ``cache_hit``), the kernel's
hash, and the sha256 of every file in its cache directory. At exit the write-back
queues flush (the library's own exit hook).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: sm_90, as on the H200; ptxas builds the cubin on the CPU.
TARGET = GPUTarget("cuda", 90, 32)
METADATA_FILE = "add_kernel.json"


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


def source() -> ASTSource:
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    return ASTSource(add_kernel, signature=signature, constexprs={"BLOCK": 128})


class CompileCounter:
    """Triton's compilation listener (``knobs.compilation.listener``): compiles and cache hits as Triton reports them."""

    def __init__(self) -> None:
        self.compiles = 0
        self.hits = 0

    def __call__(self, *, cache_hit: bool, **_: object) -> None:
        if cache_hit:
            self.hits += 1
        else:
            self.compiles += 1

    def __enter__(self) -> CompileCounter:
        knobs.compilation.listener = self
        return self

    def __exit__(self, *exc: object) -> None:
        knobs.compilation.listener = None


def compile_kernel() -> triton.compiler.CompiledKernel:
    return triton.compile(source(), target=TARGET)


def files_of(directory: str) -> dict[str, str]:
    """File name -> sha256 of each file in one key directory."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if not os.path.isfile(os.path.join(directory, name)):
            continue
        with open(os.path.join(directory, name), "rb") as fh:
            out[name] = hashlib.sha256(fh.read()).hexdigest()
    return out


def main() -> int:
    with CompileCounter() as counter:
        kernel = compile_kernel()
    root = os.environ["TRITON_CACHE_DIR"]
    key_dirs = [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]  # not stats.jsonl, a run's line
    files = {d: files_of(os.path.join(root, d)) for d in key_dirs}
    print(json.dumps({"compiles": counter.compiles, "hits": counter.hits, "hash": kernel.hash, "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
