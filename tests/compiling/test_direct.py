"""Direct mode: a node without a header scan keys a compile from the direct manifest's header sets.

The promise: a set that holds gives exactly the key a scan would (same bytes: direct-mode
nodes and scanning nodes share entries), a fresh node's hit scans nothing and hashes exactly
the files the set lists, and any change on the node to a file the compile could read (through
``pre_include``, a computed include, ``__has_include``, a file shadowing one in a later
include root, a source-directory file, a retargeted symlink, roots laid out otherwise) is a
miss that scans. A manifest keeps at most ``MAX_SETS`` sets and ``MAX_MANIFEST_BYTES``,
newest first; a corrupt, forged or oversized one is never used.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.chain.tiered import as_chain
from tiered_progcache.compiling import direct, headermemo, headerscan
from tiered_progcache.compiling.keys import compile_key
from tiered_progcache.stores.kinds import DIRECT, kind_of

from header_support import OLD, direct_set, fresh_header_memo, write_header  # noqa: F401  (autouse)

#: A CCCL-shaped tree: nested directories, ``..``, ``__has_include`` of a missing header, a computed
#: include, a second include root, a relative pre_include found on the include path.
TREE = {
    "include/lib/all.h": ('#pragma once\n#include <lib/detail/core.h>\n#include "detail/../config.h"\n'
                          "#if __has_include(<lib/optional.h>)\n#include <lib/optional.h>\n#endif\n"
                          "#define LIB_PICK <lib/picked.h>\n#include LIB_PICK\n"),
    "include/lib/detail/core.h": '#pragma once\n#include "../config.h"\n#define CORE 1\n',
    "include/lib/config.h": "#pragma once\n#define CFG 2\n",
    "include/lib/picked.h": "#pragma once\n#define PICKED 3\n",
    "include/pre.h": "#pragma once\n#define PRE 5\n",
    "extra/ext.h": "#pragma once\n#define EXT 4\n",
}
SRC = ('#include <lib/all.h>\n#include "ext.h"\n'
       'extern "C" __global__ void k(int* o) { *o = CORE + CFG + PICKED + EXT + PRE; }\n')


def _tree(root: Path) -> Path:
    for rel, text in TREE.items():
        write_header(root / rel, text)
    return root


def _opts(root: Path, **kw) -> ProgramOptions:
    return ProgramOptions(arch="sm_90", std="c++17", include_path=[str(root / "include"), str(root / "extra")],
                          pre_include="pre.h", **kw)


def _scan_key(root: Path, source: str = SRC, **kw):
    """What a node that scans gets (the memo cleared before and after)."""
    headermemo.clear_memo()
    try:
        return compile_key(source, "c++", _opts(root, **kw), "cubin")
    finally:
        headermemo.clear_memo()


def _direct(chain, root: Path, source: str = SRC, **kw):
    """A node without a scan memo asking ``chain``'s direct manifest; (key, was it a direct hit)."""
    headermemo.clear_memo()
    hits = direct.direct_counts().hits
    opts = _opts(root, **kw)
    got = direct.compile_key(chain, source, "c++", opts, "cubin")
    hit = direct.direct_counts().hits - hits
    if not hit:  # what compile() does after the compile it runs then
        direct.record(chain, got, source, "c++", opts, "cubin", (), None, 1.0)
    return got, hit


def _sets(chain, root: Path):
    key = direct.direct_key(SRC, "c++", _opts(root), "cubin", (), None, True)
    payload = chain.get(key)
    return key, (None if payload is None else direct.decode_direct(payload))


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """(shared chain, host A's root, host B's root): A scanned and recorded; B has a copy under another root."""
    chain = as_chain(InMemoryProgramCache())
    a, b = _tree(tmp_path / "ci" / "home" / "runner" / "venv"), tmp_path / "node" / "opt" / "v"
    (tmp_path / "wa").mkdir()
    (tmp_path / "wb").mkdir()
    monkeypatch.chdir(tmp_path / "wa")
    recorded, hit = _direct(chain, a)
    assert hit == 0
    shutil.copytree(a, b)  # copy2: the mtimes stay settled
    monkeypatch.chdir(tmp_path / "wb")
    return chain, a, b, recorded


