"""The tiered-progcache command, run for real (``python -m tiered_progcache``) against a local dir.

Each subprocess pays for importing cuda.core (about a quarter second), so tests share
their setup and check several things per run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cuda.core import Program, ProgramOptions

from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.samples import matmul_source
from tiered_progcache.stores.store import entry_name

from support import assert_one_line_error, run_cli

DAY = 86400.0


@pytest.fixture(scope="module")
def cubins() -> list[bytes]:
    """Two real cubins of the sample kernel (compiled on the CPU by NVRTC)."""
    return [
        Program(matmul_source(tile), "c++", ProgramOptions(arch="sm_90", std="c++17")).compile("cubin").code
        for tile in (16, 32)
    ]


@pytest.fixture
def cache_dir(tmp_path, cubins) -> Path:
    """A local dir with four entries: cubins 40 and 10 days old, a fresh cubin, and a truncated one."""
    root = tmp_path / "cache"
    local = LocalDir(root)
    now = time.time()
    for key, data, age in (
        (b"old", cubins[0], 40 * DAY),
        (b"mid", cubins[1], 10 * DAY),
        (b"new", cubins[0], 0.0),
        (b"cut", cubins[1][:1000], 5 * DAY),
    ):
        name = entry_name(key)
        local.write_entry(name, data)
        os.utime(local.path_for(name), (now - age, now - age))
    return root


def names_in(root: Path) -> set[str]:
    return {entry.name for entry in LocalDir(root).iter_entries()}


# -- usage errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["bogus"], {}, "invalid choice"),
        (["prune"], {}, "--older-than"),
        (["prune", "--older-than", "30"], {}, "not a duration"),
        (["prune", "--max-bytes", "lots"], {}, "not a size"),
        (["clear"], {}, "--local"),
        (["warm"], {}, "no remote configured"),
        (["warm", "--remote", "file:///nowhere", "not-a-name"], {}, "not an entry name"),
        (["warm", "--remote", "ab" * 32], {}, "no remote configured"),  # a name, not a URL: a bare --remote
        (["ls", "--", "x"], {}, "only for stats --run"),
        (["stats", "--run"], {}, "needs a command"),
        (["stats", "--run", "--", "true"], {"TIERED_PROGCACHE_REMOTE_TIMEOUT": "soon"}, "REMOTE_TIMEOUT"),
        (["config", "--remote-options", "[1, 2]"], {}, "JSON object"),
        (["config", "--remote-options", "{nope"], {}, "not valid JSON"),
        (["config"], {"TIERED_PROGCACHE_MAX_LOCAL_BYTES": "lots"}, "TIERED_PROGCACHE_MAX_LOCAL_BYTES"),
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path, args, env, needle):
    proc = run_cli(*args, env={"TIERED_PROGCACHE_DIR": str(tmp_path / "c"), **env})
    line = assert_one_line_error(proc, 2)
    assert needle in line
    assert line.startswith("tiered-progcache")


def test_help_names_every_command():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("config", "stats", "ls", "warm", "push", "prune", "verify", "clear"):
        assert command in proc.stdout
    assert "config --help" in proc.stdout  # where the settings' flags are listed, once


# -- config --------------------------------------------------------------------------------------


def test_config_shows_each_value_and_where_it_came_from(tmp_path):
    env = {"TIERED_PROGCACHE_DIR": str(tmp_path / "from-env"), "TIERED_PROGCACHE_REMOTE_TIMEOUT": "7.5"}
    remote = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    proc = run_cli("config", "--remote", remote, "--remote-options", '{"auto_mkdir": true, "secret": "hunter2"}',
                   env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert str(tmp_path / "from-env") in rows["local_dir"] and rows["local_dir"].endswith(" env TIERED_PROGCACHE_DIR")
    assert remote in rows["remote"] and rows["remote"].endswith(" flag --remote")
    assert "7.5 s" in rows["remote_timeout"] and rows["remote_timeout"].endswith(" env TIERED_PROGCACHE_REMOTE_TIMEOUT")
    assert rows["strict"].split() == ["strict", "False", "default"]
    assert rows["max_local_bytes"].split() == ["max_local_bytes", "no", "limit", "default"]
    assert "hunter2" not in proc.stdout  # secrets in storage options are masked

    as_json = json.loads(run_cli("config", "--json", "--dir", str(tmp_path / "flag"), env=env).stdout)
    assert as_json["local_dir"] == {"value": str(tmp_path / "flag"), "source": "flag --dir"}
    assert as_json["remote"] == {"value": None, "source": "default"}


def test_config_masks_nested_secret_options_and_a_password_in_the_remote_url(tmp_path):
    options = {"client_kwargs": {"region_name": "eu-west-1", "aws_secret_access_key": "hunter2"}, "anon": False}
    remote = "sftp://alice:hunter2@build-host/kernels"
    for extra in ([], ["--json"]):
        proc = run_cli("config", *extra, "--remote", remote, "--remote-options", json.dumps(options),
                       env={"TIERED_PROGCACHE_DIR": str(tmp_path / "c")})  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "hunter2" not in proc.stdout
        assert "sftp://alice:***@build-host/kernels" in proc.stdout and "eu-west-1" in proc.stdout
    shown = json.loads(proc.stdout)
    assert shown["remote_options"]["value"]["client_kwargs"] == {"region_name": "eu-west-1", "aws_secret_access_key": "***"}


def test_a_bare_remote_after_the_command_keeps_the_url_given_before_it(tmp_path):
    remote = (tmp_path / "bucket").as_uri()
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a missing file:// root is an error, not created
    proc = run_cli("--remote", remote, "ls", "--remote", "--long", env={"TIERED_PROGCACHE_DIR": str(tmp_path / "c")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"total 0 kernels (+0 metadata), 0 B in {remote}"


# -- ls, stats -----------------------------------------------------------------------------------


def test_ls_and_stats_show_entries_sizes_and_ages(cache_dir, cubins):
    env = {"TIERED_PROGCACHE_DIR": str(cache_dir)}
    proc = run_cli("ls", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines()}
    assert set(lines) == names_in(cache_dir)
    assert lines[entry_name(b"old")][3:5] == ["40d", "kernel"]  # name, size, age, kind, kernel names
    assert lines[entry_name(b"mid")][3] == "10d"
    assert lines[entry_name(b"cut")][1:3] == ["1000", "B"]

    long = run_cli("ls", "--long", env=env).stdout.splitlines()
    assert long[0].split() == ["NAME", "BYTES", "MODIFIED", "LAST", "READ", "AGE", "HOST", "WRITTEN", "COMPILE", "CODE",
                               "KIND", "KERNELS"]  # fmt: skip
    assert all(line.split()[-6:-2] == ["-", "-", "-", "-"] for line in long[1:-1])  # written without manifests
    assert any(line.startswith(entry_name(b"old")) and f" {len(cubins[0])} " in line for line in long)
    total = sum(len(c) for c in cubins) + len(cubins[0]) + 1000
    assert long[-1].startswith("total 4 kernels (+0 metadata)")

    stats = json.loads(run_cli("stats", "--json", env=env).stdout)
    held = {k: stats["local"][k] for k in ("where", "entries", "kernels", "metadata", "bytes", "max_bytes")}
    assert held == {"where": str(cache_dir), "entries": 4, "kernels": 4, "metadata": 0, "bytes": total, "max_bytes": None}
    table = run_cli("stats", env=env).stdout
    assert "local" in table and " 4 " in table


# -- prune ---------------------------------------------------------------------------------------


def test_prune_dry_run_deletes_nothing_and_yes_deletes_the_oldest(cache_dir, cubins):
    env = {"TIERED_PROGCACHE_DIR": str(cache_dir)}
    before = names_in(cache_dir)

    dry = run_cli("prune", "--older-than", "30d", env=env)
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {entry_name(b'old')}" in dry.stdout
    assert "would remove 1 of 4 entries" in dry.stdout and "--yes" in dry.stdout
    assert names_in(cache_dir) == before

    # Keep at most what the two newest entries take: the 40- and 10-day-old ones must go, oldest first.
    cap = str(len(cubins[0]) + 1000)
    dry = run_cli("prune", "--max-bytes", cap, env=env)
    would = [line.split()[2] for line in dry.stdout.splitlines() if line.startswith("would remove ")][:-1]
    assert would == [entry_name(b"old"), entry_name(b"mid")]
    assert names_in(cache_dir) == before

    done = run_cli("prune", "--older-than", "30d", "--yes", env=env)
    assert done.returncode == 0, done.stderr
    assert "removed 1 of 4 entries" in done.stdout
    assert names_in(cache_dir) == before - {entry_name(b"old")}

    done = run_cli("prune", "--max-bytes", cap, "--yes", env=env)
    assert names_in(cache_dir) == {entry_name(b"new"), entry_name(b"cut")}


# -- verify, clear -------------------------------------------------------------------------------


def test_verify_local_finds_a_truncated_cubin_and_deletes_it_on_request(cache_dir):
    env = {"TIERED_PROGCACHE_DIR": str(cache_dir)}
    proc = run_cli("verify", env=env)
    assert proc.returncode == 1
    assert f"BAD {entry_name(b'cut')}: truncated ELF" in proc.stdout
    assert "checked 4 entries" in proc.stdout and "1 bad" in proc.stdout
    assert entry_name(b"cut") in names_in(cache_dir)

    proc = run_cli("verify", "--delete-bad", env=env)
    assert proc.returncode == 1 and "deleted 1" in proc.stdout
    assert entry_name(b"cut") not in names_in(cache_dir)
    proc = run_cli("verify", env=env)
    assert proc.returncode == 0 and "checked 3 entries" in proc.stdout and "0 bad" in proc.stdout


def test_clear_local(cache_dir):
    proc = run_cli("clear", "--local", env={"TIERED_PROGCACHE_DIR": str(cache_dir)})
    assert proc.returncode == 0, proc.stderr
    assert "4 entries" in proc.stdout
    assert names_in(cache_dir) == set()


# -- stats --run ---------------------------------------------------------------------------------

_CHILD = """
import sys
from cuda.core import Program, ProgramOptions
from tiered_progcache import TieredProgramCache
src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }'
def compile(cache):
    return Program(src, "c++", ProgramOptions(arch="sm_90")).compile("cubin", cache=cache)
