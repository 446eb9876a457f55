"""What a first-time operator trips over (issue 19), run for real: ``python -m tiered_progcache`` in subprocesses.

Mistyped remotes, the Prometheus textfile, kernels counted apart from metadata, short
names, the ccache-like ``stats`` and its counters across processes, the help text and
``config --check``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.stores.remote import RemoteProgramCache

from support import assert_one_line_error, run_cli, run_cli_here

DOCS = Path(__file__).resolve().parent.parent.parent / "docs"

# Two kernels compiled by compile() with name expressions: each leaves a binary, a manifest and a symbol map.
_COMPILE_TWO = """
import tiered_progcache
from cuda.core import ProgramOptions
for n in (2, 3):
    src = f'template <int N> __global__ void scale(float* x) {{ x[threadIdx.x] *= N; }}'
    tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_90", name=f"k{n}"), "cubin",
                             name_expressions=(f"scale<{n}>",))
"""


@pytest.fixture(scope="module")
def two_kernels(tmp_path_factory) -> Path:
    """A local directory that compile() filled with 2 kernels, 2 manifests and 2 symbol maps."""
    root = tmp_path_factory.mktemp("two") / "cache"
    proc = subprocess.run([sys.executable, "-c", _COMPILE_TWO], env={**os.environ, "TIERED_PROGCACHE_DIR": str(root)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return root


# -- 1. mistyped remotes ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["warm"], ["ls", "--remote"], ["explain", "0" * 64, "--remote"]])
def test_mistyped_remotes_exit_1_and_create_nothing(tmp_path, command):
    missing = tmp_path / "nfs" / "kernels"
    (tmp_path / "nfs").mkdir()
    for url, says in (("notaurl", "has no scheme"), ("s3:/bad-url", "did you mean s3://bad-url"),
                      (missing.as_uri(), "does not exist")):  # fmt: skip
        proc = run_cli(*command, "--dir", str(tmp_path / "local"), "--remote", url, cwd=tmp_path)
        assert says in assert_one_line_error(proc, rc=1), (url, proc.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nfs"], "a mistyped remote created something"
    assert not any((tmp_path / "nfs").iterdir())


def test_a_missing_file_root_is_created_only_when_asked_and_never_by_a_reading_command(tmp_path, two_kernels):
    root = tmp_path / "kernels"
    proc = run_cli("ls", "--remote", root.as_uri(), "--create-remote-root")
    assert_one_line_error(proc, rc=1)
    assert not root.exists()
    proc = run_cli("push", "--dir", str(two_kernels), "--remote", root.as_uri(),
                   env={"TIERED_PROGCACHE_CREATE_REMOTE_ROOT": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "pushed 2 kernels (+4 metadata" in proc.stdout


def test_library_refuses_a_url_without_a_scheme_and_a_missing_file_root(tmp_path):
    from tiered_progcache.errors import RemoteURLError

    with pytest.raises(RemoteURLError, match="remote: remote URL 'notaurl' has no scheme"):
        TieredProgramCache(tmp_path / "local", remote="notaurl")
    with pytest.raises(ValueError, match="did you mean s3://bad-url"):
        TieredProgramCache(tmp_path / "local", remote="s3:/bad-url")
    missing = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RemoteProgramCache.from_url(missing.as_uri(), strict=True, create_root=False)
    with TieredProgramCache(tmp_path / "local", remote=missing.as_uri()) as cache:  # lenient: local-only, warned
        cache[b"k"] = b"v"
        assert cache.flush(10) in (True, False)
    assert not missing.exists(), "a write recreated a missing file:// root"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TieredProgramCache(tmp_path / "local", remote=missing.as_uri(), strict=True)
    TieredProgramCache(tmp_path / "local", remote=missing.as_uri(), strict=True, create_remote_root=True).close()
    assert missing.is_dir()
    remote = RemoteProgramCache.from_url(missing.as_uri(), strict=True)  # code that builds a tier: created
    remote.close()
    gone = tmp_path / "gone"
    remote = RemoteProgramCache.from_url(gone.as_uri(), strict=True)
    gone.rmdir()  # the share went away under a running tier: a write fails, and creates nothing
    with pytest.raises(OSError):
        remote.write_entry("ab" * 32, b"payload")
    assert not gone.exists()


# -- 2. the Prometheus textfile -------------------------------------------------------------------


def test_prometheus_file_is_written_whole_and_the_jobs_stdout_is_left_alone(tmp_path):
    parser = pytest.importorskip("prometheus_client.parser")
    target = tmp_path / "textfile" / "job.prom"
    target.parent.mkdir()
    job = "print('epoch 1: loss 0.5'); print('done')"
    proc = run_cli("stats", "--dir", str(tmp_path / "cache"), "--run", "--prometheus-file", str(target), "--",
                   sys.executable, "-c", job)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "epoch 1: loss 0.5\ndone\n"
    families = {f.name for f in parser.text_string_to_metric_families(target.read_text())}
    assert families, "the textfile holds no metric"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # node_exporter runs as another user
    assert [p.name for p in target.parent.iterdir()] == ["job.prom"]  # the staged file was renamed, not left


# -- 4. kernels apart from metadata -----------------------------------------------------------------


def test_manifests_and_symbol_maps_are_counted_apart_from_kernels(tmp_path, two_kernels):
    env = {"TIERED_PROGCACHE_DIR": str(two_kernels)}
    local = json.loads(run_cli("stats", "--json", env=env).stdout)["local"]
    assert (local["entries"], local["kernels"], local["metadata"]) == (6, 2, 4)
    rows = [line.split() for line in run_cli("ls", env=env).stdout.splitlines()]
    kinds = sorted(row[4] for row in rows)
    assert kinds == ["kernel", "kernel", "manifest", "manifest", "symbols", "symbols"]
    assert sorted(row[5] for row in rows if row[4] == "symbols") == ["scale<2>", "scale<3>"]
    assert all(row[5] == "scale" for row in rows if row[4] == "kernel")  # from the manifest
    proc = run_cli("export", str(tmp_path / "b.tar"), "--format", "tar", env=env)
    assert "exported 2 kernels (+4 metadata" in proc.stdout, proc.stdout
    remote = tmp_path / "remote"
    remote.mkdir()
    assert run_cli("push", "--remote", remote.as_uri(), env=env).returncode == 0
    proc = run_cli("warm", "--dir", str(tmp_path / "node"), "--remote", remote.as_uri())
    assert "warmed 2 kernels (+2 metadata" in proc.stdout, proc.stdout  # manifests stay behind, symbol maps come


def test_looking_at_a_directory_never_counts_as_using_its_entries(tmp_path, two_kernels, capsys):
    """stats, ls -l, explain, verify, export and push read entries, none of them as a lookup: each file's access time
    stays where it was, so `prune --older-than` still finds what no compile read for weeks (on a relatime mount the
    first read of a file would set it to now, and a daily `stats --prometheus-file` would keep every entry)."""
    root = tmp_path / "cache"
    shutil.copytree(two_kernels, root)
    files = sorted(p for p in (root / "entries").rglob("*") if p.is_file())
    old_ns = 1_000_000_000 * 1_000_000_000  # 2001
    for path in files:
        os.utime(path, ns=(old_ns, old_ns))
    env = {"TIERED_PROGCACHE_DIR": str(root)}
    kernel = next(line.split()[0] for line in run_cli_here(capsys, "ls", env=env).stdout.splitlines()
                  if " kernel " in line)  # fmt: skip
    (tmp_path / "remote").mkdir()
    for command in (["stats"], ["ls", "-l"], ["explain", kernel], ["verify"],
                    ["export", str(tmp_path / "b.tar"), "--format", "tar"],
                    ["push", "--remote", (tmp_path / "remote").as_uri()]):  # fmt: skip
        assert run_cli_here(capsys, *command, env=env).returncode == 0, command
    assert [os.stat(path).st_atime_ns for path in files] == [old_ns] * len(files) == [old_ns] * 6
    proc = run_cli_here(capsys, "prune", "--older-than", "7d", env=env)
    assert "would remove 6 of 6 entries" in proc.stdout, proc.stdout


# -- 5. one name for an entry --------------------------------------------------------------------------


def test_unique_prefixes_are_accepted_and_ambiguous_ones_say_how_many(tmp_path, two_kernels):
    env = {"TIERED_PROGCACHE_DIR": str(two_kernels)}
    kernel = next(line.split()[0] for line in run_cli("ls", env=env).stdout.splitlines() if " kernel " in line)
    proc = run_cli("explain", kernel[:8].upper(), env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"entry         {kernel}\n")
    local = LocalDir(tmp_path / "twins")
    for tail in ("a", "b"):
        local.write_entry("deadbeef" + tail * 56, b"x")
    line = assert_one_line_error(run_cli("explain", "deadbeef", "--dir", str(local.root)))
    assert "ambiguous" in line and "2 entries" in line
    assert_one_line_error(run_cli("explain", "deadbee", "--dir", str(local.root)))  # under 8 digits
    line = assert_one_line_error(run_cli("explain", "0123abcd", "--dir", str(local.root)), rc=1)
    assert "no entry" in line


def test_explain_remote_then_name_and_ls_long_fed_to_warm(tmp_path, two_kernels):
    env = {"TIERED_PROGCACHE_DIR": str(two_kernels)}
    remote = tmp_path / "remote"
    remote.mkdir()
    assert run_cli("push", "--remote", remote.as_uri(), env=env).returncode == 0
    kernel = next(line.split()[0] for line in run_cli("ls", env=env).stdout.splitlines() if " kernel " in line)
    for argv, extra in ((["explain", "--remote", remote.as_uri(), kernel[:10]], {}),
                        (["explain", "--remote", kernel], {"TIERED_PROGCACHE_REMOTE": remote.as_uri()})):  # fmt: skip
        proc = run_cli(*argv, env={**env, **extra})
        assert proc.returncode == 0, (argv, proc.stderr)
        assert f"entry         {kernel}" in proc.stdout
    listing = run_cli("ls", "-l", env=env).stdout
    node = tmp_path / "node"
    proc = subprocess.run([sys.executable, "-m", "tiered_progcache", "warm", "--names-from", "-", "--dir", str(node),
                           "--remote", remote.as_uri()], input=listing, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "warmed 2 kernels (+4 metadata" in proc.stdout


def test_the_explain_log_prints_the_name_ls_prints():
    from tiered_progcache.compiling.explain import Explanation

    name = "ab" * 32
    shown = Explanation(name, True, "local", "/x", None, None, (), (), 0, ()).one_line()  # type: ignore[arg-type]
    assert shown.startswith(f"hit {name}:")


# -- 6. stats like ccache -s, counted across processes ---------------------------------------------------

# Each process: REPORTS caches, each with 3 lookups (1 local hit of a stored entry, 2 misses), closed (one report each).
_LOOKUPS = """
import sys
from tiered_progcache import TieredProgramCache
root, reports = sys.argv[1], int(sys.argv[2])
for n in range(reports):
    with TieredProgramCache(root) as cache:
        cache.get(b"stored"); cache.get(b"absent"); cache.get(b"also absent")
