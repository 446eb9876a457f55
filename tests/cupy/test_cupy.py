"""tiered_progcache.cupy: CuPy's kernel-cache backend on CuPy's directory and the shared tiers.

CuPy imports here, but its compile asks the driver for the device first, so these tests
drive the backend through CuPy's own calls, ``load(name)`` and ``save(name, payload,
source)``, with CuPy's payloads (a real NVRTC cubin; with name expressions, CuPy's own
``_encode_cache_payload``), and read what lands with CuPy's own ``DiskKernelCacheBackend``.
The compile-context wrapper is exercised around a stand-in with CuPy's call order (load,
compile on a miss, save). Nodes are separate ``CUPY_CACHE_DIR`` directories on one
``file://`` remote. The real compiles run on the GPU host (tests/gpu/test_cupy_gpu.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cupy", exc_type=ImportError)

from cupy.cuda import compiler  # noqa: E402
from cupy.cuda._compiler_cache import DiskKernelCacheBackend  # noqa: E402

from support import ARCH, child_pythonpath  # noqa: E402
from tiered_progcache import cupy as tpc  # noqa: E402
from tiered_progcache.config import CacheConfig  # noqa: E402
from tiered_progcache.chain.tiered import TieredProgramCache  # noqa: E402
from tiered_progcache.cupy import backend as cupy_backend  # noqa: E402
from tiered_progcache.cupy.cupydir import write_local  # noqa: E402
from tiered_progcache.cupy.cupynames import frame, name_of  # noqa: E402
from tiered_progcache.stores.remote import RemoteProgramCache  # noqa: E402

NAME = "0123456789abcdef0123456789abcdef01234567.cubin"
OTHER = "fedcba9876543210fedcba9876543210fedcba98.cubin"


@pytest.fixture(scope="module")
def cubin() -> bytes:
    """A real cubin (NVRTC on the CPU), the payload CuPy stores for a kernel without name expressions."""
    from cuda.core import Program, ProgramOptions

    code = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }'
    return bytes(Program(code, "c++", ProgramOptions(arch=ARCH)).compile("cubin").code)


@pytest.fixture(autouse=True)
def fresh():
    """No backend installed, no chain, zero counters, before and after each test."""
    tpc.uninstall()
    tpc._reset_for_tests()
    yield
    chain = tpc._shared.if_built()
    tpc.uninstall()
    tpc._reset_for_tests()
    if chain is not None:
        chain.close()


def _chain(remote: Path, **settings: Any) -> TieredProgramCache:
    remote.mkdir(exist_ok=True)
    chain = CacheConfig(remote=f"file://{remote}", strict=True, **settings).build_shared(namespace=tpc.NAMESPACE)
    assert chain is not None
    tpc.use_shared_cache(chain)
    return chain


def _node(directory: Path) -> cupy_backend.TieredKernelCacheBackend:
    assert tpc.install(directory)
    backend = compiler._kernel_cache_backend
    assert backend is tpc.installed()
    return backend


def _switch(directory: Path) -> cupy_backend.TieredKernelCacheBackend:
    tpc.uninstall()
    return _node(directory)


def _object_path(remote: Path, name: str) -> Path:
    store = RemoteProgramCache.from_url(f"file://{remote}", namespace=tpc.NAMESPACE)
    return Path(store.path_for(name_of(name)).removeprefix("file://"))


# -- CuPy's own format, both ways -----------------------------------------------------------------


def test_a_saved_payload_is_cupy_s_own_file_and_cupy_s_backend_reads_it(cubin, tmp_path):
    backend = _node(tmp_path / "a")
    backend.save(NAME, cubin, "source")
    data = (tmp_path / "a" / NAME).read_bytes()
    assert data == hashlib.sha1(cubin).hexdigest().encode() + cubin
    assert DiskKernelCacheBackend(str(tmp_path / "a")).load(NAME) == cubin
    assert sorted(os.listdir(tmp_path / "a")) == [NAME]  # no staged file left, no source unless asked
    DiskKernelCacheBackend(str(tmp_path / "a")).save(OTHER, cubin[::-1], "source")
    assert backend.load(OTHER) == cubin[::-1]
    local = tpc.stats()["cupy-local"]
    assert (local.hits, local.misses, local.writes, local.bytes_written) == (1, 0, 1, len(cubin))


def test_a_file_that_fails_cupy_s_sha1_check_is_a_miss(cubin, tmp_path):
    backend = _node(tmp_path / "a")
    backend.save(NAME, cubin, "source")
    path = tmp_path / "a" / NAME
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    assert backend.load(NAME) is None
    path.write_bytes(b"abc")  # shorter than a SHA-1
    assert backend.load(NAME) is None


def test_cupy_cache_save_cuda_source_writes_the_source_beside_as_cupy_does(cubin, tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_SAVE_CUDA_SOURCE", "1")
    _node(tmp_path / "a").save(NAME, cubin, "the source")
    assert (tmp_path / "a" / (NAME + ".cu")).read_text() == "the source"


# -- across nodes ---------------------------------------------------------------------------------


def test_a_name_expressions_payload_saved_on_node_a_loads_on_node_b_byte_for_byte(cubin, tmp_path):
    chain = _chain(tmp_path / "remote")
    payload = compiler._encode_cache_payload(["_Z6kernelIfEvPT_", "_Z6kernelIdEvPT_"], cubin)
    _node(tmp_path / "a").save(NAME, payload, "source")
    assert chain.flush(timeout=30)
    assert chain.stats()["remote"].writes == 1
    b = _switch(tmp_path / "b")
    assert b.load(NAME) == payload
    assert compiler._decode_cache_payload(b.load(NAME), 2) == (["_Z6kernelIfEvPT_", "_Z6kernelIdEvPT_"], cubin)
    assert DiskKernelCacheBackend(str(tmp_path / "b")).load(NAME) == payload  # landed in CuPy's own format
    local, remote = tpc.stats()["cupy-local"], chain.stats()["remote"]
    assert (local.misses, local.hits, remote.hits, remote.misses) == (1, 1, 1, 0)


def test_a_local_hit_asks_the_shared_tier_nothing(cubin, tmp_path):
    remote_dir = tmp_path / "remote"
    chain = _chain(remote_dir)
    backend = _node(tmp_path / "a")
    backend.save(NAME, cubin, "source")
    assert chain.flush(timeout=30)
    opened: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].startswith(str(remote_dir)):
            opened.append(args[0])

    sys.addaudithook(audit)
    before = chain.stats()["remote"]
    for _ in range(3):
        assert backend.load(NAME) == cubin
    after = chain.stats()["remote"]
    assert (after.hits, after.misses, after.errors) == (before.hits, before.misses, before.errors)
    assert opened == []
    assert tpc.stats()["cupy-local"].hits == 3


def test_a_miss_everywhere_is_none_and_counted_once_per_tier(tmp_path):
    chain = _chain(tmp_path / "remote")
    assert _node(tmp_path / "a").load(NAME) is None
    assert (tpc.stats()["cupy-local"].misses, chain.stats()["remote"].misses) == (1, 1)


def test_without_a_remote_the_backend_is_cupy_s_directory_alone(cubin, tmp_path, monkeypatch):
    monkeypatch.delenv("TIERED_PROGCACHE_REMOTE", raising=False)
    backend = _node(tmp_path / "a")
    backend.save(NAME, cubin, "source")
    assert backend.load(NAME) == cubin and backend.load(OTHER) is None
    assert list(tpc.stats()) == ["cupy-local"]


# -- what a shared read refuses -------------------------------------------------------------------


def _seeded(cubin: bytes, tmp_path: Path, **settings: Any) -> tuple[TieredProgramCache, Path]:
    chain = _chain(tmp_path / "remote", **settings)
    writer = _node(tmp_path / "a")
    writer.save(NAME, cubin, "source")
    writer.save(OTHER, cubin[:-8], "source")
    assert chain.flush(timeout=30)
    return chain, tmp_path / "remote"


def _nothing_loaded_on_node_b(tmp_path: Path, name: str = NAME) -> None:
    b = _switch(tmp_path / "b")
    assert b.load(name) is None
    assert not (tmp_path / "b" / name).exists()


@pytest.mark.parametrize("signing_key", [None, "cluster key"], ids=["unsigned", "signed"])
def test_a_tampered_object_on_the_shared_tier_is_never_loaded(cubin, tmp_path, signing_key):
    chain, remote = _seeded(cubin, tmp_path, signing_key=signing_key)
    path = _object_path(remote, NAME)
    stored = bytearray(path.read_bytes())
    stored[-5] ^= 0x40  # one bit of the cubin
    path.write_bytes(bytes(stored))
    _nothing_loaded_on_node_b(tmp_path)
    assert chain.stats()["remote"].rejected == 1


@pytest.mark.parametrize("signing_key", [None, "cluster key"], ids=["unsigned", "signed"])
def test_a_whole_object_moved_under_another_name_is_refused(cubin, tmp_path, signing_key):
    chain, remote = _seeded(cubin, tmp_path, signing_key=signing_key)
    _object_path(remote, NAME).write_bytes(_object_path(remote, OTHER).read_bytes())
    _nothing_loaded_on_node_b(tmp_path)


def test_signed_entries_from_another_key_are_refused(cubin, tmp_path):
    writer, remote = _seeded(cubin, tmp_path, signing_key="writer's key")
    tpc._reset_for_tests()
    reader = _chain(remote, signing_key="another key")
    _nothing_loaded_on_node_b(tmp_path)
    assert reader.stats()["remote"].rejected == 1
    writer.close()


def test_an_unsigned_object_is_refused_where_a_key_is_set(cubin, tmp_path):
    writer, remote = _seeded(cubin, tmp_path)
    tpc._reset_for_tests()
    reader = _chain(remote, signing_key="cluster key")
    _nothing_loaded_on_node_b(tmp_path)
    assert reader.stats()["remote"].rejected == 1
    writer.close()


def test_a_failing_shared_tier_is_a_miss_and_a_save_still_lands_locally(cubin, tmp_path):
    chain = _chain(tmp_path / "remote")
    (tmp_path / "remote").rename(tmp_path / "gone")
    backend = _node(tmp_path / "a")
    assert backend.load(NAME) is None
    backend.save(NAME, cubin, "source")
    chain.flush(timeout=30)
    assert backend.load(NAME) == cubin


def _unwritable(directory: Path) -> None:
    """CuPy's directory replaced by a file (a mode would not stop root, who runs CI here)."""
    directory.rmdir()
    directory.write_bytes(b"")


