"""A TCP proxy that adds network latency (and optionally a bandwidth cap) in front of a real server.

Tests and benchmarks put it between s3fs/gcsfs and moto/fake-gcs so requests cross real
HTTP with the round-trip time of an object store in another zone, not loopback's 50 µs:

>>> with DelayProxy("127.0.0.1", moto_port, rtt_s=0.030) as proxy:
...     fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint_url}, ...)

Each direction delays every chunk by half the RTT, so a request and its answer cost one
RTT, and a new connection costs one more (the TCP handshake a real client would pay).
Chunks keep their order and overlap in flight, so latency does not cap throughput; with
``bandwidth_bytes_per_s`` each direction also serializes at that rate. ``connections``
counts accepted connections: what a client's connection reuse looks like from the wire.

moto's server (werkzeug) closes the connection after every response, which a real object
store does not: behind it every request would pay a handshake. ``keep_alive=True`` makes
the proxy speak HTTP/1.1 keep-alive to the client itself and send each request upstream
on a fresh loopback connection (free, sent with ``Connection: close`` so any server ends
it after its answer), so the client sees the connection reuse it would get from S3 and
``requests`` counts them. fake-gcs-server keeps connections alive by itself: it needs
``keep_alive`` only for the count.

For in-process filesystems with no socket, use :mod:`.slowfs` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from typing import NamedTuple
from types import TracebackType

__all__ = ["DelayProxy", "SentRequest"]

logger = logging.getLogger(__name__)

_CHUNK = 64 * 1024


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be >= 0 and finite, got {value!r}")
    return float(value)


class DelayProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream_host:upstream_port`` with ``rtt_s`` added per round trip.

    Runs its own event loop on a daemon thread; ``close()`` (or leaving the ``with``
    block) stops it and drops every connection. ``rtt_s`` may be changed while it
    runs; it applies to chunks read after the change. Thread-safe.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        rtt_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        keep_alive: bool = False,
    ) -> None:
        if not isinstance(upstream_host, str) or not upstream_host:
            raise TypeError(f"upstream_host must be a non-empty str, got {upstream_host!r}")
        if isinstance(upstream_port, bool) or not isinstance(upstream_port, int) or not 0 < upstream_port < 65536:
            raise ValueError(f"upstream_port must be a TCP port (1-65535), got {upstream_port!r}")
        if bandwidth_bytes_per_s is not None:
            if isinstance(bandwidth_bytes_per_s, bool) or not isinstance(bandwidth_bytes_per_s, (int, float)):
                raise TypeError("bandwidth_bytes_per_s must be a number or None, "
                                f"got {type(bandwidth_bytes_per_s).__name__}")
            if not (bandwidth_bytes_per_s > 0 and math.isfinite(bandwidth_bytes_per_s)):
                raise ValueError(f"bandwidth_bytes_per_s must be > 0 and finite, got {bandwidth_bytes_per_s!r}")
        if not isinstance(keep_alive, bool):
            raise TypeError(f"keep_alive must be a bool, got {type(keep_alive).__name__}")
        self._keep_alive = keep_alive
        self._requests = 0
        self._sent: list[SentRequest] = []
        self._upstream = (upstream_host, upstream_port)
        self._rtt_s = _check_seconds("rtt_s", rtt_s)
        self._bandwidth = float(bandwidth_bytes_per_s) if bandwidth_bytes_per_s is not None else None
        self._lock = threading.Lock()
        self._connections = 0
        self._bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    # -- what callers read ------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>``: what to give a client as its endpoint."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """TCP connections accepted so far."""
        with self._lock:
            return self._connections

    @property
    def requests(self) -> int:
        """HTTP requests forwarded so far (counted with ``keep_alive`` only; 0 otherwise)."""
        with self._lock:
            return self._requests

    @property
    def sent(self) -> list[SentRequest]:
        """Each request forwarded so far and its answer's status, in order (with ``keep_alive`` only)."""
        with self._lock:
            return list(self._sent)

    @property
    def bytes_forwarded(self) -> int:
        """Payload bytes forwarded so far, both directions together."""
        with self._lock:
            return self._bytes

    @property
    def rtt_s(self) -> float:
        return self._rtt_s

    @rtt_s.setter
    def rtt_s(self, value: float) -> None:
        self._rtt_s = _check_seconds("rtt_s", value)

    # -- life cycle -----------------------------------------------------------------------------------

    def start(self) -> DelayProxy:
        """Listen on a free loopback port (``port``) and serve until :meth:`close`."""
        if self._thread is not None:
            raise RuntimeError("DelayProxy already started")
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="tiered-progcache-delayproxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def close(self) -> None:
        """Stop listening, drop every connection and stop the loop. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = None

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DelayProxy(127.0.0.1:{self.port} -> {self._upstream[0]}:{self._upstream[1]}, "
                f"rtt_s={self._rtt_s}, bandwidth_bytes_per_s={self._bandwidth})")

    # -- forwarding --------------------------------------------------------------------------------------

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self._connections += 1
        try:
            await asyncio.sleep(self._rtt_s)  # the handshake a real connection pays
            if self._keep_alive:
                await self._serve_http(client_reader, client_writer)
                return
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            try:
                await asyncio.gather(
                    self._pipe(client_reader, up_writer),
                    self._pipe(up_reader, client_writer),
                )
            finally:
                up_writer.close()
        except (ConnectionError, OSError) as exc:
            logger.debug("delay proxy connection ended: %r", exc)
        except asyncio.CancelledError:
            pass
        finally:
            client_writer.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer``, each chunk delivered half an RTT (plus serialization) after it arrived."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    with contextlib.suppress(OSError, RuntimeError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        line_free_at = 0.0  # when this direction's "wire" finishes the previous chunk
        try:
            while True:
                chunk = await reader.read(_CHUNK)
                now = loop.time()
                sent_at = now
                if chunk and self._bandwidth is not None:
                    sent_at = max(now, line_free_at) + len(chunk) / self._bandwidth
                    line_free_at = sent_at
                queue.put_nowait((sent_at + self._rtt_s / 2, chunk))
                if not chunk:
                    break
                with self._lock:
                    self._bytes += len(chunk)
            await sender
        finally:
            if not sender.done():
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sender

    # -- HTTP keep-alive in front of a server that closes after each response -------------------------

    async def _serve_http(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        """One client connection, many requests: each forwarded on its own upstream connection."""
        loop = asyncio.get_running_loop()
        while True:
            request = await _read_request(client_reader, client_writer)
            if request is None:
                return
            head, body, method = request
            arrived = loop.time()
            await self._sleep_until(arrived + self._transmit(len(head) + len(body)) + self._rtt_s / 2)
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            try:
                up_writer.write(head + body)
                await up_writer.drain()
                response = await up_reader.read()  # the upstream closes after its response
            finally:
                up_writer.close()
            with self._lock:
                self._requests += 1
                self._sent.append(SentRequest(method.decode("ascii", "replace"), _target_of(head), _status_of(response)))
                self._bytes += len(head) + len(body) + len(response)
            answer, keep = _keep_alive_response(response, method)
            await self._sleep_until(loop.time() + self._transmit(len(answer)) + self._rtt_s / 2)
            client_writer.write(answer)
            await client_writer.drain()
            if not keep:
                return

    def _transmit(self, size: int) -> float:
        return size / self._bandwidth if self._bandwidth is not None else 0.0

    @staticmethod
    async def _sleep_until(due: float) -> None:
        wait = due - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)


_MAX_HEAD = 64 * 1024


class SentRequest(NamedTuple):
    """One request the proxy forwarded: its method, its path (no query) and the status of its answer (0: none)."""

    method: str
    path: str
    status: int


def _status_of(response: bytes) -> int:
    parts = response.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _target_of(head: bytes) -> str:
    """The path of a request's first line (its query dropped)."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    return parts[1].split(b"?", 1)[0].decode("ascii", "replace") if len(parts) > 1 else ""


