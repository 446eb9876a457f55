"""Issue 28 item 2: a dead shared tier's failed probe is remembered in the local directory for a bounded time.

Before, every new process paid the probe of a dead bucket (3.9 s refused, 5.2 s hanging), because
"skipped for 30 s" held inside one process only. Now the next process on the node, within
``DOWN_MEMO_S``, starts with the tier's breaker open and probes nothing; after it, or once the file is
removed, it probes again; a successful probe removes the memo; ``strict`` always probes.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

from tiered_progcache.chain.downmemo import DOWN_MEMO_DIR, DOWN_MEMO_S, DownMemo
from tiered_progcache.chain.tiered import shared_tier
from tiered_progcache.config import CacheConfig
from tiered_progcache.testing.redis_server import free_port

PW = "PLANTED-MEMO-PW-0002"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_probe_is_skipped_by_the_next_build_for_the_memos_lifetime_only(tmp_path, caplog):
    root, node, clock = tmp_path / "share", tmp_path / "node", Clock()
    url = f"file://{root}"
    memo = DownMemo(node, clock=clock)
    config = CacheConfig(remote=url)
    first, _ = shared_tier(config, url, down_memo=memo)
    assert first.wait_ready(60)  # the probe runs beside the constructor
    assert first.breaker.state == "open" and "does not exist" in first.breaker.last_error
    assert memo.path(url).parent == node / DOWN_MEMO_DIR and memo.path(url).is_file()
    assert memo.recall(url)[1] == DOWN_MEMO_S
    root.mkdir()  # the share is back, but within the memo's time nobody looks
    clock.now += DOWN_MEMO_S - 1
    caplog.clear()
    second, _ = shared_tier(config, url, down_memo=memo)
    assert second.wait_ready(60) and second.breaker.state == "open"
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # one line, no probe
    assert line == (f"remote cache {url} is unreachable: {first.breaker.last_error} (found down {DOWN_MEMO_S - 1:.0f} s "
                    f"ago on this node; remove {memo.path(url)} to probe now); continuing without it, probing again "
                    "in 30 s")  # fmt: skip
    strict, _ = shared_tier(CacheConfig(remote=url, strict=True), url, down_memo=memo)  # strict: always the truth
    assert strict.breaker.state == "closed"
    clock.now += 1  # the memo's time is over: probed, found, forgotten
    third, _ = shared_tier(config, url, down_memo=memo)
    assert third.wait_ready(60)
    assert third.breaker.state == "closed" and not memo.path(url).exists()
    for store in (first, second, strict, third):
        store.close()


def test_no_memo_keeps_a_remote_off_for_longer_than_its_bound(tmp_path):
    clock = Clock()
    memo = DownMemo(tmp_path, clock=clock)
    memo.directory.mkdir()
    for until in (clock.now + DOWN_MEMO_S + 1, clock.now + 1e12, float("inf"), "soon"):
        memo.path("s3://b/k").write_text(json.dumps({"until": until, "message": "down"}))
        assert memo.recall("s3://b/k") is None
    memo.path("s3://b/k").write_bytes(b"\x00not json")
    assert memo.recall("s3://b/k") is None


def test_the_next_process_skips_the_probe_of_a_dead_redis_and_the_memo_holds_no_password(tmp_path):
    url = f"redis://:{PW}@127.0.0.1:{free_port()}/0"  # nothing listens: refused
    env = {"TIERED_PROGCACHE_REMOTE": url, "TIERED_PROGCACHE_DIR": str(tmp_path / "node"),
           "TIERED_PROGCACHE_REMOTE_TIMEOUT": "2", "PATH": "/usr/bin:/bin"}  # fmt: skip
    code = "from tiered_progcache import TieredProgramCache; TieredProgramCache.from_env().close()"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, **_py()},
                           timeout=120) for _ in range(2)]  # fmt: skip
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    assert "is unreachable" in runs[0].stderr and "found down" not in runs[0].stderr
    first, second = (run.stderr.strip() for run in runs)
    cause = first.split(" is unreachable: ", 1)[1].split("; continuing without it", 1)[0]
    assert re.fullmatch(rf"{re.escape(first.split(' is unreachable: ')[0])} is unreachable: {re.escape(cause)} "
                        r"\(found down \d+ s ago on this node; remove \S+ to probe now\); continuing without it, "
                        r"probing again in 30 s", second), second  # one line, the first process's cause first
    memos = list((tmp_path / "node" / DOWN_MEMO_DIR).iterdir())
    assert len(memos) == 1 and PW not in memos[0].read_text()
    assert all(PW not in run.stderr for run in runs)


def _py() -> dict[str, str]:
    import os

    return {name: os.environ[name] for name in ("PYTHONPATH", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HOME")
            if name in os.environ}  # fmt: skip