def test_a_fetched_entry_that_cannot_be_written_locally_is_still_served(cubin, tmp_path):
    chain, _ = _seeded(cubin, tmp_path)
    b = _switch(tmp_path / "b")
    _unwritable(tmp_path / "b")
    assert b.load(NAME) == cubin


# -- header keys ------------------------------------------------------------------------------------


class CupyLike:
    """CuPy's order of calls in ``_compile_with_cache_cuda``: name, load, compile on a miss, save; counts compiles.

    Wrapped with the backend's compile context as install() wraps CuPy's own.
    """

    def __init__(self, headers: Path) -> None:
        self.headers = headers
        self.compiles = 0
        self.run = cupy_backend.compile_context(self._compile_with_cache)

    @staticmethod
    def name_of(source: str, options: tuple[str, ...], arch: str = "90") -> str:
        return hashlib.sha1(repr((arch, options, source)).encode()).hexdigest() + ".cubin"  # CuPy's kind of name

    def _compile_with_cache(self, source: str, options: tuple[str, ...], arch: str = "90") -> bytes:
        name = self.name_of(source, options, arch)
        backend = compiler._kernel_cache_backend
        payload = backend.load(name)
        if payload is None:
            self.compiles += 1
            payload = b"cubin of " + (self.headers / "my.h").read_bytes()  # what NVRTC would have read
            backend.save(name, payload, source)
        return payload


