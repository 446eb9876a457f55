"""The shared contract, run against cuda-core's two tiers and against the chain."""

from __future__ import annotations

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache.testing import ProgramCacheContract


class TestInMemoryProgramCache(ProgramCacheContract):
    @pytest.fixture
    def cache(self):
        with InMemoryProgramCache() as c:
            yield c


class TestFileStreamProgramCache(ProgramCacheContract):
    @pytest.fixture
    def cache(self, tmp_path):
        with FileStreamProgramCache(tmp_path / "fs") as c:
            yield c


class TestTieredDefaultChain(ProgramCacheContract):
    @pytest.fixture
    def cache(self, tmp_path):
        with TieredProgramCache(tmp_path / "tiered") as c:
            yield c


class TestTieredCustomChain(ProgramCacheContract):
    """A user-assembled chain: two memory tiers (one not promoted into) and a background file tier."""

    @pytest.fixture
    def cache(self, tmp_path):
        chain = TieredProgramCache(
            tiers=[
                InMemoryProgramCache(),
                (InMemoryProgramCache(), TierPolicy("no-promote", promote=False)),
                (FileStreamProgramCache(tmp_path / "bg"), TierPolicy("background-disk", write="background")),
            ]
        )
        with chain as c:
            yield c
