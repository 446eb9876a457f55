"""Interpreter exit after a compile, when the remote hangs: the exit flush's budget is all it costs.

The remote is a real moto S3 server in its own process, stopped with SIGSTOP after the
compile took its lease: connections still open (the kernel accepts them) and nothing
ever answers, as with a hung server. The compiling process exits right after the
compile; the test measures how long that exit takes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tiered_progcache.writeback import EXIT_FLUSH_TIMEOUT_S

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

#: What interpreter start-up and teardown may add to the exit budget on a loaded machine.
SLACK_S = 4.0

_MOTO = textwrap.dedent("""
    import sys
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()
""")

_NODE = textwrap.dedent("""
    import json, sys, time
    import tiered_progcache as tpc
    from cuda.core import ProgramOptions
    url, options = sys.argv[1], json.loads(sys.argv[2])

    def hold(event):
        print("compiling", flush=True)
        sys.stdin.readline()  # the test stops the remote now

    tpc.on_compile(hold)
    cache = tpc.TieredProgramCache(sys.argv[3], remote=url, remote_options=options, remote_timeout=60)
    tpc.compile('extern "C" __global__ void k(int* o) { *o = 7; }', "c++", ProgramOptions(arch="sm_90"),
                cache=cache, lease_ttl=600)
    print("compiled", flush=True)
""")


@pytest.fixture
def stoppable_moto():
    server = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        yield server, f"http://127.0.0.1:{port}"
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()


@pytest.mark.timeout(300)
def test_exit_after_a_compile_against_a_hung_remote_takes_at_most_the_exit_budget(tmp_path, stoppable_moto):
    server, endpoint = stoppable_moto
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket="exit-bound")
    import json

    node = subprocess.Popen(
        [sys.executable, "-c", _NODE, "s3://exit-bound/kernels", json.dumps(options), str(tmp_path / "local")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert node.stdout.readline().strip() == "compiling"  # it holds the lease now
        os.kill(server.pid, signal.SIGSTOP)  # the remote hangs from here on
        node.stdin.write("go\n")
        node.stdin.flush()
        assert node.stdout.readline().strip() == "compiled"
        compiled = time.monotonic()
        node.wait(timeout=240)
        exit_s = time.monotonic() - compiled
    finally:
        node.kill()
        node.wait()
    print(f"exit took {exit_s:.2f} s after the compile (exit budget {EXIT_FLUSH_TIMEOUT_S:.0f} s)")
    assert node.returncode == 0
    assert exit_s < EXIT_FLUSH_TIMEOUT_S + SLACK_S
