"""The one masking function: secrets out of URLs, storage options and messages before anything prints them.

:func:`masked` serves reprs, ``location``, ``tiered-progcache config``, ``stats --remote``
and log lines alike. What it understands, in any string and at any depth of a mapping
or sequence:

- a URL's userinfo, the way redis-py and fsspec split it (``urllib.parse``): the
  authority runs to the first ``/``, and the userinfo to the LAST ``@`` before it, so
  ``redis://user:p@ssPW@host`` keeps ``user`` and masks all of ``p@ssPW``; a userinfo
  with no ``:`` is a user name (``abfs://container@account``, ``redis://user@host``);
- query parameters whose name looks secret (``?password=PW``, redis-py's documented
  form, for ``unix:///path?password=PW`` too; ``pass``, ``token``, ``sig``, ``*key``, ...);
- every URL of an fsspec chain (``simplecache::s3://...``) and of a comma-separated
  list, and URLs inside free text (an exception message);
- storage options (mappings): the value of every secret-looking key, nested or not
  (``client_kwargs.aws_session_token``).

What is not secret (an endpoint, a region, a host, a db number) is kept, so a printed
configuration can still be debugged. Masking errs toward hiding: a ``?`` or ``#`` before
the last ``@`` is taken as part of a password, not as the start of a query.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "SECRET_NAME", "mask_url", "masked"]

MASK = "***"

#: Option keys and query parameters whose values are masked (``aws_session_token``, ``password``, ``sig``, ``api_key``).
SECRET_NAME = re.compile(
    r"secret|token|pass|pwd|credential|connection_string|auth|private|sas|signature|^sig$|key$", re.IGNORECASE
)
#: A URL's scheme and ``://``; what follows up to whitespace is the URL (secrets in URLs are percent-encoded).
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
#: One query parameter (``name=value``), after ``?``, ``&`` or ``;``.
_PARAM = re.compile(r"(?<=[?&;])([^=&;#?\s]*)=([^&;#\s]*)")


def _mask_userinfo(text: str, start: int) -> str:
    """``text`` with the password of the userinfo that starts at ``start`` (just after ``://``) masked."""
    slash = text.find("/", start)
    end = len(text) if slash < 0 else slash
    whitespace = re.search(r"\s", text[start:end])
    if whitespace:
        end = start + whitespace.start()
    at = text.rfind("@", start, end)
    if at < 0:
        return text
    colon = text.find(":", start, at)
    if colon < 0:
        return text  # a user name only (redis://user@host, abfs://container@account)
    return f"{text[: colon + 1]}{MASK}{text[at:]}"


def mask_url(text: str) -> str:
    """``text`` with the password of every URL in it and every secret-looking query parameter masked.

    >>> mask_url("redis://u:p@ss@cache:6379/0?password=PW&db=0")
    'redis://u:***@cache:6379/0?password=***&db=0'
    """
    # Right to left, so each mask leaves the positions of the URLs before it as they were.
    for match in reversed(list(_SCHEME.finditer(text))):
        text = _mask_userinfo(text, match.end())
    if "=" in text:
        text = _PARAM.sub(lambda m: f"{m.group(1)}={MASK}" if m.group(2) and SECRET_NAME.search(m.group(1))
                          else m.group(0), text)  # fmt: skip
    return text


def masked(value: Any) -> Any:
    """``value`` safe to print: secret-looking keys' values, URL passwords and secret query parameters masked."""
    if isinstance(value, Mapping):
        return {k: MASK if v and SECRET_NAME.search(str(k)) else masked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(masked(v) for v in value)
    if isinstance(value, str):
        return mask_url(value)
    return value
