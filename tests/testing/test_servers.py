"""The loopback S3 server keeps S3's promise that a conditional create has one winner."""

from __future__ import annotations

import sys
import threading
import uuid

import pytest

from tiered_progcache.testing.servers import moto_server  # noqa: F401

ROUNDS = 30
RACERS = 8


@pytest.fixture
def fast_thread_switches():
    """Switch threads every microsecond: moto's check-then-put loses a race within a few rounds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_racing_creates_of_one_key_have_exactly_one_winner(moto_server, fast_thread_switches):  # noqa: F811
    s3fs = pytest.importorskip("s3fs")
    options = moto_server.storage_options()
    bucket = f"race-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket=bucket)
    clients = [s3fs.S3FileSystem(**options, skip_instance_cache=True) for _ in range(RACERS)]
    winners_per_round = []
    for round_number in range(ROUNDS):
        barrier = threading.Barrier(RACERS)
        winners: list[int] = []

        def race(racer: int, path: str = f"{bucket}/key-{round_number}", barrier=barrier, winners=winners) -> None:
            barrier.wait(30)
            try:
                clients[racer].pipe_file(path, b"racer %d" % racer, mode="create")
            except FileExistsError:
                return
            winners.append(racer)

        threads = [threading.Thread(target=race, args=(racer,)) for racer in range(RACERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        winners_per_round.append(len(winners))
    assert winners_per_round == [1] * ROUNDS
