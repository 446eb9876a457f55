"""Header scans persisted in the local cache directory: a new process validates one instead of scanning.

Real processes (subprocess) play the new process; ``headermemo.files_hashed()`` in it says
whether it read headers. A bad memo file is planted on disk, never simulated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import InMemoryProgramCache

import tiered_progcache as tpc
from tiered_progcache.compiling import headermemo, scanmemo
from tiered_progcache.stores import ratelimit
from tiered_progcache.compiling.headerscan import header_digest, header_scan
from tiered_progcache.compiling.scanmemo import ScanMemoStore

from header_support import SRC, fresh_header_memo  # noqa: F401  (autouse)
from header_support import write_header as _write
from support import REPO_ROOT, child_pythonpath, options as _opts

ARCH = "sm_90"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    _write(inc / "a.h", '#pragma once\n#include "sub/b.h"\n#define A_VAL (B_VAL + 1)\n')
    _write(inc / "sub" / "b.h", '#pragma once\n#include "c.h"\n#define B_VAL (C_VAL * 2)\n')
    _write(inc / "sub" / "c.h", "#pragma once\n#define C_VAL 3\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return inc


_CHILD = textwrap.dedent(
    """
    import json, sys
    from cuda.core import ProgramOptions
    from tiered_progcache.compiling import headermemo, headerscan
    inc, memo_dir, src = sys.argv[1], sys.argv[2], sys.argv[3]
    digest = headerscan.header_digest(src, ProgramOptions(arch="sm_90", include_path=[inc]), memo_dir=memo_dir)
    print(json.dumps([digest.hex(), headermemo.files_hashed(), headermemo.validation_counts().by_stat]))
    """
)


def _in_new_process(inc: Path, memo_dir: Path) -> tuple[str, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(inc), str(memo_dir), SRC], check=True, capture_output=True, text=True,
        cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": child_pythonpath()},
    ).stdout
    digest, hashed, by_stat = json.loads(out)
    return digest, hashed, by_stat


def _memo_files(memo_dir: Path) -> list[Path]:
    return sorted(memo_dir.glob("*.json"))


# -- across processes ------------------------------------------------------------------------------


def test_a_new_process_gets_the_digest_without_reading_a_header(tree, tmp_path):
    memo_dir = tmp_path / "cache" / "header-scans"
    digest = header_digest(SRC, _opts(tree), memo_dir=memo_dir)
    assert len(_memo_files(memo_dir)) == 1
    assert _in_new_process(tree, memo_dir) == (digest.hex(), 0, 1)  # validated by stat once, nothing read


def test_an_edit_between_processes_is_seen(tree, tmp_path):
    memo_dir = tmp_path / "cache" / "header-scans"
    digest = header_digest(SRC, _opts(tree), memo_dir=memo_dir)
    path = tree / "sub" / "c.h"
    st = os.stat(path)
    path.write_text("#pragma once\n#define C_VAL 4\n")  # same size; mtime put back: only ctime tells
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    child_digest, hashed, _ = _in_new_process(tree, memo_dir)
    assert child_digest != digest.hex() and hashed == 3  # a.h, b.h, c.h scanned again
    assert _in_new_process(tree, memo_dir) == (child_digest, 0, 1)  # ...and the new scan persisted


def test_compile_persists_scans_in_the_local_directory_and_a_new_process_compiles_nothing(tree, tmp_path):
    cache_dir = tmp_path / "cache"
    with tpc.TieredProgramCache(cache_dir) as cache:
        tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    assert len(_memo_files(cache_dir / "header-scans")) == 1
    child = textwrap.dedent(
        """
        import json, sys
        from cuda.core import ProgramOptions
        import tiered_progcache as tpc
        from tiered_progcache.compiling import headermemo
        with tpc.TieredProgramCache(sys.argv[2]) as cache:
            tpc.compile(sys.argv[3], "c++", ProgramOptions(arch="sm_90", include_path=[sys.argv[1]]), cache=cache)
        print(json.dumps([tpc.compile_count(), headermemo.files_hashed()]))
        """
    )
    out = subprocess.run([sys.executable, "-c", child, str(tree), str(cache_dir), SRC], check=True,
                         capture_output=True, text=True, cwd=os.getcwd(),
                         env={**os.environ, "PYTHONPATH": child_pythonpath()}).stdout
    assert json.loads(out) == [0, 0]


def test_without_a_local_tier_nothing_is_persisted(tree, tmp_path):
    cache = tpc.TieredProgramCache(tiers=[InMemoryProgramCache()])
    assert cache.local_store is None
    before = set(tmp_path.rglob("*"))
    tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    assert {p for p in set(tmp_path.rglob("*")) - before if "header-scans" in p.parts} == set()


# -- what is never trusted ----------------------------------------------------------------------------


def _corrupt_body(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


def _another_key(path: Path) -> None:
    head, body = path.read_bytes().split(b"\n", 1)
    doc = json.loads(head)
    doc["key"] = "0" * 64
    path.write_bytes(json.dumps(doc).encode() + b"\n" + body)


def _forged_types(path: Path) -> None:
    """A well-formed file (its digest matches) whose body has a value of the wrong type."""
    head, body = path.read_bytes().split(b"\n", 1)
    doc = json.loads(head)
    obj = json.loads(body)
    obj["checks"] = "not a list"
    body = json.dumps(obj).encode()
    import hashlib

    doc.update(sha256=hashlib.sha256(body).hexdigest(), bytes=len(body))
    path.write_bytes(json.dumps(doc).encode() + b"\n" + body)


def _oversize(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b" " * scanmemo.MAX_FILE_BYTES)


def _not_json(path: Path) -> None:
    path.write_bytes(b"\x80\x04\x95pickle, never loaded\n.")


def _a_symlink(path: Path) -> None:
    elsewhere = path.with_name("elsewhere.txt")
    os.replace(path, elsewhere)
    path.symlink_to(elsewhere)


@pytest.mark.parametrize("damage", [_corrupt_body, _truncate, _another_key, _forged_types, _oversize, _not_json,
                                    _a_symlink])
def test_a_bad_memo_file_is_ignored_rescanned_and_replaced(tree, tmp_path, damage):
    memo_dir = tmp_path / "header-scans"
    digest = header_digest(SRC, _opts(tree), memo_dir=memo_dir)
    (path,) = _memo_files(memo_dir)
    damage(path)
    headermemo.clear_memo()  # as in a new process
    hashed = headermemo.files_hashed()
    assert header_digest(SRC, _opts(tree), memo_dir=memo_dir) == digest
    assert headermemo.files_hashed() - hashed == 3
    headermemo.clear_memo()
    hashed = headermemo.files_hashed()
    assert header_digest(SRC, _opts(tree), memo_dir=memo_dir) == digest
    assert headermemo.files_hashed() == hashed  # the rescan wrote a good one in its place
    assert not path.is_symlink()


def test_a_forged_digest_over_a_fresh_header_is_never_returned(tree, tmp_path):
    """The racy-mtime rule holds at load: a header modified in the last RACY_NS cannot be vouched for by stat."""
    memo_dir = tmp_path / "header-scans"
    header_digest(SRC, _opts(tree), memo_dir=memo_dir)
    (path,) = _memo_files(memo_dir)
    fresh = _write(tree / "sub" / "c.h", "#pragma once\n#define C_VAL 3\n", mtime=time.time())
    forged = headermemo.ScanResult(b"\xff" * 32, True, ((str(fresh), headermemo.signature(str(fresh))),), (), 0.0,
                                   (), (), True, None)
    assert ScanMemoStore(memo_dir).save(path.stem, headermemo.scan_document(forged))
    headermemo.clear_memo()
    assert header_digest(SRC, _opts(tree), memo_dir=memo_dir) != b"\xff" * 32


def test_a_memo_written_by_another_scanner_is_never_read():
    key = ("src", ("/inc",), None, None, False, None, "/work")
    assert scanmemo.memo_name(key, b"scanner one") != scanmemo.memo_name(key, b"scanner two")
    assert scanmemo.memo_name(key, b"one") != scanmemo.memo_name((*key[:-1], "/elsewhere"), b"one")
    with pytest.raises(TypeError, match="memo key"):
        scanmemo.memo_name((1.5,), b"one")


# -- bounds, modes, the codec ------------------------------------------------------------------------


def _doc(i: int, pad: int = 0) -> dict:
    """A document of about ``pad`` bytes for the store (which persists any JSON document)."""
    return {"i": i, "pad": "a" * pad}


def _any(doc):
    return doc


def _scan(tree) -> headermemo.ScanResult:
    """A real scan's result, with a probe that found nothing and a directory's realpath in it."""
    result = header_scan(SRC, _opts(tree)).result
    assert result is not None and None in {sig for _, sig in result.checks} and result.real_checks
    return result


def test_a_scan_is_persisted_field_by_field_and_its_process_state_left_out(tree):
    result = dataclasses.replace(_scan(tree), checked_at=123.0, textual=(("/i/a.h", "/i/x/../a.h"),),
                                 declined="a computed include", relocatable=True)
    result.validations = 7
    doc = json.loads(json.dumps(headermemo.scan_document(result)))
    assert set(doc) == {"digest", "read_anything", "paths", "signatures", "real_checks", "headers", "missing",
                        "path_free", "declined", "relocatable", "textual"}
    back = headermemo.scan_from_document(doc)
    assert back == dataclasses.replace(result, checked_at=0.0)
    assert back.validations == 0 and back.watch is None


def test_rows_are_written_by_columns_and_read_back_exactly():
    result = headermemo.ScanResult(b"\x01" * 32, True, (("/i/a.h", ("f", 1, 2, 3, 4)), ("/i/b.h", None),
                                                        ("/i/c", ("error", "PermissionError"))),
                                   (("/i", "/r/i"),), 0.0, (("I0", "a.h", "ab" * 32), ("I0", "c.h", "cd" * 32)),
                                   ("cuda_fp16.h",), True, None)
    doc = headermemo.scan_document(result)
    assert doc["paths"] == ["/i/a.h", "/i/b.h", "/i/c"]
    assert doc["signatures"] == [[5, -1, 2], ["f", 1, 2, 3, 4, "error", "PermissionError"]]
    assert doc["headers"] == [["I0", "I0"], ["a.h", "c.h"], ["ab" * 32, "cd" * 32]]
    assert doc["real_checks"] == [["/i"], ["/r/i"]] and doc["textual"] == [[], []]
    assert headermemo.scan_from_document(doc) == result
    back = headermemo.scan_from_document(doc).headers  # HeaderFiles, named: a scan's view hands them out as they are
    assert [type(h) for h in back] == [headermemo.HeaderFile] * 2 and back[1].path == "c.h"
    empty = headermemo.ScanResult(b"", False, (), (), 0.0, (), (), True, None)
    assert headermemo.scan_from_document(json.loads(json.dumps(headermemo.scan_document(empty)))) == empty


_ROWS = headermemo.ScanResult(b"\x01" * 32, True, (("/i/a.h", ("f", 1, 2, 3, 4)), ("/i/b.h", None),
                                                   ("/i/c", ("error", "PermissionError"))),
                              (("/i", "/r/i"),), 0.0, (("I0", "a.h", "ab" * 32), ("I0", "c.h", "cd" * 32)), (),
                              True, None)


@pytest.mark.parametrize("change", [
    lambda o: o["paths"].pop(),  # fewer paths than signatures
    lambda o: o["signatures"].pop(),  # a column missing
    lambda o: o["signatures"][0].__setitem__(0, 6),  # lengths that do not add up to the items
    lambda o: o["signatures"][0].__setitem__(1, -2),
    lambda o: o["signatures"][0].__setitem__(1, False),
    lambda o: o["signatures"][0].__setitem__(1, 1.0),
    lambda o: o["signatures"][1].__setitem__(1, [1]),  # a nested value in a signature
    lambda o: o["signatures"][1].__setitem__(1, None),
    lambda o: o["paths"].__setitem__(1, 7),  # a path that is not a string
    lambda o: o["headers"][2].__setitem__(0, None),
    lambda o: o["headers"][1].pop(),  # columns of different lengths
    lambda o: o.__setitem__("headers", [["I0", "I0"], ["a.h", "c.h"]]),
    lambda o: o.__setitem__("real_checks", "/i"),
    lambda o: o.__setitem__("digest", "not hex"),
    lambda o: o.__setitem__("digest", 5),
    lambda o: o.__setitem__("read_anything", 1),
    lambda o: o.__setitem__("path_free", None),
    lambda o: o.__setitem__("relocatable", "yes"),
    lambda o: o.__setitem__("declined", 3),
    lambda o: o.__setitem__("missing", "cuda_fp16.h"),
    lambda o: o.__setitem__("textual", [["a"], []]),
    lambda o: o.pop("textual"),
    lambda o: o.__setitem__("extra", 1),
], ids=["path-missing", "column-missing", "lengths", "length-below-minus-one", "bool-length", "float-length",
        "nested-item", "null-item", "path-type", "header-type", "header-column-short", "header-columns",
        "real-checks-type", "digest-not-hex", "digest-type", "flag-int", "flag-null", "flag-str", "declined-type",
        "missing-type", "textual-uneven", "field-missing", "field-extra"])
def test_forged_rows_are_never_loaded(tmp_path, change):
    store = ScanMemoStore(tmp_path / "m")
    assert store.save("ab" * 32, headermemo.scan_document(_ROWS))
    assert store.load("ab" * 32, headermemo.scan_from_document) == _ROWS
    _planted(store, "ab" * 32, change)
    assert store.load("ab" * 32, headermemo.scan_from_document) is None


@pytest.mark.parametrize("change, reason", [
    (lambda o: o.pop("textual"), "the fields of a scan expected, got ['declined', 'digest', 'headers', 'missing', "
     "'path_free', 'paths', 'read_anything', 'real_checks', 'relocatable', 'signatures']"),
    (lambda o: o.__setitem__("digest", 5), "a string expected, got int"),
    (lambda o: o.__setitem__("read_anything", 1), "true or false expected, got int"),
    (lambda o: o.__setitem__("declined", 3), "declined is neither a string nor null"),
    (lambda o: o.__setitem__("paths", "/i/a.h"), "a list of strings expected"),
    (lambda o: o.__setitem__("signatures", 5), "[lengths, items] expected"),
    (lambda o: o.__setitem__("signatures", [[5, -1], []]), "3 lengths and a list of items expected"),
    (lambda o: o["signatures"][0].__setitem__(1, -2), "a signature length is not an int of at least -1"),
    (lambda o: o["signatures"][1].__setitem__(1, None), "a signature holds strings and ints only"),
    (lambda o: o["signatures"][0].__setitem__(0, 6), "signature lengths do not add up to the items"),
    (lambda o: o.__setitem__("headers", [["I0"]]), "3 columns expected"),
    (lambda o: o["headers"][1].pop(), "columns of different lengths"),
])
def test_each_refusal_of_a_scans_document_says_what_is_wrong(change, reason):
    doc = json.loads(json.dumps(headermemo.scan_document(_ROWS)))
    change(doc)
    with pytest.raises(ValueError) as refused:
        headermemo.scan_from_document(doc)
    assert str(refused.value) == reason


def test_a_document_that_is_not_an_object_is_refused_by_its_type():
    with pytest.raises(ValueError) as refused:
        headermemo.scan_from_document(["digest"])
    assert str(refused.value) == "the fields of a scan expected, got list"


def test_a_signature_of_no_items_reads_back_as_empty_not_as_none():
    doc = headermemo.scan_document(dataclasses.replace(_ROWS, checks=(("/i/a.h", ()), ("/i/b.h", None))))
    assert doc["signatures"] == [[0, -1], []]
    assert headermemo.scan_from_document(doc).checks == (("/i/a.h", ()), ("/i/b.h", None))


def _file(head: object, body: bytes) -> bytes:
    return json.dumps(head).encode() + b"\n" + body


def _head(name: str, body: bytes, **changed: object) -> dict:
    import hashlib

    return {"format": scanmemo.FORMAT, "key": name, "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body),
            **changed}


def _refused(store: ScanMemoStore, path: Path, reason: str, caplog) -> None:
    """The memo at ``path`` does not load, and the one line logged says ``reason``."""
    with caplog.at_level("INFO", logger="tiered_progcache.compiling.scanmemo"):
        assert store.load("ab" * 32, _any) is None
    assert [r.getMessage() for r in caplog.records] == [f"ignoring header scan memo {path} ({reason}): scanning again"]


@pytest.mark.parametrize("data, reason", [
    (b'{"format": "x"}', "no header line"),
    (_file(["a list"], b"{}"), "another format"),
    (_file(_head("ab" * 32, b"{}", format="tiered-progcache/header-scan/2"), b"{}"), "another format"),
    (_file(_head("cd" * 32, b"{}"), b"{}"), "written for another key"),
    (_file(_head("ab" * 32, b"{}", bytes=3), b"{}"), "torn or corrupt: the body does not match its digest"),
    (_file(_head("ab" * 32, b"{}", sha256="0" * 64), b"{}"), "torn or corrupt: the body does not match its digest"),
], ids=["no-newline", "head-a-list", "format-2", "another-key", "byte-count", "digest"])
def test_each_refusal_of_a_memo_file_is_logged_with_its_reason(tmp_path, caplog, data, reason):
    store = ScanMemoStore(tmp_path / "m")
    path = Path(store.path_for("ab" * 32))
    path.parent.mkdir()
    path.write_bytes(data)
    _refused(store, path, reason, caplog)


def test_a_body_that_spans_lines_is_read_whole(tmp_path):
    store = ScanMemoStore(tmp_path / "m")
    path = Path(store.path_for("ab" * 32))
    path.parent.mkdir()
    body = b'{\n  "i": 1\n}'
    path.write_bytes(_file(_head("ab" * 32, body), body))
    assert store.load("ab" * 32, _any) == {"i": 1}


def _planted(store: ScanMemoStore, name: str, change) -> None:
    """Rewrite a saved memo's body with ``change`` applied, its digest made to match (a forged, well-formed file)."""
    import hashlib

    path = Path(store.path_for(name))
    head, body = path.read_bytes().split(b"\n", 1)
    obj = json.loads(body)
    change(obj)
    body = json.dumps(obj).encode()
    doc = json.loads(head)
    doc.update(sha256=hashlib.sha256(body).hexdigest(), bytes=len(body))
    path.write_bytes(json.dumps(doc).encode() + b"\n" + body)


