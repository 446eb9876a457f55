"""GCS through its JSON API on urllib3: a client a fresh process builds in tens of milliseconds.

gcsfs takes 0.7-1.0 s of the interpreter to import (aiohttp, google-auth, Google's storage
control client), on the clock of every fresh process and beside its first compiles. The remote
tier asks six things of a bucket (an object's metadata, its bytes or a range of them, a put, a
create-if-absent, a listing, a delete), each one documented request of GCS's JSON API, which
:class:`GcsJsonCalls` makes with urllib3 and, for credentials, google-auth (both installed with
gcsfs), under the blocking fsspec method names the requests call (:class:`~.runner.BlockingCalls`).
:func:`gcs_config` says when: where the storage options say nothing but an endpoint, a project
and a token it reads as gcsfs does (anonymous, Google's default credentials, the metadata
server's, or a key file); otherwise gcsfs is built as before.

Thread-safe; a forked child builds its own (the runner rebuilds the client there).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import threading
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import Any

from ..redact import mask_url
from .envelope import MAX_ENTRY_BYTES, max_stored_bytes
from .objectstore import CACHE_ONLY_OPTIONS, BucketCalls, BucketFactory
from .ratelimit import log_once

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_ENDPOINT", "GcsJsonCalls", "GcsJsonFactory", "gcs_config"]

#: Where GCS answers, unless the options or ``STORAGE_EMULATOR_HOST`` name another endpoint (as for gcsfs).
DEFAULT_ENDPOINT = "https://storage.googleapis.com"
#: What a token from Google's credentials may do: read, write and delete objects, nothing of the bucket's.
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
#: gcsfs's ``token`` values read the same way here (any other string must be a key file's path).
_TOKENS = ("anon", "google_default", "cloud")
#: The key files read here, as gcsfs reads them: a service account's key, a user's refresh token.
_KEY_FILE_TYPES = ("service_account", "authorized_user")
#: gcsfs's own cache of user tokens, which it tries before the metadata server where ``token`` is None: only gcsfs
#: reads it, so with it present gcsfs is used.
_GCSFS_TOKEN_CACHE = "~/.gcs_tokens"
#: Deletes of one batch in flight at once (GCS has no multi-object delete in its JSON API but a batch endpoint).
DELETE_CONCURRENCY = 16
#: Connections kept per endpoint: the runner's threads, a warm's batch of them included, each hold one at a time.
POOL_SIZE = 32
#: Far past any deadline of the runner's, which ends the caller's wait first: these free a thread a hung server holds
#: (a read that may be sent twice is tried once more, so within two read timeouts).
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 600.0
#: Statuses GCS's guidance says to retry: a GET, HEAD or DELETE answered with one is sent again (at most twice).
RETRIED_STATUSES = (408, 429, 500, 502, 503, 504)
#: Objects per page of a listing (GCS's most).
LIST_PAGE_SIZE = 1000
#: The most bytes of an answer read that is not an object's bytes (metadata, a listing page: about 1 MB at most).
MAX_ANSWER_BYTES = 16 << 20
#: The most bytes of an object read without a range: the largest envelope (the largest entry, its header, a MAC).
MAX_OBJECT_BYTES = max_stored_bytes(MAX_ENTRY_BYTES)


def gcs_config(storage_options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The endpoint and token :class:`GcsJsonCalls` uses for gcsfs's ``storage_options``, or None (use gcsfs).

    None where urllib3 is not installed, where an option is one only gcsfs honours, where a token
    needs google-auth and it is not installed, or where gcsfs would find a token in its own cache.
    """
    if environ is None:
        environ = os.environ
    if importlib.util.find_spec("urllib3") is None:
        return None
    config: dict[str, Any] = {"token": None}
    for name, value in storage_options.items():
        if name in CACHE_ONLY_OPTIONS or (name == "project" and isinstance(value, str)):
            continue  # a project is for creating or listing buckets, never asked here
        if name == "endpoint_url" and isinstance(value, str) and value.startswith(("http://", "https://")):
            config["endpoint"] = value.rstrip("/")
        elif name == "token" and (value is None or value in _TOKENS or _key_file_type(value) in _KEY_FILE_TYPES):
            config["token"] = value
        else:
            return None
    if "endpoint" not in config:
        emulator = environ.get("STORAGE_EMULATOR_HOST", "")
        config["endpoint"] = (emulator if "://" in emulator else f"http://{emulator}").rstrip("/") if emulator \
            else DEFAULT_ENDPOINT  # fmt: skip
    if config["token"] != "anon" and importlib.util.find_spec("google.auth") is None:
        return None
    if config["token"] is None and os.path.exists(os.path.expanduser(_GCSFS_TOKEN_CACHE)):
        return None
    return config


