"""Two nodes, one bucket: node A compiles once with real NVRTC, node B never compiles that kernel."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401
from support import compile_matmul as _compile

OPTIONS = {"std": "c++17", "arch": "sm_90"}


def test_node_b_gets_node_a_compile_from_the_bucket(s3_bucket, tmp_path):
    remote = {"remote": s3_bucket.url, "remote_options": s3_bucket.storage_options, "strict": True}
    node_a = TieredProgramCache(tmp_path / "node-a", **remote)
    node_b = TieredProgramCache(tmp_path / "node-b", **remote)

    cubin = _compile(node_a)
    assert cubin.startswith(b"\x7fELF")
    assert node_a.flush(timeout=30)
    a = node_a.stats()
    assert (a["remote"].misses, a["remote"].writes) == (1, 1)
    assert len(s3_bucket.objects()) == 1

    before = node_b.stats()
    assert _compile(node_b) == cubin
    b = node_b.stats() - before
    assert (b["memory"].misses, b["local"].misses, b["remote"].hits) == (1, 1, 1)
    assert b["remote"].writes == 0 and b["local"].promotions == 1 and b["memory"].promotions == 1
    node_b_dir = LocalDir(tmp_path / "node-b")
    (entry,) = node_b_dir.iter_entries()
    entry_path = node_b_dir.path_for(entry.name)
    assert entry_path.read_bytes() == cubin  # raw cubin on B's disk, readable by cuobjdump

    before = node_b.stats()
    assert _compile(node_b) == cubin
    b = node_b.stats() - before
    assert (b["memory"].hits, b["local"].lookups, b["remote"].lookups) == (1, 0, 0)
    node_a.close()
    node_b.close()

    # A new process on node B finds it on local disk and never asks the remote.
    script = textwrap.dedent(
        f"""
        import json, sys
        from cuda.core import Program, ProgramOptions
        from tiered_progcache import TieredProgramCache
        from tiered_progcache.samples import matmul_source
        cache = TieredProgramCache({str(tmp_path / "node-b")!r}, remote={s3_bucket.url!r},
                                   remote_options=json.loads(sys.argv[1]))
        obj = Program(matmul_source(16), "c++", ProgramOptions(**{OPTIONS!r})).compile("cubin", cache=cache)
        stats = cache.stats()
        print(json.dumps({{"same": bytes(obj.code) == open(sys.argv[2], "rb").read(),
                          "local_hits": stats["local"].hits, "remote_lookups": stats["remote"].lookups}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(s3_bucket.storage_options), str(entry_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"same": True, "local_hits": 1, "remote_lookups": 0}


def test_read_only_fleet_node_reads_what_ci_wrote(s3_bucket, tmp_path):
    ci = TieredProgramCache(tmp_path / "ci", remote=s3_bucket.url, remote_options=s3_bucket.storage_options)
    cubin = _compile(ci, tile=32)
    assert ci.flush(timeout=30)
    fleet = TieredProgramCache(
        tmp_path / "fleet", remote=s3_bucket.url, remote_options=s3_bucket.storage_options, remote_read_only=True
    )
    assert _compile(fleet, tile=32) == cubin
    assert fleet.stats()["remote"].hits == 1
    assert fleet.tier("remote").writeback is None
    pytest.importorskip("s3fs")
    ci.close()
    fleet.close()
