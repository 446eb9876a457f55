"""The tiered-progcache command against a real S3 endpoint (moto, on loopback): push, ls, warm, verify, prune, clear."""

from __future__ import annotations

import json
import sys

import pytest
from cuda.core import Program, ProgramOptions

from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.samples import EPILOGUES, matmul_source
from tiered_progcache.stores.store import entry_name

from support import assert_one_line_error, run_cli
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401  (pytest fixtures)



@pytest.fixture(scope="module")
def cubins() -> dict[str, bytes]:
    """Three real cubins of the sample kernel, by entry name."""
    out = {}
    for tile, epilogue in ((16, EPILOGUES[0]), (16, EPILOGUES[1]), (32, EPILOGUES[0])):
        code = Program(matmul_source(tile, epilogue), "c++", ProgramOptions(arch="sm_90")).compile("cubin").code
        out[entry_name(f"{tile}-{epilogue}")] = bytes(code)
    return out


@pytest.fixture
def local(tmp_path, cubins) -> LocalDir:
    d = LocalDir(tmp_path / "ci-cache")
    for name, data in cubins.items():
        d.write_entry(name, data)
    return d


def remote_flags(bucket) -> list[str]:
    return ["--remote", bucket.url, "--remote-options", json.dumps(bucket.storage_options)]