SOURCE = '#include "my.h"\nextern "C" __global__ void k(int* x) { x[0] = VAL; }\n'


def test_a_header_edit_under_an_include_directory_is_a_miss(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "my.h").write_text("#define VAL 1\n")
    _node(tmp_path / "a")
    cupy = CupyLike(inc)
    options = ("-I" + str(inc), "--std=c++17")
    assert cupy.run(SOURCE, options) == b"cubin of #define VAL 1\n" and cupy.compiles == 1
    assert cupy.run(SOURCE, options) == b"cubin of #define VAL 1\n" and cupy.compiles == 1
    (inc / "my.h").write_text("#define VAL 22\n")
    assert cupy.run(SOURCE, options) == b"cubin of #define VAL 22\n" and cupy.compiles == 2
    (inc / "my.h").write_text("#define VAL 1\n")  # back: the first entry serves again
    assert cupy.run(SOURCE, options) == b"cubin of #define VAL 1\n" and cupy.compiles == 2
    files = sorted(os.listdir(tmp_path / "a"))
    assert len(files) == 2 and all("-h" in f and f.endswith(".cubin") for f in files)


def test_every_flag_spelling_of_an_include_directory_is_keyed(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "my.h").write_text("#define VAL 1\n")
    _node(tmp_path / "a")
    for spelling in (("-I" + str(inc),), ("-I", str(inc)), ("--include-path=" + str(inc),), ("--include-path", str(inc))):
        cupy = CupyLike(inc)
        cupy.run(SOURCE, spelling)
        (inc / "my.h").write_text((inc / "my.h").read_text() + "// edited\n")
        cupy.run(SOURCE, spelling)
        assert cupy.compiles == 2, spelling


