"""Shared-tier URLs: which backend a URL names and whether its shape is usable, without loading a backend.

The settings table checks ``remote`` with these (a bad URL fails as the setting is
read, before anything is built), and the backends parse their URLs with them, so a
URL the settings accept is one the backend opens. Nothing here imports redis-py;
:func:`check_url` asks fsspec (a dependency, loaded only when an fsspec URL is named)
which schemes it knows.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

from .errors import RemoteURLError
from .redact import mask_url

__all__ = ["DEFAULT_REDIS_PREFIX", "REDIS_SCHEMES", "check_redis_url", "check_url", "is_redis_url", "split_redis_url"]

#: URL schemes the Redis tier serves; every other scheme is an fsspec remote.
REDIS_SCHEMES = ("redis", "rediss", "unix")
#: Redis key prefix when the URL gives none.
DEFAULT_REDIS_PREFIX = "tiered-progcache"


def is_redis_url(url: object) -> bool:
    """True for ``redis://``, ``rediss://`` and ``unix://`` URLs (no redis import needed)."""
    return isinstance(url, str) and url.split("://", 1)[0].lower() in REDIS_SCHEMES and "://" in url


def check_redis_url(url: str) -> None:
    """``ValueError`` unless ``url`` is a Redis URL the Redis tier can use (a db number, a non-empty prefix)."""
    split_redis_url(url)


def split_redis_url(url: str) -> tuple[str, str]:
    """``(url for redis-py, key prefix)``: the prefix taken out of the path or the query."""
    if not is_redis_url(url):
        raise ValueError(f"not a Redis URL (redis://, rediss:// or unix://): {mask_url(str(url))!r}")
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = DEFAULT_REDIS_PREFIX
    kept = []
    for name, value in query:
        if name == "prefix":
            prefix = value
        else:
            kept.append((name, value))
    path = parts.path
    if parts.scheme in ("redis", "rediss"):
        db, _, rest = path.strip("/").partition("/")
        if db and not db.isdigit():
            raise ValueError(f"Redis URL path must start with a database number: {mask_url(url)!r}")
        if rest:
            prefix = rest.strip("/")
        path = f"/{db}" if db else ""
    if not prefix or any(c.isspace() for c in prefix):
        raise ValueError(f"Redis key prefix must be non-empty, without spaces, got {prefix!r}")
    query_text = urlencode(kept)
    # Built by hand: urlunsplit drops the "//" of a unix:// URL that has no host.
    return f"{parts.scheme}://{parts.netloc}{path}" + (f"?{query_text}" if query_text else ""), prefix


#: Schemes fsspec's registry always lists (``fsspec.available_protocols()``), known here without importing it.
FSSPEC_BUILT_IN = frozenset({"s3", "s3a", "gs", "gcs", "file", "memory"})


def check_url(url: str) -> None:
    """``RemoteURLError`` unless ``url`` is non-empty, has a scheme (``s3://``, ``file://``), and fsspec knows each one.

    A chained URL (``simplecache::s3://bucket``) names bare protocols before its last
    part, which must have ``://``. A path without a scheme is refused rather than read
    as a local path: ``notaurl`` or ``s3:/bucket`` is a typo, and taking it for a
    directory would put the "shared" cache in the working directory.
    """
    if not isinstance(url, str) or not url.strip():
        raise RemoteURLError(f"remote URL must be a non-empty str, got {url!r}")
    shown = mask_url(url)
    *outer, last = url.split("::")
    if "://" not in last:
        shown = _mask_schemeless(shown)
        hint = ""
        scheme, sep, rest = last.partition(":")
        if sep and scheme.isalnum():
            hint = f"; did you mean {scheme}://{_mask_schemeless(rest.lstrip('/'))}?"
        elif last.startswith("/"):
            hint = f"; for a local or NFS directory write file://{_mask_schemeless(last)}"
        raise RemoteURLError(
            f"remote URL {shown!r} has no scheme (give s3://bucket/prefix, gs://..., file:///abs/path, memory://...){hint}"
        )
    schemes = [*outer, last.split("://", 1)[0]]
    if FSSPEC_BUILT_IN.issuperset(schemes):
        return  # fsspec's import (tens of ms) is for the filesystem's build, off a fresh process's first compile
    import fsspec

    known = set(fsspec.available_protocols())
    for scheme in schemes:
        if scheme not in known:
            raise RemoteURLError(f"unknown URL scheme {scheme!r} in {shown!r} (fsspec knows e.g. s3, gs, file, memory)")


def _mask_schemeless(text: str) -> str:
    """A URL missing its ``://`` (``redis:/:PW@host``) may still carry a password: everything before its last ``@`` is hidden."""
    _, at, tail = text.rpartition("@")
    return f"***@{tail}" if at else text
