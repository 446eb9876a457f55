"""A Redis client of the commands the Redis tier sends: RESP2 on a socket, imported in a millisecond.

redis-py's import (asyncio, its parsers and observability: 100-170 ms of a core) came before a fresh
node's first Redis answer, beside its first compiles. The tier sends a few commands (``PING``,
``GET``, ``SET`` with ``PX``/``NX``, ``GETRANGE``, ``STRLEN``, ``EXISTS``, ``DEL``, ``SCAN``) and
pipelines of them; this client sends those, with the method names and answers of redis-py's that
the tier reads. :func:`resp_config` says which URLs it serves (``redis://`` and ``unix://``, with a
user, a password and a database, nothing else); for any other (TLS, query options) and for a client
handed in, the tier uses redis-py.

Connections are kept idle in a pool (newest first, as many as threads used at once); a connection's
``AUTH`` and ``SELECT`` go out with its first request, so opening one costs the TCP handshake alone.
An error closes the connection it happened on. Thread-safe; a forked child builds its own client
(the runner rebuilds it there).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Sequence
from typing import Any, Union
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = ["DEFAULT_PORT", "MAX_BULK_BYTES", "MAX_DEPTH", "MAX_LINE_BYTES", "AuthenticationFailed",
           "ConnectionFailed", "Pipeline", "RedisError", "RespClient", "RespConfig", "ResponseError", "TimedOut",
           "resp_config"]

DEFAULT_PORT = 6379
#: The longest string a reply may carry (Redis's own limit on a value); past it the connection is dropped.
MAX_BULK_BYTES = 512 * 1024 * 1024
#: The deepest nesting of arrays a reply may have (``SCAN``'s is 2).
MAX_DEPTH = 4
#: The longest line a reply may start with (its type and length, or a status or an error).
MAX_LINE_BYTES = 64 * 1024


class RedisError(Exception):
    """What this client raises (each kind as redis-py's of the same role)."""


class ResponseError(RedisError):
    """An error the server answered (``-ERR``, ``-WRONGTYPE``): raised, or a pipeline's answer."""


class ConnectionFailed(RedisError):
    """The connection could not be made or broke (refused, reset, closed, an answer that is not RESP)."""


class AuthenticationFailed(ConnectionFailed):
    """The server refused the user or password, or asks for one that was not given."""


class TimedOut(RedisError):
    """No answer within the socket timeout."""


Reply = Union[bytes, int, None, list, ResponseError]
Command = Sequence[Union[str, bytes, int]]


@dataclasses.dataclass(frozen=True, repr=False)
class RespConfig:
    """Where a served URL points and how to log in. Immutable; no repr (it holds the password)."""

    host: str | None  # None: a Unix socket at ``path``
    port: int
    path: str | None
    username: str | None
    password: str | None
    db: int


def resp_config(url: str) -> RespConfig | None:
    """The connection a ``redis://`` or ``unix://`` URL names, or None where redis-py must serve it
    (``rediss://``, a query option other than ``db``, a port or database that does not parse)."""
    try:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))  # a blank option is an option: redis-py's
        if parts.scheme not in ("redis", "unix") or set(query) - {"db"}:
            return None
        db_text = query.get("db") or (parts.path.strip("/") if parts.scheme == "redis" else "")
        db = int(db_text or "0")
        port = parts.port or DEFAULT_PORT
    except ValueError:
        return None
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    if parts.scheme == "unix":
        return RespConfig(None, 0, unquote(parts.path), username, password, db) if parts.path else None
    if not parts.hostname:
        return None
    return RespConfig(unquote(parts.hostname), port, None, username, password, db)


