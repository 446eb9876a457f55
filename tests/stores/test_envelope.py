"""The remote entry envelope: what it round-trips, and every way a tampered one is refused."""

from __future__ import annotations

import hashlib
import importlib.util
import struct

import pytest

from tiered_progcache import EntryRejected
from tiered_progcache.stores.envelope import (
    FLAG_SIGNED,
    FLAG_ZSTD,
    HEADER_SIZE,
    MAGIC,
    EnvelopeCodec,
    InvalidEnvelope,
    max_stored_bytes,
    read_header,
    stored_length,
)

NAME = hashlib.sha256(b"some key").hexdigest()
OTHER = hashlib.sha256(b"another key").hexdigest()
KEY = b"k" * 32
CUBIN = b"\x7fELF" + bytes(range(256)) * 40  # compressible, like a real cubin

zstd_needed = pytest.mark.skipif(importlib.util.find_spec("zstandard") is None, reason="zstandard not installed")


@pytest.mark.parametrize(
    "key, compression",
    [(None, None), (KEY, None), pytest.param(None, "zstd", marks=zstd_needed), pytest.param(KEY, "zstd", marks=zstd_needed)],
)
@pytest.mark.parametrize("payload", [b"", b"x", CUBIN])
def test_roundtrip(key, compression, payload):
    codec = EnvelopeCodec(key, compression)
    blob = codec.seal(NAME, payload)
    assert codec.open(NAME, blob) == payload
    head = read_header(blob)
    assert (head.name, head.raw_length, head.signed) == (NAME, len(payload), key is not None)
    assert head.payload_sha256 == hashlib.sha256(payload).hexdigest()
    assert len(blob) == head.total_length


def test_header_layout_is_the_documented_one():
    blob = EnvelopeCodec(KEY).seal(NAME, b"payload")
    assert blob[:4] == MAGIC and blob[4] == 1 and blob[5] == FLAG_SIGNED and blob[6:8] == b"\0\0"
    assert blob[8:40] == bytes.fromhex(NAME)
    assert struct.unpack(">QQ", blob[40:56]) == (7, 7)
    assert blob[56:88] == hashlib.sha256(b"payload").digest()
    assert len(blob) == HEADER_SIZE + 32 + 7 and blob[-7:] == b"payload"


@zstd_needed
def test_zstd_shrinks_the_body_and_is_flagged():
    blob = EnvelopeCodec(None, "zstd").seal(NAME, CUBIN)
    assert blob[5] & FLAG_ZSTD and len(blob) < len(CUBIN) // 2
    assert EnvelopeCodec().open(NAME, blob) == CUBIN  # readers decode whatever the flags say


@zstd_needed
def test_incompressible_payload_is_stored_raw():
    import os

    payload = os.urandom(4096)
    blob = EnvelopeCodec(None, "zstd").seal(NAME, payload)
    assert not blob[5] & FLAG_ZSTD and blob.endswith(payload)


def _reject(codec, blob, name=NAME):
    with pytest.raises(InvalidEnvelope) as info:
        codec.open(name, blob)
    assert isinstance(info.value, EntryRejected) and isinstance(info.value, KeyError)
    return info.value.reason


@pytest.mark.parametrize("key", [None, KEY])
def test_every_flipped_byte_is_caught(key):
    codec = EnvelopeCodec(key)
    blob = codec.seal(NAME, b"cubin bytes")
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        _reject(codec, bytes(bad))


