"""fsutil.open_regular: the one safe open of a file something else may have planted."""

from __future__ import annotations

import os

import pytest

from tiered_progcache.stores import fsutil
from tiered_progcache.stores.envelope import InvalidEnvelope
from tiered_progcache.errors import EntryRejected


def test_a_regular_file_within_the_cap_opens_with_its_stat(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"1234")
    fd, st = fsutil.open_regular(path, 4)
    try:
        assert (os.read(fd, 10), st.st_size) == (b"1234", 4)
    finally:
        os.close(fd)


def test_a_file_one_byte_over_the_cap_is_refused_and_its_descriptor_closed(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"12345")
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(EntryRejected, match="5 bytes, over the 4-byte limit"):
        fsutil.open_regular(path, 4)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_symbolic_link_is_not_followed(tmp_path):
    (tmp_path / "link").symlink_to("/dev/zero")
    with pytest.raises(EntryRejected, match="symbolic link"):
        fsutil.open_regular(tmp_path / "link", 1 << 20)


def test_a_fifo_is_refused_without_blocking_the_open(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would wait forever
    with pytest.raises(EntryRejected, match="not a regular file"):
        fsutil.open_regular(tmp_path / "fifo")


def test_refusals_raise_the_callers_exception_and_a_missing_file_is_file_not_found(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InvalidEnvelope, match="not a regular file"):
        fsutil.open_regular(tmp_path / "fifo", refuse=InvalidEnvelope)
    with pytest.raises(FileNotFoundError):
        fsutil.open_regular(tmp_path / "absent")
