"""A node booting against a warm remote: one listing and one batch of reads, then compile() asks the remote nothing.

Requests are counted on the wire (moto behind the delay proxy with keep-alive), or by the
in-memory ``SlowFileSystem``; the command runs as a real subprocess.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import tiered_progcache as tpc
from tiered_progcache import TieredProgramCache
from tiered_progcache.chain import transfer
from tiered_progcache.cluster.flightpolicy import compile_times
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.compiling.manifest import manifest_name
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401
from tiered_progcache.testing.slowfs import SlowFileSystem

from support import assert_one_line_error, run_cli
from test_singleflight import kernel, options

K = 6


def _names_in(path) -> set[str]:
    return {entry.name for entry in LocalDir(path).iter_entries()}


@pytest.fixture
def warm_s3(s3_bucket, tmp_path):
    """(proxy, settings) of a bucket that CI filled with K kernels, behind a 20 ms keep-alive delay proxy."""
    from tiered_progcache.testing.delayproxy import DelayProxy

    host, port = s3_bucket.storage_options["endpoint_url"].split("//")[1].split(":")
    with DelayProxy(host, int(port), rtt_s=0.02, keep_alive=True) as proxy:
        settings = {"remote": s3_bucket.url, "remote_options": {**s3_bucket.storage_options,
                                                                "endpoint_url": proxy.endpoint_url}}
        with TieredProgramCache(tmp_path / "ci", **settings) as ci:
            for i in range(K):
                tpc.compile(kernel(400 + i), "c++", options(), cache=ci)
            assert ci.flush(60)
        for releaser in [t for t in threading.enumerate() if t.name.startswith("tiered-progcache-lease-")]:
            releaser.join(60)  # CI's lease releases are done: their requests are not the node's
        # The node is a fresh process: it has timed none of CI's compiles (this process's times are
        # CI's), so it looks before compiling; a node predicting them short would race the lookup.
        compile_times.clear()
        yield proxy, settings


def test_a_fresh_node_is_ready_after_one_listing_and_one_batch_then_compiles_from_disk(tmp_path, warm_s3, events):
    proxy, settings = warm_s3
    with TieredProgramCache(tmp_path / "node", **settings) as node:
        assert node.shared_store.wait_ready(60)  # its probe (beside the constructor) is not counted below
        before = proxy.requests
        report = node.warm()
        assert (report.entries, report.failures) == (K, 0)  # the cubins; their manifests stay on the remote
        assert proxy.requests - before == 1 + K  # one listing, K reads
        before, stats = proxy.requests, node.stats()
        for i in range(K):
            tpc.compile(kernel(400 + i), "c++", options(), cache=node)
        assert proxy.requests - before == 0 and events == []
        assert (node.stats() - stats)["local"].hits == K


def test_without_the_prefetch_a_fresh_node_pays_one_request_per_kernel(tmp_path, warm_s3, events):
    """One GET per kernel. ``lease_min_compile_rtts=0``: no kernel is short, so each looks before compiling.
    The boot fetch is off."""
    proxy, settings = warm_s3
    with TieredProgramCache(tmp_path / "node", lease_min_compile_rtts=0.0, boot_fetch_bytes=0, **settings) as node:
        assert node.shared_store.wait_ready(60)  # its probe (beside the constructor) is not counted below
        before = proxy.requests
        for i in range(K):
            tpc.compile(kernel(400 + i), "c++", options(), cache=node)
        assert proxy.requests - before == K and events == []
        assert compile_times.predict("c++", "cubin", 1000) is None  # a hit teaches nothing


def test_a_fresh_node_that_only_compiles_gets_its_kernels_in_one_listing_and_one_batch(tmp_path, warm_s3, events):
    """The boot fetch (default on): the first kernel's GET as above, one listing and one batch of the
    other K - 1 beside it (manifests stay behind); every later kernel waits for that batch and asks nothing."""
    proxy, settings = warm_s3
    others = set(threading.enumerate())  # an earlier test's fetch from a dead store is not this node's to wait for
    with TieredProgramCache(tmp_path / "node", lease_min_compile_rtts=0.0, **settings) as node:
        assert node.shared_store.wait_ready(60)  # its probe (beside the constructor) is not counted below
        before, stats = proxy.requests, node.stats()
        for i in range(K):
            tpc.compile(kernel(400 + i), "c++", options(), cache=node)
        for helper in [t for t in threading.enumerate() if t.name.startswith("tiered-progcache-boot-fetch")
                       and t not in others]:
            helper.join(60)
        assert proxy.requests - before == 1 + 1 + (K - 1) and events == []
        run = node.stats() - stats
        assert (run["remote"].hits, run["remote"].misses, run["local"].hits) == (1, 0, K - 1)
        assert len(_names_in(tmp_path / "node")) == K


def _slow_remote(sizes: list[int]) -> tuple[RemoteProgramCache, SlowFileSystem, list[str]]:
    """A remote whose entry n has a payload of sizes[n] bytes and was written n seconds after entry 0."""
    fs = SlowFileSystem()
    fs.mkdir("bucket")
    remote = RemoteProgramCache(fs, "bucket/kernels")
    names = []
    for n, size in enumerate(sizes):
        name = entry_name(b"budget-%d" % n)
        remote.write_entry(name, b"\x7fELF" + bytes(size - 4))
        path = fs._strip_protocol(remote.path_for(name))
        data, _ = fs.objects[path]
        fs.objects[path] = (data, 1_000_000.0 + n)  # its write time
        names.append(name)
    return remote, fs, names


def test_a_byte_budget_takes_the_newest_entries_that_fit(tmp_path):
    remote, fs, names = _slow_remote([1000] * 6)
    stored = next(iter(remote.iter_entries())).size  # an envelope: the payload and its header
    local = LocalDir(tmp_path)
    local.write_entry(names[5], b"\x7fELF" + bytes(996))  # the newest is here already: it counts
    fs.requests.clear()
    report = transfer.warm(remote, local, max_bytes=3 * stored + stored // 2)
    assert (report.entries, report.skipped) == (2, 1)
    assert _names_in(tmp_path) == set(names[3:])
    assert fs.requests["get"] == 2
    assert transfer.warm(remote, LocalDir(tmp_path / "none"), max_bytes=0).entries == 0


def test_a_byte_budget_and_names_do_not_mix_and_are_checked(tmp_path):
    remote, _, names = _slow_remote([100])
    with pytest.raises(ValueError, match="names or max_bytes"):
        transfer.warm(remote, LocalDir(tmp_path), names[:1], max_bytes=10)
    with pytest.raises(ValueError, match="max_bytes"):
        transfer.warm(remote, LocalDir(tmp_path), max_bytes=-1)
    with pytest.raises(TypeError, match="max_bytes"):
        transfer.warm(remote, LocalDir(tmp_path), max_bytes="1G")


def test_warm_from_a_names_file_lists_nothing_and_reads_only_those(tmp_path):
    """An earlier run's local directory names what the job needs: ``ls`` output is the file's format."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()  # a missing file:// root is an error, not created
    url = remote_dir.as_uri()
    with TieredProgramCache(tmp_path / "ci", remote=url) as ci:
        for i in range(4):
            tpc.compile(kernel(410 + i), "c++", options(), cache=ci)
        assert ci.flush(60)
    earlier = tmp_path / "earlier-run"
    with TieredProgramCache(earlier, remote=url, boot_fetch_bytes=0) as run:  # holds what it compiled, no more
        for i in range(2):
            tpc.compile(kernel(410 + i), "c++", options(), cache=run)  # this job needs two of the four
    listing = run_cli("ls", "--dir", str(earlier))
    assert listing.returncode == 0, listing.stderr
    names_file = tmp_path / "needed.txt"
    names_file.write_text("# the kernels of job 42\n" + listing.stdout)
    node = tmp_path / "node"
    warmed = run_cli("warm", "--dir", str(node), "--remote", url, "--names-from", str(names_file))
    assert warmed.returncode == 0, warmed.stderr
    assert "warmed 2 kernels (+0 metadata" in warmed.stdout
    assert _names_in(node) == _names_in(earlier)


