"""The command on CuPy's kernel cache (``--cupy``): CuPy's own directory and the remote's ``cupy/`` namespace.

The directories hold CuPy's own files (written by CuPy's ``DiskKernelCacheBackend``);
the command runs in this process through its ``main`` (the subprocess path is
tests/triton's and tests/ops'), and what lands is read back with CuPy's backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy", exc_type=ImportError)

from cupy.cuda._compiler_cache import DiskKernelCacheBackend  # noqa: E402

from tiered_progcache.ops import cli  # noqa: E402
from tiered_progcache.cupy.cupynames import header_name, name_of  # noqa: E402
from tiered_progcache.stores.remote import RemoteProgramCache  # noqa: E402

from support import child_pythonpath

PLAIN = "0123456789abcdef0123456789abcdef01234567.cubin"
HEADERED = header_name("89abcdef0123456789abcdef0123456789abcdef.cubin", b"digest")
PAYLOADS = {PLAIN: b"\x7fELF" + b"a" * 3000, HEADERED: b"\x93CUPYNE\x00" + b"b" * 5000}


class Ran:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """The command's ``main`` on ``args``: (exit code, stdout, stderr), with no remote from the environment."""
    monkeypatch.delenv("TIERED_PROGCACHE_REMOTE", raising=False)

    def run(*args: str) -> Ran:
        capsys.readouterr()
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return run


def _cupy_dir(directory: Path) -> Path:
    cupy = DiskKernelCacheBackend(str(directory))
    for name, payload in PAYLOADS.items():
        cupy.save(name, payload, "source")
    return directory


def _read_back(directory: Path) -> dict[str, bytes | None]:
    cupy = DiskKernelCacheBackend(str(directory))
    return {name: cupy.load(name) for name in PAYLOADS}


def test_push_ls_warm_verify_export_import_prune_move_cupy_s_cache(tmp_path, run_cli):
    a = _cupy_dir(tmp_path / "a")
    remote = tmp_path / "remote"
    remote.mkdir()
    url = f"file://{remote}"
    pushed = run_cli("push", "--cupy", "--dir", str(a), "--remote", url)
    assert pushed.returncode == 0 and "pushed 2 CuPy kernels" in pushed.stdout, pushed.stderr
    assert {p.relative_to(remote).parts[0] for p in remote.rglob("*") if p.is_file()} == {"cupy"}
    assert not list(RemoteProgramCache.from_url(url).iter_entries())  # the program cache sees none of them
    listed = run_cli("ls", "--cupy", "--remote", url)
    assert listed.returncode == 0 and {line.split()[0] for line in listed.stdout.splitlines()} == {
        name_of(n) for n in PAYLOADS
    }, listed.stdout
    warmed = run_cli("warm", "--cupy", "--dir", str(tmp_path / "b"), "--remote", url)
    assert warmed.returncode == 0 and "warmed 2 CuPy kernels" in warmed.stdout, warmed.stderr
    assert _read_back(tmp_path / "b") == PAYLOADS  # CuPy's own backend reads what landed
    assert sorted(os.listdir(tmp_path / "b")) == sorted(PAYLOADS)  # CuPy's layout, nothing else
    verified = run_cli("verify", "--cupy", "--remote", url)
    assert verified.returncode == 0 and "2 entries" in verified.stdout and "0 bad" in verified.stdout, verified.stdout
    bundle = tmp_path / "cupy.tar"
    exported = run_cli("export", "--cupy", "--dir", str(a), str(bundle))
    assert exported.returncode == 0 and "exported 2 CuPy kernels" in exported.stdout, exported.stderr
    imported = run_cli("import", "--cupy", "--dir", str(tmp_path / "c"), str(bundle))
    assert imported.returncode == 0 and "imported 2 CuPy kernels" in imported.stdout, imported.stderr
    assert _read_back(tmp_path / "c") == PAYLOADS
    pruned = run_cli("prune", "--cupy", "--dir", str(tmp_path / "c"), "--max-bytes", "0", "--yes")
    assert pruned.returncode == 0 and "removed 2 of 2" in pruned.stdout, pruned.stdout + pruned.stderr
    assert os.listdir(tmp_path / "c") == []


def test_verify_names_a_cupy_file_that_fails_its_sha1(tmp_path, run_cli):
    a = _cupy_dir(tmp_path / "a")
    path = a / PLAIN
    path.write_bytes(path.read_bytes()[:-1] + b"!")
    verified = run_cli("verify", "--cupy", "--dir", str(a))
    assert verified.returncode != 0 and "1 bad" in verified.stdout, verified.stdout + verified.stderr


def test_stats_cupy_shows_the_hits_a_process_s_backend_reported(tmp_path, run_cli):
    a = _cupy_dir(tmp_path / "a")
    script = (
        "import tiered_progcache.cupy as tpc\n"
        f"assert tpc.install({str(a)!r})\n"
        "from cupy.cuda import compiler\n"
        f"for name in {sorted(PAYLOADS)!r} * 2: assert compiler._kernel_cache_backend.load(name)\n"
        f"assert compiler._kernel_cache_backend.load({'f' * 40 + '.cubin'!r}) is None\n"
    )
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    env.pop("TIERED_PROGCACHE_REMOTE", None)
    node = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert node.returncode == 0, node.stderr
    stats = run_cli("stats", "--cupy", "--dir", str(a), "--json")
    assert stats.returncode == 0, stats.stderr
    cumulative = json.loads(stats.stdout)["local"]["cumulative"]
    assert (cumulative["hits"], cumulative["misses"], cumulative["lookups"], cumulative["reports"]) == (
        {"cupy-local": 4}, 1, 5, 1)  # fmt: skip
    people = run_cli("stats", "--cupy", "--dir", str(a))
    assert "cupy-local" in people.stdout and "hits                    4" in people.stdout, people.stdout


def test_triton_and_cupy_together_is_a_usage_error(tmp_path, run_cli):
    proc = run_cli("ls", "--cupy", "--triton", "--dir", str(tmp_path))
    assert proc.returncode == 2 and "--triton and --cupy name two caches: pick one" in proc.stderr