def _encode(command: Command) -> bytes:
    """A command as RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read(reader: Any, depth: int = 0) -> Reply:
    """One reply from ``reader`` (a buffered socket file); an error reply is returned, not raised."""
    line = reader.readline(MAX_LINE_BYTES)
    if not line.endswith(b"\r\n"):
        raise ConnectionFailed("the connection closed mid-answer" if len(line) < MAX_LINE_BYTES
                               else f"an answer's line is over {MAX_LINE_BYTES} bytes")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        message = rest.decode("utf-8", "replace")
        if message.startswith(("NOAUTH", "WRONGPASS")):
            raise AuthenticationFailed(message)
        return ResponseError(message)
    try:
        number = int(rest)
    except ValueError:
        raise ConnectionFailed(f"not a Redis answer: {line[:64]!r}") from None
    if kind == b":":
        return number
    if kind == b"$":
        if number == -1:
            return None
        if not 0 <= number <= MAX_BULK_BYTES:
            raise ConnectionFailed(f"a string of {number} bytes announced (at most {MAX_BULK_BYTES})")
        data = reader.read(number + 2)
        if len(data) != number + 2 or not data.endswith(b"\r\n"):
            raise ConnectionFailed("the connection closed mid-answer")
        return data[:-2]
    if kind == b"*":
        if number == -1:
            return None
        if number < 0 or depth >= MAX_DEPTH:
            raise ConnectionFailed(f"an array of {number} nested {depth + 1} deep announced (at most {MAX_DEPTH})")
        return [_read(reader, depth + 1) for _ in range(number)]
    raise ConnectionFailed(f"not a Redis answer: {line[:64]!r}")


class _Connection:
    """One socket to the server; its first request carries the login (``AUTH``, ``SELECT``) before it."""

    def __init__(self, config: RespConfig, timeout: float) -> None:
        if config.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(config.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((config.host, config.port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.timeout = timeout
        self.reader = sock.makefile("rb")
        self.login: list[Command] = []
        if config.password is not None:
            self.login.append(("AUTH", config.username, config.password) if config.username else
                              ("AUTH", config.password))
        if config.db:
            self.login.append(("SELECT", config.db))

    def request(self, commands: Sequence[Command]) -> list[Reply]:
        """Send ``commands`` (after the login, on a new connection) at once; their answers in order."""
        login, self.login = self.login, []
        self.sock.sendall(b"".join(_encode(c) for c in (*login, *commands)))
        for command in login:
            answer = _read(self.reader)
            if isinstance(answer, ResponseError):
                kind = AuthenticationFailed if command[0] == "AUTH" else ConnectionFailed
                raise kind(f"{command[0]} refused: {answer}")
        return [_read(self.reader) for _ in commands]

    def closed_by_server(self) -> bool:
        """True if the server closed this idle connection or sent what nobody asked for (a peek, never a wait)."""
        self.sock.setblocking(False)
        try:
            self.sock.recv(1, socket.MSG_PEEK)
            return True  # the end of the stream, or bytes nobody asked for
        except BlockingIOError:
            return False  # nothing to read: open, and in step
        except OSError:
            return True
        finally:
            self.sock.settimeout(self.timeout)

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.sock.close()


class ConnectionPool:
    """Idle connections, newest first; a request takes one (or opens one) and gives it back if nothing failed."""

    def __init__(self, config: RespConfig, timeout: float) -> None:
        self.config = config
        self.timeout = timeout
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []

    def request(self, commands: Sequence[Command]) -> list[Reply]:
        connection = self._take()
        try:
            answers = connection.request(commands)
        except OSError as exc:
            connection.close()
            raise self._failure(exc, "talking to") from None
        except BaseException:  # a refusal, an answer that is not RESP, an interrupt: the connection is out of step
            connection.close()
            raise
        with self._lock:
            self._idle.append(connection)
        return answers

    def _take(self) -> _Connection:
        """An idle connection the server has not closed (one it closed answers EOF at once), else a new one."""
        while True:
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                try:
                    return _Connection(self.config, self.timeout)
                except OSError as exc:
                    raise self._failure(exc, "connecting to") from None
            if not connection.closed_by_server():
                return connection
            connection.close()

    def _failure(self, exc: OSError, doing: str) -> RedisError:
        """``exc`` as this client's error, in redis-py's words (``Error 111 connecting to host:port. ...``)."""
        if isinstance(exc, socket.timeout):  # TimeoutError, an OSError
            return TimedOut(f"no answer within {self.timeout:g} s ({doing} {self._where()})")
        return ConnectionFailed(f"Error {exc.errno} {doing} {self._where()}. {exc.strerror or exc}.")

    def idle(self) -> int:
        """Connections kept idle now."""
        with self._lock:
            return len(self._idle)

    def disconnect(self, inuse_connections: bool = False) -> None:
        """Close the idle connections (those in use close when their request ends with an error, else stay)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _where(self) -> str:
        c = self.config
        return c.path if c.path is not None else f"{c.host}:{c.port}"