def test_a_fresh_node_keys_from_the_set_as_the_scan_would_scanning_nothing_and_hashing_the_listed_files(cluster):
    chain, a, b, recorded = cluster
    _, sets = _sets(chain, b)
    assert len(sets) == 1
    scans, hashed = headerscan.scans_run(), headermemo.files_hashed()
    got, hit = _direct(chain, b)
    assert hit == 1
    assert headerscan.scans_run() - scans == 0
    assert headermemo.files_hashed() - hashed == len(sets[0]["files"])  # each listed file once, no other
    listed = {os.path.realpath(os.path.join(str(b / "include") if i == 0 else str(b / "extra"), rel))
              for i, rel, _, _ in sets[0]["files"]}
    assert listed == {str(b / rel) for rel in TREE}  # exactly the files the compile can read
    # What a compile after this hit would record is the very set it verified (named by roots, not places).
    assert direct.header_set(got, SRC, _opts(b)) == sets[0]
    # The verified set is this process's memo now: the next call neither asks nor scans.
    asked = direct.direct_counts()
    assert direct.compile_key(chain, SRC, "c++", _opts(b), "cubin").key == got.key
    assert direct.direct_counts() == asked and headerscan.scans_run() - scans == 0
    want = _scan_key(b)
    assert (got.key, got.headers, got.missing, got.header_digest, got.portable, got.options) == (
        want.key, want.headers, want.missing, want.header_digest, want.portable, want.options)
    assert got.key == recorded.key  # the same headers under another root: host A's entry


@pytest.mark.parametrize("linked", ["recorder", "node"])
def test_a_root_reached_through_a_symbolic_link_on_one_host_and_a_plain_directory_on_the_other_shares_the_set(
        tmp_path, monkeypatch, linked):
    """CI's CCCL is often reached through a link above it (``/usr/local/cuda`` -> ``cuda-13.0``), a node's
    copy is a plain directory, or the other way round: the set holds on both, with the scan's own key,
    and an edit behind the link is still a miss that scans."""
    chain = as_chain(InMemoryProgramCache())
    real = _tree(tmp_path / "real" / "cuda-13.0" / "targets")
    (tmp_path / "link").mkdir()
    os.symlink(real, tmp_path / "link" / "cuda")
    copy = tmp_path / "node" / "opt" / "v"
    shutil.copytree(real, copy)
    recorder, node = (tmp_path / "link" / "cuda", copy) if linked == "recorder" else (copy, tmp_path / "link" / "cuda")
    for work in ("wa", "wb"):
        (tmp_path / work).mkdir()
    monkeypatch.chdir(tmp_path / "wa")
    recorded, hit = _direct(chain, recorder)
    assert hit == 0
    monkeypatch.chdir(tmp_path / "wb")
    scans = headerscan.scans_run()
    got, hit = _direct(chain, node)
    assert (hit, headerscan.scans_run() - scans) == (1, 0)
    assert got.key == recorded.key == _scan_key(node).key
    _edit(real / "include" / "lib" / "config.h")
    _edit(copy / "include" / "lib" / "config.h")
    got, hit = _direct(chain, node)
    assert hit == 0 and got.key != recorded.key and got.key == _scan_key(node).key


def _edit(path: Path, text: str = "#define EDITED 1\n") -> None:
    with open(path, "a") as fh:
        fh.write(text)
    os.utime(path, (OLD, OLD))  # an edit that even keeps the mtime


