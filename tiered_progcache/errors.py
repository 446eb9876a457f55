"""Exceptions a tier raises so the chain can count *why* a lookup missed."""

from __future__ import annotations

__all__ = ["DeleteFailed", "EntryRejected", "InterpreterExiting", "RemoteURLError", "TierUnavailable", "one_line"]


class EntryRejected(KeyError):
    """The stored entry failed its integrity or signature check and was not returned.

    A ``KeyError`` so that ``get()`` on any tier treats it as a miss.
    """


class RemoteURLError(ValueError):
    """A remote URL that cannot name a shared store: no scheme (``notaurl``, ``s3:/bucket``), an unknown one.

    A ``ValueError`` (a bad setting); the command reports it as a configuration problem
    (exit 1, like a missing bucket), since a typo here would otherwise run a fleet uncached.
    """


class TierUnavailable(OSError):
    """The tier is cooling down after repeated failures; the operation was not attempted."""


class InterpreterExiting(RuntimeError):
    """A request needed a thread or a pool that the exiting interpreter refused: not the store's fault.

    Python 3.12.0 to 3.12.2 start no thread once the main thread has ended, so a store whose
    client was not built by then cannot take the uploads the exit flush gives it. The breaker
    and the node's down memo do not count it; the write is dropped with this message.
    """


class DeleteFailed(OSError):
    """``del cache[key]`` could not remove the entry from every tier that may hold it.

    The tiers that could delete it did; the ones named in ``tiers`` may still serve it
    (a remote during an outage would hand it back to the next process). Raised rather
    than logged because a delete is asked for on purpose: the caller must know it did
    not happen, and may retry.
    """

    def __init__(self, message: str, tiers: tuple[str, ...]) -> None:
        super().__init__(message)
        self.tiers = tiers


def one_line(exc: BaseException) -> str:
    """``"Type: first line of the message"``, at most 200 characters: how every log line and CLI error names a failure."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]
