"""How direct mode names a header it verified: by the role of the real directory it lies in, as the scan names it.

``_namer`` turns a path as a recorded set spells it into ``(role, path)``: ``I<n>`` for an include
directory, ``source`` and ``cwd``, else ``abs`` with the real directory. The name is part of the
key a hit is served under, so each role, each spelling and each unknown directory is pinned here.
"""

from __future__ import annotations

from cuda.core import ProgramOptions

from tiered_progcache.compiling.direct import _covered, _namer

# Spelled roots (include directories, the source's directory, the working directory), then their real paths.
ROOTS = ("/spelled/inc", "/spelled/src", "/spelled/cwd", "/real/inc", "/real/src", "/real/cwd")
REAL = {
    "/spelled/inc": "/real/inc",
    "/spelled/inc/cub/block": "/real/inc/cub/block",
    "/spelled/src": "/real/src",
    "/spelled/src/detail": "/real/src/detail",
    "/spelled/cwd": "/real/cwd",
    "/link/to/other": "/real/other",
    ".": "/real/cwd",
    "/": "/",
    "//": "/",
}


def _name(path: str, **options: object) -> tuple[str, str] | None:
    return _namer(REAL, ROOTS, ProgramOptions(arch="sm_90", include_path=["/spelled/inc"], **options))(path)


def test_a_file_in_or_under_an_include_directory_is_named_by_its_index():
    assert _name("/spelled/inc/a.h") == ("I0", "a.h")
    assert _name("/spelled/inc/cub/block/b.cuh") == ("I0", "cub/block/b.cuh")


def test_a_file_by_the_source_is_named_source_unless_the_source_directory_is_not_searched():
    assert _name("/spelled/src/detail/d.h") == ("source", "detail/d.h")
    assert _name("/spelled/src/s.h") == ("source", "s.h")
    assert _name("/spelled/src/detail/d.h", no_source_include=True) == ("abs", "/real/src/detail/d.h")


def test_a_file_in_the_working_directory_and_a_bare_name_are_named_cwd():
    assert _name("/spelled/cwd/c.h") == ("cwd", "c.h")
    assert _name("c.h") == ("cwd", "c.h")  # no directory spelled: the working directory


def test_a_file_under_no_root_is_named_by_its_real_directory():
    assert _name("/link/to/other/o.h") == ("abs", "/real/other/o.h")
    assert _name("/r.h") == ("abs", "/r.h")
    assert _name("//r.h") == ("abs", "/r.h")  # '//' is a directory of its own spelling, real '/'


def test_a_directory_whose_real_path_is_unknown_names_nothing():
    assert _name("/spelled/inc/unknown/u.h") is None
    assert _covered(["/spelled/inc/a.h", "/nowhere/n.h"], REAL, ROOTS,
                    ProgramOptions(arch="sm_90", include_path=["/spelled/inc"])) is None  # fmt: skip
    named = _covered(["/spelled/inc/a.h", "/spelled/cwd/c.h"], REAL, ROOTS,
                     ProgramOptions(arch="sm_90", include_path=["/spelled/inc"]))  # fmt: skip
    assert named == [("I0", "a.h"), ("cwd", "c.h")]


def test_each_directory_is_located_once():
    class CountingReal(dict):
        asked: list[str] = []

        def get(self, key, default=None):  # type: ignore[override]
            self.asked.append(key)
            return super().get(key, default)

    real = CountingReal(REAL)
    name_of = _namer(real, ROOTS, ProgramOptions(arch="sm_90", include_path=["/spelled/inc"]))
    assert [name_of(p) for p in ("/spelled/inc/a.h", "/spelled/inc/b.h", "/nowhere/x.h", "/nowhere/y.h")] == [
        ("I0", "a.h"), ("I0", "b.h"), None, None]
    assert real.asked == ["/spelled/inc", "/nowhere"]


def test_a_doubled_slash_is_looked_up_as_os_path_dirname_spells_the_directory():
    """``inc//a.h`` lies in ``inc`` (the slash before the name is not part of the directory); ``//a.h`` in ``//``."""
    real = {"/spelled/inc": "/real/inc", "/": "/"}
    name_of = _namer(real, ROOTS, ProgramOptions(arch="sm_90", include_path=["/spelled/inc"]))
    assert name_of("/spelled/inc//a.h") == ("I0", "a.h")
    assert name_of("//r.h") is None  # '//' was never seen spelled so: unknown, not '/'