@pytest.mark.parametrize("compression", [None, pytest.param("zstd", marks=zstd_needed)])
def test_every_truncation_is_caught(compression):
    codec = EnvelopeCodec(KEY, compression)
    blob = codec.seal(NAME, CUBIN)
    for cut in sorted({0, 3, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 31, len(blob) // 2, len(blob) - 1}):
        assert "truncated" in _reject(codec, blob[:cut])
    assert "trailing" in _reject(codec, blob + b"\0")


def test_entry_replayed_under_another_name_is_rejected():
    codec = EnvelopeCodec(KEY)
    assert "belongs to" in _reject(codec, codec.seal(OTHER, b"valid, but for another key"))


def test_signing_key_rejects_unsigned_and_foreign_entries():
    reader = EnvelopeCodec(KEY)
    assert "unsigned" in _reject(reader, EnvelopeCodec(None).seal(NAME, b"x"))
    assert "signature" in _reject(reader, EnvelopeCodec(b"another key").seal(NAME, b"x"))


def test_forged_payload_with_recomputed_digest_fails_the_signature():
    """An attacker who can write the bucket can fix up the digest, not the HMAC."""
    blob = bytearray(EnvelopeCodec(KEY).seal(NAME, b"good"))
    blob[-4:] = b"evil"
    blob[56:88] = hashlib.sha256(b"evil").digest()
    assert "signature" in _reject(EnvelopeCodec(KEY), bytes(blob))
    # The same forgery passes the digest check of a reader without a key: that is the trust model.
    assert EnvelopeCodec().open(NAME, bytes(blob)) == b"evil"


def test_without_a_key_signed_entries_are_still_read():
    assert EnvelopeCodec().open(NAME, EnvelopeCodec(KEY).seal(NAME, b"x")) == b"x"


def test_unknown_version_flags_and_magic_are_rejected():
    blob = EnvelopeCodec().seal(NAME, b"x")
    assert "version" in _reject(EnvelopeCodec(), blob[:4] + b"\x02" + blob[5:])
    assert "flags" in _reject(EnvelopeCodec(), blob[:5] + b"\x80" + blob[6:])
    assert "magic" in _reject(EnvelopeCodec(), b"\x80\x04\x95\x00" + blob[4:])  # a pickle is not an envelope


def test_raw_length_over_the_cap_is_rejected_before_decompressing():
    big = EnvelopeCodec().seal(NAME, b"x" * 2048)
    assert "cap" in _reject(EnvelopeCodec(max_entry_bytes=1024), big)


@zstd_needed
def test_decompression_is_bounded_by_the_declared_length():
    """A zstd bomb: a small body that expands far beyond what the (signed) header says."""
    import zstandard

    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    header = struct.pack(">4sBBH32sQQ32s", MAGIC, 1, FLAG_ZSTD, 0, bytes.fromhex(NAME), 10, len(bomb), b"\0" * 32)
    assert "declares" in _reject(EnvelopeCodec(), header + bomb)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))
    header = struct.pack(">4sBBH32sQQ32s", MAGIC, 1, FLAG_ZSTD, 0, bytes.fromhex(NAME), 10, len(unsized), b"\0" * 32)
    assert "decompress" in _reject(EnvelopeCodec(), header + unsized)


def test_bad_construction_arguments():
    with pytest.raises(ValueError, match="compression"):
        EnvelopeCodec(compression="gzip")
    with pytest.raises(ValueError, match="empty"):
        EnvelopeCodec(signing_key=b"")
    with pytest.raises(TypeError):
        EnvelopeCodec(signing_key=123)
    with pytest.raises(ValueError, match="entry name"):
        EnvelopeCodec().seal("not-hex", b"x")


def test_zstd_without_zstandard_is_a_clear_import_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"tiered-progcache\[zstd\]"):
        EnvelopeCodec(compression="zstd")


