"""Which entries of a store's listing are kernels and which are metadata, with the kernels' names.

``stats`` and ``ls`` count kernels apart from the manifests and symbol maps
beside them (:mod:`tiered_progcache.stores.kinds` says what each kind is and tells one by its
bytes). :func:`classify` reads, in the store's batches, only the listed entries small enough
to be metadata (at most :data:`~tiered_progcache.stores.kinds.METADATA_READ_BYTES` stored)
and not already known by name, and with ``names`` the kernels' manifests.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..compiling.manifest import Manifest, ManifestError, decode_manifest, read_manifests
from ..stores.kinds import DIRECT, KERNEL, MANIFEST, METADATA_READ_BYTES, SYMBOLS, TRITON, TRITON_KERNEL, EntryKind, kind_of
from ..stores.store import manifest_name, read_in_batches
from ..triton.tritonnames import describe, name_of

if TYPE_CHECKING:
    from ..stores.store import EntryStore, StoredEntry

__all__ = ["classify"]

_TRITON_GROUP_PREFIX = "__grp__"


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
        return _triton_kinds(store, listed, names=names)
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
    for chunk, got in read_in_batches(store, small):
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


def _triton_kinds(store: EntryStore, listed: Sequence[StoredEntry], *, names: bool) -> dict[str, EntryKind]:
    """Triton's files by key and name: from the listing where the store knows them (Triton's directory),
    else, with ``names``, from each entry's frame (one batched read per ``transfer_batch``; a frame is
    believed only where the entry's name is the one its key and file give)."""
    out = {e.name: _triton_kind(store.file_of(e.name)) for e in listed}
    unnamed = [e.name for e in listed if store.file_of(e.name) is None] if names else []
    for chunk, got in read_in_batches(store, unnamed):
        for name in chunk:
            payload = got.hits.get(name)
            which = None if payload is None else describe(payload)
            if which is not None and name_of(which.key, which.file) == name:
                out[name] = _triton_kind((which.key, which.file))
    return out


def _triton_kind(which: tuple[str, str] | None) -> EntryKind:
    """A Triton file by its key and name: its compile's group index is the kernel, the rest its files."""
    if which is None:
        return EntryKind(TRITON)
    key, file = which
    kind = TRITON_KERNEL if file.startswith(_TRITON_GROUP_PREFIX) else TRITON
    return EntryKind(kind, (f"{key}/{file}",))