EDITS = {
    "a header's content": lambda b: _edit(b / "include/lib/config.h"),
    "the pre_include": lambda b: _edit(b / "include/pre.h"),
    "a computed include's target": lambda b: _edit(b / "include/lib/picked.h"),
    "a __has_include that now finds one": lambda b: write_header(b / "include/lib/optional.h", "#define OPT 1\n"),
    "a file shadowing one in a later root": lambda b: write_header(b / "include/ext.h", "#define EXT 9\n"),
    "a file in the source's directory": lambda b: write_header(Path(os.getcwd()) / "ext.h", "#define EXT 8\n"),
    "the pre_include found in the working directory": lambda b: write_header(Path(os.getcwd()) / "pre.h", "\n"),
    "a header replaced by a directory": lambda b: (os.remove(b / "include/lib/picked.h"),
                                                   os.mkdir(b / "include/lib/picked.h")),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_change_on_the_node_to_anything_the_compile_can_read_is_a_miss_that_scans(cluster, edit):
    chain, a, b, recorded = cluster
    EDITS[edit](b)
    scans = headerscan.scans_run()
    got, hit = _direct(chain, b)
    assert hit == 0 and headerscan.scans_run() - scans == 1
    assert got.key == _scan_key(b).key and got.key != recorded.key
    # ...and the set it scanned is recorded (not where a directory stands in a header's place: a set
    # records files and absences only): the next fresh process on the node hits it.
    again, hit = _direct(chain, b)
    assert (hit, again.key) == (int(edit != "a header replaced by a directory"), got.key)


def test_include_roots_laid_out_otherwise_or_retargeted_are_a_miss(cluster, tmp_path):
    chain, a, b, recorded = cluster
    nested = tmp_path / "nested"
    shutil.copytree(b / "include", nested / "include")
    shutil.copytree(b / "extra", nested / "include" / "extra")  # I1 now lies inside I0
    opts = ProgramOptions(arch="sm_90", std="c++17", pre_include="pre.h",
                          include_path=[str(nested / "include"), str(nested / "include" / "extra")])
    headermemo.clear_memo()
    hits = direct.direct_counts().hits
    got = direct.compile_key(chain, SRC, "c++", opts, "cubin")
    assert direct.direct_counts().hits == hits  # another layout: the set does not speak for it
    headermemo.clear_memo()
    assert got.key == compile_key(SRC, "c++", opts, "cubin").key

    # An include root reached through a symbolic link, retargeted at a tree with one header edited.
    link = tmp_path / "link"
    link.symlink_to(b)
    assert _direct(chain, link)[1] == 1  # the same tree through a link: the set holds (roots spelled or resolved)
    assert _direct(chain, link)[1] == 1  # and for the next fresh process
    edited = tmp_path / "edited"
    shutil.copytree(b, edited)
    _edit(edited / "include/lib/detail/core.h")
    link.unlink()
    link.symlink_to(edited)
    got, hit = _direct(chain, link)
    assert hit == 0 and got.key == _scan_key(link).key != recorded.key


def test_a_location_bound_set_holds_only_at_the_same_absolute_roots(cluster):
    chain, a, b, recorded = cluster
    os.chdir(a.parent.parent.parent.parent / "wa")
    bound, _ = _direct(chain, a, debug=True)  # debug information: keyed by path
    assert not bound.portable
    assert _direct(chain, a, debug=True) == (bound, 1)
    os.chdir(b.parent.parent.parent / "wb")
    got, hit = _direct(chain, b, debug=True)
    assert hit == 0 and got.key == _scan_key(b, debug=True).key != bound.key


def test_the_manifest_keeps_the_newest_sets_within_its_count_and_byte_bounds(cluster, monkeypatch):
    chain, a, b, recorded = cluster
    keys = [recorded.key]
    for n in range(direct.MAX_SETS + 2):  # one node, a header edited between fresh processes
        write_header(b / "include/lib/config.h", f"#pragma once\n#define CFG {10 + n}\n")
        keys.append(_direct(chain, b)[0].key)
    storage, sets = _sets(chain, b)
    assert len(sets) == direct.MAX_SETS
    assert [s["key"] for s in sets] == [k.hex() for k in reversed(keys[-direct.MAX_SETS:])]  # newest first
    write_header(b / "include/lib/config.h", TREE["include/lib/config.h"])
    got, hit = _direct(chain, b)
    assert hit == 0 and got.key == recorded.key  # the oldest set was dropped: scanned, and recorded again
    assert _sets(chain, b)[1][0]["key"] == recorded.key.hex()

    # Bytes: under a bound of about two sets, the newest that fit are kept, the oldest dropped.
    previous = _sets(chain, b)[1]
    bound = len(direct.encode_direct(previous[:2]))
    chain.put(storage, direct.encode_direct(previous[:2]))  # what a node under this bound would have stored
    monkeypatch.setattr(direct, "MAX_MANIFEST_BYTES", bound)
    write_header(b / "include/lib/config.h", "#pragma once\n#define CFG 99\n")
    newest = _direct(chain, b)[0]
    payload = chain.get(storage)
    kept = direct.decode_direct(payload)
    assert len(payload) <= bound and 1 <= len(kept) <= 2
    assert kept[0]["key"] == newest.key.hex() and kept[1:] == previous[:len(kept) - 1]
    assert _stored_bytes([*kept, previous[len(kept) - 1]]) > bound  # the next oldest did not fit
    # A set alone over the bound is not recorded; what was stored stays.
    monkeypatch.setattr(direct, "MAX_MANIFEST_BYTES", _stored_bytes(kept[:1]) // 2)
    write_header(b / "include/lib/config.h", "#pragma once\n#define CFG 98\n")
    with pytest.raises(direct.DirectManifestError, match="alone is over"):
        direct.encode_direct(kept[:1])
    _direct(chain, b)
    assert chain.get(storage) == payload


def _stored_bytes(sets) -> int:
    """What ``encode_direct`` would store for exactly ``sets`` (no bound applied)."""
    body = json.dumps({"format": "tiered-progcache/direct", "sets": sets}, separators=(",", ":")).encode()
    return len(direct.DIRECT_MAGIC + zlib.compress(body, 6))


def _bad_payloads(good: bytes) -> dict[str, bytes]:
    sets = direct.decode_direct(good)
    body = zlib.decompress(good[len(direct.DIRECT_MAGIC):])

    def made(doc_sets) -> bytes:
        return direct.DIRECT_MAGIC + zlib.compress(json.dumps({"format": "tiered-progcache/direct",
                                                                "sets": doc_sets}).encode())

    other = dict(sets[0], digest="ab" * 32)  # a forged header digest: keys otherwise than recorded
    wrong_file = dict(sets[0], files=[[i, rel, "cd" * 32, m] for i, rel, _, m in sets[0]["files"]])
    return {
        "cut short": good[:-7],
        "not the magic": b"{" + good[1:],
        "zlib bomb": direct.DIRECT_MAGIC + zlib.compress(b" " * (direct.MAX_DECODED_BYTES + 1)),
        "over the byte bound": good + b"\0" * direct.MAX_MANIFEST_BYTES,
        "padded": good + b"junk",
        "not JSON": direct.DIRECT_MAGIC + zlib.compress(body[:-1]),
        "an extra field": made([dict(sets[0], extra=1)]),
        "a root index out of range": made([dict(sets[0], files=[[99, "x", "ab" * 32, 1]])]),
        "too many sets": made(sets * (direct.MAX_SETS + 1)),
        "a forged header digest": made([other]),
        "files that are not these": made([wrong_file]),
    }


@pytest.mark.parametrize("bad", ["cut short", "not the magic", "zlib bomb", "over the byte bound", "padded",
                                 "not JSON", "an extra field", "a root index out of range", "too many sets",
                                 "a forged header digest", "files that are not these"])
def test_a_corrupt_forged_or_oversized_manifest_is_never_used(cluster, bad):
    chain, a, b, recorded = cluster
    storage, _ = _sets(chain, b)
    chain.put(storage, _bad_payloads(chain.get(storage))[bad])
    scans = headerscan.scans_run()
    got, hit = _direct(chain, b)
    assert hit == 0 and headerscan.scans_run() - scans == 1 and got.key == recorded.key
    assert direct.decode_direct(chain.get(storage))[0]["key"] == recorded.key.hex()  # replaced by a good one


def test_the_direct_manifest_is_metadata_to_operators(cluster):
    chain, a, b, recorded = cluster
    payload = chain.get(_sets(chain, b)[0])
    assert kind_of(payload) == DIRECT
    assert len(payload) < 4096  # a tiny tree's set; CUB's is about 30 KB


def test_a_failing_store_costs_only_the_record(cluster):
    chain, a, b, recorded = cluster

    class Refusing:
        shared_store = None  # a chain's, read for the probe: none here, so the read itself is what fails

        def get(self, key):
            raise OSError("down")

        def put(self, key, data, compile_seconds=None):
            raise OSError("down")

    got = direct.compile_key(Refusing(), SRC, "c++", _opts(b), "cubin")
    assert got.key == recorded.key


def test_a_compile_that_fails_records_no_set(tmp_path, monkeypatch):
    """A set is recorded after the compile it keys, never before: one that fails leaves no direct manifest
    (a node that finds none compiles, and fails, itself)."""
    root = _tree(tmp_path / "tree")
    monkeypatch.chdir(tmp_path)
    bad = SRC + "extern \"C\" __global__ void broken() { not_declared(); }\n"
    recorded = direct.direct_counts().recorded
    with TieredProgramCache(tmp_path / "cache") as cache:
        with pytest.raises(Exception, match="not_declared"):
            tpc.compile(bad, "c++", _opts(root), cache=cache)
        assert cache.get(direct.direct_key(bad, "c++", _opts(root), "cubin", (), None, True)) is None
    assert direct.direct_counts().recorded == recorded


def test_a_direct_hit_reads_its_entry_ahead_while_it_hashes(tmp_path, monkeypatch):
    """The newest set's entry is read from the shared tier while the set's headers are hashed: its read is
    out before any lookup asks for it (a round trip off a fresh node's first hit)."""
    import uuid

    from cuda.core.utils import FileStreamProgramCache

    from tiered_progcache.stores.remote import RemoteProgramCache
    from tiered_progcache.stores.store import entry_name
    from tiered_progcache.testing import WrapperEntryStore

    root = _tree(tmp_path / "tree")
    monkeypatch.chdir(tmp_path)
    shared = WrapperEntryStore(RemoteProgramCache.from_url(f"memory://ahead-{uuid.uuid4().hex}/k", strict=True))
    with TieredProgramCache(tiers=[InMemoryProgramCache(), shared]) as writer:
        made, hit = _direct(writer, root)  # recorded on the shared tier
        assert not hit and writer.flush(60)
    shared.write_key(made.key, b"\x7fELF" + bytes(64))
    gate = shared.hold("read_entry", name=entry_name(made.key))
    reader = TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path / "local"), shared])
    try:
        got, hit = _direct(reader, root)
        assert hit and got.key == made.key
        assert gate.wait_arrived()  # read ahead: no lookup has asked for it
    finally:
        gate.open()
        reader.close()


