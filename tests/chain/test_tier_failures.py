"""What a tier does with its store's failures that other tests leave unguarded (mutation testing of chain/tier.py)."""

from __future__ import annotations

import logging

import pytest
from cuda.core.utils import ProgramCacheResource

from tiered_progcache import TieredProgramCache, TierPolicy
from tiered_progcache.chain.tier import Tier
from tiered_progcache.errors import TierUnavailable
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.stores.store import entry_name
from tiered_progcache.testing import WrapperEntryStore

from support import FileBackDoor


class _Unmeasurable(ProgramCacheResource):
    """A resource whose ``len`` fails: the tier cannot count or measure it."""

    def __getitem__(self, key):
        raise KeyError(key)

    def __setitem__(self, key, value):
        pass

    def __delitem__(self, key):
        raise KeyError(key)

    def __len__(self):
        raise OSError("gone")

    def clear(self):
        pass


class _ProbeFailed(WrapperEntryStore):
    """A store whose probe at construction failed with ``failure`` (what ``from_url`` records when unreachable)."""

    def __init__(self, store, failure: BaseException) -> None:
        super().__init__(store)
        self._failure = failure

    @property
    def startup_failure(self) -> BaseException | None:
        return self._failure


@pytest.mark.parametrize(("probe_failure", "counts"), [
    (ConnectionRefusedError("refused"), (1, 0)),
    (TimeoutError("no answer"), (0, 1)),
    (TierUnavailable("skipped"), (0, 0)),
])
def test_a_store_whose_start_up_probe_failed_shows_it_in_its_tiers_counters(tmp_path, probe_failure, counts):
    (tmp_path / "bucket").mkdir()
    remote = RemoteProgramCache.from_url((tmp_path / "bucket").as_uri(), strict=True)
    stats = Tier(_ProbeFailed(remote, probe_failure), TierPolicy("remote", shared=True)).snapshot()
    assert (stats.errors, stats.timeouts) == counts


def test_a_tier_that_cannot_measure_itself_logs_why_at_debug_and_shows_no_size(caplog):
    tier = Tier(_Unmeasurable(), TierPolicy("odd"))
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache.chain.tier"):
        stats = tier.snapshot()
    assert (stats.entries, stats.bytes_held) == (None, None)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "tier odd could not measure its size: OSError('gone')")
    ]


def test_an_entry_rejected_on_the_fast_path_is_replaced_by_the_next_write(tmp_path):
    """A shared first tier with conditional creates (a bare remote in ``compile()``) never rewrites an
    entry, except one it found corrupt: also when the corrupt read took the untimed fast path."""
    (tmp_path / "bucket").mkdir()
    remote = RemoteProgramCache.from_url((tmp_path / "bucket").as_uri(), strict=True)
    cache = TieredProgramCache(tiers=[(remote, TierPolicy("remote", shared=True))])
    cache[b"good"] = b"\x7fELF good"
    assert cache.get(b"good") == b"\x7fELF good"  # one timed hit: the next lookup is untimed
    cache[b"bad"] = b"\x7fELF first"
    FileBackDoor(tmp_path / "bucket").write(entry_name(b"bad"), b"not an envelope")
    assert cache.get(b"bad") is None and cache.stats()["remote"].rejected == 1
    cache[b"bad"] = b"\x7fELF again"
    assert cache.get(b"bad") == b"\x7fELF again"
    cache.close()