def test_a_node_with_the_same_headers_elsewhere_hits_the_shared_tier(tmp_path):
    chain = _chain(tmp_path / "remote")
    for node in ("a", "b"):
        (tmp_path / node / "inc").mkdir(parents=True)
        (tmp_path / node / "inc" / "my.h").write_text("#define VAL 1\n")
    _node(tmp_path / "a" / "cache")
    a = CupyLike(tmp_path / "a" / "inc")
    options = ("-I" + str(tmp_path / "shared-inc"),)  # one spelling, as a cluster's image has it
    (tmp_path / "shared-inc").symlink_to(tmp_path / "a" / "inc")
    a.run(SOURCE, options)
    assert chain.flush(timeout=30)
    _switch(tmp_path / "b" / "cache")
    (tmp_path / "shared-inc").unlink()
    (tmp_path / "shared-inc").symlink_to(tmp_path / "b" / "inc")
    b = CupyLike(tmp_path / "b" / "inc")
    assert b.run(SOURCE, options) == b"cubin of #define VAL 1\n"
    assert (a.compiles, b.compiles, chain.stats()["remote"].hits) == (1, 0, 1)


def test_cupy_s_own_include_directories_leave_cupy_s_name(tmp_path):
    from tiered_progcache.cupy import _cupyprivate

    own = _cupyprivate.cupy_include_dirs()
    assert own and any(d.endswith(os.path.join("_core", "include")) for d in own)
    _node(tmp_path / "a")
    cupy = CupyLike(tmp_path)
    (tmp_path / "my.h").write_text("#define VAL 1\n")
    cupy.run('extern "C" __global__ void k() {}', tuple("-I" + d for d in own) + ("--std=c++17",))
    (name,) = os.listdir(tmp_path / "a")
    assert "-h" not in name


def test_a_kernel_whose_headers_cannot_be_bounded_is_compiled_and_never_cached(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "my.h").write_text("#define VAL 1\n")
    _node(tmp_path / "a")
    cupy = CupyLike(inc)
    computed = '#define H(x) <x>\n#include H(my.h)\nextern "C" __global__ void k() {}\n'
    cupy.run(computed, ("-I" + str(inc),))
    cupy.run(computed, ("-I" + str(inc),))
    assert cupy.compiles == 2
    assert os.listdir(tmp_path / "a") == []
    assert tpc.stats()["cupy-local"].skipped == 2  # one per compile: its load says so, its save follows


