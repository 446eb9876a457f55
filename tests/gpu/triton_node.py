"""One GPU node for test_triton_gpu: run a real ``@triton.jit`` kernel once and report, as one JSON line.

Run under the environment the test gives it (``TRITON_CACHE_DIR``, ``TRITON_CACHE_MANAGER``,
``TIERED_PROGCACHE_REMOTE``). Reports the seconds from interpreter start to the first
result on the host, and from the first launch to it (compile or fetch, without imports and CUDA's start), the compiles Triton ran (its compilation listener where the version has
one; and the files Triton wrote through the cache manager, which only a compile writes),
whether the output matched torch, and the shared tier's counters.
"""

from __future__ import annotations

import json
import sys
import time

STARTED = time.perf_counter()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

from tiered_progcache import triton as tpt  # noqa: E402


@triton.jit
def scaled_add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, alpha * x + tl.exp(y) * 0.5, mask=mask)


def main() -> int:
    events = {"compiles": 0, "hits": 0}

    def listener(*, cache_hit: bool, **_: object) -> None:
        events["hits" if cache_hit else "compiles"] += 1

    has_listener = hasattr(knobs, "compilation") and hasattr(knobs.compilation, "listener")
    if has_listener:
        knobs.compilation.listener = listener
    n = 1 << 20
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=gen)
    y = torch.randn(n, device="cuda", generator=gen)
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    launched = time.perf_counter()  # imports, CUDA's start and the inputs are behind us: what is left is compile or fetch
    scaled_add[(triton.cdiv(n, 1024),)](x, y, out, n, 2.0, BLOCK=1024)
    torch.cuda.synchronize()
    done = time.perf_counter()
    first_result_s, launch_to_result_s = done - STARTED, done - launched
    expected = 2.0 * x + torch.exp(y) * 0.5
    matches = bool(torch.allclose(out, expected, rtol=1e-5, atol=1e-5))
    chain = tpt.shared_cache()
    flushed = chain.flush(timeout=60) if chain is not None else True
    local = tpt.stats()["triton-local"]
    remote = chain.stats()["remote"].as_dict() if chain is not None else None
    print(json.dumps({
        "first_result_s": round(first_result_s, 3), "launch_to_result_s": round(launch_to_result_s, 3),
        "matches": matches,
        "listener": has_listener, "compiles": events["compiles"] if has_listener else None,
        "hits": events["hits"] if has_listener else None, "files_written": local.writes,
        "group_local_hits": local.hits, "remote": remote, "flushed": flushed,
        "triton": triton.__version__, "device": torch.cuda.get_device_name(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
