"""``warm()``: a process's start-up, the remote's entries fetched and the headers they read hashed.

``TieredProgramCache.warm`` fetches entries, and with them the direct manifests (:mod:`.direct`).
A first hit of a header-heavy kernel then still hashes every header its set names (a CUB kernel:
about 600 files, 15-25 ms), unless this process hashed them at start-up: what ``include_path``
asks for here. Nothing is trusted from it; a hit stats each file as before and finds its digest
memoized only while the stat still matches (docs/cluster.md, "Warming nodes at boot").
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from cuda.core.utils import ProgramCacheResource

from ..chain.defaultcache import default_cache
from ..chain.tiered import as_chain
from ..stores.kinds import DIRECT
from . import direct
from .direct import IncludePath

if TYPE_CHECKING:
    from ..chain.transfer import TransferReport  # (imported with the bulk transfer, on first use)

__all__ = ["warm"]


def warm(cache: ProgramCacheResource | None = None, *, include_path: IncludePath | None = None,
         names: Iterable[str] | None = None, max_bytes: int | None = None, progress: Any = None) -> TransferReport:
    """``cache.warm(names, max_bytes=..., progress=...)`` (the default cache's when None), and with
    ``include_path`` (the include directories this process compiles with) the headers the fetched direct
    manifests name under them hashed now, into this process's stat-validated digest memo.

    >>> tiered_progcache.warm(cache, include_path=[cccl_dir])  # at process start: entries, then headers
    """
    if include_path is not None and not (isinstance(include_path, (str, os.PathLike)) or (
            isinstance(include_path, Sequence) and all(isinstance(d, (str, os.PathLike)) for d in include_path))):
        raise TypeError(f"include_path must be a directory or a list of directories (str or os.PathLike), "
                        f"got {include_path!r}")
    chain = as_chain(default_cache() if cache is None else cache)
    manifests: list[bytes] = []  # the direct manifests fetched (appended on the writer threads)

    def landed(payload: bytes, kind: str) -> None:
        if kind == DIRECT:
            manifests.append(payload)

    report = chain.warm(names, max_bytes=max_bytes, progress=progress, landed=None if include_path is None else landed)
    if include_path is not None:
        direct.prehash(manifests, include_path)
    return report
