"""Test helpers for tier authors: the shared contract suites (and, with the test extra, server fixtures)."""

from __future__ import annotations

from .contract import EntryStoreTests, ProgramCacheContract

__all__ = ["EntryStoreTests", "ProgramCacheContract"]