def test_a_header_edited_while_the_kernel_compiles_is_not_cached(tmp_path, caplog):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "my.h").write_text("#define VAL 1\n")
    backend = _node(tmp_path / "a")

    def compile_with_cache(source: str, options: tuple[str, ...]) -> None:
        assert backend.load(NAME) is None
        (inc / "my.h").write_text("#define VAL 333\n")  # edited between CuPy's load and its save
        backend.save(NAME, b"cubin", source)

    with caplog.at_level(logging.WARNING):
        cupy_backend.compile_context(compile_with_cache)(SOURCE, ("-I" + str(inc),))
    assert os.listdir(tmp_path / "a") == []
    assert tpc.stats()["cupy-local"].skipped == 1
    assert _warnings(caplog) == [f"CuPy cache: a header of {NAME} changed while it compiled; not cached"]


# -- install and fail-open ------------------------------------------------------------------------


def test_install_replaces_cupy_s_backend_and_uninstall_puts_it_back(tmp_path):
    before, compile_before = compiler._kernel_cache_backend, compiler._compile_with_cache_cuda
    assert tpc.install(tmp_path / "a") and tpc.install(tmp_path / "other")  # idempotent
    assert isinstance(compiler._kernel_cache_backend, cupy_backend.TieredKernelCacheBackend)
    assert compiler._kernel_cache_backend.cache_dir == str(tmp_path / "a")
    assert repr(compiler._kernel_cache_backend) == f"TieredKernelCacheBackend({str(tmp_path / 'a')!r})"
    assert compiler._compile_with_cache_cuda.__wrapped__ is compile_before
    tpc.uninstall()
    assert compiler._kernel_cache_backend is before and compiler._compile_with_cache_cuda is compile_before


def test_install_defaults_to_cupy_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "env-dir"))
    assert tpc.install()
    assert compiler._kernel_cache_backend.cache_dir == str(tmp_path / "env-dir")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("tiered_progcache.cupy") and r.levelno == logging.WARNING]


def test_a_cupy_without_the_hook_runs_untouched_with_one_warning(tmp_path, monkeypatch, caplog):
    before = compiler._kernel_cache_backend
    monkeypatch.delattr(compiler, "_set_kernel_cache_backend")
    with caplog.at_level(logging.WARNING):
        assert tpc.install(tmp_path / "a") is False
        assert tpc.install(tmp_path / "a") is False
    assert compiler._kernel_cache_backend is before and tpc.installed() is None
    assert len(_warnings(caplog)) == 1 and "no _set_kernel_cache_backend" in _warnings(caplog)[0]
    assert not (tmp_path / "a").exists()


def test_a_changed_backend_interface_is_not_installed(tmp_path, monkeypatch, caplog):
    from cupy.cuda import _compiler_cache

    before = compiler._kernel_cache_backend
    monkeypatch.setattr(_compiler_cache.KernelCacheBackend, "__abstractmethods__", frozenset({"load", "save", "evict"}))
    with caplog.at_level(logging.WARNING):
        assert tpc.install(tmp_path / "a") is False
    assert compiler._kernel_cache_backend is before
    assert len(_warnings(caplog)) == 1 and "not the ABC of load and save" in _warnings(caplog)[0]


