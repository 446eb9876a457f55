"""A failed compile's record, so the cluster fails once: the holder publishes it, its waiters raise it.

The exception's type and message (cut at :data:`MAX_MESSAGE_BYTES`), its expiry and what the failed
work read beyond its key (a flight by direct key: the header digest, so a waiter that reads other
headers does not raise it), sealed in the shared store's envelope under a name derived from the
entry's (never the entry's own). Only
built-in and cuda-core exception types are rebuilt; a record that does not open is ignored.
docs/cluster.md ("A failing kernel fails once per cluster") says why each part is there.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import time

from .._cudacore import ERROR_MODULE
from ..stores.store import EntryStore, entry_name
from .lease import FAILURE_TTL_S

__all__ = ["MAX_MESSAGE_BYTES", "CompileFailedElsewhere", "FailureRecord", "failure_record_name"]

logger = logging.getLogger(__name__)

#: The most of the failure's message (and so of the compiler log) a record carries.
MAX_MESSAGE_BYTES = 64 * 1024
_FORMAT = "tiered-progcache/compile-failure"
#: 2: the expiry is sealed with the record (1 had none of its own).
_VERSION = 2
#: Modules whose exception classes a waiter rebuilds (what ``Program.compile`` raises from).
_REBUILT_MODULES = ("builtins", ERROR_MODULE, "cuda.core")


class CompileFailedElsewhere(RuntimeError):
    """Another node's compile of this entry failed with an exception type that is not rebuilt here."""


def failure_record_name(name: str) -> str:
    """The name a failure record of entry ``name`` is sealed under (never an entry's own name)."""
    return entry_name(f"{_FORMAT}:{name}")


class FailureRecord:
    """What one failed compile tells its waiters: the exception's type and message. Immutable.

    >>> sealed = FailureRecord.of(exc).seal(store, name); FailureRecord.open(store, name, sealed).raise_it()
    """

    __slots__ = ("module", "qualname", "message", "inputs")

    def __init__(self, module: str, qualname: str, message: str, inputs: str = "") -> None:
        self.module, self.qualname, self.message, self.inputs = module, qualname, message, inputs

    @classmethod
    def of(cls, exc: BaseException, inputs: str = "") -> FailureRecord:
        """The record of ``exc``; ``inputs``: what the failed work read beyond its key (``run_once``'s)."""
        message = str(exc)
        encoded = message.encode("utf-8", "replace")
        if len(encoded) > MAX_MESSAGE_BYTES:
            message = encoded[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore") + "\n[... cut at 64 KiB]"
        return cls(type(exc).__module__, type(exc).__qualname__, message, inputs)

    def seal(self, store: EntryStore, name: str, *, ttl_s: float = FAILURE_TTL_S, now: float | None = None) -> bytes:
        """This record sealed for entry ``name``, expiring ``ttl_s`` after ``now`` (default: the wall clock)."""
        expires_at = (time.time() if now is None else now) + ttl_s
        doc = {"format": _FORMAT, "version": _VERSION, "entry": name, "module": self.module,
               "qualname": self.qualname, "message": self.message, "expires_at": expires_at,
               "inputs": self.inputs}  # fmt: skip
        return store.seal_record(failure_record_name(name), json.dumps(doc, sort_keys=True).encode())

    @classmethod
    def open(cls, store: EntryStore, name: str, sealed: bytes, *, now: float | None = None) -> FailureRecord | None:
        """The record sealed for entry ``name``; None (logged) for one that does not verify, parse, or has expired.

        The expiry read is the sealed one: a lease document's own expiry is not signed.
        """
        try:
            doc = json.loads(store.open_record(failure_record_name(name), sealed))
            if not (isinstance(doc, dict) and doc.get("format") == _FORMAT and doc.get("entry") == name):
                raise ValueError("not a failure record of this entry")
            module, qualname, message = doc["module"], doc["qualname"], doc["message"]
            inputs = doc.get("inputs", "")
            if not all(isinstance(v, str) for v in (module, qualname, message, inputs)):
                raise ValueError("fields are not strings")
            expires_at = doc.get("expires_at")
            if doc.get("version") != _VERSION or isinstance(expires_at, bool) or not isinstance(expires_at, (int, float)) \
                    or not math.isfinite(expires_at):  # fmt: skip
                raise ValueError("it carries no sealed expiry (written by an older version)")
            late = (time.time() if now is None else now) - expires_at
            if late >= 0:
                raise ValueError(f"it expired {late:.1f} s ago (a replayed record?)")
        except Exception as exc:
            logger.warning("ignoring the failure record on lease %s: %s", name[:16], exc)
            return None
        return cls(module, qualname, message[: MAX_MESSAGE_BYTES + 64], inputs)

    def exception(self) -> Exception:
        """The exception to raise: the holder's type where it is one a compile raises, with its message."""
        kind: object = None
        if self.module in _REBUILT_MODULES and "." not in self.qualname:
            try:
                kind = getattr(importlib.import_module(self.module), self.qualname, None)
            except ImportError:
                kind = None
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                return kind(self.message)
            except Exception:
                pass
        return CompileFailedElsewhere(f"{self.module}.{self.qualname}: {self.message}")
