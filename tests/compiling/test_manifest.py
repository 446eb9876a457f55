"""Entry manifests: what compile() records beside each binary, where, within which bound, and that a bad one is refused."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import math
import platform
import socket
import time

import pytest
from cuda.bindings import nvrtc
from cuda.core import Program, ProgramOptions

import tiered_progcache
from tiered_progcache import LocalDir, TieredProgramCache
from tiered_progcache.compiling.keys import HeaderFile
from tiered_progcache.compiling.direct import direct_key
from tiered_progcache.compiling.manifest import (
    MANIFEST_FORMAT,
    MAX_MANIFEST_BYTES,
    CompileInputs,
    Manifest,
    ManifestError,
    build_manifest,
    compile_seconds_of,
    decode_manifest,
    encode_manifest,
    manifest_key,
    manifest_name,
)
from tiered_progcache.compiling.symbols import symbols_key, symbols_name
from tiered_progcache.stores.store import companion_keys, entry_name

NAMED = r"""
#include "x.h"
#include <sub/y.h>
#if __has_include(<nowhere/at_all.h>)
#include <nowhere/at_all.h>
#endif
template <typename T> __global__ void fill(T* out, int n) { int i = threadIdx.x; if (i < n) out[i] = T(X + Y); }
"""


@pytest.fixture
def include(tmp_path):
    root = tmp_path / "include"
    (root / "sub").mkdir(parents=True)
    (root / "x.h").write_text("#define X 1\n")
    (root / "sub" / "y.h").write_text("#define Y 2\n")
    return root


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _compiled(tmp_path, include, events) -> tuple[bytes, Manifest, bytes]:
    """Compile NAMED once; its key, its decoded manifest and the manifest's stored bytes."""
    opts = ProgramOptions(arch="sm_80", std="c++17", include_path=[str(include)])
    with TieredProgramCache(tmp_path / "c") as cache:
        tiered_progcache.compile(NAMED, "c++", opts, cache=cache, name_expressions=["fill<float>", b"fill<int>"],
                                 extra_digest=b"my generator v3")  # fmt: skip
        (event,) = events
        stored = cache.get(manifest_key(event.key))
    return event.key, decode_manifest(stored, entry=entry_name(event.key)), stored