def test_a_document_with_no_json_form_is_not_persisted(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(ratelimit, "_logged_once", set())  # the warning is logged once per process
    with caplog.at_level("INFO", logger="tiered_progcache.compiling.scanmemo"):
        assert not ScanMemoStore(tmp_path / "m").save("cd" * 32, {"names": {"x"}})
        assert not ScanMemoStore(tmp_path / "m").save("cd" * 32, {"nan": float("nan")})
    assert list((tmp_path / "m").glob("*.json")) == []
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "header scans are not persisted: Object of type set is not JSON serializable")]


def test_a_memo_of_exactly_max_file_bytes_is_written_and_read_and_one_byte_more_is_not(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(ratelimit, "_logged_once", set())
    probe = ScanMemoStore(tmp_path / "probe")
    assert probe.save("ab" * 32, _doc(1, pad=300))
    size = os.path.getsize(probe.path_for("ab" * 32))
    body = Path(probe.path_for("ab" * 32)).read_bytes().split(b"\n", 1)[1]
    assert body == json.dumps(_doc(1, pad=300), separators=(",", ":")).encode()  # compact: what the cap counts
    exact = ScanMemoStore(tmp_path / "exact", max_file_bytes=size)
    assert exact.save("ab" * 32, _doc(1, pad=300)) and exact.load("ab" * 32, _any) == _doc(1, pad=300)
    under = ScanMemoStore(tmp_path / "under", max_file_bytes=size - 1)
    with caplog.at_level("INFO", logger="tiered_progcache.compiling.scanmemo"):
        assert not under.save("ab" * 32, _doc(1, pad=300))
        assert ScanMemoStore(tmp_path / "under").save("ab" * 32, _doc(1, pad=300))
        assert under.load("ab" * 32, _any) is None
    path = under.path_for("ab" * 32)
    assert [r.getMessage() for r in caplog.records] == [
        f"a header scan memo of {size} bytes is over the {size - 1}-byte cap: not persisted",
        f"ignoring header scan memo {path} ({size} bytes, over the {size - 1}-byte limit): scanning again"]


def test_a_planted_symlink_is_refused_with_its_reason(tmp_path, caplog):
    store = ScanMemoStore(tmp_path / "m")
    assert store.save("ab" * 32, _doc(1))
    path = Path(store.path_for("ab" * 32))
    _a_symlink(path)
    _refused(store, path, "a symbolic link, not an entry (not followed)", caplog)


def test_a_load_marks_the_memo_used_and_keeps_its_mtime(tmp_path):
    store = ScanMemoStore(tmp_path / "m")
    assert store.save("ab" * 32, _doc(1))
    path = store.path_for("ab" * 32)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    assert store.load("ab" * 32, _any) == _doc(1)
    st = os.stat(path)
    assert st.st_mtime_ns == 2_000_000_000 and st.st_atime_ns > 2_000_000_000


def test_a_write_that_fails_says_where_and_returns_false(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(ratelimit, "_logged_once", set())
    (tmp_path / "file").write_text("not a directory")
    stores = [ScanMemoStore(tmp_path / "file" / name) for name in ("header-scans", "other")]
    with caplog.at_level("INFO", logger="tiered_progcache.compiling.scanmemo"):
        for store in stores * 2:
            assert store.save("ab" * 32, _doc(1)) is False
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]  # once per directory
    for line, store in zip(caplog.records, stores):
        assert line.getMessage().startswith(
            f"cannot persist header scans in {store.directory}: [Errno 20] Not a directory")


def test_the_memo_just_written_is_kept_even_where_the_others_look_used_later(tmp_path):
    store = ScanMemoStore(tmp_path / "m", max_files=2)
    names = [f"{i:064x}" for i in range(3)]
    for name in names[:2]:
        store.save(name, _doc(1))
        os.utime(store.path_for(name), (4_000_000_000, 4_000_000_000))  # used "later" than now (a skewed clock)
    store.save(names[2], _doc(2))
    assert names[2] in {p.stem for p in _memo_files(tmp_path / "m")}


def test_the_directory_keeps_at_most_max_files_least_recently_used_out_first(tmp_path):
    store = ScanMemoStore(tmp_path / "m", max_files=3)
    names = [f"{i:064x}" for i in range(5)]
    for i, name in enumerate(names[:3]):
        store.save(name, _doc(i))
        os.utime(store.path_for(name), (1_000_000 + i, 1_000_000 + i))  # used in this order
    assert store.load(names[0], _any) is not None  # used just now
    store.save(names[3], _doc(3))
    assert {p.stem for p in _memo_files(tmp_path / "m")} == {names[0], names[2], names[3]}
    store.save(names[4], _doc(4))
    assert {p.stem for p in _memo_files(tmp_path / "m")} == {names[0], names[3], names[4]}


def test_the_directory_keeps_at_most_max_bytes(tmp_path):
    probe = ScanMemoStore(tmp_path / "probe")
    probe.save("00" * 32, _doc(0, pad=1000))
    size = os.stat(probe.path_for("00" * 32)).st_size
    store = ScanMemoStore(tmp_path / "m", max_bytes=2 * size + size // 2)
    for i in range(4):
        store.save(f"{i:064x}", _doc(i, pad=1000))
        os.utime(store.path_for(f"{i:064x}"), (1_000_000 + i, 1_000_000 + i))
    kept = _memo_files(tmp_path / "m")
    assert [p.stem for p in kept] == [f"{i:064x}" for i in (2, 3)]
    assert sum(os.stat(p).st_size for p in kept) <= store.max_bytes


def test_a_memo_over_max_file_bytes_is_neither_written_nor_read(tmp_path):
    store = ScanMemoStore(tmp_path / "m", max_file_bytes=200)
    assert not store.save("ee" * 32, _doc(1, pad=500))
    assert _memo_files(tmp_path / "m") == []
    assert ScanMemoStore(tmp_path / "m").save("ee" * 32, _doc(1, pad=500))
    assert store.load("ee" * 32, _any) is None


def test_the_directory_is_made_with_the_librarys_modes_and_never_through_a_symlink(tmp_path):
    child = textwrap.dedent(
        """
        import os, sys
        os.umask(0)
        sys.path.insert(0, "tests")  # test_scanmemo imports header_support, as pytest finds it
        from tests.compiling.test_scanmemo import _doc
        from tiered_progcache.compiling.scanmemo import ScanMemoStore
        ScanMemoStore(sys.argv[1]).save("ab" * 32, _doc(1))
        """
    )
    memo_dir = tmp_path / "cache" / "header-scans"
    memo_dir.parent.mkdir()
    subprocess.run([sys.executable, "-c", child, str(memo_dir)], check=True, cwd=REPO_ROOT,
                   env={**os.environ, "PYTHONPATH": child_pythonpath()})
    assert not os.stat(memo_dir).st_mode & stat.S_IWOTH
    assert not os.stat(memo_dir / ("ab" * 32 + ".json")).st_mode & (stat.S_IWOTH | stat.S_IWGRP)
    planted = tmp_path / "other" / "header-scans"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted.parent.mkdir()
    planted.symlink_to(elsewhere)
    assert not ScanMemoStore(planted).save("ab" * 32, _doc(1))
    assert list(elsewhere.iterdir()) == []


def test_bad_arguments_name_the_problem(tmp_path):
    with pytest.raises(TypeError, match="max_files"):
        ScanMemoStore(tmp_path, max_files="3")
    with pytest.raises(ValueError, match="max_bytes"):
        ScanMemoStore(tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        ScanMemoStore(tmp_path).path_for("../../etc/passwd")


def test_the_default_bounds_are_the_documented_512_files_and_64_mib(tmp_path):
    assert (scanmemo.MAX_FILES, scanmemo.MAX_BYTES, scanmemo.MAX_FILE_BYTES) == (512, 64 << 20, 8 << 20)
    by_count = ScanMemoStore(tmp_path / "count")
    for i in range(513):
        by_count.save(f"{i:064x}", _doc(i % 256))
    assert len(_memo_files(tmp_path / "count")) == 512
    by_bytes = ScanMemoStore(tmp_path / "bytes")
    big = (8 << 20) - 4096  # just under the per-file cap
    for i in range(9):
        assert by_bytes.save(f"{i:064x}", _doc(i, pad=big - 400))
    kept = _memo_files(tmp_path / "bytes")
    assert len(kept) == 8 and sum(os.stat(p).st_size for p in kept) <= 64 << 20


# -- scans direct mode verified ------------------------------------------------------------------

_DIRECT_CHILD = textwrap.dedent(
    """
    import json, sys
    from cuda.core import ProgramOptions
    import tiered_progcache as tpc
    from tiered_progcache.compiling import direct, headermemo
    with tpc.TieredProgramCache(sys.argv[2]) as cache:
        tpc.compile(sys.argv[3], "c++", ProgramOptions(arch="sm_90", include_path=[sys.argv[1]]), cache=cache)
    print(json.dumps([tpc.compile_count(), headermemo.files_hashed(), direct.direct_counts().hits]))
    """
)


def _direct_child(inc: Path, cache_dir: Path) -> list[int]:
    """``[compiles, files hashed, direct hits]`` of one compile() in a new process on this node."""
    out = subprocess.run([sys.executable, "-c", _DIRECT_CHILD, str(inc), str(cache_dir), SRC], check=True,
                         capture_output=True, text=True, cwd=os.getcwd(),
                         env={**os.environ, "PYTHONPATH": child_pythonpath()}).stdout
    return json.loads(out)


def test_a_set_direct_mode_verified_is_persisted_at_exit_and_the_next_process_hashes_nothing(tree, tmp_path):
    """A node with the direct manifest in its local tier but no persisted scan (warmed, or its memo gone):
    its first process verifies the set by hashing, and leaves the scan for the next, which only stats."""
    cache_dir = tmp_path / "cache"
    with tpc.TieredProgramCache(cache_dir) as cache:
        tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    for memo in _memo_files(cache_dir / "header-scans"):
        memo.unlink()
    assert _direct_child(tree, cache_dir) == [0, 3, 1]
    assert len(_memo_files(cache_dir / "header-scans")) == 1
    assert _direct_child(tree, cache_dir) == [0, 0, 0]  # the persisted scan answered, by stat


def test_a_direct_hit_writes_no_memo_before_exit(tree, tmp_path):
    cache_dir = tmp_path / "cache"
    with tpc.TieredProgramCache(cache_dir) as cache:
        tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    for memo in _memo_files(cache_dir / "header-scans"):
        memo.unlink()
    headermemo.clear_memo()  # a new process
    with tpc.TieredProgramCache(cache_dir) as cache:
        tpc.compile(SRC, "c++", _opts(tree), cache=cache)
    assert _memo_files(cache_dir / "header-scans") == []  # not on the hit's path ...
    from tiered_progcache.compiling import headerscan

    headermemo._persist_pending(headerscan._scanner_id)  # ... but at exit
    assert len(_memo_files(cache_dir / "header-scans")) == 1