def _raised(answer: Reply) -> Reply:
    if isinstance(answer, ResponseError):
        raise answer
    return answer


def _set_command(name: str, value: bytes, ex: int | None, px: int | None, nx: bool) -> Command:
    command: list[str | bytes | int] = ["SET", name, value]
    if ex is not None:
        command += ["EX", ex]
    if px is not None:
        command += ["PX", px]
    if nx:
        command.append("NX")
    return command


class RespClient:
    """The commands the Redis tier sends, as redis-py's client names them and with the answers it reads.

    >>> client = RespClient(resp_config("redis://cache:6379/0"), timeout=5.0)
    >>> client.set("k", b"v", px=60000, nx=True), client.getrange("k", 0, 99)
    (b'OK', b'v')
    """

    def __init__(self, config: RespConfig, timeout: float) -> None:
        self.connection_pool = ConnectionPool(config, timeout)

    def __repr__(self) -> str:
        return f"RespClient({self.connection_pool._where()!r})"

    def _one(self, *command: str | bytes | int) -> Reply:
        return _raised(self.connection_pool.request([command])[0])

    def ping(self) -> bool:
        return self._one("PING") == b"PONG"

    def get(self, name: str) -> bytes | None:
        return self._one("GET", name)  # type: ignore[return-value]

    def getrange(self, name: str, start: int, end: int) -> bytes:
        return self._one("GETRANGE", name, start, end)  # type: ignore[return-value]

    def strlen(self, name: str) -> int:
        return self._one("STRLEN", name)  # type: ignore[return-value]

    def exists(self, *names: str) -> int:
        return self._one("EXISTS", *names)  # type: ignore[return-value]

    def delete(self, *names: str) -> int:
        return self._one("DEL", *names)  # type: ignore[return-value]

    def set(self, name: str, value: bytes, ex: int | None = None, px: int | None = None,
            nx: bool = False) -> bytes | None:
        """``b"OK"``, or None where ``nx`` found the key there."""
        return self._one(*_set_command(name, value, ex, px, nx))  # type: ignore[return-value]

    def scan(self, cursor: int, match: str | None = None, count: int | None = None) -> tuple[int, list[bytes]]:
        command: list[str | int] = ["SCAN", cursor]
        if match is not None:
            command += ["MATCH", match]
        if count is not None:
            command += ["COUNT", count]
        answer = self._one(*command)
        if not (isinstance(answer, list) and len(answer) == 2 and isinstance(answer[0], bytes)
                and isinstance(answer[1], list)):
            raise ConnectionFailed(f"not an answer to SCAN: {answer!r:.64}")
        return int(answer[0]), answer[1]  # type: ignore[return-value]

    def pipeline(self, transaction: bool = False) -> Pipeline:
        if transaction:
            raise ValueError("this client sends no transactions (MULTI/EXEC): pipeline(transaction=False)")
        return Pipeline(self.connection_pool)


class Pipeline:
    """Commands queued, then sent at once on one connection (``execute``); not a transaction."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._commands: list[Command] = []

    def getrange(self, name: str, start: int, end: int) -> Pipeline:
        self._commands.append(("GETRANGE", name, start, end))
        return self

    def strlen(self, name: str) -> Pipeline:
        self._commands.append(("STRLEN", name))
        return self

    def exists(self, *names: str) -> Pipeline:
        self._commands.append(("EXISTS", *names))
        return self

    def set(self, name: str, value: bytes, ex: int | None = None, px: int | None = None, nx: bool = False) -> Pipeline:
        self._commands.append(_set_command(name, value, ex, px, nx))
        return self

    def execute(self, raise_on_error: bool = True) -> list[Reply]:
        """Each command's answer, in order; an error answer raised (the first), or in its place with
        ``raise_on_error=False``. The queue is emptied."""
        commands, self._commands = self._commands, []
        answers = self._pool.request(commands) if commands else []
        if raise_on_error:
            for answer in answers:
                _raised(answer)
        return answers
