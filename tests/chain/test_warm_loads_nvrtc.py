"""``cache.warm()`` at a node's boot also loads NVRTC, so the first hit does not pay cuda-core's first key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from support import child_pythonpath

SCRIPT = textwrap.dedent("""
    import json, sys
    from tiered_progcache import TieredProgramCache

    def nvrtc_loaded():
        with open("/proc/self/maps") as maps:
            return "libnvrtc" in maps.read()

    with TieredProgramCache(sys.argv[1], remote=sys.argv[2], create_remote_root=True) as cache:
        before = nvrtc_loaded()
        report = cache.warm()
        print(json.dumps({"before": before, "after": nvrtc_loaded(), "entries": report.entries}))
""")


def test_a_fresh_process_has_nvrtc_loaded_after_warm_and_not_before(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "node"), (tmp_path / "bucket").as_uri()],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=child_pythonpath()))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"before": False, "after": True, "entries": 0}