cache = TieredProgramCache.from_env()
compile(cache)   # cold dir: memory miss, local miss, compile, write to both (warm dir: local hit, promoted)
compile(cache)   # memory hit
compile(TieredProgramCache.from_env())   # a second cache: memory miss, local hit, promoted into memory
sys.exit(int(sys.argv[1]))
"""


def test_stats_run_counts_the_hits_of_a_child_that_compiles(tmp_path):
    env = {"TIERED_PROGCACHE_DIR": str(tmp_path / "cache")}
    first = run_cli("stats", "--json", "--run", "--", sys.executable, "-c", _CHILD, "0", env=env)
    assert first.returncode == 0, first.stderr
    run = json.loads(first.stdout)
    assert (run["exit_code"], run["processes"], run["caches"]) == (0, 1, 2)
    memory, local = run["tiers"]["memory"], run["tiers"]["local"]
    # A promotion is a write too: memory is written by the compile and by the second cache's promotion.
    assert (memory["hits"], memory["misses"], memory["writes"], memory["promotions"]) == (1, 2, 2, 1)
    assert (local["hits"], local["misses"], local["writes"], local["promotions"]) == (1, 1, 1, 0)
    assert (run["hits"], run["misses"]) == (2, 1)
    assert memory["bytes_read"] > 1000 and local["bytes_written"] == local["bytes_read"] == memory["bytes_read"]

    # Run again: the local dir is warm, so the child compiles nothing; its exit code comes back.
    second = run_cli("stats", "--run", "--", sys.executable, "-c", _CHILD, "3", env=env)
    assert second.returncode == 3, second.stderr
    assert "exit code    3" in second.stdout
    assert "hits         3 (100.0% of 3 lookups)" in second.stdout
    assert "misses       0 (missed by every tier)" in second.stdout
    rows = {line.split()[0]: line.split() for line in second.stdout.splitlines() if line.startswith(("memory", "local"))}
    assert rows["memory"][1:5] == ["1", "2", "2", "2"]  # hits, misses, writes, promotions
    assert rows["local"][1:5] == ["2", "0", "0", "0"]


def test_stats_run_sums_concurrent_children_and_reports_commands_without_a_cache(tmp_path):
    env = {"TIERED_PROGCACHE_DIR": str(tmp_path / "cache")}
    # Four grandchildren at once, each with one cache and one lookup: four lines, summed.
    parent = (
        "import subprocess, sys\n"
        "code = 'from tiered_progcache import TieredProgramCache as T; T.from_env().get(b\"k\")'\n"
        "procs = [subprocess.Popen([sys.executable, '-c', code]) for _ in range(4)]\n"
        "sys.exit(max(p.wait() for p in procs))\n"
    )
    proc = run_cli("stats", "--json", "--run", "--", sys.executable, "-c", parent, env=env)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout)
    assert (run["processes"], run["caches"]) == (4, 4)
    assert run["tiers"]["memory"]["misses"] == run["tiers"]["local"]["misses"] == 4

    proc = run_cli("stats", "--run", "--", sys.executable, "-c", "pass", env=env)
    assert proc.returncode == 0
    assert "no cache reported" in proc.stdout

    killed = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    proc = run_cli("stats", "--run", "--", sys.executable, "-c", killed, env=env)
    assert proc.returncode == 128 + 15  # like a shell: 128 + the signal
    assert "exit code    -15 (killed by SIGTERM)" in proc.stdout

    proc = run_cli("stats", "--run", "--", str(tmp_path / "no-such-command"), env=env)
    assert proc.returncode == 127
    assert "command not found" in proc.stderr and "Traceback" not in proc.stderr


# -- file:// remote, without tqdm ----------------------------------------------------------------


def test_push_and_warm_on_a_file_remote_work_without_tqdm(tmp_path, cache_dir):
    """tqdm is only for the bar: with it unimportable, --progress says so once and the transfer still runs."""
    remote = (tmp_path / "nfs" / "kernels").as_uri()
    (tmp_path / "nfs" / "kernels").mkdir(parents=True)  # a missing file:// root is an error, not created
    no_tqdm = (
        "import sys; sys.modules['tqdm'] = None\n"
        "from tiered_progcache.ops.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )

    def cli_without_tqdm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", no_tqdm, *args], capture_output=True, text=True, timeout=120)

    pushed = cli_without_tqdm("push", "--dir", str(cache_dir), "--remote", remote, "--progress")
    assert pushed.returncode == 1, pushed.stderr  # the truncated cubin is never signed and uploaded
    assert "pushed 3 kernels (+0 metadata" in pushed.stdout and "1 failed" in pushed.stdout
    assert "tqdm is not installed" in pushed.stderr and "Traceback" not in pushed.stderr

    node = tmp_path / "node"
    warmed = cli_without_tqdm("warm", "--dir", str(node), "--remote", remote)
    assert warmed.returncode == 0, warmed.stderr
    assert "warmed 3 kernels (+0 metadata" in warmed.stdout and warmed.stderr == ""
    assert names_in(node) == names_in(cache_dir) - {entry_name(b"cut")}
