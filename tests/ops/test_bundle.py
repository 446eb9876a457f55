"""Cache bundles: export, import on a fresh node that then compiles nothing, and every refusal landing nothing."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile

import pytest
from cuda.core import Program, ProgramOptions

import tiered_progcache
from tiered_progcache import LocalDir, TieredProgramCache
from tiered_progcache.ops.bundle import (
    BUNDLE_FORMAT,
    BundleRefused,
    export_bundle,
    import_bundle,
    read_bundle,
)
from tiered_progcache.stores.codeobject import code_arch
from tiered_progcache.stores.envelope import EnvelopeCodec
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.samples import matmul_source
from tiered_progcache.stores.store import entry_name
from support import options

KEY = b"bundle signing key, 32 bytes ok!"
KERNELS = [matmul_source(16), matmul_source(32, "relu")]
NAMED = r"""
template <typename T> __global__ void fill(T* out, T v, int n) { int i = threadIdx.x; if (i < n) out[i] = v; }
"""


def _fill(root, sources=KERNELS, arch: str = "sm_90") -> list[str]:
    """Compile ``sources`` into the local directory ``root``; the entry names it now holds.

    Through cuda-core's ``Program.compile(cache=...)``, which stores the binary alone
    (no manifest), so each source is one entry; ``compile()`` shares these keys.
    """
    with TieredProgramCache(root) as cache:
        for src in sources:
            Program(src, "c++", options(arch=arch, std="c++17")).compile("cubin", cache=cache)
    return sorted(e.name for e in LocalDir(root).iter_entries())


def _names(store) -> list[str]:
    return sorted(e.name for e in store.iter_entries())


@pytest.mark.parametrize("compression", ["auto", None])
def test_export_then_import_gives_a_node_that_compiles_nothing(tmp_path, compression):
    _fill(tmp_path / "builder")
    # the name-expression compile below stores its symbol map as an entry too
    with TieredProgramCache(tmp_path / "builder") as cache:
        tiered_progcache.compile(NAMED, "c++", options(std="c++17"), cache=cache, name_expressions=["fill<float>"])
    built = _names(LocalDir(tmp_path / "builder"))
    report = export_bundle(LocalDir(tmp_path / "builder"), tmp_path / "k.tpcb", compression=compression)
    assert (report.entries, report.skipped, report.failures) == (len(built), 0, 0)
    zstd = compression == "auto" and importlib.util.find_spec("zstandard") is not None  # auto: zstd where installed
    assert report.compressed is zstd
    with open(tmp_path / "k.tpcb", "rb") as fh:
        assert (fh.read(4) == b"\x28\xb5\x2f\xfd") is zstd

    fresh = LocalDir(tmp_path / "fresh")
    landed = import_bundle(tmp_path / "k.tpcb", fresh)
    assert (landed.entries, landed.skipped, landed.failures) == (len(built), 0, 0)
    assert _names(fresh) == built
    for name in built:
        assert fresh.read_entry(name) == LocalDir(tmp_path / "builder").read_entry(name)

    before = tiered_progcache.compile_count()
    with TieredProgramCache(tmp_path / "fresh") as cache:
        for src in KERNELS:
            tiered_progcache.compile(src, "c++", options(std="c++17"), cache=cache)
        obj = tiered_progcache.compile(NAMED, "c++", options(std="c++17"), cache=cache, name_expressions=["fill<float>"])
        assert dict(obj.symbol_mapping) == {"fill<float>": obj.symbol_mapping["fill<float>"]}  # its map came along
        assert cache.stats()["local"].hits == 3  # 2 kernels, then 1 binary (its symbol map read is no lookup)
    assert tiered_progcache.compile_count() - before == 0

    again = import_bundle(tmp_path / "k.tpcb", fresh)  # what is there is left alone
    assert (again.entries, again.skipped) == (0, len(built))
    assert len(built) == 5  # 2 kernels (no manifests: _fill), then 1 binary + its symbol map + its manifest


def test_a_signed_bundle_from_a_remote_imports_under_the_key_and_pushes_to_another_remote(tmp_path):
    names = _fill(tmp_path / "builder")
    source = RemoteProgramCache.from_url((tmp_path / "bucket").as_uri(), signing_key=KEY)
    for name in names:
        source.write_entry(name, LocalDir(tmp_path / "builder").read_entry(name))
    report = export_bundle(source, tmp_path / "k.tpcb", signing_key=KEY)
    assert report.entries == len(names)

    target = RemoteProgramCache.from_url((tmp_path / "other").as_uri(), signing_key=b"the other cluster's key")
    landed = import_bundle(tmp_path / "k.tpcb", target, signing_key=KEY)
    assert landed.entries == len(names) and _names(target) == names
    for name in names:  # sealed again by the target with its own key
        assert target.read_entry(name) == LocalDir(tmp_path / "builder").read_entry(name)


# -- refusals: one line, nothing lands ------------------------------------------------------------


def _assert_refused(bundle, target: LocalDir, match: str, **kw) -> str:
    with pytest.raises(BundleRefused, match=match) as info:
        import_bundle(bundle, target, **kw)
    message = str(info.value)
    assert "\n" not in message
    assert _names(target) == []
    return message


def _plain_bundle(tmp_path, **kw):
    _fill(tmp_path / "builder")
    path = tmp_path / "k.tar"
    export_bundle(LocalDir(tmp_path / "builder"), path, compression=None, **kw)
    return path


def test_a_tampered_entry_refuses_the_whole_bundle(tmp_path):
    path = _plain_bundle(tmp_path)
    data = bytearray(path.read_bytes())
    first = tarfile.open(path).getmembers()[0]
    data[first.offset_data + 200] ^= 0x01  # inside the first entry's payload
    path.write_bytes(bytes(data))
    _assert_refused(path, LocalDir(tmp_path / "fresh"), "failed verification: payload digest mismatch")


def _handmade(path, members: list[tuple[tarfile.TarInfo, bytes]], *, index: int | None = None) -> None:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
        if index is not None:
            doc = json.dumps({"format": BUNDLE_FORMAT, "version": 1, "entries": index}).encode()
            info = tarfile.TarInfo("index.json")
            info.size = len(doc)
            tar.addfile(info, io.BytesIO(doc))


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _sealed(payload: bytes = b"\x7fELF payload", key=None) -> tuple[str, bytes]:
    name = entry_name(payload)
    return name, EnvelopeCodec(key).seal(name, payload)


@pytest.mark.parametrize(
    "member",
    [
        "entries/../../escaped",
        "../entries/ab/" + "c" * 62,
        "/etc/entries/ab/" + "c" * 62,
        "entries/ab/../" + "c" * 62,
        "entries/AB/" + "C" * 62,
        "entries/ab/" + "c" * 61,
    ],
)
def test_a_member_outside_entries_refuses_the_bundle(tmp_path, member):
    name, blob = _sealed()
    good = _file(f"entries/{name[:2]}/{name[2:]}", blob)
    _handmade(tmp_path / "b.tar", [good, _file(member, blob)], index=2)
    message = _assert_refused(tmp_path / "b.tar", LocalDir(tmp_path / "fresh"), "is not named entries/")
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "fresh").exists()
    assert member[:20] in message


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE])
def test_links_devices_and_directories_are_refused(tmp_path, kind):
    name, blob = _sealed()
    info = tarfile.TarInfo(f"entries/{name[:2]}/{name[2:]}")
    info.type = kind
    info.linkname = "/etc/passwd"
    _handmade(tmp_path / "b.tar", [(info, b"")], index=1)
    _assert_refused(tmp_path / "b.tar", LocalDir(tmp_path / "fresh"), "not a regular file")


@pytest.mark.parametrize("compression", ["auto", None])
def test_a_truncated_bundle_is_refused_wherever_it_is_cut(tmp_path, compression):
    _fill(tmp_path / "builder")
    path = tmp_path / "k.tpcb"
    export_bundle(LocalDir(tmp_path / "builder"), path, compression=compression)
    whole = path.read_bytes()
    if compression is None:  # cut anywhere before the end of the index (after it is only tar's zero padding)
        index = tarfile.open(path).getmembers()[-1]
        end = index.offset_data + index.size
        cuts = [0, 1, 100, 512, 513, 1024, end // 3, end // 2, index.offset, index.offset + 600, end - 1]
    else:  # a zstd stream: anywhere in its first half
        cuts = [0, 1, 4, 10, 100, len(whole) // 3, len(whole) // 2]
    for cut in cuts:
        path.write_bytes(whole[:cut])
        _assert_refused(path, LocalDir(tmp_path / f"fresh{cut}"), "truncated|not a bundle|zstd|index")


def test_a_cut_at_a_member_boundary_is_caught_by_the_missing_index(tmp_path):
    path = _plain_bundle(tmp_path)
    last = tarfile.open(path).getmembers()[-1]
    assert last.name == "index.json"
    path.write_bytes(path.read_bytes()[: last.offset])
    _assert_refused(path, LocalDir(tmp_path / "fresh"), "no index")


def test_an_unsigned_bundle_is_refused_under_a_signing_key(tmp_path):
    path = _plain_bundle(tmp_path)
    _assert_refused(path, LocalDir(tmp_path / "fresh"), "unsigned entry", signing_key=KEY)


def test_a_bundle_signed_with_another_key_is_refused(tmp_path):
    path = _plain_bundle(tmp_path, signing_key=b"someone else's key")
    _assert_refused(path, LocalDir(tmp_path / "fresh"), "bad signature", signing_key=KEY)
    # and with the right key it lands
    path2 = tmp_path / "signed.tar"
    export_bundle(LocalDir(tmp_path / "builder"), path2, signing_key=KEY)
    assert import_bundle(path2, LocalDir(tmp_path / "ok"), signing_key=KEY).entries == 2


def test_caps_on_members_total_bytes_and_duplicates(tmp_path):
    path = _plain_bundle(tmp_path)
    total = sum(m.size for m in tarfile.open(path).getmembers() if m.name != "index.json")
    _assert_refused(path, LocalDir(tmp_path / "a"), r"more than 1 entries \(max_members\)", max_members=1)
    _assert_refused(path, LocalDir(tmp_path / "b"), r"max_total_bytes", max_total_bytes=total - 1)
    assert import_bundle(path, LocalDir(tmp_path / "c"), max_total_bytes=total).entries == 2
    name, blob = _sealed()
    member = f"entries/{name[:2]}/{name[2:]}"
    _handmade(tmp_path / "dup.tar", [_file(member, blob), _file(member, blob)], index=2)
    _assert_refused(tmp_path / "dup.tar", LocalDir(tmp_path / "d"), "appears twice")
    name, blob = _sealed(b"\x7fELF" + b"x" * 1000)
    _handmade(tmp_path / "big.tar", [_file(f"entries/{name[:2]}/{name[2:]}", blob)], index=1)
    with pytest.raises(BundleRefused, match="is 1092 bytes, over the 1020-byte cap"):
        read_bundle(tmp_path / "big.tar", max_entry_bytes=900)
    with pytest.raises(BundleRefused, match="raw length 1004 exceeds the 1003-byte cap"):
        read_bundle(tmp_path / "big.tar", max_entry_bytes=1003)  # the envelope's own cap on the payload
    assert list(read_bundle(tmp_path / "big.tar", max_entry_bytes=1004)) == [name]


def test_an_index_that_disagrees_or_comes_early_is_refused(tmp_path):
    name, blob = _sealed()
    member = _file(f"entries/{name[:2]}/{name[2:]}", blob)
    _handmade(tmp_path / "count.tar", [member], index=2)
    _assert_refused(tmp_path / "count.tar", LocalDir(tmp_path / "a"), "index says 2 entries, the bundle holds 1")
    doc = json.dumps({"format": BUNDLE_FORMAT, "version": 1, "entries": 0}).encode()
    _handmade(tmp_path / "early.tar", [_file("index.json", doc), member])
    _assert_refused(tmp_path / "early.tar", LocalDir(tmp_path / "b"), "after the index")
    _handmade(tmp_path / "foreign.tar", [_file("index.json", b'{"format": "other"}')])
    _assert_refused(tmp_path / "foreign.tar", LocalDir(tmp_path / "c"), "not a tiered-progcache-bundle")
    (tmp_path / "junk").write_bytes(b"not a tar at all" * 100)
    _assert_refused(tmp_path / "junk", LocalDir(tmp_path / "d"), "not a bundle")


def test_a_zstd_bomb_stops_at_the_total_cap(tmp_path):
    """A huge PAX header (tar reads it whole) compresses to almost nothing: the byte cap stops the read."""
    zstandard = pytest.importorskip("zstandard")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        name, blob = _sealed()
        info, data = _file(f"entries/{name[:2]}/{name[2:]}", blob)
        info.pax_headers = {"comment": "x" * (32 << 20)}
        tar.addfile(info, io.BytesIO(data))
    bomb = zstandard.ZstdCompressor().compress(raw.getvalue())
    assert len(bomb) < (1 << 20)
    (tmp_path / "bomb").write_bytes(bomb)
    with pytest.raises(BundleRefused, match=r"over 1048576 bytes in all \(max_total_bytes\)"):
        read_bundle(tmp_path / "bomb", max_total_bytes=1 << 20, max_members=10)


# -- filters -------------------------------------------------------------------------------------


def test_code_arch_reads_cubin_e_flags_and_ptx_target():
    from cuda.core import Program

    for arch, sm in (("sm_75", 75), ("sm_80", 80), ("sm_90", 90), ("sm_90a", 90), ("sm_120", 120)):
        cubin = bytes(Program(KERNELS[0], "c++", ProgramOptions(arch=arch)).compile("cubin").code)
        assert code_arch(cubin) == sm
    assert code_arch(b"//\n.version 8.0\n.target sm_86\n.address_size 64\n") == 86
    assert code_arch(b'{"fill<float>": "_Z4fillIfEvPT_S0_i"}') is None


def test_export_filters_by_arch_age_and_name(tmp_path):
    root = tmp_path / "builder"
    sm90 = set(_fill(root, KERNELS[:1], "sm_90"))
    sm80 = set(_fill(root, KERNELS[:1], "sm_80")) - sm90
    assert len(sm90) == 1 and len(sm80) == 1
    local = LocalDir(root)
    assert export_bundle(local, tmp_path / "a", arch="sm_90").entries == 1
    assert set(read_bundle(tmp_path / "a")) == sm90
    assert set(read_bundle(tmp_path / "a")) == sm90
    report = export_bundle(local, tmp_path / "b", arch=80)
    assert (report.entries, report.skipped) == (1, 1) and set(read_bundle(tmp_path / "b")) == sm80

    used = {e.name: e.last_used for e in local.iter_entries()}
    newest = max(used.values())
    report = export_bundle(local, tmp_path / "c", max_age=10, now=newest + 11)
    assert (report.entries, report.skipped) == (0, 2)
    report = export_bundle(local, tmp_path / "d", max_age=10, now=min(used.values()) + 10)
    assert report.entries == 2
    report = export_bundle(local, tmp_path / "e", names=sorted(sm80))
    assert report.entries == 1 and set(read_bundle(tmp_path / "e")) == sm80


def test_bad_arguments_are_named(tmp_path):
    local = LocalDir(tmp_path)
    with pytest.raises(ValueError, match="arch must look like sm_90"):
        export_bundle(local, tmp_path / "x", arch="hopper")
    with pytest.raises(ValueError, match="not an entry name"):
        export_bundle(local, tmp_path / "x", names=["kernel"])
    with pytest.raises(ValueError, match="max_age"):
        export_bundle(local, tmp_path / "x", max_age=-1)
    with pytest.raises(TypeError, match="EntryStore"):
        export_bundle(str(tmp_path), tmp_path / "x")
    with pytest.raises(ValueError, match="compression"):
        export_bundle(local, tmp_path / "x", compression="gzip")
    assert not (tmp_path / "x").exists()


# -- the command -----------------------------------------------------------------------------------


def _cli(*args, env=None):
    from support import run_cli

    return run_cli(*args, env=env)


def test_cli_export_then_import_into_a_fresh_directory_and_to_a_remote(tmp_path):
    names = _fill(tmp_path / "builder")
    out = tmp_path / "k.tpcb"
    proc = _cli("export", str(out), "--arch", "sm_90", env={"TIERED_PROGCACHE_DIR": str(tmp_path / "builder")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"exported 2 kernels (+0 metadata, ") and "0 filtered out, 0 unreadable" in proc.stdout
    proc = _cli("import", str(out), "--dir", str(tmp_path / "fresh"))
    assert proc.returncode == 0, proc.stderr
    assert "imported 2 kernels (+0 metadata" in proc.stdout and "0 already there, 0 failed" in proc.stdout
    assert _names(LocalDir(tmp_path / "fresh")) == names
    remote = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    proc = _cli("import", str(out), "--remote", remote, "--dir", str(tmp_path / "unused"))
    assert proc.returncode == 0, proc.stderr
    assert _names(RemoteProgramCache.from_url(remote)) == names
    proc = _cli("export", str(tmp_path / "from-remote"), names[0], "--remote", remote, "--format", "tar")
    assert proc.returncode == 0, proc.stderr
    assert list(read_bundle(tmp_path / "from-remote")) == [names[0]]


def _refused_by_cli(bundle, target, *extra, env=None) -> str:
    from support import assert_one_line_error

    proc = _cli("import", str(bundle), "--dir", str(target), *extra, env=env)
    line = assert_one_line_error(proc, rc=1)
    assert line.startswith(f"tiered-progcache import: refused {bundle}: ") and line.endswith("; nothing landed")
    assert _names(LocalDir(target)) == []
    return line


def test_cli_refuses_tampered_escaping_truncated_and_unsigned_bundles_with_one_line(tmp_path):
    path = _plain_bundle(tmp_path)
    whole = path.read_bytes()
    tampered = bytearray(whole)
    tampered[tarfile.open(path).getmembers()[0].offset_data + 300] ^= 0x80
    (tmp_path / "tampered").write_bytes(bytes(tampered))
    assert "payload digest mismatch" in _refused_by_cli(tmp_path / "tampered", tmp_path / "t1")

    name, blob = _sealed()
    _handmade(tmp_path / "escape", [_file(f"entries/../../{name}", blob)], index=1)
    assert "is not named entries/" in _refused_by_cli(tmp_path / "escape", tmp_path / "t2")

    (tmp_path / "cut").write_bytes(whole[: len(whole) // 2])
    assert "truncated" in _refused_by_cli(tmp_path / "cut", tmp_path / "t3")

    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    env = {"TIERED_PROGCACHE_SIGNING_KEY_FILE": str(key_file)}
    assert "unsigned entry" in _refused_by_cli(path, tmp_path / "t4", env=env)
    # signed with that key by the command itself, it lands
    signed = tmp_path / "signed"
    assert _cli("export", str(signed), "--dir", str(tmp_path / "builder"), env=env).returncode == 0
    assert _cli("import", str(signed), "--dir", str(tmp_path / "t5"), env=env).returncode == 0
    assert len(_names(LocalDir(tmp_path / "t5"))) == 2


def test_cli_usage_and_missing_files(tmp_path):
    from support import assert_one_line_error

    line = assert_one_line_error(_cli("export", str(tmp_path / "x"), "--arch", "hopper", "--dir", str(tmp_path)))
    assert "arch must look like sm_90" in line
    line = assert_one_line_error(_cli("export", str(tmp_path / "x"), "not-a-name", "--dir", str(tmp_path)))
    assert "not an entry name" in line
    line = assert_one_line_error(_cli("import", str(tmp_path / "absent"), "--dir", str(tmp_path)), rc=1)
    assert "FileNotFoundError" in line
    assert not (tmp_path / "x").exists()


def test_the_documented_default_caps():
    """docs/operations.md: 100,000 entries, a 1 GiB payload per member, 4 GiB in all."""
    import inspect

    from tiered_progcache.ops import bundle

    assert (bundle.DEFAULT_MAX_MEMBERS, bundle.DEFAULT_MAX_TOTAL_BYTES, bundle.MAX_ENTRY_BYTES) == (100_000, 4 << 30, 1 << 30)
    for function in (import_bundle, read_bundle):
        params = inspect.signature(function).parameters
        assert params["max_members"].default == 100_000 and params["max_total_bytes"].default == 4 << 30
    assert inspect.signature(read_bundle).parameters["max_entry_bytes"].default == 1 << 30


def test_export_leaves_out_and_counts_an_entry_that_fails_its_check(tmp_path):
    names = _fill(tmp_path / "builder")
    remote = RemoteProgramCache.from_url((tmp_path / "bucket").as_uri())
    for name in names:
        remote.write_entry(name, LocalDir(tmp_path / "builder").read_entry(name))
    victim = tmp_path / "bucket" / "entries" / names[0][:2] / names[0][2:]
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 0xFF
    victim.write_bytes(bytes(blob))
    report = export_bundle(remote, tmp_path / "k.tpcb")
    assert (report.entries, report.failures) == (1, 1)
    assert list(read_bundle(tmp_path / "k.tpcb")) == names[1:]


class _DiesMidway(LocalDir):
    """A local directory whose disk fails after the first entry has gone into the bundle."""

    @property
    def transfer_batch(self) -> int:
        return 1

    def read_many(self, names):
        self.reads = getattr(self, "reads", 0) + 1
        if self.reads > 1:
            raise OSError(5, "Input/output error")
        return super().read_many(names)


def test_a_failed_export_leaves_no_file(tmp_path, monkeypatch):
    _fill(tmp_path / "builder")
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError, match="Input/output error"):
        export_bundle(_DiesMidway(tmp_path / "builder"), tmp_path / "out" / "k.tpcb")
    assert list((tmp_path / "out").iterdir()) == []  # neither the bundle nor its staging file
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)
    with pytest.raises(ImportError, match="zstandard"):
        export_bundle(LocalDir(tmp_path / "builder"), tmp_path / "out" / "k.tpcb", compression="zstd")
    assert export_bundle(LocalDir(tmp_path / "builder"), tmp_path / "out" / "k.tpcb").compressed is False  # auto: tar
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["k.tpcb"]


def test_index_version_size_and_json_are_checked(tmp_path):
    name, blob = _sealed()
    member = _file(f"entries/{name[:2]}/{name[2:]}", blob)
    cases = {
        "version": (json.dumps({"format": BUNDLE_FORMAT, "version": 2, "entries": 1}).encode(), "bundle version 2 is not supported"),
        "json": (b"{not json", "index.json is not JSON"),
        "big": (b" " * (64 << 10) + b"{}", r"index is 65538 bytes, over 65536"),
    }
    for label, (doc, match) in cases.items():
        _handmade(tmp_path / f"{label}.tar", [member, _file("index.json", doc)])
        _assert_refused(tmp_path / f"{label}.tar", LocalDir(tmp_path / label), match)


def test_a_zstd_bundle_without_zstandard_is_refused_and_a_read_only_store_is_not_written(tmp_path, monkeypatch):
    pytest.importorskip("zstandard")  # writing the zstd bundle needs it; reading is then tested without it
    _fill(tmp_path / "builder")
    export_bundle(LocalDir(tmp_path / "builder"), tmp_path / "k.tpcb", compression="zstd")
    url = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    with pytest.raises(PermissionError, match="read-only"):
        import_bundle(tmp_path / "k.tpcb", RemoteProgramCache.from_url(url, read_only=True))
    assert not (tmp_path / "bucket" / "entries").exists()
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)
    _assert_refused(tmp_path / "k.tpcb", LocalDir(tmp_path / "fresh"), "zstd-compressed and the zstandard package is not installed")


def test_the_arch_filter_keeps_the_symbol_maps_of_name_expression_compiles(tmp_path):
    with TieredProgramCache(tmp_path / "builder") as cache:
        obj = tiered_progcache.compile(NAMED, "c++", options(std="c++17"), cache=cache, name_expressions=["fill<float>"])
    names = _names(LocalDir(tmp_path / "builder"))
    assert len(names) == 3  # the binary, its symbol map and its manifest
    report = export_bundle(LocalDir(tmp_path / "builder"), tmp_path / "k", arch="sm_90")
    assert (report.entries, report.skipped) == (3, 0) and sorted(read_bundle(tmp_path / "k")) == names
    report = export_bundle(LocalDir(tmp_path / "builder"), tmp_path / "k80", arch="sm_80")
    # the sm_90 binary stays out, its manifest (it records sm_90) and its map with it: no lone map (issue 28 item 6)
    assert (report.entries, report.skipped) == (0, 3) and dict(read_bundle(tmp_path / "k80")) == {}
    assert obj.symbol_mapping


def test_caps_are_inclusive_and_checked(tmp_path):
    name, blob = _sealed(b"\x7fELF" + b"x" * 1000)  # a 1092-byte envelope of a 1004-byte payload
    doc = json.dumps({"format": BUNDLE_FORMAT, "version": 1, "entries": 1}).encode()
    doc = doc[:-1] + b" " * ((64 << 10) - len(doc)) + b"}"  # an index of exactly 64 KiB
    _handmade(tmp_path / "b.tar", [_file(f"entries/{name[:2]}/{name[2:]}", blob), _file("index.json", doc)])
    with pytest.raises(BundleRefused, match="raw length 1004 exceeds the 972-byte cap"):  # member cap met exactly: on to the envelope
        read_bundle(tmp_path / "b.tar", max_entry_bytes=972)
    assert list(read_bundle(tmp_path / "b.tar", max_entry_bytes=1004, max_total_bytes=1092, max_members=1)) == [name]
    for bad in (0, -1, True, 1.5, None):
        for cap in ("max_members", "max_total_bytes", "max_entry_bytes"):
            with pytest.raises(ValueError, match=f"^{cap} must be a positive int"):
                read_bundle(tmp_path / "b.tar", **{cap: bad})


def test_a_zstd_bundle_of_several_frames_is_read_whole(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    path = _plain_bundle(tmp_path)
    raw = path.read_bytes()
    cut = len(raw) // 2
    frames = zstandard.ZstdCompressor().compress(raw[:cut]) + zstandard.ZstdCompressor().compress(raw[cut:])
    (tmp_path / "frames.tpcb").write_bytes(frames)  # as pzstd or a concatenating tool writes them
    assert sorted(read_bundle(tmp_path / "frames.tpcb")) == sorted(read_bundle(path))
    assert len(read_bundle(path)) == 2


def test_import_reports_bytes_form_and_path_and_counts_a_failed_write(tmp_path):
    pytest.importorskip("zstandard")  # "auto" is zstd only where zstandard is installed
    names = _fill(tmp_path / "builder")
    source = LocalDir(tmp_path / "builder")
    sizes = {name: len(source.read_entry(name)) for name in names}
    for compression, zstd in (("auto", True), (None, False)):
        path = tmp_path / f"k-{zstd}"
        made = export_bundle(source, path, compression=compression)
        assert (made.path, made.bytes, made.compressed) == (str(path), sum(sizes.values()), zstd)
        assert 0 <= made.seconds < 600
        target = LocalDir(tmp_path / f"t-{zstd}")
        blocked = target.path_for(names[0])
        blocked.mkdir(parents=True)  # a directory where the first entry's file would go: its write fails
        report = import_bundle(path, target)
        assert (report.path, report.entries, report.failures, report.skipped) == (str(path), len(names) - 1, 1, 0)
        assert (report.bytes, report.compressed) == (sum(sizes[n] for n in names[1:]), zstd)
        assert 0 <= report.seconds < 600
        assert _names(target) == names[1:]


def test_import_caps_entries_at_the_target_stores_limit(tmp_path):
    names = _fill(tmp_path / "builder")
    biggest = max(len(LocalDir(tmp_path / "builder").read_entry(n)) for n in names)
    export_bundle(LocalDir(tmp_path / "builder"), tmp_path / "k")
    small = LocalDir(tmp_path / "small", max_entry_bytes=biggest - 1)
    _assert_refused(tmp_path / "k", small, f"exceeds the {biggest - 1}-byte cap")
    assert import_bundle(tmp_path / "k", LocalDir(tmp_path / "fits", max_entry_bytes=biggest)).entries == 2


def test_code_arch_reads_the_old_abi_and_short_headers():
    import struct

    old = bytearray(b"\x7fELF" + b"\x02\x01\x01\x33" + b"\x07" + b"\0" * 0x2B)  # ELF ABI version 7: SM in bits 0-7
    struct.pack_into("<I", old, 0x30, 0x0000_0056)
    assert len(old) == 0x34 and code_arch(bytes(old)) == 0x56
    assert code_arch(bytes(old[:0x33])) is None
    new = bytearray(old)
    new[8] = 8
    assert code_arch(bytes(new)) == 0  # the same flags read as the new ABI: bits 8-15
    struct.pack_into("<I", new, 0x30, 0x0000_5600)
    assert code_arch(bytes(new)) == 0x56 and code_arch(bytes(new[:8]) + b"\x09" + bytes(new[9:])) == 0x56
    struct.pack_into("<I", new, 0x30, 0x8600_5a04)
    assert code_arch(bytes(new)) == 90
    assert code_arch(b".version 8.0\n\0.target sm_86\n") is None  # a NUL: not PTX text


def test_export_skips_an_entry_gone_since_listed_and_records_mtime_and_mode(tmp_path):
    names = _fill(tmp_path / "builder")

    class RacingPrune(LocalDir):
        """A prune deletes the first listed entry between the listing and the read."""

        def read_many(self, batch):
            self.delete_entry(batch[0])
            return super().read_many(batch)

    report = export_bundle(RacingPrune(tmp_path / "builder"), tmp_path / "k", compression=None)
    assert (report.entries, report.failures) == (1, 0)
    members = {m.name: m for m in tarfile.open(tmp_path / "k").getmembers()}
    entry = LocalDir(tmp_path / "builder")
    (listed,) = entry.iter_entries()
    member = members[f"entries/{names[1][:2]}/{names[1][2:]}"]
    assert (member.mtime, member.mode, member.isreg()) == (int(listed.mtime), 0o644, True)
    with pytest.raises(ValueError, match="max_age"):
        export_bundle(entry, tmp_path / "x", max_age=True)
    assert export_bundle(entry, tmp_path / "x", max_age=0, now=listed.last_used).entries == 1


@pytest.mark.parametrize(("arch", "error"), [(9, ValueError), (256, ValueError), ("sm_9", ValueError), (True, TypeError), (9.0, TypeError)])
def test_arch_outside_10_to_255_or_of_another_type_is_refused(tmp_path, arch, error):
    with pytest.raises(error, match="arch"):
        export_bundle(LocalDir(tmp_path), tmp_path / "x", arch=arch)


def test_arch_bounds_compression_none_and_the_default_clock(tmp_path):
    _fill(tmp_path / "builder")
    local = LocalDir(tmp_path / "builder")
    for arch in (10, 255, "compute_90", "sm_100a"):
        assert export_bundle(local, tmp_path / "x", arch=arch).failures == 0
    assert export_bundle(local, tmp_path / "x", compression="none").compressed is False
    assert export_bundle(local, tmp_path / "x", max_age=10**9).entries == 2  # now defaults to the wall clock
    assert export_bundle(local, tmp_path / "x", arch=75).skipped == 2  # both sm_90 binaries filtered out


def test_every_failed_write_is_counted(tmp_path):
    names = _fill(tmp_path / "builder")
    export_bundle(LocalDir(tmp_path / "builder"), tmp_path / "k")
    target = LocalDir(tmp_path / "t")
    for name in names:
        target.path_for(name).mkdir(parents=True)
    report = import_bundle(tmp_path / "k", target)
    assert (report.entries, report.failures, report.bytes) == (0, 2, 0)
