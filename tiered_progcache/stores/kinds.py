"""What a stored entry is: a kernel (a code object) or metadata beside one (a manifest, a symbol map, a direct manifest).

``compile()`` stores up to three entries per compile: the binary, its manifest and,
with name expressions, its symbol map. Operators count kernels, so ``stats``, ``ls``,
``warm``, ``push``, ``export`` and ``import`` count the two apart.

From a listing alone, a manifest is known by its name (:func:`~.store.manifest_name` of a
listed entry); a symbol map's name derives from the cache key, which a listing does
not give, so it is known by its bytes. :func:`kind_of` reads a payload; classifying a
listing (:func:`tiered_progcache.ops.classify.classify`, which reads manifests) reads only
the listed entries small enough to be metadata (at most :data:`METADATA_READ_BYTES`
stored) and not already known by name.

The formats that tell the kinds apart are defined here, below the modules that write them
(``compiling/manifest.py``, ``compiling/symbols.py``, ``compiling/direct.py`` import them):
a store's entries are classified without importing how a compile is made.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

__all__ = ["DIRECT", "DIRECT_MAGIC", "KERNEL", "MANIFEST", "MANIFEST_FORMAT", "METADATA_READ_BYTES", "SYMBOLS",
           "SYMBOLS_FORMAT", "TRITON", "TRITON_KERNEL", "EntryKind", "count_kinds", "kind_of"]

#: The ``format`` of a stored manifest (:mod:`tiered_progcache.compiling.manifest`).
MANIFEST_FORMAT = "tiered-progcache/manifest"
#: The ``format`` of a stored symbol map (:mod:`tiered_progcache.compiling.symbols`).
SYMBOLS_FORMAT = "tiered-progcache/symbols"
#: How a stored direct manifest starts (then zlib-compressed JSON; :mod:`tiered_progcache.compiling.direct`):
#: :func:`kind_of` tells it by this.
DIRECT_MAGIC = b"tiered-progcache/direct/1\n"

KERNEL = "kernel"
MANIFEST = "manifest"
SYMBOLS = "symbols"
#: A direct manifest (:mod:`~tiered_progcache.compiling.direct`): the header sets of a compile, beside its entries.
DIRECT = "direct"
#: Every entry of a store of Triton's files (namespace ``triton``): counted as files, never read to classify.
TRITON = "triton"
#: The group index of one Triton compile (``__grp__<name>.json``), where the store names its files: one kernel.
TRITON_KERNEL = "triton-kernel"

#: Entries stored in at most this many bytes are read to tell a symbol map from a small kernel.
METADATA_READ_BYTES = 64 * 1024
_FORMATS = {MANIFEST_FORMAT: MANIFEST, SYMBOLS_FORMAT: SYMBOLS}
_MAX_NAMES_SHOWN = 8


@dataclasses.dataclass(frozen=True)
class EntryKind:
    """One entry's kind (``kernel``, ``manifest``, ``symbols``) and the kernel names known for it. Immutable.

    ``names``: for a kernel, the kernels its manifest records (empty when it has none);
    for a symbol map, its name expressions; for a manifest, the kernels it describes.
    """

    kind: str
    names: tuple[str, ...] = ()

    @property
    def is_kernel(self) -> bool:
        return self.kind in (KERNEL, TRITON_KERNEL)

    def shown_names(self) -> str:
        """The names for a column: comma-separated, at most a few, ``-`` for none."""
        if not self.names:
            return "-"
        more = len(self.names) - _MAX_NAMES_SHOWN
        return ",".join(self.names[:_MAX_NAMES_SHOWN]) + (f",+{more}" if more > 0 else "")


def kind_of(payload: bytes | memoryview) -> str:
    """``manifest``, ``symbols`` or ``direct`` for the metadata ``compile()`` stores, else ``kernel``."""
    if bytes(payload[:len(DIRECT_MAGIC)]) == DIRECT_MAGIC:
        return DIRECT
    head = bytes(payload[:1])
    if head != b"{" or len(payload) > METADATA_READ_BYTES:
        return KERNEL
    try:
        doc = json.loads(bytes(payload))
    except ValueError:
        return KERNEL
    return _FORMATS.get(doc.get("format"), KERNEL) if isinstance(doc, dict) else KERNEL


def count_kinds(kinds: Iterable[EntryKind]) -> tuple[int, int]:
    """(kernels, metadata entries)."""
    kernels = metadata = 0
    for kind in kinds:
        if kind.is_kernel:
            kernels += 1
        else:
            metadata += 1
    return kernels, metadata
