"""The README and docs/cluster.md walked through as a new operator would: three nodes, one file:// remote.

Every subcommand runs for real (``python -m tiered_progcache``, one subprocess each), in
the order the docs give them: CI compiles and pushes, nodes warm at boot (one from a
list ``ls -l`` printed), jobs run under ``stats --run --prometheus-file``, and the
safe operations (prune's dry run, verify, export/import, clear). Three mistyped remote
URLs fail with exit 1 and create nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support import assert_one_line_error, run_cli

# A job that compiles two kernels through compile() and prints, as a training script would.
_JOB = """
import tiered_progcache
from cuda.core import ProgramOptions
for n in (1, 2):
    src = f'extern "C" __global__ void step{n}(float* x) {{ x[threadIdx.x] += {n}.0f; }}'
    tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_90"), "cubin")
print("training: epoch 1 done")
"""


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.args, proc.stdout, proc.stderr)
    return proc.stdout


def test_three_nodes_one_file_remote_every_subcommand(tmp_path):
    bucket = tmp_path / "nfs" / "kernels"
    (tmp_path / "nfs").mkdir()
    url = bucket.as_uri()
    nodes = {name: {"TIERED_PROGCACHE_DIR": str(tmp_path / name), "TIERED_PROGCACHE_REMOTE": url}
             for name in ("ci", "node1", "node2")}  # fmt: skip

    # Mistyped remotes: exit 1, one line, nothing created (cwd is tmp_path: ./notaurl would land there).
    for argv in (["warm", "--remote", "notaurl"], ["stats", "--remote", "s3:/bad-url"],
                 ["verify", "--remote", (tmp_path / "nfs" / "kernles").as_uri()]):  # fmt: skip
        assert_one_line_error(run_cli(*argv, "--dir", str(tmp_path / "typo"), cwd=tmp_path), rc=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nfs"]

    # config: the sources say flag / env; --check fails before the share exists, creating nothing.
    rows = json.loads(_ok(run_cli("config", "--json", "--read-only", env=nodes["ci"])))
    assert rows["remote"]["source"] == "env TIERED_PROGCACHE_REMOTE"
    assert rows["remote_read_only"]["source"] == "flag --read-only"
    assert run_cli("config", "--check", env=nodes["ci"]).returncode == 1 and not bucket.exists()

    # CI: a job under stats --run (its stdout untouched), then push creates the share, as asked.
    prom = tmp_path / "ci.prom"
    job = run_cli("stats", "--run", "--prometheus-file", str(prom), "--", sys.executable, "-c", _JOB, env=nodes["ci"])
    assert _ok(job) == "training: epoch 1 done\n"
    assert "tiered_progcache_hits_total{" in prom.read_text()
    assert "pushed 2 kernels (+2 metadata" in _ok(run_cli("push", "--create-remote-root", env=nodes["ci"]))
    assert "0 bad" in _ok(run_cli("verify", "--remote", env=nodes["ci"]))
    _ok(run_cli("config", "--check", env=nodes["ci"]))

    # node1 boots: warm everything; node2 warms the list ls -l printed on node1 (stdin).
    assert "warmed 2 kernels (+0 metadata" in _ok(run_cli("warm", "--no-progress", "--max-bytes", "20G", env=nodes["node1"]))
    listing = _ok(run_cli("ls", "-l", env=nodes["node1"]))
    assert listing.splitlines()[-1].startswith("total 2 kernels (+0 metadata)")
    warm2 = subprocess.run([sys.executable, "-m", "tiered_progcache", "warm", "--names-from", "-"], input=listing,
                           env={**os.environ, **nodes["node2"]}, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert "warmed 2 kernels" in _ok(warm2)

    # node2's job hits the local tier, compiles nothing; stats reads like ccache -s.
    out = _ok(run_cli("stats", "--json", "--run", "--", sys.executable, "-c", _JOB, env=nodes["node2"]))
    assert out.startswith("training: epoch 1 done\n")  # the job's line, then the report
    run = json.loads(out.split("\n", 1)[1])
    assert run["compiles"] == 0 and run["hits"] == 2
    table = _ok(run_cli("stats", "--max-local-bytes", "1K", env=nodes["node2"]))
    assert "NVRTC runs              0" in table and "WARNING: over the cap" in table
    remote_rows = json.loads(_ok(run_cli("stats", "--json", "--remote", env=nodes["node2"])))
    assert (remote_rows["remote"]["kernels"], remote_rows["remote"]["metadata"]) == (2, 2)

    # explain by a short name, local and remote (the remote before the name).
    ls_rows = [line.split() for line in _ok(run_cli("ls", env=nodes["ci"])).splitlines()]
    kernel = next(row[0] for row in ls_rows if row[4] == "kernel")
    assert f"entry         {kernel}" in _ok(run_cli("explain", kernel[:8], env=nodes["ci"]))
    assert f"entry         {kernel}" in _ok(run_cli("explain", "--remote", url, kernel[:12], env=nodes["ci"]))

    # Bundles, prune (a dry run), clear.
    bundle = tmp_path / "kernels.tpcb"
    assert "exported 2 kernels (+2 metadata" in _ok(run_cli("export", str(bundle), "--format", "tar", env=nodes["ci"]))
    fresh = {"TIERED_PROGCACHE_DIR": str(tmp_path / "image")}
    assert "imported 2 kernels (+2 metadata" in _ok(run_cli("import", str(bundle), env=fresh))
    dry = _ok(run_cli("prune", "--max-bytes", "0", env=nodes["node1"]))
    assert "would remove 2 of 2 entries" in dry
    assert "2 entries" in _ok(run_cli("clear", "--local", env=nodes["node1"]))
    assert _ok(run_cli("ls", env=nodes["node1"])) == ""


def test_walkthrough_commands_are_the_documented_ones():
    """Every subcommand the walk runs is in README.md's command list and configuration.md's table."""
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    table = (root / "docs" / "configuration.md").read_text()
    for command in ("config", "stats", "warm", "push", "prune", "verify", "ls", "explain", "export", "import", "clear"):
        assert f"| `{command}" in table, command
        if command != "clear":
            assert f"tiered-progcache {command}" in readme, command
