"""NVRTC's libraries recorded by one process of a node and loaded beside the next one's first header work
(:mod:`tiered_progcache.compiling.nvrtcload`): real processes, the real NVRTC and cuda-pathfinder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiered_progcache.compiling import nvrtcload

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux's (dlopen)")

_FIRST = r"""
import sys
import tiered_progcache as tpc
from cuda.core import ProgramOptions
with tpc.TieredProgramCache(sys.argv[1]) as cache:
    tpc.compile('extern "C" __global__ void first(float* a) { a[0] = 1.0f; }', "c++", ProgramOptions(arch="sm_90"),
                cache=cache)
"""

_NEXT = r"""
import json, sys
import tiered_progcache as tpc
from cuda.core import ProgramOptions
from tiered_progcache.compiling import nvrtcload

def mapped():
    with open("/proc/self/maps") as maps:
        return sorted({line[line.index("/"):].rstrip("\n") for line in maps if "/libnvrtc" in line})

before = mapped()
thread = nvrtcload.start(sys.argv[1])
if thread is not None:
    thread.join()
preloaded = mapped()
with tpc.TieredProgramCache(sys.argv[1]) as cache:  # a miss: NVRTC compiles with what was preloaded
    code = tpc.compile('extern "C" __global__ void next(float* a) { a[0] = 2.0f; }', "c++",
                       ProgramOptions(arch="sm_90"), cache=cache).code
from cuda.pathfinder import load_nvidia_dynamic_lib
loaded = load_nvidia_dynamic_lib("nvrtc")
print(json.dumps({"started": thread is not None, "before": before, "preloaded": preloaded, "after": mapped(),
                  "elf": bytes(code[:4]) == b"\x7fELF", "found_loaded": loaded.was_already_loaded_from_elsewhere,
                  "library": loaded.abs_path}))
"""


def _run(script: str, directory, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _doc(directory) -> dict:
    with open(os.path.join(directory, nvrtcload.LIBRARIES_FILE)) as fh:
        return json.load(fh)


def test_the_next_process_loads_the_nvrtc_the_first_one_loaded_before_its_key_asks_and_compiles_with_it(tmp_path):
    """The first process records what cuda-pathfinder loaded; the next maps exactly those files on its thread,
    before cuda-core asks for anything, and cuda-pathfinder then finds them loaded; a miss compiles."""
    _run(_FIRST, tmp_path)
    (rows,) = _doc(tmp_path)["environments"].values()
    seen = json.loads(_run(_NEXT, tmp_path))
    assert seen["started"] and seen["before"] == []
    assert seen["preloaded"] == sorted(path for path, _ in rows)  # the recorded files, and no others
    assert rows[0][0] == seen["library"] and seen["found_loaded"]  # cuda-pathfinder took what was preloaded
    assert seen["elf"] and set(seen["preloaded"]) <= set(seen["after"])  # (NVRTC may load its builtins itself)


def test_another_environment_preloads_nothing_and_adds_its_own_record(tmp_path):
    """What decides cuda-pathfinder's choice (here ``LD_LIBRARY_PATH``) differs: nothing is preloaded, NVRTC is
    loaded as usual, and the process's record is kept beside the first one."""
    _run(_FIRST, tmp_path)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path / "elsewhere")}
    (first,) = _doc(tmp_path)["environments"]
    seen = json.loads(_run(_NEXT, tmp_path, env))
    assert not seen["started"] and seen["preloaded"] == [] and seen["elf"] and not seen["found_loaded"]
    kept = list(_doc(tmp_path)["environments"])
    assert len(kept) == 2 and kept[0] == first  # the other environment's record, beside the first


@pytest.fixture
def fresh_process(monkeypatch):
    """This process as one that has neither started a preload nor recorded one."""
    monkeypatch.setattr(nvrtcload, "_started", False)
    monkeypatch.setattr(nvrtcload, "_recorded", False)


def _write(directory, doc, mode: int = 0o600) -> None:
    """A record as this user's process writes one (``mode`` 0o600, whatever the umask), unless ``mode`` says."""
    path = os.path.join(directory, nvrtcload.LIBRARIES_FILE)
    with open(path, "w") as fh:
        fh.write(doc if isinstance(doc, str) else json.dumps(doc))
    os.chmod(path, mode)