@pytest.mark.parametrize("compression", [None, pytest.param("zstd", marks=zstd_needed)])
@pytest.mark.parametrize("key", [None, KEY])
def test_a_payload_of_exactly_the_cap_is_sealed_and_opened_one_more_byte_is_not(key, compression):
    cap = 4096
    codec = EnvelopeCodec(key, compression, max_entry_bytes=cap)
    at_cap = bytes(range(256)) * (cap // 256)
    assert codec.open(NAME, codec.seal(NAME, at_cap)) == at_cap
    with pytest.raises(ValueError, match="over the 4096-byte entry cap"):
        codec.seal(NAME, at_cap + b"!")
    over = EnvelopeCodec(key, compression).seal(NAME, at_cap + b"!")
    assert "cap" in _reject(codec, over)


def test_stored_length_is_what_the_header_states_and_refuses_a_header_over_the_cap():
    blob = EnvelopeCodec(KEY).seal(NAME, b"x" * 100)
    assert stored_length(blob[:HEADER_SIZE], 100) == len(blob) == HEADER_SIZE + 32 + 100
    assert max_stored_bytes(100) == HEADER_SIZE + 32 + 100
    with pytest.raises(InvalidEnvelope, match="raw length 100 exceeds the 99-byte cap"):
        stored_length(blob[:HEADER_SIZE], 99)
    body_over = struct.pack(">4sBBH32sQQ32s", MAGIC, 1, FLAG_ZSTD, 0, bytes.fromhex(NAME), 10, 200, b"\0" * 32)
    with pytest.raises(InvalidEnvelope, match="body length 200 exceeds the 100-byte cap"):
        stored_length(body_over, 100)
    with pytest.raises(InvalidEnvelope, match="truncated"):
        stored_length(blob[: HEADER_SIZE - 1], 100)


def test_each_rejection_says_exactly_why():
    signed = EnvelopeCodec(KEY).seal(NAME, CUBIN)
    plain = EnvelopeCodec().seal(NAME, CUBIN)
    reasons = {
        "other name": _reject(EnvelopeCodec(), plain, name=OTHER),
        "trailing": _reject(EnvelopeCodec(), plain + b"x"),
        "truncated": _reject(EnvelopeCodec(), plain[:-1]),
        "unsigned": _reject(EnvelopeCodec(KEY), plain),
        "bad signature": _reject(EnvelopeCodec(b"other key"), signed),
    }
    n = len(plain)
    assert reasons == {
        "other name": f"envelope belongs to entry {NAME[:16]}..., not this one",
        "trailing": f"trailing bytes: {n + 1} bytes, header says {n}",
        "truncated": f"truncated: {n - 1} bytes, header says {n}",
        "unsigned": "unsigned entry, and a signing key is configured",
        "bad signature": "bad signature (written with another key, or altered)",
    }
    corrupt = bytearray(plain)
    corrupt[-1] ^= 1
    assert _reject(EnvelopeCodec(), bytes(corrupt)) == "payload digest mismatch (corrupt)"
    with pytest.raises(InvalidEnvelope) as info:
        EnvelopeCodec().open(NAME, bytes(corrupt))
    assert info.value.args == ("payload digest mismatch (corrupt)",)


def test_a_body_shorter_than_the_stated_raw_length_is_rejected():
    header = struct.pack(
        ">4sBBH32sQQ32s", MAGIC, 1, 0, 0, bytes.fromhex(NAME), 10, 4, hashlib.sha256(b"abcd").digest()
    )
    assert _reject(EnvelopeCodec(), header + b"abcd") == "payload is 4 bytes, header says 10"


def test_read_header_returns_every_field():
    blob = EnvelopeCodec(KEY).seal(NAME, b"abc")
    head = read_header(blob)
    assert (head.version, head.flags, head.name, head.raw_length, head.body_length, head.payload_sha256) == (
        1, FLAG_SIGNED, NAME, 3, 3, hashlib.sha256(b"abc").hexdigest()
    )
    assert head.signed and not head.compressed and head.total_length == len(blob)


def test_compression_none_spelled_out_and_str_signing_keys():
    assert EnvelopeCodec(compression="none").compression is None
    assert EnvelopeCodec(compression=None).compression is None
    sealed = EnvelopeCodec("ключ").seal(NAME, b"x")  # a str key is its UTF-8 bytes
    assert EnvelopeCodec("ключ".encode("utf-8")).open(NAME, sealed) == b"x"
    with pytest.raises(TypeError, match=r"^signing_key must be bytes, str or None, got int$"):
        EnvelopeCodec(signing_key=123)
    with pytest.raises(ValueError, match=r"^signing_key must not be empty$"):
        EnvelopeCodec(signing_key="")


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1024", None])
def test_max_entry_bytes_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"^max_entry_bytes must be a positive int, got {bad!r}$"):
        EnvelopeCodec(max_entry_bytes=bad)


def test_a_one_byte_cap_is_allowed():
    codec = EnvelopeCodec(max_entry_bytes=1)
    assert codec.open(NAME, codec.seal(NAME, b"x")) == b"x"


@pytest.mark.parametrize("bad", [123, None, "AB" * 32, "ab" * 31, "zz" * 32])
def test_seal_refuses_a_bad_name_with_a_value_error(bad):
    with pytest.raises(ValueError, match=r"^not an entry name \(64 lowercase hex digits\): "):
        EnvelopeCodec().seal(bad, b"x")


@zstd_needed
def test_zstd_frames_declare_their_size_and_extra_frames_are_rejected():
    import zstandard

    blob = EnvelopeCodec(compression="zstd").seal(NAME, CUBIN)
    body = blob[HEADER_SIZE:]
    assert zstandard.frame_content_size(body) == len(CUBIN)
    cctx = zstandard.ZstdCompressor()
    two_frames = cctx.compress(CUBIN) + cctx.compress(b"smuggled")
    header = struct.pack(
        ">4sBBH32sQQ32s", MAGIC, 1, FLAG_ZSTD, 0, bytes.fromhex(NAME), len(CUBIN), len(two_frames),
        hashlib.sha256(CUBIN).digest(),
    )
    assert "does not decompress" in _reject(EnvelopeCodec(), header + two_frames)


@zstd_needed
def test_a_zstd_entry_without_zstandard_installed_is_rejected_saying_so(monkeypatch):
    import sys

    blob = EnvelopeCodec(compression="zstd").seal(NAME, CUBIN)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    assert _reject(EnvelopeCodec(), blob) == "zstd-compressed, and the zstandard package is not installed"
