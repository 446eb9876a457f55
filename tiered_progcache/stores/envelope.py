"""How one remote entry is framed and verified: digest, optional HMAC signature, optional zstd.

A shared bucket is written by many machines and read by more, so nothing read from it
is trusted until checked, and nothing in it can execute on load (no pickle, no JSON
eval: a fixed binary header parsed with ``struct``). Byte layout (big-endian)::

    offset  size  field
         0     4  magic  b"TPCE"
         4     1  version (1)
         5     1  flags: 0x01 body is zstd-compressed, 0x02 signed
         6     2  reserved, zero
         8    32  entry name: sha256(key), the object's own name, so an entry cannot be
                  replayed under another key
        40     8  raw length: bytes of the payload after decompression
        48     8  body length: bytes stored after the header (and signature)
        56    32  sha256 of the raw payload
        88    32  HMAC-SHA256(signing key, header || body)   (only when signed)
    88 / 120    *  body

Verification order (cheapest first, nothing decompressed before it is authenticated):
header fields, name, exact total length (catches truncation), signature (required
when the reader has a key), raw length against a cap, bounded decompression, payload
digest. Any failure raises :class:`InvalidEnvelope` (an ``EntryRejected``, so a miss).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct
import threading
from typing import Any

from ..errors import EntryRejected

__all__ = [
    "FLAG_SIGNED",
    "FLAG_ZSTD",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_ENTRY_BYTES",
    "VERSION",
    "EnvelopeCodec",
    "EnvelopeHeader",
    "FIRST_READ_BYTES",
    "InvalidEnvelope",
    "first_read_bytes",
    "joined_envelope",
    "normalize_compression",
    "max_stored_bytes",
    "read_header",
    "rest_to_read",
    "stored_length",
]

MAGIC = b"TPCE"
VERSION = 1
FLAG_ZSTD = 0x01
FLAG_SIGNED = 0x02
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_SIGNED
_HEADER = struct.Struct(">4sBBH32sQQ32s")
HEADER_SIZE = _HEADER.size  # 88
_MAC_SIZE = 32
#: Largest payload a reader accepts (decompressed); cubins are kilobytes to tens of megabytes.
MAX_ENTRY_BYTES = 1 << 30
#: Bytes a reader asks for in its first (ranged) request. Any envelope up to this size (a
#: cubin of tens to hundreds of KiB, a CCCL kernel of a few MiB) is read in that one
#: request; a larger one takes exactly one more, for the rest its header states.
FIRST_READ_BYTES = 8 << 20
_ZSTD_LEVEL = 3


class InvalidEnvelope(EntryRejected):
    """A remote object that failed verification; ``reason`` says why in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.reason


@dataclasses.dataclass(frozen=True)
class EnvelopeHeader:
    """The parsed fixed header of an envelope (not yet verified beyond its shape). Immutable."""

    version: int
    flags: int
    name: str
    raw_length: int
    body_length: int
    payload_sha256: str

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_SIGNED)

    @property
    def total_length(self) -> int:
        return HEADER_SIZE + (_MAC_SIZE if self.signed else 0) + self.body_length