def test_start_and_record_run_once_per_process(tmp_path, fresh_process):
    """record() writes this environment's libraries once; start() preloads them once; after a preload nothing is
    recorded again."""
    nvrtcload.record(str(tmp_path))
    (rows,) = _doc(tmp_path)["environments"].values()
    os.remove(tmp_path / nvrtcload.LIBRARIES_FILE)
    nvrtcload.record(str(tmp_path))  # a second time in the process: nothing
    assert not (tmp_path / nvrtcload.LIBRARIES_FILE).exists()
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries", "environments": {nvrtcload._environment(): rows}})
    thread = nvrtcload.start(str(tmp_path))
    assert thread is not None and thread.name == "tiered-progcache-nvrtc-load" and thread.daemon
    thread.join(60)
    assert nvrtcload.start(str(tmp_path)) is None


def test_a_process_that_preloaded_records_nothing(tmp_path, fresh_process):
    """What a preload maps is what the record says: the process's record() writes nothing (no file, no rewrite)."""
    rows = [[path, nvrtcload._signature(path)] for path in nvrtcload._loaded_nvrtc()]
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries", "environments": {nvrtcload._environment(): rows}})
    nvrtcload.start(str(tmp_path)).join(60)
    os.remove(tmp_path / nvrtcload.LIBRARIES_FILE)
    nvrtcload.record(str(tmp_path))
    assert not (tmp_path / nvrtcload.LIBRARIES_FILE).exists()


def test_an_unchanged_record_is_not_rewritten_and_a_changed_one_becomes_the_newest(tmp_path, fresh_process):
    """The same libraries for this environment: the file stays as it is (same inode). Other libraries recorded
    for it before, and it the oldest of eight: its new record replaces the old one and is kept as the newest."""
    rows = [[path, nvrtcload._signature(path)] for path in nvrtcload._loaded_nvrtc()]
    environment = nvrtcload._environment()
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries", "environments": {environment: rows}})
    inode = os.stat(tmp_path / nvrtcload.LIBRARIES_FILE).st_ino
    nvrtcload.record(str(tmp_path))
    assert os.stat(tmp_path / nvrtcload.LIBRARIES_FILE).st_ino == inode
    stale = {environment: [["/old/libnvrtc.so.13", [1, 1, 1]]], **{f"env{n}": [] for n in range(7)}}
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries", "environments": stale})
    nvrtcload._recorded = False
    nvrtcload.record(str(tmp_path))
    recorded = _doc(tmp_path)["environments"]
    assert list(recorded) == [f"env{n}" for n in range(7)] + [environment] and recorded[environment] == rows
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries",
                      "environments": {"a": [], environment: [["/old/libnvrtc.so.13", [1, 1, 1]]], "b": []}})
    nvrtcload._recorded = False
    nvrtcload.record(str(tmp_path))
    assert list(_doc(tmp_path)["environments"]) == ["a", "b", environment]  # moved to the end, not left in place


def test_a_record_of_exactly_64_kib_is_read(tmp_path, fresh_process):
    """The bound is 64 KiB: a document of exactly that size is read (one byte more is not, above)."""
    body = json.dumps({"format": "tiered-progcache/nvrtc-libraries", "environments": {"x": []}, "pad": ""})
    _write(tmp_path, body[:-2] + "p" * (64 * 1024 - len(body)) + body[-2:])  # its last byte read, or it is no JSON
    assert os.path.getsize(tmp_path / nvrtcload.LIBRARIES_FILE) == 64 * 1024
    assert nvrtcload._read(str(tmp_path)) == {"x": []}


def test_a_recorded_file_gone_and_a_directory_gone_are_logged_at_debug(tmp_path, fresh_process, caplog):
    """Neither raises: the start logs why it preloads nothing, the record why it could not write."""
    import logging

    rows = [[str(tmp_path / "gone.so"), [1, 1, 1]]]
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries", "environments": {nvrtcload._environment(): rows}})
    (tmp_path / "a-file").write_bytes(b"")
    missing = tmp_path / "a-file" / "cache"  # under a file: no directory can be made there
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.compiling.nvrtcload"):
        assert nvrtcload.start(str(tmp_path)) is None
        nvrtcload.record(str(missing))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("not preloading NVRTC: FileNotFoundError(")
    assert said[1].startswith(f"could not record NVRTC's libraries in {missing}: NotADirectoryError(")