# -- through compile(): a fresh node on a file:// remote, and after warm ------------------------


@pytest.fixture(scope="module")
def remote_with_one_kernel(tmp_path_factory):
    """A file:// remote a CI node filled by compiling the tree's kernel once (one NVRTC run)."""
    base = tmp_path_factory.mktemp("direct-remote")
    (base / "remote").mkdir()
    url = (base / "remote").as_uri()
    root = _tree(base / "ci-tree")
    (base / "ci-work").mkdir()
    previous = os.getcwd()
    os.chdir(base / "ci-work")
    try:
        headermemo.clear_memo()
        with TieredProgramCache(base / "ci-cache", remote=url) as ci:
            compiles = tpc.compile_count()
            tpc.compile(SRC, "c++", _opts(root), cache=ci)
            assert tpc.compile_count() - compiles == 1
            assert ci.flush(60)
    finally:
        os.chdir(previous)
        headermemo.clear_memo()
    return url, root


def _fresh_node(url: str, ci_root: Path, tmp_path: Path, monkeypatch) -> tuple[Path, ProgramOptions, int]:
    """A node's copy of the CI tree and a working directory of its own: (its root, its options, the files the
    recorded set names)."""
    node_root = tmp_path / "node-tree"
    shutil.copytree(ci_root, node_root)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    opts = _opts(node_root)
    return node_root, opts, len(direct.decode_direct(_direct_payload(url, opts))[0]["files"])


