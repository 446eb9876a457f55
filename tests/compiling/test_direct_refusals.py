"""Direct mode's stored form and memo path, word for word: what a bad manifest is refused with, where
each bound lies, and that the memo answering before the manifest keys by everything the compile is keyed by.

The refusal texts reach operators (``explain``, the INFO line of an ignored manifest); the bounds are
the module's constants, each tested at the value that passes and the first that does not.
"""

from __future__ import annotations

import json
import re
import os
import zlib
from pathlib import Path

import pytest
from cuda.core import ProgramOptions
from cuda.core.utils import InMemoryProgramCache

from tiered_progcache.chain.tiered import as_chain
from tiered_progcache.compiling import direct, headermemo, headerscan, keys
from tiered_progcache.compiling.direct import DirectManifestError

from header_support import direct_set, fresh_header_memo, write_header  # noqa: F401  (autouse)


def _stored(doc: object) -> bytes:
    return direct.DIRECT_MAGIC + zlib.compress(json.dumps(doc).encode())


def _with_sets(sets: object) -> bytes:
    return _stored({"format": "tiered-progcache/direct", "sets": sets})


GOOD = direct.encode_direct([direct_set()])
WRONG = "a header set holds a value of the wrong type or range"
FIELDS = "a header set has other fields than a direct manifest's"
DOCUMENT = "not a direct manifest document"
SETS = f"sets must be a list of at most {direct.MAX_SETS}"

REFUSED = {
    "one byte over the stored bound": (b"\0" * (direct.MAX_MANIFEST_BYTES + 1), f"over {direct.MAX_MANIFEST_BYTES} bytes"),
    "not the magic": (b"{" + GOOD[1:], "not a direct manifest"),
    "padded": (GOOD + b"junk", f"inflates past {direct.MAX_DECODED_BYTES} bytes, or is cut short or padded"),
    "cut short": (GOOD[:-3], f"inflates past {direct.MAX_DECODED_BYTES} bytes, or is cut short or padded"),
    "one byte over the inflated bound": (direct.DIRECT_MAGIC + zlib.compress(b" " * (direct.MAX_DECODED_BYTES + 1)),
                                         f"inflates past {direct.MAX_DECODED_BYTES} bytes, or is cut short or padded"),
    "a list, not a document": (_stored([]), DOCUMENT),
    "another format": (_stored({"format": "tiered-progcache/other", "sets": []}), DOCUMENT),
    "an extra field in the document": (_stored({"format": "tiered-progcache/direct", "sets": [], "x": 1}), DOCUMENT),
    "sets that are not a list": (_with_sets({}), SETS),
    "one set too many": (_with_sets([direct_set()] * (direct.MAX_SETS + 1)), SETS),
    "a set that is not a mapping": (_with_sets([[]]), FIELDS),
    "a set missing a field": (_with_sets([{k: v for k, v in direct_set().items() if k != "missing"}]), FIELDS),
    "no roots": (_with_sets([direct_set(n=0)]), WRONG),
    "65 roots": (_with_sets([direct_set(n=65)]), WRONG),
    "roots counted by a bool": (_with_sets([direct_set(n=True)]), WRONG),
    "a keep mask below -1": (_with_sets([direct_set(keep=-2)]), WRONG),
    "a keep mask past the roots": (_with_sets([direct_set(keep=4)]), WRONG),
    "absolute roots one short": (_with_sets([direct_set(at=["/a"])]), WRONG),
    "absolute roots that are not paths": (_with_sets([direct_set(at=["/a", 2])]), WRONG),
    "a header digest that is not sha256 hex": (_with_sets([direct_set(digest="cd" * 31)]), WRONG),
    "an empty key": (_with_sets([direct_set(key="")]), WRONG),
    "missing spellings that are not a list": (_with_sets([direct_set(missing="a.h")]), WRONG),
    "a missing spelling that is not a str": (_with_sets([direct_set(missing=[1])]), WRONG),
    "path_free that is not a bool": (_with_sets([direct_set(path_free=1)]), WRONG),
}


@pytest.mark.parametrize("bad", list(REFUSED))
def test_a_bad_manifest_is_refused_with_what_is_wrong_word_for_word(bad):
    payload, message = REFUSED[bad]
    with pytest.raises(DirectManifestError) as caught:
        direct.decode_direct(payload)
    assert str(caught.value) == message