def test_a_changed_library_file_is_not_preloaded(tmp_path, fresh_process):
    """A recorded file whose inode, size or mtime differs (a reinstalled wheel) is not loaded: cuda-pathfinder
    chooses again."""
    library = tmp_path / "libnvrtc.so.13"
    library.write_bytes(b"not a library")
    st = os.stat(library)
    rows = [[str(library), [st.st_ino, st.st_size, st.st_mtime_ns + 1]]]
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries", "environments": {nvrtcload._environment(): rows}})
    assert nvrtcload.start(str(tmp_path)) is None


@pytest.mark.parametrize("doc", ["{not json", "[]", json.dumps({"format": "other", "environments": {}}),
                                 json.dumps({"format": "tiered-progcache/nvrtc-libraries", "environments": []}),
                                 json.dumps({"format": "tiered-progcache/nvrtc-libraries",
                                             "environments": {"x": []}}) + " " * (64 * 1024)],
                         ids=["garbage", "a list", "another format", "no mapping", "over 64 KiB"])
def test_a_bad_record_preloads_nothing_and_is_replaced(tmp_path, fresh_process, doc):
    _write(tmp_path, doc)
    assert nvrtcload.start(str(tmp_path)) is None
    nvrtcload._recorded = False
    nvrtcload.record(str(tmp_path))
    assert list(_doc(tmp_path)["environments"]) == [nvrtcload._environment()]


def test_the_record_keeps_the_newest_eight_environments(tmp_path, fresh_process):
    """``MAX_ENVIRONMENTS`` (8): one directory serving several virtual environments keeps the newest 8 records."""
    assert nvrtcload.MAX_ENVIRONMENTS == 8
    others = {f"env{n}": [["/nowhere/libnvrtc.so.13", [n, 1, 1]]] for n in range(8)}
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries", "environments": others})
    nvrtcload.record(str(tmp_path))
    kept = list(_doc(tmp_path)["environments"])
    assert kept == [f"env{n}" for n in range(1, 8)] + [nvrtcload._environment()]


def test_a_builtins_library_is_recorded_only_where_this_process_loaded_it(tmp_path):
    """Beside NVRTC, each ``libnvrtc-builtins.so*`` this process has loaded (asked with ``RTLD_NOLOAD``: nothing is
    loaded by asking), and no other: here one loaded (a link to the one NVRTC loaded on its compile) and a
    copy of it, a library never loaded, whose name sorts first."""
    import shutil

    from cuda.core import Program, ProgramOptions
    from cuda.pathfinder import load_nvidia_dynamic_lib

    program = Program('extern "C" __global__ void k(float* a) { a[0] = 1.0f; }', "c++", ProgramOptions(arch="sm_90"))
    program.compile("cubin")  # NVRTC and, by now, its builtins are loaded
    program.close()
    with open("/proc/self/maps") as maps:
        (builtins,) = {line[line.index("/"):].rstrip("\n") for line in maps if "/libnvrtc-builtins" in line}
    library = tmp_path / "libnvrtc.so.13"
    library.symlink_to(load_nvidia_dynamic_lib("nvrtc").abs_path)
    (tmp_path / "libnvrtc-builtins.so.13.99").symlink_to(builtins)
    shutil.copyfile(builtins, tmp_path / "libnvrtc-builtins.so.13.0")  # another file: never loaded
    assert nvrtcload._loaded_beside(str(library)) == [str(library), str(tmp_path / "libnvrtc-builtins.so.13.99")]
    with open("/proc/self/maps") as maps:
        assert str(tmp_path / "libnvrtc-builtins.so.13.0") not in maps.read()  # asking loaded nothing


def test_a_library_that_does_not_load_stops_the_preload_and_says_so(tmp_path, fresh_process, caplog):
    """A recorded file that ``dlopen`` refuses (its signature unchanged): the preload stops there, logged at DEBUG;
    cuda-pathfinder loads NVRTC as always."""
    import logging

    from cuda.pathfinder import load_nvidia_dynamic_lib

    bogus = tmp_path / "libnvrtc.so.13"
    bogus.write_bytes(b"not a library")
    real = load_nvidia_dynamic_lib("nvrtc").abs_path
    rows = [[str(bogus), nvrtcload._signature(str(bogus))], [real, nvrtcload._signature(real)]]
    _write(tmp_path, {"format": "tiered-progcache/nvrtc-libraries", "environments": {nvrtcload._environment(): rows}})
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.compiling.nvrtcload"):
        thread = nvrtcload.start(str(tmp_path))
        assert thread is not None
        thread.join(60)
    assert [r.getMessage() for r in caplog.records] == [f"not preloaded: {bogus}"]


