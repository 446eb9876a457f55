"""Exceptions a tier raises so the chain can count *why* a lookup missed."""

from __future__ import annotations

__all__ = ["EntryRejected", "TierUnavailable"]


class EntryRejected(KeyError):
    """The stored entry failed its integrity or signature check and was not returned.

    A ``KeyError`` so that ``get()`` on any tier treats it as a miss.
    """


class TierUnavailable(OSError):
    """The tier is cooling down after repeated failures; the operation was not attempted."""