@pytest.mark.parametrize("bad, prefix", [("not zlib", "not zlib: "), ("not JSON", "not JSON: ")])
def test_undecodable_bytes_say_which_layer_failed_and_why(bad, prefix):
    payload = {"not zlib": direct.DIRECT_MAGIC + b"\x00not deflate",
               "not JSON": direct.DIRECT_MAGIC + zlib.compress(b"{not json")}[bad]
    with pytest.raises(DirectManifestError) as caught:
        direct.decode_direct(payload)
    assert str(caught.value).startswith(prefix) and len(str(caught.value)) > len(prefix)


ACCEPTED = {
    "64 roots": direct_set(n=64),
    "a keep mask of every root": direct_set(keep=3),
    "no keep mask": direct_set(keep=-1),
    "absolute roots, one per root": direct_set(at=["/a", "/b"]),
    "missing spellings": direct_set(missing=["<x.h>"]),
}


@pytest.mark.parametrize("good", list(ACCEPTED))
def test_the_values_at_each_bound_decode(good):
    assert direct.decode_direct(_with_sets([ACCEPTED[good]])) == [ACCEPTED[good]]


def test_the_set_count_bound_keeps_exactly_max_sets():
    sets = [direct_set(key=f"{i:02x}") for i in range(direct.MAX_SETS)]
    assert direct.decode_direct(_with_sets(sets)) == sets
    stored = direct.decode_direct(direct.encode_direct([*sets, direct_set(key="ff")]))
    assert stored == sets  # the oldest (last) dropped, the newest MAX_SETS kept in order


def test_a_payload_of_exactly_the_stored_bound_is_not_refused_for_its_size():
    with pytest.raises(DirectManifestError) as caught:
        direct.decode_direct(b"\0" * direct.MAX_MANIFEST_BYTES)
    assert str(caught.value) == "not a direct manifest"  # read past the size check


# -- the memo that answers before the manifest ---------------------------------------------------------