def read_header(blob: bytes | memoryview) -> EnvelopeHeader:
    """Parse and shape-check the header; raises :class:`InvalidEnvelope`."""
    if len(blob) < HEADER_SIZE:
        raise InvalidEnvelope(f"truncated: {len(blob)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, reserved, name, raw_len, body_len, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise InvalidEnvelope(f"not an entry envelope (magic {magic!r})")
    if version != VERSION:
        raise InvalidEnvelope(f"envelope version {version} is not supported (this reader knows {VERSION})")
    if flags & ~_KNOWN_FLAGS or reserved:
        raise InvalidEnvelope(f"unknown envelope flags 0x{flags:02x}/0x{reserved:04x}")
    return EnvelopeHeader(version, flags, name.hex(), raw_len, body_len, digest.hex())


def max_stored_bytes(max_entry_bytes: int) -> int:
    """The most bytes an envelope of a payload within ``max_entry_bytes`` can take (header, signature, body)."""
    return HEADER_SIZE + _MAC_SIZE + max_entry_bytes


def stored_length(head: bytes | bytearray | memoryview, max_entry_bytes: int) -> int:
    """The envelope's total length as its first ``HEADER_SIZE`` bytes state it, checked against the cap.

    A reader streams an object and stops at this length, so a planted object costs at
    most :func:`max_stored_bytes`. Raises :class:`InvalidEnvelope` for a header that is
    malformed or states a payload (or a stored body) over ``max_entry_bytes``.
    """
    header = read_header(head)
    if header.raw_length > max_entry_bytes:
        raise InvalidEnvelope(f"raw length {header.raw_length} exceeds the {max_entry_bytes}-byte cap")
    if header.body_length > max_entry_bytes:
        raise InvalidEnvelope(f"body length {header.body_length} exceeds the {max_entry_bytes}-byte cap")
    return header.total_length


def first_read_bytes(max_entry_bytes: int) -> int:
    """Bytes a reader's first ranged request asks for: :data:`FIRST_READ_BYTES`, or less under a small cap.

    Under a small cap it is the largest envelope the cap allows plus one byte, so an
    object longer than any valid envelope shows itself in that same request.
    """
    return min(FIRST_READ_BYTES, max_stored_bytes(max_entry_bytes) + 1)


def rest_to_read(first: bytes | memoryview, asked: int, max_entry_bytes: int) -> tuple[int, int] | None:
    """The byte range ``(start, end)`` still to read after a first request for ``asked`` bytes returned ``first``.

    None when ``first`` is the whole object (it came back shorter than asked) or is too
    short to hold a header (the codec then reports the truncation). ``end`` is one byte
    past the length the header states, so trailing bytes show. Raises
    :class:`InvalidEnvelope` for a header stating more than the cap, or for ``first``
    already longer than its header states.
    """
    if len(first) < HEADER_SIZE:
        return None
    end = stored_length(first[:HEADER_SIZE], max_entry_bytes) + 1  # one more byte shows trailing bytes
    joined_envelope(first, b"", end)
    if len(first) < asked:
        return None
    return len(first), end


def joined_envelope(first: bytes | memoryview, rest: bytes, end: int) -> bytes | memoryview:
    """``first`` and ``rest`` as one object, unless it reaches ``end`` (one byte past the stated length): ``InvalidEnvelope``."""
    if len(first) + len(rest) >= end:
        raise InvalidEnvelope(f"trailing bytes: the object is longer than the {end - 1} bytes its header states")
    return first if not rest else bytes(first) + rest


def normalize_compression(compression: str | None) -> str | None:
    """``None``/``"none"`` -> None, ``"zstd"`` -> ``"zstd"`` (needs the zstandard package); else ValueError."""
    if compression is None or compression == "none":
        return None
    if compression != "zstd":
        raise ValueError(f"compression must be 'zstd', 'none' or None, got {compression!r}")
    _zstd()  # fail now, at construction, not on the first background upload
    return "zstd"


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ImportError(
            "compression='zstd' needs the zstandard package: pip install 'tiered-progcache[zstd]'"
        ) from None
    return zstandard


def _as_key(signing_key: bytes | str | None) -> bytes | None:
    if signing_key is None:
        return None
    if isinstance(signing_key, str):
        signing_key = signing_key.encode("utf-8")
    if not isinstance(signing_key, (bytes, bytearray)):
        raise TypeError(f"signing_key must be bytes, str or None, got {type(signing_key).__name__}")
    if not signing_key:
        raise ValueError("signing_key must not be empty")
    return bytes(signing_key)


class EnvelopeCodec:
    """Seals payloads into envelopes and opens them again, for one signing key and compression.

    >>> codec = EnvelopeCodec(signing_key=b"32 random bytes...", compression="zstd")
    >>> codec.open(name, codec.seal(name, cubin)) == cubin

    Thread-safe (zstd contexts are per thread); holds no I/O. ``compression`` applies
    to what this codec writes; it reads either kind. With a ``signing_key``, ``open``
    rejects unsigned and wrongly signed envelopes; without one it accepts both and
    checks only the digest (anyone who can write the bucket is trusted).
    """

    def __init__(
        self,
        signing_key: bytes | str | None = None,
        compression: str | None = None,
        *,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        self._key = _as_key(signing_key)
        self.compression = normalize_compression(compression)
        if not isinstance(max_entry_bytes, int) or max_entry_bytes <= 0:
            raise ValueError(f"max_entry_bytes must be a positive int, got {max_entry_bytes!r}")
        self.max_entry_bytes = max_entry_bytes
        self._local = threading.local()

    @property
    def signed(self) -> bool:
        return self._key is not None

    def seal(self, name: str, payload: bytes) -> bytes:
        """The envelope for ``payload`` stored under entry ``name`` (64 hex digits).

        ``ValueError`` for a payload over ``max_entry_bytes``: no reader would accept it.
        """
        name_bytes = _name_bytes(name)
        if len(payload) > self.max_entry_bytes:
            raise ValueError(f"payload of {len(payload)} bytes is over the {self.max_entry_bytes}-byte entry cap")
        flags = 0
        body: bytes = payload
        if self.compression == "zstd":
            compressed = self._compressor().compress(payload)
            if len(compressed) < len(payload):  # incompressible payloads go as they are
                body, flags = compressed, FLAG_ZSTD
        if self._key is not None:
            flags |= FLAG_SIGNED
        header = _HEADER.pack(
            MAGIC, VERSION, flags, 0, name_bytes, len(payload), len(body), hashlib.sha256(payload).digest()
        )
        if self._key is None:
            return b"".join((header, body))
        mac = hmac.new(self._key, header, hashlib.sha256)
        mac.update(body)
        return b"".join((header, mac.digest(), body))

    def open(self, name: str, blob: bytes) -> bytes:
        """The verified payload of ``blob``, read from entry ``name``; raises :class:`InvalidEnvelope`."""
        view = memoryview(blob)
        head = read_header(view)
        if head.name != name:
            raise InvalidEnvelope(f"envelope belongs to entry {head.name[:16]}..., not this one")
        if len(view) != head.total_length:
            word = "truncated" if len(view) < head.total_length else "trailing bytes"
            raise InvalidEnvelope(f"{word}: {len(view)} bytes, header says {head.total_length}")
        body_at = HEADER_SIZE + (_MAC_SIZE if head.signed else 0)
        body = view[body_at:]
        if self._key is not None:
            if not head.signed:
                raise InvalidEnvelope("unsigned entry, and a signing key is configured")
            mac = hmac.new(self._key, view[:HEADER_SIZE], hashlib.sha256)
            mac.update(body)
            if not hmac.compare_digest(mac.digest(), view[HEADER_SIZE:body_at]):
                raise InvalidEnvelope("bad signature (written with another key, or altered)")
        if head.raw_length > self.max_entry_bytes:
            raise InvalidEnvelope(f"raw length {head.raw_length} exceeds the {self.max_entry_bytes}-byte cap")
        payload = self._decompress(body, head.raw_length) if head.compressed else bytes(body)
        if len(payload) != head.raw_length:
            raise InvalidEnvelope(f"payload is {len(payload)} bytes, header says {head.raw_length}")
        if hashlib.sha256(payload).hexdigest() != head.payload_sha256:
            raise InvalidEnvelope("payload digest mismatch (corrupt)")
        return payload

    def _compressor(self) -> Any:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = _zstd().ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True)
        return cctx

    def _decompress(self, body: memoryview, raw_length: int) -> bytes:
        try:
            zstandard = _zstd()
        except ImportError:
            raise InvalidEnvelope("zstd-compressed, and the zstandard package is not installed") from None
        try:
            # A frame that declares its size is decompressed into exactly that much memory,
            # whatever max_output_size says, so the declared size is checked first.
            declared = zstandard.frame_content_size(body)
            if declared not in (-1, raw_length):
                raise InvalidEnvelope(f"zstd frame declares {declared} bytes, header says {raw_length}")
            dctx = getattr(self._local, "dctx", None)
            if dctx is None:
                dctx = self._local.dctx = zstandard.ZstdDecompressor()
            return dctx.decompress(body, max_output_size=raw_length, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise InvalidEnvelope(f"zstd body does not decompress: {exc}") from None


def _name_bytes(name: str) -> bytes:
    if not isinstance(name, str) or len(name) != 64:
        raise ValueError(f"not an entry name (64 lowercase hex digits): {name!r}")
    try:
        raw = bytes.fromhex(name)
    except ValueError:
        raise ValueError(f"not an entry name (64 lowercase hex digits): {name!r}") from None
    if raw.hex() != name:
        raise ValueError(f"not an entry name (64 lowercase hex digits): {name!r}")
    return raw
