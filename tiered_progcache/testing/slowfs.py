"""An in-memory object store with injected round-trip time and a write gate, for tests and benchmarks.

``SlowFileSystem`` is an fsspec ``AsyncFileSystem`` (so the remote tier treats it like
s3fs or gcsfs: batched ``cat``, deadlines by cancellation) whose every request waits
``delay_s`` on the event loop before it is answered: 1000 sequential reads at 30 ms
take 30 s, 1000 concurrent ones about 30 ms. ``write_gate`` (a ``threading.Event``)
holds every write until the test sets it, which makes "a background upload is still
running" a state a test can reach without sleeping. ``requests`` counts calls by
operation, for tests that must prove something never reached the store. Setting
``failure`` to an exception makes every request raise it (a remote that is down) until
it is set back to None (the remote recovered).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

from fsspec.asyn import AsyncFileSystem

__all__ = ["SlowFileSystem"]


class SlowFileSystem(AsyncFileSystem):
    """Buckets of objects in a dict, behind a fixed per-request delay. Thread-safe under the GIL.

    >>> fs = SlowFileSystem(delay_s=0.03); fs.mkdir("bench")
    >>> RemoteProgramCache(fs, "bench/kernels")
    """

    protocol = "slow"
    root_marker = ""  # an object store: the first path component is the bucket
    cachable = False  # each instance is its own store (fsspec would hand back an equal instance's objects)

    def __init__(self, delay_s: float = 0.0, write_gate: threading.Event | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s
        self.write_gate = write_gate
        self.writes_started = threading.Event()
        self.objects: dict[str, tuple[bytes, float]] = {}
        self.buckets: set[str] = set()
        self.requests: collections.Counter[str] = collections.Counter()
        self.in_flight = 0
        self.max_in_flight = 0  # the most requests ever waiting at once: proof of concurrency
        self.failure: BaseException | None = None  # raised by every request while set


    async def _round_trip(self, op: str) -> None:
        self.requests[op] += 1
        if self.failure is not None:
            raise self.failure
        if self.delay_s:
            self.in_flight += 1  # every request runs on the one event loop: no lock needed
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.in_flight -= 1

    def _file_info(self, path: str) -> dict[str, Any]:
        data, mtime = self.objects[path]
        return {"name": path, "size": len(data), "type": "file", "mtime": mtime}

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        await self._round_trip("info")
        path = self._strip_protocol(path).rstrip("/")
        if path in self.objects:
            return self._file_info(path)
        if path in self.buckets or any(p.startswith(path + "/") for p in self.objects):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        await self._round_trip("get")
        path = self._strip_protocol(path)
        try:
            return self.objects[path][0][start:end]
        except KeyError:
            raise FileNotFoundError(path) from None

    async def _pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self.writes_started.set()
        if self.write_gate is not None:
            await _wait_for_event(self.write_gate)
        await self._round_trip("put")
        path = self._strip_protocol(path)
        if path.split("/", 1)[0] not in self.buckets:
            raise FileNotFoundError(f"no such bucket: {path}")
        if mode == "create" and path in self.objects:
            raise FileExistsError(path)
        self.objects[path] = (bytes(value), time.time())

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        await self._round_trip("delete")
        path = self._strip_protocol(path)
        if self.objects.pop(path, None) is None:
            raise FileNotFoundError(path)

    async def _rm(self, path: str | list[str], recursive: bool = False, **kwargs: Any) -> None:
        await self._round_trip("delete")
        for p in [path] if isinstance(path, str) else path:
            self.objects.pop(self._strip_protocol(p), None)

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        prefix = self._strip_protocol(path).rstrip("/") + "/"
        found = sorted(p for p in self.objects if p.startswith(prefix))
        for _ in range(max(1, -(-len(found) // 1000))):  # one request per page of 1000, like S3
            await self._round_trip("list")
        if kwargs.get("detail"):
            return {p: self._file_info(p) for p in found}
        return found

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        await self._round_trip("list")
        prefix = self._strip_protocol(path).rstrip("/") + "/"
        children: dict[str, dict[str, Any]] = {}
        for p in self.objects:
            if p.startswith(prefix):
                head, sep, _ = p[len(prefix) :].partition("/")
                child = prefix + head
                children[child] = {"name": child, "size": 0, "type": "directory"} if sep else self._file_info(p)
        if not children and prefix.rstrip("/") not in self.buckets:
            raise FileNotFoundError(path)
        return list(children.values()) if detail else sorted(children)

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.buckets.add(self._strip_protocol(path).split("/", 1)[0])

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        await self._mkdir(path)


async def _wait_for_event(event: threading.Event) -> None:
    """Await a ``threading.Event`` from a daemon thread (a pool thread would hold up interpreter exit)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    threading.Thread(target=lambda: (event.wait(), loop.call_soon_threadsafe(wake)), daemon=True).start()
    await done