@pytest.fixture
def tree(tmp_path, monkeypatch):
    write_header(tmp_path / "inc" / "a.h", "#pragma once\n#define A 1\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


SRC = '#include <a.h>\nextern "C" __global__ void k(int* o) { *o = A; }\n'


def _opts(root: Path) -> ProgramOptions:
    return ProgramOptions(arch="sm_90", include_path=[str(root / "inc")])


def test_the_memo_answer_is_keyed_by_the_callers_extra_digest(tree):
    chain = as_chain(InMemoryProgramCache())
    first = direct.compile_key(chain, SRC, "c++", _opts(tree), "cubin", extra_digest=b"x" * 32)
    counts, scans = direct.direct_counts(), headerscan.scans_run()
    again = direct.compile_key(chain, SRC, "c++", _opts(tree), "cubin", extra_digest=b"x" * 32)
    assert (direct.direct_counts(), headerscan.scans_run()) == (counts, scans)  # the memo answered
    assert again.key == first.key == keys.compile_key(SRC, "c++", _opts(tree), "cubin", extra_digest=b"x" * 32).key
    assert again.key != keys.compile_key(SRC, "c++", _opts(tree), "cubin").key


def test_a_scan_persisted_in_memo_dir_answers_a_process_without_its_own_memo(tree):
    chain, memo_dir = as_chain(InMemoryProgramCache()), tree / "header-scans"
    memo_dir.mkdir()
    first = direct.compile_key(chain, SRC, "c++", _opts(tree), "cubin", memo_dir=memo_dir)
    assert os.listdir(memo_dir)  # the scan, persisted
    headermemo.clear_memo()  # as a new process on the node starts
    counts, scans = direct.direct_counts(), headerscan.scans_run()
    again = direct.compile_key(chain, SRC, "c++", _opts(tree), "cubin", memo_dir=memo_dir)
    assert (direct.direct_counts(), headerscan.scans_run()) == (counts, scans)  # no manifest read, no scan
    assert again.key == first.key


# -- the direct key and the manifest's own record ------------------------------------------------------


def test_the_direct_key_tells_apart_compiles_that_differ_in_name_expressions_or_extra_digest(tree):
    def key(names=(), extra=None, by_role=True):
        return direct.direct_key(SRC, "c++", _opts(tree), "cubin", names, extra, by_role)

    assert len({key(), key(names=("k",)), key(extra=b"x" * 32), key(by_role=False)}) == 4
    assert key() == key()  # pure: the same inputs, the same key


def _fresh_lookup(chain, options, **kw):
    """A process without a memo asking ``chain``; (key, 1 if the manifest answered)."""
    headermemo.clear_memo()
    hits = direct.direct_counts().hits
    got = direct.compile_key(chain, SRC, "c++", options, "cubin", **kw)
    return got, direct.direct_counts().hits - hits


def test_a_set_recorded_with_an_extra_digest_is_found_with_it(tree):
    chain, extra = as_chain(InMemoryProgramCache()), b"x" * 32
    first, hit = _fresh_lookup(chain, _opts(tree), extra_digest=extra)
    assert hit == 0 and direct.record(chain, first, SRC, "c++", _opts(tree), "cubin", (), extra, 1.0)
    again, hit = _fresh_lookup(chain, _opts(tree), extra_digest=extra)
    assert (hit, again.key) == (1, first.key)
    assert first.key == keys.compile_key(SRC, "c++", _opts(tree), "cubin", extra_digest=extra).key


@pytest.mark.parametrize("extra", [None, b"x" * 32])
def test_a_manifest_that_lacks_this_nodes_set_gets_it_from_the_lookup_itself(tree, extra):
    """No compile runs where the entry is there already: the lookup that scanned adds its set."""
    chain = as_chain(InMemoryProgramCache())
    first, _ = _fresh_lookup(chain, _opts(tree), extra_digest=extra)
    assert direct.record(chain, first, SRC, "c++", _opts(tree), "cubin", (), extra, 1.0)
    write_header(tree / "inc" / "a.h", "#pragma once\n#define A 2\n")  # this node's header differs
    scans = headerscan.scans_run()
    edited, hit = _fresh_lookup(chain, _opts(tree), extra_digest=extra)
    assert (hit, headerscan.scans_run() - scans) == (0, 1) and edited.key != first.key
    sets = direct.decode_direct(chain.get(direct.direct_key(SRC, "c++", _opts(tree), "cubin", (), extra, True)))
    assert [s["key"] for s in sets] == [edited.key.hex(), first.key.hex()]  # newest first, both kept
    again, hit = _fresh_lookup(chain, _opts(tree), extra_digest=extra)
    assert (hit, again.key, headerscan.scans_run() - scans) == (1, edited.key, 1)


# -- what a set records: the roots its masks compare, and where it holds -------------------------------


def _recorded(source: str, options: ProgramOptions, **kw) -> dict:
    headermemo.clear_memo()
    one = direct.header_set(keys.compile_key(source, "c++", options, "cubin", **kw), source, options)
    assert one is not None
    return one


ANGLE_SRC = SRC
QUOTE_SRC = '#include "a.h"\nextern "C" __global__ void k(int* o) { *o = A; }\n'
COMPUTED_SRC = '#define PICK <a.h>\n#include PICK\nextern "C" __global__ void k(int* o) { *o = A; }\n'
#: Roots of a compile with one include directory: [inc, source's directory, cwd], as spelled then as resolved.
INCLUDE_BITS = (1 << 0) | (1 << 3)


@pytest.mark.parametrize("case, keep", [
    ("angle includes, working directory elsewhere", INCLUDE_BITS),
    ("a quoted include, working directory elsewhere", INCLUDE_BITS),
    ("a quoted include from inside the include directory", -1),
    ("a computed include", -1),
    ("a relative pre_include from inside the include directory", -1),
    ("an absolute pre_include from inside the include directory", INCLUDE_BITS),
    ("no source include", (1 << 0) | (1 << 2)),
])
def test_a_set_compares_only_the_include_roots_unless_the_working_directory_can_lead_into_one(tree, monkeypatch,
                                                                                               case, keep):
    source = {"angle": ANGLE_SRC, "a quoted": QUOTE_SRC, "a computed": COMPUTED_SRC}.get(case.split(" include")[0],
                                                                                        ANGLE_SRC)
    options = _opts(tree)
    if "inside the include directory" in case:
        monkeypatch.chdir(tree / "inc")
    if "pre_include" in case:
        write_header(tree / "inc" / "pre.h", "#pragma once\n")
        pre = "pre.h" if "relative" in case else str(tree / "inc" / "pre.h")
        options = ProgramOptions(arch="sm_90", include_path=[str(tree / "inc")], pre_include=pre)
    if case == "no source include":
        options = ProgramOptions(arch="sm_90", include_path=[str(tree / "inc")], no_source_include=True)
    assert _recorded(source, options)["keep"] == keep


def test_a_location_bound_set_records_its_absolute_roots_and_a_portable_one_none(tree):
    work = os.getcwd()
    bound = _recorded(SRC, _opts(tree), portable=False)
    spelled = [str(tree / "inc"), work, work]
    assert bound["at"] == spelled + [os.path.realpath(p) for p in spelled]  # as spelled, then as resolved
    assert _recorded(SRC, _opts(tree))["at"] is None


def test_a_relative_include_directory_is_recorded_from_the_working_directory(tree, monkeypatch):
    monkeypatch.chdir(tree)
    relative = ProgramOptions(arch="sm_90", include_path=["inc"])
    assert _recorded(SRC, relative, portable=False)["at"][0] == str(tree / "inc")


# -- what an operator reads, and what record() answers -------------------------------------------------


def _storage(tree: Path) -> bytes:
    return direct.direct_key(SRC, "c++", _opts(tree), "cubin", (), None, True)


@pytest.fixture
def recorded(tree):
    """(chain, the key a scan gave, its set): the tree's compile recorded in a fresh chain's manifest."""
    chain = as_chain(InMemoryProgramCache())
    first, _ = _fresh_lookup(chain, _opts(tree))
    assert direct.record(chain, first, SRC, "c++", _opts(tree), "cubin", (), None, 1.0) is True
    return chain, first, direct.decode_direct(chain.get(_storage(tree)))[0]


def test_an_ignored_manifest_says_which_and_why_in_one_info_line(tree, recorded, caplog):
    chain, first, _ = recorded
    chain.put(_storage(tree), b"{not a manifest")
    with caplog.at_level("INFO", logger="tiered_progcache.compiling.direct"):
        got, hit = _fresh_lookup(chain, _opts(tree))
    assert (hit, got.key) == (0, first.key)
    lines = [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.compiling.direct"]
    assert lines == [f"ignoring the direct manifest {_storage(tree)[:8].hex()}: not a direct manifest"]


@pytest.mark.parametrize("before", ["roots counted otherwise", "other absolute roots", "a set keying otherwise"])
def test_a_set_that_does_not_speak_for_this_node_is_passed_over_for_the_next(tree, recorded, caplog, before):
    chain, first, good = recorded
    other = {"roots counted otherwise": dict(good, n=good["n"] + 2),
             "other absolute roots": dict(good, at=["/elsewhere"] * good["n"]),
             "a set keying otherwise": dict(good, digest="ab" * 32)}[before]
    chain.put(_storage(tree), direct.encode_direct([other, good]))
    with caplog.at_level("INFO", logger="tiered_progcache.compiling.direct"):
        got, hit = _fresh_lookup(chain, _opts(tree))
    assert (hit, got.key) == (1, first.key)
    lines = [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.compiling.direct"]
    if before == "a set keying otherwise":
        assert len(lines) == 1
        assert re.fullmatch(rf"a direct manifest's set keys as [0-9a-f]{{16}}, recorded as {good['key'][:16]}: "
                            r"scanning", lines[0]), lines
        assert lines[0].split()[6].rstrip(",") != good["key"][:16]
    else:
        assert lines == []


def test_record_says_whether_it_storeddirect_set(tree, recorded, caplog):
    chain, first, _ = recorded
    assert direct.record(chain, first, SRC, "c++", _opts(tree), "cubin", (), None, 1.0) is False  # it is there
    plain = 'extern "C" __global__ void k(int* o) { *o = 1; }\n'
    headerless = keys.compile_key(plain, "c++", _opts(tree), "cubin")
    assert direct.record(chain, headerless, plain, "c++", _opts(tree), "cubin", (), None, 1.0) is False  # no set

    class Refusing:
        def get(self, key):
            raise OSError("down")

        def put(self, key, data, compile_seconds=None):
            raise OSError("down")

    with caplog.at_level("WARNING", logger="tiered_progcache.compiling.direct"):
        assert direct.record(Refusing(), first, SRC, "c++", _opts(tree), "cubin", (), None, 1.0) is False
    assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.compiling.direct"] == [
        f"could not record the direct manifest of entry {first.key[:8].hex()}: OSError('down')"]


@pytest.mark.parametrize("bound", ["MAX_MANIFEST_BYTES", "MAX_DECODED_BYTES"])
def test_a_set_exactly_at_a_byte_bound_is_stored_and_one_byte_more_is_not(monkeypatch, bound):
    body = json.dumps({"format": "tiered-progcache/direct", "sets": [direct_set()]}, separators=(",", ":")).encode()
    size = {"MAX_MANIFEST_BYTES": len(direct.DIRECT_MAGIC + zlib.compress(body, 6)),
            "MAX_DECODED_BYTES": len(body)}[bound]  # compact JSON, zlib level 6: what encode_direct stores
    monkeypatch.setattr(direct, bound, size)
    assert direct.encode_direct([direct_set()]) == direct.DIRECT_MAGIC + zlib.compress(body, 6)
    monkeypatch.setattr(direct, bound, size - 1)
    with pytest.raises(DirectManifestError) as caught:
        direct.encode_direct([direct_set()])
    assert str(caught.value) == f"a header set alone is over {direct.MAX_MANIFEST_BYTES} bytes"


@pytest.mark.parametrize("case, keep", [
    ("a quoted include beside a source named inside the include directory", -1),
    ("the same without source includes", (1 << 0) | (1 << 2)),
    ("a quoted include beside a source named elsewhere", INCLUDE_BITS),
])
def test_the_sources_directory_comes_from_its_name(tree, case, keep):
    """``options.name`` with a directory is where a quoted include is looked for first: inside an include
    directory, the set compares every root; with ``no_source_include``, that directory is no root at all."""
    elsewhere = tree / "src"
    elsewhere.mkdir()
    name = str((elsewhere if "elsewhere" in case else tree / "inc") / "k.cu")
    options = ProgramOptions(arch="sm_90", include_path=[str(tree / "inc")], name=name,
                             no_source_include="without source includes" in case)
    assert _recorded(QUOTE_SRC, options)["keep"] == keep


def test_a_miss_with_no_manifest_reads_it_once_in_all_record_included(tree):
    """The lookup found the manifest absent; the record after the compile writes one without asking again
    (on a shared tier each read is a round trip)."""
    reads: list[bytes] = []

    class Counting(InMemoryProgramCache):
        def __getitem__(self, key):
            reads.append(bytes(key))
            return super().__getitem__(key)

    chain, storage = as_chain(Counting()), bytes(_storage(tree))
    got, hit = _fresh_lookup(chain, _opts(tree))
    assert hit == 0 and reads.count(storage) == 1
    assert direct.record(chain, got, SRC, "c++", _opts(tree), "cubin", (), None, 1.0) is True
    assert reads.count(storage) == 1  # written, not read again
    assert direct.decode_direct(chain.get(storage))[0]["key"] == got.key.hex()
    reads.clear()
    assert direct.record(chain, got, SRC, "c++", _opts(tree), "cubin", (), None, 1.0) is False
    assert reads.count(storage) == 1  # a record not right after an absent lookup reads what is there


@pytest.mark.parametrize("adopt, fresh, memoized", [(True, False, True), (False, False, False), (True, True, False)],
                         ids=["adopted", "adopt-false", "a-header-too-fresh"])
def test_a_verified_set_is_memoized_as_a_scan_unless_asked_not_to_or_a_header_is_too_fresh(tree, recorded, adopt,
                                                                                         fresh, memoized):
    chain, first, good = recorded
    if fresh:
        os.utime(tree / "inc" / "a.h")  # modified now, its bytes the same: the set still holds, a stat cannot vouch
    headermemo.clear_memo()
    got = direct.match([good], SRC, "c++", _opts(tree), "cubin", (), None, True, os.getcwd(), adopt=adopt)
    assert got is not None and got.key == first.key
    assert len(headermemo._scan_memo) == int(memoized)  # (a fresh header's scan would be refused there anyway)
    assert (headerscan.header_scan(SRC, _opts(tree), memo_only=True) is not None) is memoized
