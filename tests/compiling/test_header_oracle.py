"""The header key against NVRTC itself: every file NVRTC opens is digested, and editing it changes the key.

Hypothesis builds small trees (two include directories, the source's directory, the
working directory, a directory under no root reached by a symlink, ``..`` and absolute
spellings) and sources that include through them: quoted and angle, through a macro,
``__has_include`` (directly and through a wrapper macro), ``pre_include``. NVRTC compiles
each in-process while inotify ``IN_OPEN`` watches every directory of the tree
(``nvrtc_oracle``). A compile the scanner declines is not cached, so only the others are checked.
Every key the test takes is also asked of direct mode (:func:`compile_key` here): the header sets
recorded so far, on this host and the other, must give exactly the scan's key or nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from cuda.core import ProgramOptions
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cuda.core.utils import InMemoryProgramCache

from tiered_progcache.chain.tiered import as_chain
from tiered_progcache.compiling import direct, headermemo, headerscan, keys

from header_support import fresh_header_memo  # noqa: F401  (autouse)
from nvrtc_oracle import opened_by_nvrtc

ARCH = "sm_90"
#: Directories of a generated tree (relative to its root); "wd" is the working directory.
DIRS = ("I0", "I1", "src", "wd", "ext", "ext/d")
NAMES = ("a.h", "b.h", "c.h")
#: Examples per run: deterministic (derandomized, no database), so CI runs the same ones every time.
EXAMPLES = 300
OLD = time.time() - 3600


def _spelling(draw, name: str) -> str:
    """One way to write an include of ``name`` (a line or a few, ending in a newline)."""
    form = draw(st.sampled_from(["quote", "angle", "macro-quote", "macro-angle", "abs", "dotdot", "symlink-dotdot",
                                 "has", "has-wrapper", "subdir", "command-line", "function-like"]))
    if form == "quote":
        return f'#include "{name}"\n'
    if form == "angle":
        return f"#include <{name}>\n"
    if form == "macro-quote":
        return f'#define HDR_{name[0]} "{name}"\n#include HDR_{name[0]}\n'
    if form == "macro-angle":
        return f"#define HDRA_{name[0]} <{name}>\n#include HDRA_{name[0]}\n"
    if form == "abs":
        return f'#include "@ROOT@/ext/{name}"\n'
    if form == "dotdot":
        return f'#include "../ext/{name}"\n'
    if form == "symlink-dotdot":
        return f"#include <lnk/../{name}>\n"
    if form == "subdir":
        return f'#include "d/{name}"\n'
    if form == "command-line":  # ``-DHDRD_x="x.h"`` (define_macro, added by trees())
        return f"#include HDRD_{name[0]}\n"
    if form == "function-like":  # no single macro name: the directories count, or the compile is declined
        return f"#define ANGLE_{name[0]}(x) <x>\n#include ANGLE_{name[0]}({name})\n"
    if form == "has":
        return f"#if __has_include(<{name}>)\n#include <{name}>\n#endif\n"
    return (f"#define HAS_{name[0]}(x) __has_include(x)\n#if HAS_{name[0]}(\"{name}\")\n"
            f"#include \"{name}\"\n#endif\n")


@st.composite
def trees(draw):
    """(files {relative path: text}, source text, option keywords with @ROOT@ for the tree's root)."""
    files = {}
    for directory in DIRS:
        for name in NAMES:
            if draw(st.integers(0, 2)) != 0:
                body = ""
                if draw(st.booleans()):
                    body = _spelling(draw, draw(st.sampled_from(NAMES)))
                files[f"{directory}/{name}"] = f"#pragma once\n{body}#define V_{directory.replace('/', '_')}_{name[0]} 1\n"
    source = "".join(_spelling(draw, draw(st.sampled_from(NAMES))) for _ in range(draw(st.integers(1, 3))))
    kw = {}
    include_path = draw(st.lists(st.sampled_from(["@ROOT@/I0", "@ROOT@/I1", "../I1", "I0", "."]), min_size=1,
                                 max_size=2, unique=True))
    if include_path:
        kw["include_path"] = include_path
    kw["name"] = draw(st.sampled_from([None, "k.cu", "@ROOT@/src/k.cu", "../src/k.cu"]))
    if draw(st.integers(0, 3)) == 0:
        kw["pre_include"] = draw(st.sampled_from(NAMES))
    if draw(st.integers(0, 5)) == 0:
        kw["no_source_include"] = True
    kw["define_macro"] = [(f"HDRD_{n[0]}", f'"{n}"') for n in NAMES]
    return files, source, kw


#: Every example's direct manifests (a set recorded for one tree holds for another only if the files match).
_DIRECT_CHAIN = as_chain(InMemoryProgramCache())


def compile_key(source: str, code_type: str, opts: ProgramOptions, target_type: str) -> keys.CompileKey:
    """The scan's key (memo as it stands), and direct mode's answer checked against it (memo untouched)."""
    want = keys.compile_key(source, code_type, opts, target_type)
    by_role = keys.keyed_by_role(opts, code_type, True)
    storage = direct.direct_key(source, code_type, opts, target_type, (), None, by_role)
    for attempt in ("before", "after"):  # the sets recorded so far, then with this scan's set recorded
        sets = direct.decode_direct(_DIRECT_CHAIN.get(storage)) if _DIRECT_CHAIN.get(storage) else []
        got = direct.match(sets, source, code_type, opts, target_type, (), None, by_role, os.getcwd(), adopt=False)
        if got is not None:
            assert (got.key, got.headers, got.missing) == (want.key, want.headers, want.missing), (
                "direct mode keyed otherwise than the scan")
        if attempt == "before":
            event(f"direct: {'hit' if got is not None else 'miss'}")
            recordable = direct.header_set(want, source, opts) is not None
            direct.record(_DIRECT_CHAIN, want, source, code_type, opts, target_type, (), None)
        else:
            assert (got is not None) == recordable, "a recorded set does not hold where it was recorded"
    return want


def _opts(kw: dict, root: str) -> ProgramOptions:
    made = {}
    for k, v in kw.items():
        if v is None:
            continue
        if k == "define_macro":
            made[k] = v
        elif isinstance(v, list):
            made[k] = [p.replace("@ROOT@", root) for p in v]
        elif isinstance(v, str):
            made[k] = v.replace("@ROOT@", root)
        else:
            made[k] = v
    return ProgramOptions(arch=ARCH, **made)


def _covered(source: str, opts: ProgramOptions) -> tuple[set[str], str | None]:
    roots = {f"I{i}": p for i, p in enumerate(opts.include_path or [])}
    name = opts.name
    roots["source"] = os.path.dirname(name) if name and "/" in name else os.getcwd()
    roots["cwd"] = os.getcwd()
    scan = headerscan.header_scan(source, opts)
    return ({os.path.realpath(h.path if h.root == "abs" else os.path.join(roots[h.root], h.path))
             for h in scan.headers}, scan.declined)


def _materialize(root: str, files: dict) -> None:
    for directory in DIRS:
        os.makedirs(os.path.join(root, directory), exist_ok=True)
    os.symlink("../ext/d", os.path.join(root, "I1", "lnk"))
    for rel, text in files.items():
        path = os.path.join(root, rel)
        with open(path, "w") as fh:
            fh.write(text.replace("@ROOT@", root))
        os.utime(path, (OLD, OLD))


def _other_host_never_shares_the_key(root: str, files: dict, source: str, kw: dict, opened: str, key: bytes) -> None:
    """The same tree under another root, one file NVRTC opens differing: another key (portable or not)."""
    other = root + "-other"
    _materialize(other, files)  # the same tree, its absolute spellings naming its own root
    previous = os.getcwd()
    try:
        edited = other + opened[len(root):]
        with open(edited, "a") as fh:
            fh.write("#define OTHER_HOST 1\n")
        os.utime(edited, (OLD, OLD))
        os.chdir(os.path.join(other, "wd"))
        other_source = source.replace(root, other)
        assert compile_key(other_source, "c++", _opts(kw, other), "cubin").key != key, (
            f"another host whose {opened[len(root):]} differs got the same key")
    finally:
        os.chdir(previous)
        shutil.rmtree(other, ignore_errors=True)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(trees())
def test_every_file_nvrtc_opens_is_digested_and_an_edit_to_it_changes_the_key(example):
    files, source, kw = example
    root = os.path.realpath(tempfile.mkdtemp(prefix="oracle-"))
    previous = os.getcwd()
    try:
        _materialize(root, files)
        os.chdir(os.path.join(root, "wd"))
        source = source.replace("@ROOT@", root) + 'extern "C" __global__ void k(int* out) { *out = 1; }\n'
        opts = _opts(kw, root)
        headermemo.clear_memo()
        covered, declined = _covered(source, opts)
        opened, _ = opened_by_nvrtc(source, opts, [root])
        event(f"files opened: {min(len(opened), 3)}{'+' if len(opened) >= 3 else ''}")
        if declined is not None:
            event("declined")
            return  # compiled every time, never cached: nothing to cover
        assert opened <= covered, f"NVRTC opened {sorted(opened - covered)} the key does not cover"
        before = compile_key(source, "c++", opts, "cubin").key
        if opened:
            _other_host_never_shares_the_key(root, files, source, kw, sorted(opened)[0], before)
        for path in sorted(opened):
            with open(path, "a") as fh:
                fh.write("#define EDITED 1\n")
            os.utime(path, (OLD, OLD))  # an edit that even keeps the mtime
            after = compile_key(source, "c++", opts, "cubin").key
            assert after != before, f"editing {path} left the key unchanged"
            before = after
    finally:
        os.chdir(previous)
        shutil.rmtree(root, ignore_errors=True)
