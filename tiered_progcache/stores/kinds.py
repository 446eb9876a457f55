"""What a stored entry is: a kernel (a code object) or metadata beside one (a manifest, a symbol map, a direct manifest).

``compile()`` stores up to three entries per compile: the binary, its manifest and,
with name expressions, its symbol map. Operators count kernels, so ``stats``, ``ls``,
``warm``, ``push``, ``export`` and ``import`` count the two apart.

From a listing alone, a manifest is known by its name (:func:`manifest_name` of a
listed entry); a symbol map's name derives from the cache key, which a listing does
not give, so it is known by its bytes. :func:`kind_of` reads a payload; :func:`classify`
reads, in the store's batches, only the listed entries small enough to be metadata
(at most :data:`METADATA_READ_BYTES` stored) and not already known by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..compiling.manifest import (
    MANIFEST_FORMAT,
    Manifest,
    ManifestError,
    decode_manifest,
    manifest_name,
    read_manifests,
)
from ..compiling.symbols import SYMBOLS_FORMAT
from ..compiling.direct import DIRECT_MAGIC

if TYPE_CHECKING:
    from .store import EntryStore, StoredEntry

__all__ = ["DIRECT", "KERNEL", "MANIFEST", "METADATA_READ_BYTES", "SYMBOLS", "TRITON", "TRITON_KERNEL", "EntryKind",
           "classify", "count_kinds", "kind_of"]

KERNEL = "kernel"
MANIFEST = "manifest"
SYMBOLS = "symbols"
#: A direct manifest (:mod:`~tiered_progcache.compiling.direct`): the header sets of a compile, beside its entries.
DIRECT = "direct"
#: Every entry of a store of Triton's files (namespace ``triton``): counted as files, never read to classify.
TRITON = "triton"
#: The group index of one Triton compile (``__grp__<name>.json``), where the store names its files: one kernel.
TRITON_KERNEL = "triton-kernel"
_TRITON_GROUP_PREFIX = "__grp__"

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


def _symbol_names(payload: bytes) -> tuple[str, ...]:
    try:
        pairs = json.loads(payload)["symbols"]
        return tuple(str(pair[0][1]) for pair in pairs)
    except (ValueError, KeyError, TypeError, IndexError):
        return ()


def classify(store: EntryStore, listed: Sequence[StoredEntry], *, names: bool = False) -> dict[str, EntryKind]:
    """Entry name -> :class:`EntryKind` for every listed entry.

    Reads small unknown entries (see the module docstring); with ``names``, also each
    kernel's manifest (from the listing, as ``ls --long`` does) for its kernel names.
    Entries that cannot be read count as kernels.
    """
    if store.namespace == TRITON:
        return {e.name: _triton_kind(store.file_of(e.name)) for e in listed}
    if store.namespace == "cupy":  # CuPy's kernel cache holds kernels only: none is read to classify it
        return {e.name: EntryKind(KERNEL) for e in listed}
    by_name = {e.name: e for e in listed}
    manifests = {manifest_name(name): name for name in by_name}
    out: dict[str, EntryKind] = {}
    small = []
    for e in listed:
        if e.name in manifests and manifests[e.name] in by_name and manifests[e.name] not in manifests:
            out[e.name] = EntryKind(MANIFEST)
        elif e.size <= METADATA_READ_BYTES:
            small.append(e.name)
        else:
            out[e.name] = EntryKind(KERNEL)
    described: dict[str, Manifest] = {}
    batch = max(1, store.transfer_batch)
    for start in range(0, len(small), batch):
        chunk = small[start : start + batch]
        got = store.read_many(chunk)
        for name in chunk:
            payload = got.hits.get(name)
            if payload is None:  # absent or unreadable
                out[name] = EntryKind(KERNEL)
                continue
            kind = kind_of(payload)
            if kind == SYMBOLS:
                out[name] = EntryKind(SYMBOLS, _symbol_names(payload))
            elif kind == DIRECT:
                out[name] = EntryKind(DIRECT)
            elif kind == MANIFEST:
                out[name] = EntryKind(MANIFEST)
                try:
                    m = decode_manifest(payload)
                    described[m.entry] = m
                except ManifestError:
                    pass
            else:
                out[name] = EntryKind(KERNEL)
    if names:
        for name, m in read_manifests(store, listed).items():
            if isinstance(m, Manifest):
                described[name] = m
        for name, kind in list(out.items()):
            m = described.get(name)
            if kind.is_kernel and m is not None:
                out[name] = EntryKind(KERNEL, tuple(m.inputs.kernels))
            elif kind.kind == MANIFEST and manifests.get(name) in described:
                out[name] = EntryKind(MANIFEST, tuple(described[manifests[name]].inputs.kernels))
    return out


def _triton_kind(which: tuple[str, str] | None) -> EntryKind:
    """A Triton file by its key and name: its compile's group index is the kernel, the rest its files."""
    if which is None:
        return EntryKind(TRITON)
    key, file = which
    kind = TRITON_KERNEL if file.startswith(_TRITON_GROUP_PREFIX) else TRITON
    return EntryKind(kind, (f"{key}/{file}",))


def count_kinds(kinds: Iterable[EntryKind]) -> tuple[int, int]:
    """(kernels, metadata entries)."""
    kernels = metadata = 0
    for kind in kinds:
        if kind.is_kernel:
            kernels += 1
        else:
            metadata += 1
    return kernels, metadata
