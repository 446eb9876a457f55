"""What a lookup says at DEBUG and which tiers a span reads: the miss line names the tiers asked, word for word,
and a metadata read stays inside its span. Real cuda-core tiers and a ``file://`` remote."""

from __future__ import annotations

import logging

import pytest
from cuda.core.utils import FileStreamProgramCache, InMemoryProgramCache

from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache.chain.stats import MetadataKey

KEY = bytes(range(32))
LOGGER = "tiered_progcache.chain.tiered"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def chain(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    with TieredProgramCache(tmp_path / "local", remote=remote.as_uri()) as cache:
        yield cache


@pytest.mark.parametrize("key, where, asked", [
    (KEY, "all", "every tier"),
    ("a str key", "all", "every tier"),  # the slow path: read from the first tier
    (KEY, "nearby", "memory, local"),
    (KEY, "shared", "remote"),
])
def test_a_miss_names_the_tiers_it_asked(chain, caplog, key, where, asked):
    with caplog.at_level(logging.DEBUG, LOGGER):
        assert chain.get(key, where=where) is None
    shown = (key.encode() if isinstance(key, str) else key)[:8].hex()
    assert _lines(caplog) == [f"lookup {shown}: miss in {asked}"]


def test_a_shared_miss_on_a_chain_without_a_shared_tier_says_no_tier(tmp_path, caplog):
    with TieredProgramCache(tiers=[InMemoryProgramCache(), FileStreamProgramCache(tmp_path)]) as cache:
        with caplog.at_level(logging.DEBUG, LOGGER):
            assert cache.get(KEY, where="shared") is None
    assert _lines(caplog) == [f"lookup {KEY[:8].hex()}: miss in no tier"]


def test_a_hit_is_logged_once_with_its_tier_and_size(chain, caplog):
    chain.local_store.write_key(KEY, b"cubin" * 3)
    with caplog.at_level(logging.DEBUG, LOGGER):
        assert chain.get(KEY) == b"cubin" * 3  # from the local directory, promoted
        assert chain.get(KEY) == b"cubin" * 3  # from memory: its own lookup logs it
    assert _lines(caplog) == [f"lookup {KEY[:8].hex()}: local hit (15 bytes)", f"lookup {KEY[:8].hex()}: memory hit (15 bytes)"]


def test_a_metadata_read_stays_in_its_span(tmp_path):
    memory = InMemoryProgramCache()
    remote = tmp_path / "remote"
    remote.mkdir()
    with TieredProgramCache(tiers=[(memory, TierPolicy("memory")), (FileStreamProgramCache(tmp_path / "l"), TierPolicy("local")),
                                   (FileStreamProgramCache(remote), TierPolicy("remote", shared=True))]) as cache:
        memory[KEY] = b"symbols"
        assert cache.get(MetadataKey(KEY), where="shared") is None  # memory is not in the shared span
        assert cache.get(MetadataKey(KEY), where="nearby") == b"symbols"
        assert cache.stats()["memory"].lookups == 0  # metadata reads are not lookups


def test_a_memory_hit_of_a_str_key_is_logged_once(chain, caplog):
    chain["a str key"] = b"cubin"
    with caplog.at_level(logging.DEBUG, LOGGER):
        assert chain.get("a str key") == b"cubin"  # the slow path reads the first tier too: its own line only
    assert _lines(caplog) == [f"lookup {b'a str key'[:8].hex()}: memory hit (5 bytes)"]


@pytest.mark.parametrize("where", ["all", "nearby", "shared"])
def test_a_metadata_miss_returns_the_default(chain, where):
    assert chain.get(MetadataKey(KEY), b"none here", where=where) == b"none here"
