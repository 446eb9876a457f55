"""Test helpers for tier authors: the shared contract suite (and, with the test extra, server fixtures)."""

from __future__ import annotations

from .contract import ProgramCacheContract

__all__ = ["ProgramCacheContract"]
