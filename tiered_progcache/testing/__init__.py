"""Test helpers for tier authors: the shared contract suites, a fault-injecting store wrapper (and, with the test extra, server fixtures)."""

from __future__ import annotations

from .contract import BackDoor, EntryStoreTests, LeaseStoreTests, ProgramCacheContract, keyed_chain
from .wrapper import Gate, WrapperEntryStore

__all__ = ["BackDoor", "EntryStoreTests", "Gate", "LeaseStoreTests", "ProgramCacheContract", "WrapperEntryStore",
           "keyed_chain"]