def _mapped() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line[line.index("/"):].rstrip("\n") for line in maps if "/" in line}


@pytest.fixture
def planted(tmp_path):
    """A record for this environment naming one loadable library that nothing else loads (a copy of NVRTC's
    builtins under a name of its own): what a file planted in a shared local directory would name."""
    import shutil

    from cuda.pathfinder import load_nvidia_dynamic_lib

    directory = os.path.dirname(load_nvidia_dynamic_lib("nvrtc").abs_path)
    (builtins,) = [name for name in os.listdir(directory) if name.startswith("libnvrtc-builtins.so")][:1]
    library = tmp_path / f"libplanted-{os.getpid()}-{tmp_path.name}.so"
    shutil.copyfile(os.path.join(directory, builtins), library)
    return str(library), {"format": "tiered-progcache/nvrtc-libraries",
                          "environments": {nvrtcload._environment(): [[str(library),
                                                                       nvrtcload._signature(str(library))]]}}


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o755])
def test_a_record_of_this_users_that_only_it_can_write_is_preloaded(tmp_path, fresh_process, planted, mode):
    """The control for the refusals below: the same planted library, in a file of this user's that others may read
    or execute but not write, is mapped (so a refusal below that mapped it would show)."""
    library, doc = planted
    _write(tmp_path, doc, mode)
    nvrtcload.start(str(tmp_path)).join(60)
    assert library in _mapped()


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o660, 0o666], ids=["group", "others", "group rw", "everyone"])
def test_a_record_others_can_write_is_ignored_with_a_warning_and_replaced(tmp_path, fresh_process, planted, caplog,
                                                                          mode):
    """The record names host code this process maps: one that a group or everyone may write (a planted one, in a
    local directory shared by a team) maps nothing; one WARNING says why; this process's record replaces it with
    a file only its user can write, naming this environment alone."""
    import logging

    library, doc = planted
    _write(tmp_path, doc, mode)
    path = os.path.join(tmp_path, nvrtcload.LIBRARIES_FILE)
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.compiling.nvrtcload"):
        assert nvrtcload.start(str(tmp_path)) is None
        nvrtcload.record(str(tmp_path))
    assert library not in _mapped()
    assert [r.getMessage() for r in caplog.records] == [
        f"ignoring {path}: a file of uid {os.geteuid()}, mode {mode:o}; only one of this user's that no one else "
        f"can write is read"]
    assert caplog.records[0].levelno == logging.WARNING
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert list(_doc(tmp_path)["environments"]) == [nvrtcload._environment()]
    assert _doc(tmp_path)["environments"][nvrtcload._environment()][0][0] != library


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_record_owned_by_another_user_is_ignored(tmp_path, fresh_process, planted):
    """A file only its owner can write, but its owner is not this process's user: ignored."""
    library, doc = planted
    _write(tmp_path, doc)
    os.chown(os.path.join(tmp_path, nvrtcload.LIBRARIES_FILE), 65534, 65534)
    assert nvrtcload.start(str(tmp_path)) is None
    assert library not in _mapped()


def test_a_link_or_a_fifo_at_the_records_name_is_not_read(tmp_path, fresh_process, planted):
    """A symbolic link to a good record is not followed; a FIFO is refused without blocking the compile."""
    library, doc = planted
    (tmp_path / "elsewhere").mkdir()
    _write(tmp_path / "elsewhere", doc)
    os.symlink(tmp_path / "elsewhere" / nvrtcload.LIBRARIES_FILE, tmp_path / nvrtcload.LIBRARIES_FILE)
    assert nvrtcload.start(str(tmp_path)) is None
    os.remove(tmp_path / nvrtcload.LIBRARIES_FILE)
    os.mkfifo(tmp_path / nvrtcload.LIBRARIES_FILE)
    nvrtcload._started = False
    assert nvrtcload.start(str(tmp_path)) is None  # (an open that blocked would hang here)
    assert library not in _mapped()
