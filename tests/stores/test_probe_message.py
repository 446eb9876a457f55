"""One fault, one message: a refused endpoint reads the same in every command and every process.

Whether the filesystem's own retries of a refused connection end before the request deadline
(the probe fails with the connection error) or the deadline ends them (the probe fails with a
timeout) depends on the machine's load; the message, the error type and the counter must not.
The endpoint is a real loopback port that is bound and not listening, so every connect is refused.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from tiered_progcache import TieredProgramCache
from tiered_progcache.stores.remote import RemoteProgramCache, _endpoint_of, _probe_failure
from support import run_cli

pytest.importorskip("s3fs")


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port on which every connect is refused for the test's life (bound, never listening: nobody else gets it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _s3_options(port: int, **extra: object) -> dict[str, object]:
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s", **extra}


def _expected(port: int) -> str:
    return f"remote cache s3://bucket/x is unreachable: 127.0.0.1:{port} refused the connection"


def test_a_refused_port_gives_one_message_whether_the_deadline_or_the_retries_end_first(refused_port):
    # The deadline first: s3fs and botocore retry a refused connect for seconds, the deadline is 0.3 s.
    with pytest.raises(ConnectionRefusedError) as by_deadline:
        RemoteProgramCache.from_url("s3://bucket/x", storage_options=_s3_options(refused_port), timeout=0.3,
                                    strict=True)  # fmt: skip
    # The retries first: botocore's own retries off, a deadline far beyond s3fs's backoff.
    options = _s3_options(refused_port, config_kwargs={"retries": {"max_attempts": 1}})
    with pytest.raises(ConnectionRefusedError) as by_retries:
        RemoteProgramCache.from_url("s3://bucket/x", storage_options=options, timeout=60, strict=True)
    assert str(by_deadline.value) == str(by_retries.value) == _expected(refused_port)


def test_a_refused_port_is_counted_as_an_error_not_a_timeout(refused_port, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tiered_progcache"):
        cache = TieredProgramCache(tmp_path / "node", remote="s3://bucket/x", remote_timeout=0.3,
                                   remote_options=_s3_options(refused_port))  # fmt: skip
        assert cache.shared_store.wait_ready(60)  # the probe runs beside the constructor
    try:
        remote = cache.stats()["remote"]
        assert (remote.errors, remote.timeouts) == (1, 0)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings[0] == f"{_expected(refused_port)}; continuing without it, probing again in 30 s"
    finally:
        cache.close(timeout=5)


def test_a_port_that_answers_and_a_timeout_stays_a_timeout():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        endpoint = listening.getsockname()
        error, message = _probe_failure("s3://bucket/x", TimeoutError("deadline"), 5.0, endpoint)
    assert (error, message) == (TimeoutError, "remote cache s3://bucket/x: no answer within 5 s")


def test_the_diagnosis_names_only_host_and_port(refused_port):
    endpoint = _endpoint_of({"client_kwargs": {"endpoint_url": f"http://user:hunter2@127.0.0.1:{refused_port}/p?q=1"}})
    assert endpoint == ("127.0.0.1", refused_port)
    error, message = _probe_failure("s3://bucket/x", TimeoutError("deadline"), 5.0, endpoint)
    assert error is ConnectionRefusedError and "hunter2" not in message and "user" not in message
    assert message == _expected(refused_port)


@pytest.mark.parametrize("options", [{}, {"endpoint_url": 9}, {"endpoint_url": "http://[::1"}, {"endpoint_url": "x"}])
def test_no_endpoint_means_no_diagnosis(options):
    assert _endpoint_of(options) is None
    assert _probe_failure("s3://bucket/x", TimeoutError(), 2.5, None) == (
        TimeoutError, "remote cache s3://bucket/x: no answer within 2.5 s")


def test_every_command_says_the_same_for_one_refused_port(refused_port, tmp_path):
    import json

    said = {}
    for command in (["config", "--check"], ["push"], ["warm"]):
        env = {"TIERED_PROGCACHE_DIR": str(tmp_path / command[0]), "TIERED_PROGCACHE_REMOTE": "s3://bucket/x",
               "TIERED_PROGCACHE_REMOTE_OPTIONS": json.dumps(_s3_options(refused_port)),
               "TIERED_PROGCACHE_REMOTE_TIMEOUT": "0.3"}  # fmt: skip
        result = run_cli(*command, env=env)
        assert result.returncode == 1, result.stderr
        lines = [line for line in (result.stdout + result.stderr).splitlines() if "remote cache" in line]
        said[command[0]] = lines[-1].split("ConnectionRefusedError: ", 1)[1]
    assert set(said.values()) == {_expected(refused_port)}, said