"""


def test_cumulative_counters_from_two_concurrent_processes_add_up_exactly(tmp_path):
    root = tmp_path / "cache"
    with TieredProgramCache(root) as cache:
        cache[b"stored"] = b"payload"
    assert run_cli("stats", "--zero", "--dir", str(root)).returncode == 0
    reports = 40
    children = [subprocess.Popen([sys.executable, "-c", _LOOKUPS, str(root), str(reports)]) for _ in range(2)]
    assert [child.wait(timeout=120) for child in children] == [0, 0]
    totals = json.loads(run_cli("stats", "--json", "--dir", str(root)).stdout)["local"]["cumulative"]
    assert totals["reports"] == 2 * reports
    assert totals["lookups"] == 2 * reports * 3
    assert totals["hits"] == {"memory": 0, "local": 2 * reports}
    assert totals["misses"] == 2 * reports * 2
    text = run_cli("stats", "--dir", str(root)).stdout
    assert f"hits                    {2 * reports} (33.3% of {6 * reports} lookups)" in text
    assert run_cli("stats", "--zero", "--dir", str(root)).returncode == 0
    assert json.loads(run_cli("stats", "--json", "--dir", str(root)).stdout)["local"]["cumulative"]["lookups"] == 0


def test_stats_shows_nvrtc_runs_seconds_saved_and_the_cap(tmp_path, two_kernels):
    env = {"TIERED_PROGCACHE_DIR": str(tmp_path / "cache")}
    first = run_cli("stats", "--run", "--", sys.executable, "-c", _COMPILE_TWO, env=env)
    assert "NVRTC runs   2 (" in first.stdout, first.stdout
    again = run_cli("stats", "--json", "--run", "--", sys.executable, "-c", _COMPILE_TWO, env=env)
    assert json.loads(again.stdout)["compiles"] == 0
    proc = run_cli("stats", "--max-local-bytes", "1K", env=env)
    assert "NVRTC runs              2 (" in proc.stdout
    assert "WARNING: over the cap" in proc.stdout and "over its cap" in proc.stderr
    saved = json.loads(run_cli("stats", "--json", env=env).stdout)["local"]["cumulative"]["saved_seconds"]
    assert saved > 0
    under = run_cli("stats", "--max-local-bytes", "10G", env=env)
    assert "WARNING" not in under.stdout and "(0.0%)" in under.stdout


def test_a_fresh_nodes_hits_from_the_remote_are_shown_as_hits_of_no_known_compile_time(tmp_path):
    """Their manifests stay on the remote, so the seconds saved leave them out, and every report says how many."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    remote = {"TIERED_PROGCACHE_REMOTE": bucket.as_uri()}
    first = run_cli("stats", "--run", "--", sys.executable, "-c", _COMPILE_TWO,
                    env={**remote, "TIERED_PROGCACHE_DIR": str(tmp_path / "node-a")})
    run_line = r"\nNVRTC runs   2 \(\d+\.\d\d s compiling; \d+\.\d\d s saved by hits\)\n"
    assert re.search(run_line, first.stdout), first.stdout
    fresh = {**remote, "TIERED_PROGCACHE_DIR": str(tmp_path / "node-b")}
    table = run_cli("stats", "--run", "--", sys.executable, "-c", _COMPILE_TWO, env=fresh).stdout
    assert "NVRTC runs   0 (0.00 s compiling; 0.00 s saved by hits; and 2 hits of no known compile time (the " \
           "manifest stayed on the remote))" in table, table
    again = json.loads(run_cli("stats", "--json", "--run", "--", sys.executable, "-c", _COMPILE_TWO, env=fresh).stdout)
    assert (again["compiles"], again["saved_seconds"], again["hits_without_compile_time"]) == (0, 0, 2)
    directory = run_cli("stats", env=fresh).stdout
    assert "0.00 s (what the hits' entries took to compile); and 4 hits of no known compile time" in directory
    from prometheus_client.parser import text_string_to_metric_families

    def unpriced(text: str) -> list[float]:
        return [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "tiered_progcache_hits_without_compile_time_total"]

    assert unpriced(run_cli("stats", "--prometheus", env=fresh).stdout) == [4]  # the directory's, summed
    ran = run_cli("stats", "--run", "--prometheus", "--", sys.executable, "-c", _COMPILE_TWO, env=fresh).stdout
    assert unpriced(ran) == [2]