def _key_file_type(token: object) -> str | None:
    """The ``type`` a JSON key file at ``token`` names (a path, as gcsfs takes one), else None."""
    if not isinstance(token, str):
        return None
    try:
        with open(os.path.expanduser(token), encoding="utf-8") as fh:
            kind = json.loads(fh.read(1 << 20)).get("type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


@dataclasses.dataclass(frozen=True)
class GcsJsonFactory(BucketFactory):
    """A GCS bucket's client (:class:`GcsJsonCalls`). Immutable."""

    @classmethod
    def config_for(cls, scheme: str, storage_options: Mapping[str, Any]) -> dict[str, Any] | None:
        return gcs_config(storage_options) if scheme in ("gs", "gcs") else None

    def build(self, fresh: bool = False) -> Any:
        return GcsJsonCalls(self.root.split("/", 1)[0], self.config, self.storage_options)


class GcsJsonCalls(BucketCalls):
    """One bucket's JSON API requests under the blocking fsspec method names the remote tier's requests call.

    Errors as :class:`~.objectstore.BucketCalls` says, and ``ConnectionRefusedError`` and
    ``TimeoutError``; each in one line naming the object, never a credential.
    """

    protocol = ("gs", "gcs")

    def __init__(self, bucket: str, config: Mapping[str, Any], storage_options: Mapping[str, Any], *,
                 read_timeout_s: float = READ_TIMEOUT_S, list_page_size: int = LIST_PAGE_SIZE) -> None:
        import urllib3

        self._urllib3 = urllib3
        # A connection that failed, and a lost answer (once) or a status GCS says to retry (408, 429, 5xx) of a request
        # that may be sent twice, are tried again within the runner's deadline: at most twice in all. A POST is not
        # (urllib3's methods to retry hold none: a create whose answer was lost would find its own object).
        retries = urllib3.Retry(total=2, read=1, status_forcelist=RETRIED_STATUSES, backoff_factor=0.05,
                                backoff_max=1.0, raise_on_status=False)
        self._retries = retries
        self._http = urllib3.PoolManager(maxsize=POOL_SIZE, retries=retries,
                                         timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=read_timeout_s))
        self._endpoint = str(config["endpoint"])
        self._page_size = str(list_page_size)
        self._credentials = _Credentials(config.get("token"), self._http)
        super().__init__(bucket, storage_options)

    def __repr__(self) -> str:
        return f"GcsJsonCalls(gs://{self._bucket})"

    def _object_url(self, key: str) -> str:
        return f"/storage/v1/b/{self._bucket}/o/{urllib.parse.quote(key, safe='')}"

    def info(self, path: str) -> dict[str, Any]:
        key = self._key(path)
        if not key:  # the bucket: one listing of a prefix nothing is stored under, which a missing bucket refuses
            self._request("GET", f"/storage/v1/b/{self._bucket}/o", path,
                          query={"prefix": "tiered-progcache-probe/", "maxResults": "1"})
            return {"name": self._bucket, "type": "directory", "size": 0}
        return self._info_of(json.loads(self._request("GET", self._object_url(key), path)))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        key = self._key(path)
        if start is None and end is None:
            return self._request("GET", self._object_url(key), path, query={"alt": "media"}, limit=MAX_OBJECT_BYTES)
        first = start or 0
        if end is not None and end <= first:
            return b""
        wanted = f"bytes={first}-" + ("" if end is None else str(end - 1))
        try:  # (at most ``end`` bytes read: a server that ignores the range sends the object from its start)
            data = self._request("GET", self._object_url(key), path, query={"alt": "media"},
                                 headers={"range": wanted}, ranged=True,
                                 limit=MAX_OBJECT_BYTES if end is None else end)
        except _RangeNotSatisfiable:
            return b""  # the object is there (an absent one is a 404) and ends before ``start``
        return data

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **_: Any) -> None:
        """One multipart upload (the object's name, then its bytes), as gcsfs makes it: the emulator honours a
        create's precondition there."""
        query = {"uploadType": "multipart"}
        if mode == "create":
            query["ifGenerationMatch"] = "0"  # only if no live object has the name: GCS refuses it with 412
        boundary = uuid.uuid4().hex  # in no body: a new one per upload
        head = (f"--{boundary}\r\ncontent-type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps({'name': self._key(path)})}\r\n--{boundary}\r\n"
                f"content-type: application/octet-stream\r\n\r\n").encode()
        body = b"".join((head, value, f"\r\n--{boundary}--\r\n".encode()))
        self._request("POST", f"/upload/storage/v1/b/{self._bucket}/o", path, query=query, body=body,
                      headers={"content-type": f'multipart/related; boundary="{boundary}"'})

    def find(self, path: str, detail: bool = False) -> Any:
        key = self._key(path).rstrip("/")
        query = {"prefix": key + "/" if key else "", "maxResults": self._page_size}
        found: dict[str, dict[str, Any]] = {}
        while True:
            page = json.loads(self._request("GET", f"/storage/v1/b/{self._bucket}/o", path, query=query))
            for meta in page.get("items", ()):
                info = self._info_of(meta)
                found[info["name"]] = info
            token = page.get("nextPageToken")
            if not token:
                break
            query["pageToken"] = token
        return found if detail else sorted(found)

    def rm_file(self, path: str) -> None:
        self._request("DELETE", self._object_url(self._key(path)), path)

    def rm(self, paths: list[str] | str) -> None:
        """Remove each path (an absent one too: the outcome asked for holds), ``DELETE_CONCURRENCY`` at once."""
        paths = [paths] if isinstance(paths, str) else list(paths)
        for path in paths:
            self._key(path)  # every path in this bucket, before any is removed

        def remove(path: str) -> None:
            with contextlib.suppress(FileNotFoundError):
                self.rm_file(path)

        with concurrent.futures.ThreadPoolExecutor(min(DELETE_CONCURRENCY, max(1, len(paths))),
                                                   thread_name_prefix="tiered-progcache-gcs-rm") as pool:
            for done in pool.map(remove, paths):
                del done  # each one's exception, if any, raised here

    def _info_of(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        return {"name": f"{self._bucket}/{meta['name']}", "type": "file", "size": int(meta.get("size") or 0),
                "updated": meta.get("updated"), "generation": meta.get("generation")}  # fmt: skip

    def _request(self, method: str, url_path: str, path: str, *, query: Mapping[str, str] | None = None,
                 body: bytes | None = None, headers: Mapping[str, str] | None = None, ranged: bool = False,
                 limit: int = MAX_ANSWER_BYTES) -> bytes:
        """One request's body, of which at most ``limit`` bytes are read (a longer one's connection is dropped and,
        but for a range's whole object, the answer refused); its failure raised as gcsfs raises it, in one line
        naming ``path``."""
        url = self._endpoint + url_path + ("?" + urllib.parse.urlencode(query) if query else "")
        try:
            sent = {**(headers or {}), **self._credentials.headers()}
            retries = self._retries
            while True:
                response = self._http.request(method, url, body=body, headers=sent, redirect=False, retries=retries,
                                              preload_content=False)
                try:
                    data = _read_at_most(response, limit)
                    break
                except self._urllib3.exceptions.HTTPError as exc:  # a body cut short: a lost answer, as urllib3's
                    retries = response.retries.increment(method, url, error=exc)  # own retries count it (or raise)
                    retries.sleep()
        except self._urllib3.exceptions.HTTPError as exc:
            raise _transport_error(path, exc) from None
        except _CredentialsError as exc:
            raise PermissionError(mask_url(f"{path}: {exc}")) from None
        status = response.status
        if status < 400 and len(data) > limit and not (ranged and status == 200):
            raise OSError(mask_url(f"{path}: an answer over the {limit} bytes this request reads"))
        if status >= 400 and status != 404:
            # A server may close the connection after an error answer without saying so (fake-gcs-server does after
            # its 416), and a POST sent on it would fail: the connections kept are dropped, in-flight ones once done.
            self._http.clear()
        if status == 416 and ranged:
            raise _RangeNotSatisfiable
        if status >= 400:
            raise _status_error(path, status, data)
        if ranged and status == 200:  # a server that ignored the range sent it all
            first, _, last = headers["range"][len("bytes="):].partition("-")  # type: ignore[index]
            return data[int(first): None if not last else int(last) + 1]
        return data


def _read_at_most(response: Any, limit: int) -> bytes:
    """Up to ``limit`` + 1 bytes of ``response``'s body; its connection goes back to the pool for another request only
    where the body ended within them (a longer body, or a read that failed, closes it)."""
    try:
        return response.read(limit + 1)
    finally:
        if not response.closed:  # (a body read to its end closes itself)
            response.close()
        response.release_conn()


class _RangeNotSatisfiable(Exception):
    """GCS's 416: a range that starts at or past the object's end."""


class _CredentialsError(Exception):
    """google-auth could not give a token (no credentials found, or the refresh failed)."""


class _Credentials:
    """The Authorization header of each request: none for anonymous access, else a google-auth token, made on the
    first request and refreshed when it expires, under a lock (one refresh for every thread)."""

    def __init__(self, token: str | None, http: Any) -> None:
        self._token = token
        self._http = http
        self._lock = threading.Lock()
        self._anonymous = token == "anon"
        self._google: Any = None

    def headers(self) -> dict[str, str]:
        if self._anonymous:
            return {}
        with self._lock:
            try:
                if self._google is None:
                    self._google = self._load()
                    if self._google is None:
                        self._anonymous = True
                        return {}
                if not self._google.valid:
                    import google.auth.transport.urllib3

                    self._google.refresh(google.auth.transport.urllib3.Request(self._http))
            except Exception as exc:  # google-auth's errors: no credentials, a refused refresh, a transport fault
                raise _CredentialsError(f"no GCS token: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") \
                    from None  # fmt: skip
            return {"authorization": f"Bearer {self._google.token}"}

    def _load(self) -> Any:
        """google-auth's credentials for the token, or None for anonymous access (no default credentials found
        where ``token`` is None, as gcsfs ends its search)."""
        import google.auth
        import google.auth.exceptions

        if self._token == "cloud":
            import google.auth.compute_engine

            return google.auth.compute_engine.Credentials()
        if self._token not in (None, "google_default"):
            with open(os.path.expanduser(str(self._token)), encoding="utf-8") as fh:
                info = json.load(fh)
            if info.get("type") == "authorized_user":  # a user's token refuses a scope it was not granted
                import google.oauth2.credentials

                return google.oauth2.credentials.Credentials.from_authorized_user_info(info)
            import google.oauth2.service_account

            return google.oauth2.service_account.Credentials.from_service_account_info(info, scopes=[SCOPE])
        try:
            return google.auth.default(scopes=[SCOPE])[0]
        except google.auth.exceptions.DefaultCredentialsError:
            if self._token == "google_default":
                raise
            log_once(logger, "gcs-anonymous", logging.INFO, "no Google credentials found: GCS requests go anonymous")
            return None


def _status_error(path: str, status: int, body: bytes) -> OSError:
    """An error status as the exception gcsfs raises for it, with GCS's own message (its JSON's ``error.message``)."""
    try:
        said = str(json.loads(body)["error"]["message"])
    except Exception:
        said = body[:200].decode("utf-8", "replace")
    said = " ".join(said.split())[:300]
    kind: type[OSError] = {404: FileNotFoundError, 412: FileExistsError, 401: PermissionError,
                           403: PermissionError}.get(status, OSError)  # fmt: skip
    return kind(mask_url(f"{path}: HTTP {status}: {said}"))


def _transport_error(path: str, exc: BaseException) -> OSError:
    """urllib3's failure to get an answer as the builtin it is: a refused connection, a timeout, else OSError."""
    reason = getattr(exc, "reason", None) or exc  # MaxRetryError says why in ``reason``
    cause: BaseException | None = reason
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ConnectionRefusedError):
            return ConnectionRefusedError(mask_url(f"{path}: the endpoint refused the connection"))
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    first = str(reason).splitlines()[0] if str(reason) else type(reason).__name__
    kind = TimeoutError if isinstance(reason, TimeoutError) or "timed out" in first.lower() else OSError
    return kind(mask_url(f"{path}: {type(reason).__name__}: {first}"))