async def _read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[bytes, bytes, bytes] | None:
    """``(head, body, method)`` of the next request, or None at end of connection.

    ``Expect: 100-continue`` is answered here and dropped from the forwarded head, so a
    client that waits for it sends its body at once.
    """
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    if len(head) > _MAX_HEAD:
        return None
    lines = head.split(b"\r\n")
    method = lines[0].split(b" ", 1)[0].upper()
    kept = [lines[0]]
    length = 0
    chunked = expect_continue = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname == b"expect" and value.strip().lower() == b"100-continue":
            expect_continue = True
            continue
        if lname == b"connection":  # upstream: one request per connection (below), whatever the client asked
            continue
        if lname == b"content-length":
            length = int(value.strip())
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        kept.append(line)
    if expect_continue:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if chunked:
        body = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            body += size_line
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = await reader.readuntil(b"\r\n")
                    body += trailer
                    if trailer == b"\r\n":
                        break
                break
            body += await reader.readexactly(size + 2)
        data = bytes(body)
    else:
        data = await reader.readexactly(length) if length else b""
    while kept[-1] == b"":  # the head's closing empty line, restored after the header added
        kept.pop()
    kept += [b"Connection: close", b"", b""]
    return b"\r\n".join(kept), data, method


def _keep_alive_response(response: bytes, method: bytes) -> tuple[bytes, bool]:
    """``response`` with ``Connection: close`` dropped and a length stated, and whether the connection stays open."""
    end = response.find(b"\r\n\r\n")
    if end < 0:
        return response, False
    head, body = response[:end], response[end + 4 :]
    lines = head.split(b"\r\n")
    status = lines[0].split(b" ")
    code = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
    kept = [lines[0]]
    framed = False
    for line in lines[1:]:
        name = line.partition(b":")[0].strip().lower()
        if name == b"connection":
            continue
        if name in (b"content-length", b"transfer-encoding"):
            framed = True
        kept.append(line)
    if not framed and method != b"HEAD" and code not in (204, 304) and not 100 <= code < 200:
        kept.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(kept) + b"\r\n\r\n" + body, True