def test_push_ls_stats_then_warm_a_fresh_node_with_progress(tmp_path, s3_bucket, local, cubins):
    flags = remote_flags(s3_bucket)
    pushed = run_cli("push", "--dir", str(local.root), *flags)
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed 3 kernels (+0 metadata" in pushed.stdout and "0 failed" in pushed.stdout
    assert len(s3_bucket.objects()) == 3

    listed = run_cli("ls", *flags)
    assert listed.returncode == 0, listed.stderr
    assert {line.split()[0] for line in listed.stdout.splitlines()} == set(cubins)

    stats = json.loads(run_cli("stats", "--json", "--dir", str(local.root), *flags).stdout)
    assert stats["local"]["entries"] == stats["remote"]["entries"] == 3
    assert stats["remote"]["bytes"] > sum(map(len, cubins.values()))  # envelopes: payload + header

    node = tmp_path / "node"
    warmed = run_cli("warm", "--dir", str(node), "--progress", *flags)
    assert warmed.returncode == 0, warmed.stderr
    assert f"warmed 3 kernels (+0 metadata, {_kib(cubins)}" in warmed.stdout and "0 entries already there, 0 failed" in warmed.stdout
    assert "3/3" in warmed.stderr and "100%" in warmed.stderr  # the tqdm bar
    node_dir = LocalDir(node)
    assert {e.name: node_dir.read_entry(e.name) for e in node_dir.iter_entries()} == cubins  # raw cubins again, verified

    again = run_cli("warm", "--dir", str(node), "--no-progress", *flags)
    assert "warmed 0 kernels" in again.stdout and "3 entries already there" in again.stdout
    assert again.stderr == ""


def _kib(cubins: dict[str, bytes]) -> str:
    return f"{sum(map(len, cubins.values())) / 1024:.1f} KiB"


def test_verify_remote_finds_a_flipped_byte_and_deletes_it_on_request(s3_bucket, local, cubins):
    flags = remote_flags(s3_bucket)
    assert run_cli("push", "--dir", str(local.root), *flags).returncode == 0
    victim = sorted(cubins)[1]
    path = s3_bucket.entry_path(victim)
    blob = bytearray(s3_bucket.fs.cat_file(path))
    blob[-100] ^= 0x01
    s3_bucket.fs.pipe_file(path, bytes(blob))

    proc = run_cli("verify", *flags)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[0] == f"BAD {victim}: payload digest mismatch (corrupt)"
    assert "checked 3 entries" in proc.stdout and ": 1 bad" in proc.stdout
    assert len(s3_bucket.objects()) == 3

    proc = run_cli("verify", "--delete-bad", *flags)
    assert proc.returncode == 1 and "deleted 1" in proc.stdout
    assert len(s3_bucket.objects()) == 2
    proc = run_cli("verify", *flags)
    assert proc.returncode == 0 and "checked 2 entries" in proc.stdout and ": 0 bad" in proc.stdout


def test_verify_checks_signatures(tmp_path, s3_bucket, local):
    flags = remote_flags(s3_bucket)
    ci_key, other_key = tmp_path / "ci.key", tmp_path / "other.key"
    ci_key.write_bytes(b"ci-signing-key-0123456789abcdef!")
    other_key.write_bytes(b"someone-else-0123456789abcdef!!!")
    assert run_cli("push", "--dir", str(local.root), "--signing-key-file", str(ci_key), *flags).returncode == 0

    good = run_cli("verify", "--signing-key-file", str(ci_key), *flags)
    assert good.returncode == 0 and ": 0 bad" in good.stdout
    forged = run_cli("verify", "--signing-key-file", str(other_key), *flags)
    assert forged.returncode == 1 and ": 3 bad" in forged.stdout
    assert all("bad signature" in line for line in forged.stdout.splitlines()[:3])


def test_prune_remote_dry_run_then_yes(s3_bucket, local, cubins):
    flags = remote_flags(s3_bucket)
    assert run_cli("push", "--dir", str(local.root), *flags).returncode == 0
    sizes = {e.split()[0]: int(e.split()[1]) for e in run_cli("ls", "--long", *flags).stdout.splitlines()[1:-1]}
    cap = str(sum(sizes.values()) - 1)  # one entry over: exactly one must go

    dry = run_cli("prune", "--max-bytes", cap, *flags)
    assert dry.returncode == 0, dry.stderr
    assert "would remove 1 of 3 entries" in dry.stdout
    assert len(s3_bucket.objects()) == 3

    read_only = run_cli("prune", "--max-bytes", cap, "--yes", "--read-only", *flags)
    assert "read-only" in assert_one_line_error(read_only, 2)
    assert len(s3_bucket.objects()) == 3

    done = run_cli("prune", "--max-bytes", cap, "--yes", *flags)
    assert done.returncode == 0, done.stderr
    assert "removed 1 of 3 entries" in done.stdout
    assert len(s3_bucket.objects()) == 2


def test_clear_remote_needs_yes(s3_bucket, local):
    flags = remote_flags(s3_bucket)
    assert run_cli("push", "--dir", str(local.root), *flags).returncode == 0
    refused = run_cli("clear", *flags)
    assert "--yes" in assert_one_line_error(refused, 2)
    assert len(s3_bucket.objects()) == 3
    done = run_cli("clear", "--yes", *flags)
    assert done.returncode == 0, done.stderr
    assert "(3 entries)" in done.stdout
    assert s3_bucket.objects() == []


def test_a_missing_bucket_is_one_line_and_exit_1(s3_bucket):
    options = json.dumps(s3_bucket.storage_options)
    proc = run_cli("ls", "--remote", "s3://no-such-bucket-tpc/kernels", "--remote-options", options)
    line = assert_one_line_error(proc, 1)
    assert "no-such-bucket-tpc" in line


_CHILD = """
from cuda.core import Program, ProgramOptions
from tiered_progcache import TieredProgramCache
src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }'
Program(src, "c++", ProgramOptions(arch="sm_90")).compile("cubin", cache=TieredProgramCache.from_env())
"""


def test_stats_run_counts_remote_writes_and_hits_of_children(tmp_path, s3_bucket):
    """CI compiles and uploads (in the background, flushed at exit); a fresh node then hits the remote."""
    flags = remote_flags(s3_bucket)
    ci = run_cli("stats", "--json", "--dir", str(tmp_path / "ci"), *flags, "--run", "--", sys.executable, "-c", _CHILD)
    assert ci.returncode == 0, ci.stderr
    tiers = json.loads(ci.stdout)["tiers"]
    assert (tiers["remote"]["misses"], tiers["remote"]["writes"], tiers["remote"]["hits"]) == (1, 1, 0)
    assert len(s3_bucket.objects()) == 1

    node = run_cli("stats", "--json", "--dir", str(tmp_path / "node"), *flags, "--run", "--", sys.executable, "-c", _CHILD)
    assert node.returncode == 0, node.stderr
    run = json.loads(node.stdout)
    assert (run["hits"], run["misses"]) == (1, 0)
    assert (run["tiers"]["remote"]["hits"], run["tiers"]["local"]["promotions"]) == (1, 1)


def test_delete_bad_under_a_wrong_key_keeps_every_signature_failure_and_deletes_only_the_corrupt(
    tmp_path, s3_bucket, local, cubins
):
    """Before: a wrong key made every entry "bad signature" and --delete-bad deleted them all (5 of 5)."""
    flags = remote_flags(s3_bucket)
    ci_key, wrong_key = tmp_path / "ci.key", tmp_path / "wrong.key"
    ci_key.write_bytes(b"ci-signing-key-0123456789abcdef!\n")
    wrong_key.write_bytes(b"not-the-ci-key-0123456789abcdef!\n")
    assert run_cli("push", "--dir", str(local.root), "--signing-key-file", str(ci_key), *flags).returncode == 0
    victim = sorted(cubins)[0]
    path = s3_bucket.entry_path(victim)
    s3_bucket.fs.pipe_file(path, s3_bucket.fs.cat_file(path)[:20])  # truncated: corrupt under any key

    proc = run_cli("verify", "--delete-bad", "--signing-key-file", str(wrong_key), *flags)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"BAD {victim}: truncated")
    assert sorted(lines[1:3]) == sorted(
        f"BAD-SIGNATURE {name}: bad signature (written with another key, or altered)" for name in sorted(cubins)[1:]
    )
    assert lines[-1] == (
        f"checked 3 entries in {s3_bucket.url}: 3 bad; deleted 1; 2 failed the signature check only, kept "
        "(a wrong key is likelier than forgery: check the key, then delete them with clear or prune)"
    )
    assert len(s3_bucket.objects()) == 2
    good = run_cli("verify", "--signing-key-file", str(ci_key), *flags)
    assert good.returncode == 0 and ": 0 bad" in good.stdout  # the right key: every kept entry is fine