def test_a_fresh_node_hits_through_compile_with_no_scan_and_after_warm_asks_the_remote_nothing(
        remote_with_one_kernel, tmp_path, monkeypatch):
    url, ci_root = remote_with_one_kernel
    node_root, opts, files = _fresh_node(url, ci_root, tmp_path, monkeypatch)
    with TieredProgramCache(tmp_path / "fresh", remote=url, boot_fetch_bytes=0) as node:  # the entry read ahead
        compiles, scans, hashed = tpc.compile_count(), headerscan.scans_run(), headermemo.files_hashed()
        before = node.stats()
        tpc.compile(SRC, "c++", opts, cache=node)
        remote = (node.stats() - before)["remote"]
        assert (tpc.compile_count() - compiles, headerscan.scans_run() - scans) == (0, 0)
        assert headermemo.files_hashed() - hashed == files
        assert remote.hits == 1  # the entry (the direct manifest read before it is metadata: no lookup)

    headermemo.clear_memo()
    with TieredProgramCache(tmp_path / "warmed", remote=url) as node:
        report = node.warm()
        assert report.failures == 0 and report.metadata >= 1  # the direct manifest came too
        scans, before = headerscan.scans_run(), node.stats()
        tpc.compile(SRC, "c++", opts, cache=node)
        delta = node.stats() - before
        assert (delta["remote"].lookups, delta["remote"].bytes_read, delta["remote"].writes) == (0, 0, 0)
        assert headerscan.scans_run() - scans == 0 and delta["local"].hits == 1  # the entry; its direct manifest is metadata