def test_without_cupy_install_changes_nothing_with_one_warning(tmp_path):
    """In a process where ``import cupy`` fails (as where CuPy is not installed)."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING, format='%(name)s: %(message)s')\n"
        "sys.modules['cupy'] = None\n"
        "import tiered_progcache.cupy as tpc\n"
        f"print(tpc.install({str(tmp_path / 'a')!r}), tpc.install(), tpc.installed())\n"
    )
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout == "False False None\n", proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("tiered_progcache.cupy")]
    assert len(warnings) == 1 and "CuPy runs with its own cache" in warnings[0], proc.stderr
    assert not (tmp_path / "a").exists()


def test_a_moved_compile_function_installs_the_backend_without_header_keys(tmp_path, monkeypatch, caplog):
    monkeypatch.delattr(compiler, "_compile_with_cache_cuda")
    with caplog.at_level(logging.WARNING):
        assert tpc.install(tmp_path / "a") is True
    assert isinstance(compiler._kernel_cache_backend, cupy_backend.TieredKernelCacheBackend)
    assert len(_warnings(caplog)) == 1 and "without header keys" in _warnings(caplog)[0]
    tpc.uninstall()


def test_entries_land_in_their_own_namespace_beside_the_program_cache_s(cubin, tmp_path):
    chain, remote = _seeded(cubin, tmp_path)
    assert {p.relative_to(remote).parts[0] for p in remote.rglob("*") if p.is_file()} == {"cupy"}
    assert not list(RemoteProgramCache.from_url(f"file://{remote}").iter_entries())
    assert write_local and frame  # the names the command uses exist


def test_a_killed_redis_fails_open_and_the_breaker_opens(cubin, tmp_path):
    pytest.importorskip("redis")
    from support import FakeClock
    from tiered_progcache.stores.breaker import CircuitBreaker
    from tiered_progcache.stores.redis_store import RedisProgramCache
    from tiered_progcache.testing.redis_server import RedisServer

    with RedisServer() as server:
        breaker = CircuitBreaker(3, 30.0, name="redis", clock=FakeClock())
        tier = RedisProgramCache.from_url(server.url, timeout=2, strict=True, breaker=breaker, namespace=tpc.NAMESPACE)
        chain = TieredProgramCache(tiers=[tier])
        tpc.use_shared_cache(chain)
        _node(tmp_path / "a").save(NAME, cubin, "source")
        assert chain.flush(timeout=30)
        server.kill()
        for n in range(5):
            backend = _switch(tmp_path / f"b{n}")
            assert backend.load(NAME) is None  # a miss, never an exception
            backend.save(NAME, cubin, "source")  # the compile's save lands locally
            assert backend.load(NAME) == cubin
            chain.flush(timeout=30)
        stats = chain.stats()["remote"]  # a tier given in code is named "remote"
        assert stats.errors == 3 and stats.skipped > 0, stats  # three failures open the breaker, then nothing is asked
        assert breaker.state == "open"
        chain.close()


def test_a_name_of_another_form_is_cupy_s_own_directory_cache_unshared(cubin, tmp_path, caplog):
    chain = _chain(tmp_path / "remote")
    backend = _node(tmp_path / "a")
    future = "ab" * 32 + ".cubin"  # say, a CuPy that names entries by SHA-256
    with caplog.at_level(logging.WARNING):
        backend.save(future, cubin, "source")
        assert backend.load(future) == cubin
        assert backend.load("cd" * 32 + ".cubin") is None
    assert DiskKernelCacheBackend(str(tmp_path / "a")).load(future) == cubin
    assert chain.flush(timeout=30) and chain.stats()["remote"].writes == 0
    assert _warnings(caplog) == [f"CuPy cache: {future!r} is not a name of the form checked (<sha1>.cubin): "
                                 "such entries stay in CuPy's own directory cache, unshared"]  # fmt: skip


def test_a_pre_included_header_edit_is_a_miss(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "my.h").write_text("#define VAL 1\n")
    (inc / "pre.h").write_text("#define PRE 1\n")
    _node(tmp_path / "a")
    cupy = CupyLike(inc)
    options = ("--pre-include=" + str(inc / "pre.h"),)
    plain = 'extern "C" __global__ void k(int* x) { x[0] = PRE; }\n'
    cupy.run(plain, options)
    cupy.run(plain, options)
    (inc / "pre.h").write_text("#define PRE 22\n")
    cupy.run(plain, options)
    assert cupy.compiles == 2


def test_a_computed_include_through_a_d_macro_is_resolved_and_its_edit_is_a_miss(tmp_path, caplog):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "my.h").write_text("#define VAL 1\n")
    (inc / "chosen.h").write_text("#define CHOSEN 1\n")
    _node(tmp_path / "a")
    cupy = CupyLike(inc)
    computed = '#include CHOICE\nextern "C" __global__ void k(int* x) { x[0] = CHOSEN; }\n'
    options = (b"not a str", "-I" + str(inc), '-DCHOICE="chosen.h"')  # a stray non-str option is passed over
    with caplog.at_level(logging.WARNING):
        cupy.run(computed, options)
        cupy.run(computed, options)
        (inc / "chosen.h").write_text("#define CHOSEN 333\n")
        cupy.run(computed, options)
    assert cupy.compiles == 2 and tpc.stats()["cupy-local"].skipped == 0 and _warnings(caplog) == []
    assert len(os.listdir(tmp_path / "a")) == 2


def test_a_declined_scan_says_why_once_per_kernel(tmp_path, caplog):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "my.h").write_text("#define VAL 1\n")
    _node(tmp_path / "a")
    computed = '#define H(x) <x>\n#include H(my.h)\nextern "C" __global__ void k() {}\n'
    options = ("-I" + str(inc),)
    with caplog.at_level(logging.WARNING):
        another = computed + "// another kernel\n"
        for source in (computed, computed, another):
            CupyLike(inc).run(source, options)
    first, second = _warnings(caplog)
    assert first.startswith(f"CuPy cache: {CupyLike.name_of(computed, options)} compiled, not cached: "
                            "a computed #include the scanner cannot resolve")  # fmt: skip
    assert second.startswith(f"CuPy cache: {CupyLike.name_of(another, options)} compiled, not cached: ")


def test_include_options_that_cannot_be_scanned_compile_uncached_with_a_warning(tmp_path, caplog):
    _node(tmp_path / "a")
    cupy = CupyLike(tmp_path)
    (tmp_path / "my.h").write_text("#define VAL 1\n")
    options = ("-I" + str(tmp_path) + "\0more",)  # no path can hold a NUL
    with caplog.at_level(logging.WARNING):
        cupy.run(SOURCE, options)
    assert cupy.compiles == 1 and os.listdir(tmp_path / "a") == []
    assert tpc.stats()["cupy-local"].skipped == 1
    (message,) = _warnings(caplog)
    assert message.startswith(f"CuPy cache: headers of {CupyLike.name_of(SOURCE, options)} not scanned "
                              "(compiled, not cached): ")  # fmt: skip
    assert message.endswith("embedded null byte")


# -- the backend's edges ----------------------------------------------------------------------------


def _backend(directory: Path, chain: Any = None, **kwargs: Any) -> cupy_backend.TieredKernelCacheBackend:
    from tiered_progcache.chain.stats import TierCounters

    kwargs.setdefault("cupy_dirs", ())
    kwargs.setdefault("save_source", False)
    return cupy_backend.TieredKernelCacheBackend(directory, shared=lambda: chain, local=TierCounters(), **kwargs)


def test_the_seconds_cupy_compiled_are_from_a_missed_load_to_its_save(cubin, tmp_path):
    from support import FakeClock

    clock = FakeClock()
    backend = _backend(tmp_path / "a", clock=clock)

    def compile_with_cache(name: str) -> None:
        if backend.load(name) is None:
            clock.advance(2.5)  # NVRTC
            backend.save(name, cubin, "source")
        clock.advance(100)  # after the compile: not counted

    run = cupy_backend.compile_context(lambda source, options, name: compile_with_cache(name))
    run("source", (), NAME)
    assert backend.compile_seconds == 2.5
    run("source", (), NAME)  # a hit: nothing compiled
    assert backend.compile_seconds == 2.5
    run("source", (), OTHER)
    assert backend.compile_seconds == 5.0

    def broken() -> None:
        raise RuntimeError("the chain cannot be built")

    backend = cupy_backend.TieredKernelCacheBackend(tmp_path / "b", shared=broken, local=tpc._local, cupy_dirs=(),
                                                    save_source=False, clock=clock)  # fmt: skip
    run("source", (), NAME)  # the shared tiers failed: CuPy compiles, and that is timed too
    assert backend.compile_seconds == 2.5


def test_a_save_with_no_load_before_it_is_stored(cubin, tmp_path):
    backend = _backend(tmp_path / "a")
    cupy_backend.compile_context(lambda source, options: backend.save(NAME, cubin, source))("source", ())
    assert backend.load(NAME) == cubin and backend.compile_seconds == 0.0


def test_install_keeps_an_existing_cupy_directory_and_its_files(cubin, tmp_path):
    DiskKernelCacheBackend(str(tmp_path / "a")).save(NAME, cubin, "source")
    assert _node(tmp_path / "a").load(NAME) == cubin


def test_an_unreadable_local_entry_is_a_miss_the_shared_tier_answers(cubin, tmp_path, caplog):
    chain, _ = _seeded(cubin, tmp_path)
    (tmp_path / "b" / NAME).mkdir(parents=True)  # not a file CuPy could have written
    with caplog.at_level(logging.WARNING):
        assert _switch(tmp_path / "b").load(NAME) == cubin
    assert f"CuPy cache: local {NAME} unreadable (a miss): [Errno 21] Is a directory" in _warnings(caplog)[0]
    assert chain.stats()["remote"].hits == 1


def test_a_source_beside_an_unknown_name_is_cupy_s_own_doing(cubin, tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_SAVE_CUDA_SOURCE", "1")
    future = "ab" * 32 + ".cubin"
    _node(tmp_path / "a").save(future, cubin, "the source")
    assert (tmp_path / "a" / (future + ".cu")).read_text() == "the source"


def test_each_failure_is_one_warning_naming_the_entry_and_the_cause(cubin, tmp_path, caplog):
    chain, remote = _seeded(cubin, tmp_path)
    b = _switch(tmp_path / "b")
    _unwritable(tmp_path / "b")
    with caplog.at_level(logging.WARNING):
        assert b.load(NAME) == cubin
        b.save(OTHER, cubin, "source")
    unreadable, fetched, written = _warnings(caplog)
    assert unreadable.startswith(f"CuPy cache: local {NAME} unreadable (a miss): [Errno 20] Not a directory")
    assert fetched.startswith(f"CuPy cache: {NAME} fetched but not written locally: [Errno 17] File exists")
    assert written.startswith(f"CuPy cache: {OTHER} not written locally: [Errno 17] File exists")
    caplog.clear()

    def broken() -> None:
        raise RuntimeError("the chain cannot be built")

    c = cupy_backend.TieredKernelCacheBackend(tmp_path / "c", shared=broken, local=tpc._local, cupy_dirs=(),
                                              save_source=False)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert c.load(NAME) is None
        c.save(NAME, cubin, "source")
    assert _warnings(caplog) == [f"CuPy cache: {NAME} not fetched (a miss): the chain cannot be built",
                                 f"CuPy cache: {NAME} not uploaded: the chain cannot be built"]  # fmt: skip
    assert c.load(NAME) == cubin


def test_a_compile_faster_than_min_upload_compile_s_stays_local_as_compile_s_would(cubin, tmp_path):
    from support import FakeClock

    chain = _chain(tmp_path / "remote", min_upload_compile_s=1.0)
    clock = FakeClock()
    backend = _backend(tmp_path / "a", chain, clock=clock)

    def compile_with_cache(name: str, seconds: float) -> None:
        assert backend.load(name) is None
        clock.advance(seconds)
        backend.save(name, cubin, "source")

    run = cupy_backend.compile_context(lambda source, options, name, seconds: compile_with_cache(name, seconds))
    run("source", (), NAME, 0.25)  # cheaper to compile again elsewhere than to upload
    run("source", (), OTHER, 4.0)
    assert chain.flush(timeout=30)
    assert chain.stats()["remote"].writes == 1
    assert _backend(tmp_path / "b", chain).load(OTHER) == cubin
