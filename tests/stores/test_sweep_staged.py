"""Debris of writers that died: staged files in ``tmp/`` are swept by prune (and clear), never while young.

A writer SIGKILLed between staging and rename leaves its staged file behind; before this,
nothing ever removed it (10 kills left 67 MB in one run of the issue).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tiered_progcache.stores.envelope import HEADER_SIZE
from tiered_progcache.stores.localdir import LocalDir
from tiered_progcache.ops.prune import prune
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import STALE_STAGED_AGE_S, entry_name

HOUR = 3600.0

# The child uploads one 4 MiB entry to a file:// remote through a write that stalls halfway:
# it writes half the staged file, says so on stdout, then waits to be killed.
_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from fsspec.implementations.local import LocalFileSystem
    from tiered_progcache.stores.remote import RemoteProgramCache

    real_pipe = LocalFileSystem.pipe_file

    def slow_pipe(self, path, value, **kwargs):
        with open(path, "wb") as fh:
            fh.write(value[: len(value) // 2])
            fh.flush()
        print("staged", path, flush=True)
        time.sleep(3600)

    LocalFileSystem.pipe_file = slow_pipe
    remote = RemoteProgramCache.from_url(sys.argv[1], strict=True)
    remote.write_entry("ab" * 32, bytes(4 << 20))
    """
)


def _kill_a_writer_mid_upload(root: Path) -> Path:
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, root.as_uri()],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    line = child.stdout.readline()  # the staged file is half written: the child is mid-upload
    assert line.startswith("staged "), line
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    child.stdout.close()
    return Path(line.split(" ", 1)[1].strip())


def test_a_killed_upload_leaves_a_staged_file_that_prune_sweeps_once_stale(tmp_path):
    root = tmp_path / "nfs"
    staged = _kill_a_writer_mid_upload(root)
    assert staged.parent == root / "tmp" and staged.stat().st_size == (HEADER_SIZE + (4 << 20)) // 2  # half an envelope
    remote = RemoteProgramCache.from_url(root.as_uri(), strict=True)
    remote.write_entry(entry_name(b"live"), b"x")  # a real entry, to show prune keeps what it should

    young = prune(remote, older_than=30 * 86400, dry_run=False)  # the upload may still be live: kept
    assert (young.removed, young.swept) == (0, 0) and staged.exists()
    dry = prune(remote, older_than=30 * 86400, now=time.time() + 2 * HOUR)  # a dry run removes nothing
    assert dry.swept == 0 and staged.exists()

    stale = prune(remote, older_than=30 * 86400, now=time.time() + 2 * HOUR, dry_run=False)
    assert (stale.removed, stale.swept) == (0, 1)
    assert list((root / "tmp").iterdir()) == []
    assert remote.read_entry(entry_name(b"live")) == b"x"
    remote.close()


def test_sweep_staged_keeps_young_files_and_counts_exactly(tmp_path):
    for store, tmp in (
        (LocalDir(tmp_path / "local"), tmp_path / "local" / "tmp"),
        (RemoteProgramCache.from_url((tmp_path / "remote").as_uri(), strict=True), tmp_path / "remote" / "tmp"),
    ):
        tmp.mkdir(parents=True, exist_ok=True)
        now = time.time()
        for i, age in enumerate((0.0, STALE_STAGED_AGE_S - 60, STALE_STAGED_AGE_S + 60, 5 * STALE_STAGED_AGE_S)):
            path = tmp / f"stage-{i}"
            path.write_bytes(b"partial")
            os.utime(path, (now - age, now - age))
        assert store.sweep_staged(now=now) == 2
        assert sorted(p.name for p in tmp.iterdir()) == ["stage-0", "stage-1"]
        assert store.sweep_staged(older_than=0.0, now=now + 1) == 2
        assert list(tmp.iterdir()) == []
        assert store.sweep_staged(now=now) == 0


def test_object_stores_and_read_only_remotes_sweep_nothing(tmp_path):
    root = tmp_path / "ro"
    (root / "tmp").mkdir(parents=True)
    (root / "tmp" / "stage-x").write_bytes(b"x")
    os.utime(root / "tmp" / "stage-x", (0, 0))
    assert RemoteProgramCache.from_url(root.as_uri(), read_only=True, strict=True).sweep_staged() == 0
    assert (root / "tmp" / "stage-x").exists()
    assert RemoteProgramCache.from_url("memory://sweep-nothing/k").sweep_staged(older_than=0.0) == 0


def test_clear_sweeps_stale_staged_files_and_keeps_young_ones(tmp_path, capsys):
    from tiered_progcache.ops.cli import main

    root = tmp_path / "cache"
    local = LocalDir(root)
    local.write_entry(entry_name(b"k"), b"x")
    now = time.time()
    for name, age in (("stale", 2 * HOUR), ("young", 60.0)):
        (root / "tmp" / name).write_bytes(b"partial")
        os.utime(root / "tmp" / name, (now - age, now - age))
    assert main(["clear", "--local", "--dir", str(root)]) == 0
    assert "(1 entries)" in capsys.readouterr().out
    assert sorted(p.name for p in (root / "tmp").iterdir()) == ["young"]
    assert list(local.iter_entries()) == []