def test_warm_with_the_include_path_hashes_the_headers_now_and_a_header_changed_after_it_still_misses(
        remote_with_one_kernel, tmp_path, monkeypatch):
    """``tiered_progcache.warm(cache, include_path=...)`` hashes each file the fetched set names there, once; the
    first hit then hashes none. A header changed after the warm no longer stats as hashed: hashed again, the set
    fails, NVRTC runs."""
    url, ci_root = remote_with_one_kernel
    node_root, opts, files = _fresh_node(url, ci_root, tmp_path, monkeypatch)
    with TieredProgramCache(tmp_path / "hashed", remote=url) as node:
        hashed = headermemo.files_hashed()
        tpc.warm(node, include_path=[Path(d) for d in opts.include_path])  # os.PathLike as ProgramOptions takes
        assert headermemo.files_hashed() - hashed == files
        compiles, scans, hashed = tpc.compile_count(), headerscan.scans_run(), headermemo.files_hashed()
        tpc.compile(SRC, "c++", opts, cache=node)
        assert (tpc.compile_count() - compiles, headerscan.scans_run() - scans) == (0, 0)
        assert headermemo.files_hashed() - hashed == 0
    headermemo.clear_memo()
    with TieredProgramCache(tmp_path / "edited", remote=url) as node:
        tpc.warm(node, include_path=opts.include_path)
        write_header(node_root / "include" / "lib" / "config.h", "#pragma once\n#define CFG 9\n")  # same size
        compiles = tpc.compile_count()
        tpc.compile(SRC, "c++", opts, cache=node)
        assert tpc.compile_count() - compiles == 1