def test_warm_max_bytes_on_the_command_line(tmp_path):
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()  # a missing file:// root is an error, not created
    url = remote_dir.as_uri()
    with TieredProgramCache(tmp_path / "ci", remote=url) as ci:
        for i in range(3):
            tpc.compile(kernel(420 + i), "c++", options(), cache=ci)
        assert ci.flush(60)
    stored = [p for p in (remote_dir / "entries").rglob("*") if p.is_file()]
    manifests = {manifest_name(p.parent.name + p.name) for p in stored}
    objects = sorted((p for p in stored if p.parent.name + p.name not in manifests), key=os.path.getmtime)
    assert len(objects) == 3  # the cubins; a warm from a listing leaves their manifests behind
    for n, path in enumerate(objects):  # written one minute apart, oldest first
        os.utime(path, (time.time() - 600 + 60 * n,) * 2)
    budget = os.path.getsize(objects[-1]) + os.path.getsize(objects[-2])
    node = tmp_path / "node"
    warmed = run_cli("warm", "--dir", str(node), "--remote", url, "--max-bytes", str(budget))
    assert warmed.returncode == 0, warmed.stderr
    assert "warmed 2 kernels (+0 metadata" in warmed.stdout
    assert _names_in(node) == {p.parent.name + p.name for p in objects[-2:]}


@pytest.mark.parametrize("args, needle", [
    (["--names-from", "{missing}"], "No such file"),
    (["--names-from", "{bad}"], "not an entry name"),
    (["--names-from", "{good}", "--max-bytes", "1G"], "not both"),
    (["--max-bytes", "lots"], "not a size"),
])
def test_warm_selection_errors_are_one_line_usage_errors(tmp_path, args, needle):
    (tmp_path / "bad.txt").write_text("not-a-name 12 KiB 3d\n")
    (tmp_path / "good.txt").write_text(entry_name(b"x") + "\n")
    paths = {"missing": str(tmp_path / "missing.txt"), "bad": str(tmp_path / "bad.txt"),
             "good": str(tmp_path / "good.txt")}
    argv = [arg.format(**paths) for arg in args]
    proc = run_cli("warm", "--dir", str(tmp_path / "node"), "--remote", (tmp_path / "remote").as_uri(), *argv)
    assert needle in assert_one_line_error(proc)