def _installed(name: str) -> str:
    """The version a manifest records: "unknown" where the package runs from a checkout, uninstalled."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def test_compile_records_what_the_entry_was_built_from_by_whom_when_and_how_long(tmp_path, include, events):
    before = time.time()
    key, m, stored = _compiled(tmp_path, include, events)
    after = time.time()
    i, p = m.inputs, m.provenance
    _, major, minor = nvrtc.nvrtcVersion()
    assert m.entry == entry_name(key)
    assert (i.compiler, i.compiler_version) == ("NVRTC", f"{major}.{minor}")
    assert (i.code_type, i.target, i.arch, i.portable) == ("c++", "cubin", "sm_80", True)
    assert i.source_sha256 == _sha(NAMED.encode())
    assert i.options == ("-arch=sm_80", "--include-path=<tiered-progcache:I0>", "--std=c++17")  # the include directory as its role
    assert i.headers == (
        HeaderFile("I0", "sub/y.h", _sha(b"#define Y 2\n")),
        HeaderFile("I0", "x.h", _sha(b"#define X 1\n")),
    )
    assert (i.headers_omitted, i.missing) == (0, ("nowhere/at_all.h",))
    assert i.name_expressions == ("fill<float>", b"fill<int>") and i.kernels == ("fill",)
    assert i.extra_digest_sha256 == _sha(b"my generator v3")
    assert m.compile_seconds == round(events[0].seconds, 6) > 0
    assert p.host == socket.gethostname()
    written = datetime.datetime.strptime(p.written_at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    assert math.floor(before) <= written.timestamp() <= after
    assert dict(p.packages) == {
        "tiered-progcache": tiered_progcache.__version__,
        "cuda-core": _installed("cuda-core"),
        "cuda-bindings": _installed("cuda-bindings"),
        "python": platform.python_version(),
    }
    assert str(tmp_path).encode() not in stored  # no absolute path of this machine
    assert json.loads(stored)["format"] == MANIFEST_FORMAT and stored == encode_manifest(m)


def test_the_packages_a_manifest_records_are_the_installed_ones_read_without_a_metadata_scan(monkeypatch):
    """The versions come from the imported modules, not a scan of the installed distributions' metadata
    (a fresh process's first compile pays it); they are the installed distributions' versions."""
    from tiered_progcache.compiling import manifest

    def no_scan(name: str) -> str:
        raise AssertionError(f"importlib.metadata.version({name!r}) was called")

    monkeypatch.setattr(importlib.metadata, "version", no_scan)
    packages = dict(manifest._packages.__wrapped__())
    monkeypatch.undo()
    assert packages == {name: importlib.metadata.version(name) for name in ("tiered-progcache", "cuda-core",
                                                                              "cuda-bindings")} | {
        "python": platform.python_version()}
    assert tiered_progcache.__version__ == packages["tiered-progcache"]


def test_the_symbol_map_then_the_binary_then_its_manifest_named_from_the_binarys(tmp_path, include, events):
    """The binary before its manifest: the upload other nodes wait for goes first."""
    order: list[str] = []

    class Recording(TieredProgramCache):
        def put(self, key, value, *, compile_seconds=None):
            order.append(entry_name(key))
            super().put(key, value, compile_seconds=compile_seconds)

    opts = ProgramOptions(arch="sm_80", include_path=[str(include)])
    with Recording(tmp_path / "c") as cache:
        tiered_progcache.compile(NAMED, "c++", opts, cache=cache, name_expressions=["fill<float>"])
    binary = entry_name(events[0].key)
    assert order[:3] == [entry_name(symbols_key(events[0].key)), binary, manifest_name(binary)]
    assert manifest_name(binary) == entry_name(manifest_key(events[0].key)) and len(order) == 4
    # then the direct manifest: the header set it was keyed by
    assert order[-1] == entry_name(direct_key(NAMED, "c++", opts, "cubin", ("fill<float>",), None, True))
    assert {e.name for e in LocalDir(tmp_path / "c").iter_entries()} == set(order)
    with pytest.raises(ValueError, match="not an entry name"):
        manifest_name("ABC")


def test_program_compile_with_a_cache_writes_no_manifest(tmp_path):
    with TieredProgramCache(tmp_path / "c") as cache:
        Program('extern "C" __global__ void k() {}', "c++", ProgramOptions(arch="sm_80")).compile("cubin", cache=cache)
    (only,) = LocalDir(tmp_path / "c").iter_entries()
    assert LocalDir(tmp_path / "c").read_entry(only.name)[:4] == b"\x7fELF"


def test_the_remote_copy_rides_the_signed_envelope(tmp_path, include, events):
    remote = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    with TieredProgramCache(tmp_path / "c", remote=remote, signing_key=b"k" * 32) as cache:
        tiered_progcache.compile(NAMED, "c++", ProgramOptions(arch="sm_80", include_path=[str(include)]), cache=cache)
        assert cache.flush(30)
        store = cache.shared_store
        name = manifest_name(entry_name(events[0].key))
        assert decode_manifest(store.read_entry(name)).entry == entry_name(events[0].key)
        path = tmp_path / "bucket" / "entries" / name[:2] / name[2:]
        blob = path.read_bytes()
        assert blob[:4] == b"TPCE" and blob[5] & 0x02  # an envelope, signed
        path.write_bytes(blob.replace(b"sm_80", b"sm_90"))  # forged in the bucket
        assert store.verify_entry(name).startswith("bad signature")


# -- the bound ----------------------------------------------------------------------------------------


def _manifest(**inputs) -> Manifest:
    template = build_manifest(b"k", _INPUTS, 0.25, now=lambda: 1.7e9)
    return dataclasses.replace(template, inputs=dataclasses.replace(template.inputs, **inputs))


def test_the_size_bound_drops_the_header_list_first_and_is_exact(tmp_path):
    assert MAX_MANIFEST_BYTES == 256 * 1024
    many = tuple(HeaderFile("I0", f"cub/detail/header_{n:05d}.cuh", "a" * 64) for n in range(5000))
    data = encode_manifest(_manifest(headers=many))
    assert len(data) <= MAX_MANIFEST_BYTES
    lean = decode_manifest(data)
    assert (lean.inputs.headers, lean.inputs.headers_omitted) == ((), 5000)
    fits = _manifest(headers=many[:1500])
    assert decode_manifest(encode_manifest(fits)).inputs.headers == many[:1500]  # 1500 CUB-like headers fit
    with pytest.raises(ManifestError, match="over the 262144-byte bound"):
        encode_manifest(_manifest(options=tuple(f"-DVALUE_{n}=1" for n in range(30000))))
    # a document of exactly the bound is read; one byte more is refused unread
    doc = encode_manifest(_manifest())
    exact = doc[:-1] + b" " * (MAX_MANIFEST_BYTES - len(doc)) + b"}"
    assert len(exact) == MAX_MANIFEST_BYTES and decode_manifest(exact) == decode_manifest(doc)
    with pytest.raises(ManifestError, match=f"{MAX_MANIFEST_BYTES + 1} bytes, over the"):
        decode_manifest(exact[:-1] + b" }")


# -- the strict decoder ------------------------------------------------------------------------------

_INPUTS = build_manifest(  # a small, valid manifest's inputs to build variants from
    b"k",
    CompileInputs(
        key_schema=2, portable=True, source_sha256="0" * 64, code_type="c++", target="cubin", arch="sm_80",
        program_name=None, options=("-arch=sm_80",), compiler="NVRTC", compiler_version="13.0", headers=(),
        headers_omitted=0, missing=(), name_expressions=(), kernels=("k",), extra_digest_sha256=None,
    ),
    0.25,
).inputs


def _mutated(change) -> bytes:
    doc = json.loads(encode_manifest(_manifest()))
    change(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"format": "tiered-progcache/manifest"', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_000, "not JSON"),
        (_mutated(lambda d: d.update(format="tiered-progcache/symbols")), "format 'tiered-progcache/symbols'"),
        (_mutated(lambda d: d.update(version=2)), "version 2, this reader knows 1"),
        (_mutated(lambda d: d.update(env={"AWS_SECRET_ACCESS_KEY": "x"})), r"unknown \['env'\]"),
        (_mutated(lambda d: d.pop("written_by")), r"missing \['written_by'\]"),
        (_mutated(lambda d: d.update(compile_seconds="1.5")), "compile_seconds must be a non-negative number"),
        (_mutated(lambda d: d.update(compile_seconds=-1)), "compile_seconds must be a non-negative number"),
        (_mutated(lambda d: d.update(source_sha256="g" * 64)), "source_sha256 must be 64 lowercase hex"),
        (_mutated(lambda d: d.update(headers=[["I0", "x.h"]])), r"a header must be \[root, path, digest\]"),
        # the header list is checked by columns first: each of these must still be refused, by name
        (_mutated(lambda d: d.update(headers=[["I0", "a.h", "a" * 64], ["I0", "b.h", "A" * 64]])), "header digest must be"),
        (_mutated(lambda d: d.update(headers=[["I0", "a.h", "a" * 32], ["I0", "b.h", "a" * 96]])), "header digest must be"),
        (_mutated(lambda d: d.update(headers=[["I0", "a.h", "a" * 63 + "\u00e9"]])), "header digest must be"),
        (_mutated(lambda d: d.update(headers=[["I0", "a.h", "a" * 64], [0, "b.h", "a" * 64]])), "header root must be a string"),
        (_mutated(lambda d: d.update(headers=[["I0", "x" * 5000, "a" * 64]])), "header path is over 4096"),
        (_mutated(lambda d: d.update(headers=[["I0", "a.h", "a" * 64], ("I0", "b.h")])), r"a header must be \[root"),
        (_mutated(lambda d: d.update(options=["x" * 5000])), "options item is over 4096 characters"),
        (_mutated(lambda d: d.update(portable="yes")), "portable must be true or false"),
        (_mutated(lambda d: d.update(entry="ABC")), "entry is not an entry name"),
        (_mutated(lambda d: d["written_by"].update(time="yesterday")), "bad field"),
        # the time is what strftime wrote: two digits a field, a real date, Z, nothing around it
        (_mutated(lambda d: d["written_by"].update(time="2026-13-01T00:00:00Z")), "bad field"),
        (_mutated(lambda d: d["written_by"].update(time="2026-02-30T00:00:00Z")), "bad field"),
        (_mutated(lambda d: d["written_by"].update(time="2026-2-03T00:00:00Z")), "bad field"),
        (_mutated(lambda d: d["written_by"].update(time="2026-02-03T00:00:00")), "bad field"),
        (_mutated(lambda d: d["written_by"].update(time=" 2026-02-03T00:00:00Z")), "bad field"),
        (_mutated(lambda d: d["written_by"].update(time="2026-02-03T00:00:00Z\n")), "bad field"),
        (_mutated(lambda d: d["written_by"].update(time="\u0662026-02-03T00:00:00Z")), "bad field"),
        (_mutated(lambda d: d["compiler"].update(extra=1)), "compiler must be"),
        (_mutated(lambda d: d.update(name_expressions=[["x", "f"]])), "a name expression must be"),
        (encode_manifest(_manifest()).replace(b'"portable":true', b'"portable":true,"portable":true'), "a key appears twice"),
        (encode_manifest(_manifest()).replace(b'"compile_seconds":0.25', b'"compile_seconds":NaN'), "NaN is not a number"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_the_decoder_refuses_anything_malformed(data, reason):
    with pytest.raises(ManifestError, match=reason):
        decode_manifest(data)
    with pytest.raises(ManifestError, match=reason):  # what a hit reads for the tally: the same checks
        compile_seconds_of(data)


def test_a_time_written_at_any_moment_reads_back():
    for moment in (0, 951_782_400, 1_800_000_000.5, 4_102_444_799):  # 1970, a leap day, 2027, the last second of 2099
        m = build_manifest(b"k", _INPUTS, 0.25, now=lambda: moment)
        assert decode_manifest(encode_manifest(m)) == m


def test_a_manifest_is_bound_to_its_entry_and_round_trips():
    m = _manifest(name_expressions=("f<int>", b"f<\xff>"), headers=(HeaderFile("abs", "/usr/include/x.h", "b" * 64),))
    assert decode_manifest(encode_manifest(m), entry=m.entry) == m
    with pytest.raises(ManifestError, match=f"describes entry {m.entry[:12]}, not {'0' * 12}"):
        decode_manifest(encode_manifest(m), entry="0" * 64)
    with pytest.raises(ManifestError, match="no manifest"):
        decode_manifest(None)


@pytest.mark.parametrize("key", [b"k" * 32, bytes(range(32)), hashlib.sha256(b"x").digest() + b"long"])
def test_the_companion_keys_are_the_manifest_and_symbol_map_keys_and_their_names_what_a_listing_pairs(key):
    """What a tier drops on a hit (``companion_keys``) is exactly what ``compile()`` stores beside the entry."""
    manifest, symbols = companion_keys(key)
    assert (manifest, symbols) == (manifest_key(key), symbols_key(key))
    assert entry_name(manifest) == manifest_name(entry_name(key)) and entry_name(symbols) == symbols_name(entry_name(key))


def test_the_companion_keys_are_spelled_as_every_stored_manifest_and_symbol_map_was():
    """The names already in stores: ``<entry name>#manifest`` and ``<entry name>#symbols`` (a rename orphans them)."""
    name = entry_name(b"k" * 32)
    assert companion_keys(b"k" * 32) == ((name + "#manifest").encode(), (name + "#symbols").encode())