def test_prehash_skips_a_set_laid_out_for_other_roots_and_a_manifest_that_does_not_decode(
        remote_with_one_kernel, tmp_path, monkeypatch):
    url, ci_root = remote_with_one_kernel
    monkeypatch.chdir(tmp_path)
    opts = _opts(ci_root)
    payload = _direct_payload(url, opts)
    headermemo.clear_memo()
    assert direct.prehash([payload], opts.include_path[:1]) == 0  # one include root where the set has two
    assert direct.prehash([b"not a direct manifest", payload[:-4]], opts.include_path) == 0
    files = direct.decode_direct(payload)[0]["files"]
    assert direct.prehash([b"not a direct manifest", payload, payload], opts.include_path) == len(files)


def test_prehash_goes_on_past_a_set_for_other_roots_a_file_hashed_already_one_missing_and_one_over_the_bound(
        remote_with_one_kernel, tmp_path, monkeypatch):
    """Each file is judged alone: what is skipped (a set laid out otherwise, a file hashed by an earlier set, one
    not on this node, one over ``MAX_HEADER_BYTES``) never ends the walk through the rest."""
    url, ci_root = remote_with_one_kernel
    node_root = tmp_path / "node-tree"
    shutil.copytree(ci_root, node_root)
    monkeypatch.chdir(tmp_path)
    opts = _opts(node_root)
    one = direct.decode_direct(_direct_payload(url, _opts(ci_root)))[0]
    files = one["files"]
    elsewhere = {**one, "n": one["n"] + 2}
    fewer = {**one, "files": files[:-1]}
    spelled = direct._spelled_roots(opts, str(tmp_path))
    roots = spelled + tuple(os.path.realpath(r) for r in spelled)
    headermemo.clear_memo()
    assert direct.prehash([direct.encode_direct([elsewhere, fewer, one])], opts.include_path) == len(files)
    gone = direct._place(files[0][0], files[0][1], roots)
    os.unlink(gone)
    headermemo.clear_memo()
    assert direct.prehash([direct.encode_direct([one])], opts.include_path) == len(files) - 1
    sizes = [os.path.getsize(direct._place(i, rel, roots)) for i, rel, _, _ in files[1:]]
    monkeypatch.setattr(direct, "MAX_HEADER_BYTES", max(sizes))  # the bound itself is within it
    headermemo.clear_memo()
    assert direct.prehash([direct.encode_direct([one])], opts.include_path) == len(files) - 1
    monkeypatch.setattr(direct, "MAX_HEADER_BYTES", max(sizes) - 1)  # the biggest files skipped, the rest hashed
    headermemo.clear_memo()
    assert direct.prehash([direct.encode_direct([one])], opts.include_path) == len(files) - 1 - sizes.count(max(sizes))


@pytest.mark.parametrize("include_path", [3, [b"/opt/cccl"], ["/opt/cccl", None]])
def test_warm_refuses_an_include_path_that_is_not_directories(tmp_path, include_path):
    with TieredProgramCache(tmp_path) as cache, pytest.raises(TypeError, match="include_path must be a directory"):
        tpc.warm(cache, include_path=include_path)


@pytest.mark.parametrize("include_path", ["/opt/cccl", Path("/opt/cccl"), ("/opt/cccl", Path("/opt/cub"))])
def test_warm_takes_an_include_path_as_program_options_does(tmp_path, include_path):
    """One directory or several, str or os.PathLike: past the type check to the chain's own refusal (no remote)."""
    with TieredProgramCache(tmp_path) as cache, pytest.raises(ValueError, match="warm needs a remote"):
        tpc.warm(cache, include_path=include_path)


def test_warm_without_an_include_path_hashes_nothing_and_reports_what_the_chains_warm_does(
        remote_with_one_kernel, tmp_path):
    url, _ = remote_with_one_kernel
    headermemo.clear_memo()
    with TieredProgramCache(tmp_path / "plain", remote=url) as node, \
            TieredProgramCache(tmp_path / "other", remote=url) as other:
        hashed = headermemo.files_hashed()
        report = tpc.warm(node)
        assert headermemo.files_hashed() - hashed == 0
        same = other.warm()
        assert (report.entries, report.metadata, report.failures) == (same.entries, same.metadata, 0)
        assert report.metadata >= 1  # the direct manifest came