def test_hits_of_no_known_compile_time_are_said_in_the_number_they_are():
    from tiered_progcache.ops.cli import _unpriced

    tail = " of no known compile time (the manifest stayed on the remote)"
    assert (_unpriced(0), _unpriced(1), _unpriced(2)) == ("", "; and 1 hit" + tail, "; and 2 hits" + tail)


# -- 11, 12. help, config ---------------------------------------------------------------------------------


def test_settings_flags_are_listed_once_in_config_help():
    ls_help = run_cli("ls", "--help").stdout
    assert "--signing-key-file PATH" not in ls_help and "--transfer-concurrency" not in ls_help
    body = ls_help.split("options:", 1)[1]
    assert body.index("--long") < body.index("--remote")  # its own options first
    assert "config --help" in ls_help
    config_help = run_cli("config", "--help").stdout
    assert "--signing-key-file" in config_help and "--create-remote-root" in config_help


def test_config_names_flags_and_check_tries_the_key_file_and_the_remote(tmp_path):
    rows = json.loads(run_cli("config", "--json", "--dir", str(tmp_path)).stdout)
    assert rows["local_dir"]["source"] == "flag --dir"
    key = tmp_path / "key"
    remote = tmp_path / "remote"
    proc = run_cli("config", "--check", "--signing-key-file", str(key), "--remote", remote.as_uri())
    assert proc.returncode == 1
    assert "check signing key file" in proc.stdout and "FAILED" in proc.stdout
    assert f"check remote {remote.as_uri()}: FAILED" in proc.stdout and not remote.exists()
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    remote.mkdir()
    proc = run_cli("config", "--check", "--signing-key-file", str(key), "--remote", remote.as_uri())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 2


def test_docs_name_every_command_and_show_the_include_path_as_printed():
    configuration = (DOCS / "configuration.md").read_text()
    for text in ("`export ", "`import ", "--prometheus-file", "--max-bytes", "--names-from", "--zero", "--check",
                 "--create-remote-root"):  # fmt: skip
        assert text in configuration, text
    cluster = (DOCS / "cluster.md").read_text()
    assert "--include-path=I0" not in cluster.replace("--include-path=<tiered-progcache:I0>", "")
