"""Cache bundles: a store's entries as one file, to ship with an image or carry to an air-gapped node.

A bundle is a tar stream (zstd-compressed when the zstandard package is installed;
a reader tells the two apart by their magic bytes) of regular files::

    entries/<2 hex>/<62 hex>    one entry, sealed in its envelope (envelope.py: digest, HMAC when signed)
    index.json                  last: {"format": "tiered-progcache-bundle", "version": 1, "entries": N, ...}

The index comes last so that a bundle cut short anywhere is missing it (or is cut
inside a member, which tar notices): a truncated bundle is refused, never half-read.

A bundle may come from an untrusted place, so :func:`read_bundle` trusts nothing in
it: members are counted and size-capped as they are read (decompressed bytes
included), only regular files named exactly ``entries/<2 hex>/<62 hex>`` are
accepted (no ``..``, no absolute paths, no links, no devices), and every envelope is
verified (digest; signature when a key is given, and then unsigned entries are
refused) *before* anything lands. :func:`import_bundle` lands nothing from a bundle
that fails any check; each entry it lands is written whole by the target store
(``write_entry``: the local directory stages and renames).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from ..stores.codeobject import check_code_object, code_arch
from ..stores.envelope import HEADER_SIZE, MAX_ENTRY_BYTES, EnvelopeCodec, InvalidEnvelope
from ..errors import one_line
from ..stores.kinds import KERNEL, MANIFEST, SYMBOLS, kind_of
from ..compiling.manifest import ManifestError, decode_manifest, manifest_name
from ..stores.store import BatchRead, EntryStore, check_entry_name

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "DEFAULT_MAX_MEMBERS",
    "DEFAULT_MAX_TOTAL_BYTES",
    "BundleRefused",
    "BundleReport",
    "export_bundle",
    "import_bundle",
    "read_bundle",
]

logger = logging.getLogger(__name__)

BUNDLE_FORMAT = "tiered-progcache-bundle"
BUNDLE_VERSION = 1
#: The most entries one bundle may hold.
DEFAULT_MAX_MEMBERS = 100_000
#: The most envelope bytes (after decompression) one bundle may hold; they are held in memory until verified.
DEFAULT_MAX_TOTAL_BYTES = 4 << 30

_INDEX = "index.json"
_MAX_INDEX_BYTES = 64 << 10
_MEMBER = re.compile(r"entries/([0-9a-f]{2})/([0-9a-f]{62})")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAC_SIZE = 32
#: Tar's own bytes per member (header, padding; a PAX header at most this much more) on top of the payloads.
_TAR_OVERHEAD_PER_MEMBER = 4096
_ZSTD_LEVEL = 3


class BundleRefused(Exception):
    """The bundle failed a check; nothing from it landed. ``str()`` is one line saying why."""


@dataclasses.dataclass(frozen=True)
class BundleReport:
    """What one export or import did. Immutable.

    ``entries``/``bytes``: entries written into the bundle (export) or landed in the
    store (import) and their payload bytes; ``skipped``: left out by the age or arch
    filter (export; entries not among ``names`` are not counted) or already in the
    store (import); ``failures``: entries that could not be read (export) or written
    (import), each logged. ``metadata``: how many of ``entries`` are manifests or symbol
    maps rather than kernels (:mod:`~tiered_progcache.stores.kinds`).
    """

    path: str
    entries: int
    bytes: int
    skipped: int
    failures: int
    compressed: bool
    seconds: float
    metadata: int = 0


# -- export --------------------------------------------------------------------------------------


def export_bundle(
    store: EntryStore,
    path: str | os.PathLike[str],
    *,
    names: Iterable[str] | None = None,
    max_age: float | None = None,
    arch: int | str | None = None,
    signing_key: bytes | str | None = None,
    compression: str | None = "auto",
    now: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BundleReport:
    """Write ``store``'s entries (the local directory or a shared store) into one bundle file at ``path``.

    >>> export_bundle(LocalDir("/var/cache/kernels"), "kernels.tpcb", arch="sm_90", max_age=30 * 86400)

    Filters: ``names`` (entry names, as ``ls`` prints them), ``max_age`` (seconds since
    last used: read locally, written on a remote; entries whose store gives no time are
    kept), ``arch`` (``"sm_90"`` or ``90``: cubins and PTX for that SM number; fatbins
    and LTO-IR, whose arch this cannot read, are left out; a manifest goes by the arch it
    records, a symbol map only with a binary exported that holds its mangled names).
    ``metadata`` counts manifests (known by name, as ``stats`` knows them) and symbol maps. Each entry
    is sealed with ``signing_key`` when one is given. ``compression``: ``"auto"`` (zstd
    when zstandard is installed), ``"zstd"`` or ``None``. ``now`` is the clock for
    ``max_age`` (default ``time.time()``). The file appears whole or not at all
    (written beside ``path``, then renamed). Unreadable entries are logged, counted in
    ``failures`` and left out. ``progress(done, total)`` is called after each entry read.
    """
    if not isinstance(store, EntryStore):
        raise TypeError(f"store must be an EntryStore, got {type(store).__name__}")
    wanted = None if names is None else {check_entry_name(n) for n in names}
    if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, (int, float)) or max_age < 0):
        raise ValueError(f"max_age must be a non-negative number of seconds, got {max_age!r}")
    sm = _parse_arch(arch)
    zstd = _compressor(compression)
    codec = EnvelopeCodec(signing_key)
    started = time.monotonic()
    clock = time.time() if now is None else now

    listed, skipped = [], 0
    for entry in store.iter_entries():
        if wanted is not None and entry.name not in wanted:
            continue
        used = entry.last_used
        if max_age is not None and used is not None and clock - used > max_age:
            skipped += 1
            continue
        listed.append(entry)
    listed.sort(key=lambda e: e.name)

    target = Path(path)
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    count = total = failures = metadata = 0
    manifests = {manifest_name(e.name) for e in listed}  # as stats and ls know them: by name, whatever their size
    deferred: list[tuple[Any, bytes]] = []  # with arch: symbol maps, exported once a binary of theirs is
    exported: list[Any] = []
    try:
        with open(staging, "wb") as raw:
            sink: IO[bytes] = zstd.stream_writer(raw, closefd=False) if zstd is not None else raw
            with tarfile.open(fileobj=sink, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
                for done, (entry, got) in enumerate(_read_all(store, listed), start=1):
                    if progress is not None:
                        progress(done, len(listed))
                    payload = got.hits.get(entry.name)
                    if payload is None:
                        failures += 1
                        logger.warning("export: could not read %s: %s", entry.name, one_line(got.errors[entry.name]))
                        continue
                    kind = MANIFEST if entry.name in manifests else kind_of(payload)
                    if sm is not None and kind == SYMBOLS:
                        deferred.append((entry, payload))
                        continue
                    if sm is not None and not _matches_arch(payload, sm):
                        skipped += 1
                        continue
                    _add(tar, f"entries/{entry.name[:2]}/{entry.name[2:]}", codec.seal(entry.name, payload), entry.mtime)
                    count += 1
                    total += len(payload)
                    metadata += kind != KERNEL
                    if kind == KERNEL:
                        exported.append(entry)
                kept = _with_their_binaries(store, deferred, exported)
                skipped += len(deferred) - len(kept)
                for entry, payload in kept:
                    _add(tar, f"entries/{entry.name[:2]}/{entry.name[2:]}", codec.seal(entry.name, payload), entry.mtime)
                    count += 1
                    total += len(payload)
                    metadata += 1
                index = {
                    "format": BUNDLE_FORMAT,
                    "version": BUNDLE_VERSION,
                    "entries": count,
                    "signed": codec.signed,
                    "source": store.location,
                    "created": clock,
                }
                _add(tar, _INDEX, json.dumps(index, sort_keys=True).encode(), clock)
            if zstd is not None:
                sink.close()  # ends the zstd frame; closefd=False leaves raw to the with
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(staging, target)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return BundleReport(
        str(target), count, total, skipped, failures, zstd is not None, time.monotonic() - started, metadata
    )


def _parse_arch(arch: int | str | None) -> int | None:
    if arch is None:
        return None
    if isinstance(arch, bool):
        raise TypeError("arch must be 'sm_90', 90 or None, got a bool")
    if isinstance(arch, int):
        sm = arch
    elif isinstance(arch, str):
        match = re.fullmatch(r"(?:sm_|compute_)?(\d+)[af]?", arch.strip().lower())
        if not match:
            raise ValueError(f"arch must look like sm_90 (or 90), got {arch!r}")
        sm = int(match.group(1))
    else:
        raise TypeError(f"arch must be 'sm_90', 90 or None, got {type(arch).__name__}")
    if not 10 <= sm <= 255:
        raise ValueError(f"arch must be an SM number such as 90, got {arch!r}")
    return sm


def _with_their_binaries(
    store: EntryStore, maps: list[tuple[Any, bytes]], exported: list[Any]
) -> list[tuple[Any, bytes]]:
    """The symbol maps of ``maps`` whose mangled names some exported binary holds (a map names no binary,
    but the binary it maps into carries those names); the exported binaries are read again only for this."""
    wanted = {}
    for entry, payload in maps:
        try:
            mangled = {m for m in _mangled_names(payload) if m}
        except (ValueError, KeyError, TypeError, IndexError):
            continue
        if mangled:
            wanted[entry.name] = (entry, payload, mangled)
    kept: list[tuple[Any, bytes]] = []
    for exported_entry, got in _read_all(store, exported) if wanted else ():
        binary = got.hits.get(exported_entry.name)
        if binary is None:
            continue
        for name, (entry, payload, mangled) in list(wanted.items()):
            if all(m in binary for m in mangled):
                kept.append((entry, payload))
                del wanted[name]
        if not wanted:
            break
    return kept


def _mangled_names(payload: bytes) -> set[bytes]:
    """The mangled names a symbol map maps to (as the binary holds them: bytes)."""
    pairs = json.loads(payload)["symbols"]
    return {str(pair[1][1]).encode("latin-1") for pair in pairs}


def _matches_arch(payload: bytes, sm: int) -> bool:
    if payload[:1] == b"{":
        try:  # a manifest goes with its binary: by the arch it records
            arch = decode_manifest(payload).inputs.arch
        except ManifestError:
            return True  # a symbol map (or an unreadable manifest), which goes with its binary
        try:
            return _parse_arch(arch) == sm
        except (TypeError, ValueError):
            return True
    if check_code_object(payload) is not None:
        return True  # of no format known here: kept, as it may go with a binary
    return code_arch(payload) == sm


def _compressor(compression: str | None) -> Any:
    if compression not in ("auto", "zstd", None, "none"):
        raise ValueError(f"compression must be 'auto', 'zstd', 'none' or None, got {compression!r}")
    if compression in (None, "none"):
        return None
    try:
        import zstandard
    except ImportError:
        if compression == "zstd":
            raise ImportError("compression='zstd' needs the zstandard package: pip install 'tiered-progcache[zstd]'") from None
        return None
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL)


def _read_all(store: EntryStore, listed: list[Any]) -> Iterator[tuple[Any, BatchRead]]:
    """Each listed entry still there (read, or failed to read), a store batch at a time, with what its batch's
    ``read_many`` got: its payload in ``hits``, else why in ``errors``."""
    batch = max(1, store.transfer_batch)
    for start in range(0, len(listed), batch):
        chunk = listed[start : start + batch]
        got = store.read_many([e.name for e in chunk])
        for entry in chunk:
            if entry.name in got.hits or entry.name in got.errors:  # else gone since listed
                yield entry, got


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float | None) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = int(mtime or 0)
    tar.addfile(info, io.BytesIO(data))


# -- import --------------------------------------------------------------------------------------


def read_bundle(
    path: str | os.PathLike[str],
    *,
    signing_key: bytes | str | None = None,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    max_entry_bytes: int = MAX_ENTRY_BYTES,
) -> dict[str, bytes]:
    """Every entry of the bundle at ``path``, verified: ``{entry name: payload}``.

    Raises :class:`BundleRefused` (one line) at the first thing wrong: not a bundle,
    truncated, a member that is not a regular file named ``entries/<2 hex>/<62 hex>``,
    a name twice, more than ``max_members`` entries, a member over the envelope of a
    ``max_entry_bytes`` payload, more than ``max_total_bytes`` in all, an envelope that
    fails its digest, or (with ``signing_key``) one unsigned or wrongly signed.
    ``OSError`` if the file cannot be opened.
    """
    for label, value in (("max_members", max_members), ("max_total_bytes", max_total_bytes), ("max_entry_bytes", max_entry_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    codec = EnvelopeCodec(signing_key, max_entry_bytes=max_entry_bytes)
    max_member_bytes = HEADER_SIZE + _MAC_SIZE + max_entry_bytes
    with open(path, "rb") as fh:
        stream, closer, stream_errors = _decompressed(fh)
        capped = _CappedReader(stream, max_total_bytes + (max_members + 1) * _TAR_OVERHEAD_PER_MEMBER + _MAX_INDEX_BYTES)
        try:
            return _read_members(capped, codec, max_members, max_total_bytes, max_member_bytes)
        except BundleRefused:
            raise
        except _OverCap:
            raise BundleRefused(f"over {max_total_bytes} bytes in all (max_total_bytes)") from None
        except (tarfile.TarError, EOFError) as exc:
            raise BundleRefused(f"truncated or not a bundle: {one_line(exc)}") from None
        except stream_errors as exc:  # a zstd stream that does not decompress
            raise BundleRefused(f"truncated or corrupt zstd stream: {exc}") from None
        finally:
            closer()


def _read_members(
    stream: IO[bytes], codec: EnvelopeCodec, max_members: int, max_total_bytes: int, max_member_bytes: int
) -> dict[str, bytes]:
    payloads: dict[str, bytes] = {}
    index: dict[str, Any] | None = None
    total = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            where = repr(member.name)[:120]
            if index is not None:
                raise BundleRefused(f"member {where} after the index (a bundle ends with its index)")
            if not member.isreg():
                raise BundleRefused(f"member {where} is not a regular file (links and devices are refused)")
            if member.name == _INDEX:
                index = _read_index(tar, member)
                continue
            match = _MEMBER.fullmatch(member.name)
            if match is None:
                raise BundleRefused(f"member {where} is not named entries/<2 hex>/<62 hex>")
            name = match.group(1) + match.group(2)
            if name in payloads:
                raise BundleRefused(f"entry {name[:16]}... appears twice")
            if len(payloads) >= max_members:
                raise BundleRefused(f"more than {max_members} entries (max_members)")
            if member.size > max_member_bytes:
                raise BundleRefused(f"entry {name[:16]}... is {member.size} bytes, over the {max_member_bytes}-byte cap")
            total += member.size
            if total > max_total_bytes:
                raise BundleRefused(f"over {max_total_bytes} bytes in all (max_total_bytes)")
            blob = _member_bytes(tar, member)
            try:
                payloads[name] = codec.open(name, blob)
            except InvalidEnvelope as exc:
                raise BundleRefused(f"entry {name[:16]}... failed verification: {exc}") from None
    if index is None:
        raise BundleRefused("truncated or not a bundle: no index (a bundle ends with index.json)")
    if index.get("entries") != len(payloads):
        raise BundleRefused(f"the index says {index.get('entries')!r} entries, the bundle holds {len(payloads)}")
    return payloads


def _read_index(tar: tarfile.TarFile, member: tarfile.TarInfo) -> dict[str, Any]:
    if member.size > _MAX_INDEX_BYTES:
        raise BundleRefused(f"index is {member.size} bytes, over {_MAX_INDEX_BYTES}")
    try:
        index = json.loads(_member_bytes(tar, member))
    except ValueError:
        raise BundleRefused("index.json is not JSON") from None
    if not isinstance(index, dict) or index.get("format") != BUNDLE_FORMAT:
        raise BundleRefused(f"not a {BUNDLE_FORMAT} (index format {index.get('format') if isinstance(index, dict) else None!r})")
    if index.get("version") != BUNDLE_VERSION:
        raise BundleRefused(f"bundle version {index.get('version')!r} is not supported (this reader knows {BUNDLE_VERSION})")
    return index


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    reader = tar.extractfile(member)
    if reader is None:  # pragma: no cover - isreg() members always have a reader
        raise BundleRefused(f"member {member.name!r} has no data")
    data = reader.read()
    if len(data) != member.size:
        raise BundleRefused(f"truncated: member {member.name[:80]!r} has {len(data)} of {member.size} bytes")
    return data


def _decompressed(fh: IO[bytes]) -> tuple[IO[bytes], Any, tuple[type[Exception], ...]]:
    """The tar stream of the file: through zstd when its magic bytes say so (detected, not trusted to a name)."""
    magic = fh.read(4)
    fh.seek(0)
    if magic != _ZSTD_MAGIC:
        return fh, lambda: None, ()
    try:
        import zstandard
    except ImportError:
        raise BundleRefused("the bundle is zstd-compressed and the zstandard package is not installed") from None
    reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True, closefd=False)
    return reader, reader.close, (zstandard.ZstdError,)


class _OverCap(Exception):
    pass


class _CappedReader(io.RawIOBase):
    """A read-only stream that raises once more than ``limit`` bytes were read: a decompression bomb stops here."""

    def __init__(self, inner: IO[bytes], limit: int) -> None:
        self._inner = inner
        self._left = limit

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._left + 1
        data = self._inner.read(min(size, self._left + 1))
        self._left -= len(data)
        if self._left < 0:
            raise _OverCap()
        return data


def import_bundle(
    path: str | os.PathLike[str],
    store: EntryStore,
    *,
    signing_key: bytes | str | None = None,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> BundleReport:
    """Verify every entry of the bundle at ``path``, then land those ``store`` lacks (``progress(done, total)`` per batch).

    >>> import_bundle("kernels.tpcb", LocalDir("/var/cache/kernels"))    # at image build or node boot

    Nothing lands unless the whole bundle passes :func:`read_bundle` (else
    :class:`BundleRefused`). Each entry is written whole by the store (a shared store
    seals it in its own envelope, with its own key); entries already in the store are
    skipped. ``PermissionError`` for a read-only store. A write that fails is logged
    and counted in ``failures``; the others still land.
    """
    if not isinstance(store, EntryStore):
        raise TypeError(f"store must be an EntryStore, got {type(store).__name__}")
    if store.read_only:
        raise PermissionError(f"{store.location} is read-only; refusing to import into it")
    started = time.monotonic()
    compressed = _is_zstd(path)
    payloads = read_bundle(
        path,
        signing_key=signing_key,
        max_members=max_members,
        max_total_bytes=max_total_bytes,
        max_entry_bytes=min(store.max_entry_bytes, MAX_ENTRY_BYTES),
    )
    held = {entry.name for entry in store.iter_entries()}
    todo = sorted(name for name in payloads if name not in held)
    landed = nbytes = failures = metadata = 0
    batch = max(1, store.transfer_batch)
    for start in range(0, len(todo), batch):
        chunk = {name: payloads[name] for name in todo[start : start + batch]}
        wrote = store.write_many(chunk)
        for name in chunk:
            if name in wrote.written:
                landed += 1
                nbytes += len(chunk[name])
                metadata += kind_of(chunk[name]) != KERNEL
            elif name in wrote.errors:
                failures += 1
                logger.warning("import: could not write %s to %s: %s", name, store.location, one_line(wrote.errors[name]))
        if progress is not None:
            progress(min(start + batch, len(todo)), len(todo))
    return BundleReport(
        str(path), landed, nbytes, len(payloads) - len(todo), failures, compressed, time.monotonic() - started, metadata
    )


def _is_zstd(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == _ZSTD_MAGIC

