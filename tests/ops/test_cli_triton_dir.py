"""Issue 28 item 19: ``--triton`` acts on Triton's directory (``TRITON_CACHE_DIR``) even when ``TIERED_PROGCACHE_DIR`` is set.

The documented CI recipe sets ``TIERED_PROGCACHE_DIR`` for the whole job; before, ``ls --triton``
listed the program cache's ``header-scans/`` file, ``clear --triton --local`` deleted it and left
Triton's cache alone, and ``push --triton`` pushed 0 files. Neither directory needs Triton itself:
Triton's layout is ``<dir>/<key>/<file>``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import assert_one_line_error, run_cli

from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.triton.tritonnames import name_of

KEY = "A" * 52  # Triton's base32 key form


@pytest.fixture
def dirs(tmp_path) -> tuple[Path, Path, dict[str, str]]:
    program = tmp_path / "progcache"
    (program / "header-scans").mkdir(parents=True)
    (program / "header-scans" / "scan").write_bytes(b"the program cache's file")
    triton = tmp_path / "triton"
    (triton / KEY).mkdir(parents=True)
    (triton / KEY / "kernel.cubin").write_bytes(b"\x7fELF triton cubin")
    env = {"TIERED_PROGCACHE_DIR": str(program), "TRITON_CACHE_DIR": str(triton)}
    return program, triton, env


def test_ls_and_clear_with_triton_act_on_tritons_directory_only(dirs):
    program, triton, env = dirs
    listed = run_cli("ls", "--triton", env=env)
    assert listed.returncode == 0, listed.stderr
    listed_names = [field for line in listed.stdout.splitlines() for field in line.split()]
    assert name_of(KEY, "kernel.cubin") in listed_names  # Triton's file, listed under its kernel
    assert "header-scans" not in listed.stdout and "scan" not in listed_names  # never the program cache's
    cleared = run_cli("clear", "--triton", "--local", env=env)
    assert cleared.returncode == 0, cleared.stderr
    assert str(triton) in cleared.stdout and "(1 entries)" in cleared.stdout
    assert not (triton / KEY / "kernel.cubin").exists()
    assert (program / "header-scans" / "scan").read_bytes() == b"the program cache's file"  # untouched


def test_push_with_triton_pushes_tritons_files(dirs, tmp_path):
    _, _, env = dirs
    remote = tmp_path / "remote"
    remote.mkdir()
    pushed = run_cli("push", "--triton", "--remote", f"file://{remote}", env=env)
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.startswith("pushed 1 Triton files"), pushed.stdout
    shared = RemoteProgramCache.from_url(f"file://{remote}", namespace="triton")
    try:
        assert [e.name for e in shared.iter_entries()] == [name_of(KEY, "kernel.cubin")]  # Triton's, not header-scans/
    finally:
        shared.close()


def test_dir_given_on_the_command_line_still_wins(dirs, tmp_path):
    _, _, env = dirs
    other = tmp_path / "other"
    (other / KEY).mkdir(parents=True)
    (other / KEY / "a.json").write_bytes(b"{}")
    listed = run_cli("ls", "--triton", "--dir", str(other), env=env)
    assert name_of(KEY, "a.json") in [field for line in listed.stdout.splitlines() for field in line.split()]
    assert name_of(KEY, "kernel.cubin") not in listed.stdout  # TRITON_CACHE_DIR's file: --dir wins


def test_triton_on_the_program_caches_directory_is_refused(dirs):
    program, _, env = dirs
    for args in (["ls", "--triton"], ["clear", "--triton", "--local"]):
        result = run_cli(*args, env={**env, "TRITON_CACHE_DIR": str(program)})
        line = assert_one_line_error(result, 2)
        assert "TIERED_PROGCACHE_DIR" in line and "TRITON_CACHE_DIR" in line
    assert (program / "header-scans" / "scan").exists()