def test_warm_passes_names_the_byte_budget_and_progress_through_and_takes_the_default_cache(
        remote_with_one_kernel, tmp_path, monkeypatch):
    from tiered_progcache.chain import defaultcache

    url, _ = remote_with_one_kernel
    with TieredProgramCache(tmp_path / "none", remote=url) as node:
        assert tpc.warm(node, max_bytes=0).entries == 0
    with TieredProgramCache(tmp_path / "named", remote=url) as node:
        name = min(entry.name for entry in node.shared_store.iter_entries())
        told: list[tuple[int, int]] = []
        report = tpc.warm(node, names=[name], progress=lambda done, total: told.append((done, total)))
        assert (report.entries, told[0], told[-1]) == (1, (0, 1), (1, 1))
    with TieredProgramCache(tmp_path / "default", remote=url) as node, \
            TieredProgramCache(tmp_path / "other", remote=url) as other:
        monkeypatch.setattr(defaultcache, "_default", node)
        report = tpc.warm()  # into the default cache's directory: what the same warm of another node lands
        assert report.entries == other.warm().entries == len(list(node.local_store.iter_entries()))
        assert report.entries > 0


def _direct_payload(url: str, opts: ProgramOptions) -> bytes:
    with TieredProgramCache(Path(url[len("file://"):]).parent / "peek", remote=url) as peek:
        return peek.get(direct.direct_key(SRC, "c++", opts, "cubin", (), None, True))


def test_headers_under_one_hosts_working_directory_and_not_the_others_still_share(tmp_path, monkeypatch):
    """A CI runner's venv inside its checkout (the working directory), a node's under /opt: one set holds."""
    chain = as_chain(InMemoryProgramCache())
    checkout = tmp_path / "runner" / "work" / "proj"
    a = _tree(checkout / ".venv" / "cccl")
    monkeypatch.chdir(checkout)
    recorded, _ = _direct(chain, a)
    b = tmp_path / "opt" / "cccl"
    shutil.copytree(a, b)
    (tmp_path / "app").mkdir()
    monkeypatch.chdir(tmp_path / "app")
    got, hit = _direct(chain, b)
    assert (hit, got.key) == (1, recorded.key) and got.key == _scan_key(b).key


@pytest.mark.parametrize("rows", [
    {"files": "not a list"},
    {"files": [[0, "a.h", "ab" * 32]]},  # a row one item short
    {"files": [[0, "a.h", "ab" * 32, 1, 0]]},  # one item long
    {"files": [[0, 7, "ab" * 32, 1]]},  # a path that is not a str
    {"files": [[0, "a.h", "AB" * 32, 1]]},  # a digest that is not lowercase hex
    {"files": [[0, "a.h", "ab" * 32, True]]},  # a mask that is a bool
    {"files": [[0, "a.h", "ab" * 32, 1 << 2]]},  # a mask past the two roots
    {"files": [[0, "a.h", "ab" * 32, -1]]},  # a negative mask
    {"files": [[True, "a.h", "ab" * 32, 1]]},  # an index that is a bool
    {"files": [[2, "a.h", "ab" * 32, 1]]},  # an index past the roots
    {"files": [[-2, "a.h", "ab" * 32, 1]]},  # below -1, the lowest a file row's index may be
    {"absent": [[-5, "b.h", 1]]},  # below a made path's lowest
    {"real": [[0, "", 1, -7, "", 1, "I0", ""]]},  # below _ANCESTOR
])
def test_a_header_set_with_a_row_out_of_shape_is_refused(rows):
    assert direct.decode_direct(direct.encode_direct([direct_set()]))[0]["files"]  # the well-formed one decodes
    with pytest.raises(direct.DirectManifestError, match="wrong type or range"):
        direct.decode_direct(direct.encode_direct([direct_set(**rows)]))
