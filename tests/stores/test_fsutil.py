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


MOUNTS = (
    "1 0 8:1 / / rw,relatime - nfs4 server:/export rw\n"
    "2 1 0:5 / /scratch rw - xfs /dev/nvme0n1 rw\n"
    "3 2 0:6 / /scratch/shared\\040dir rw shared:4 - fuse.gcsfuse bucket rw\n"
    "4 1 0:7 / /scratch2 rw - ext4 /dev/sda rw\n"
    "5 1 0:8 / /tmp rw - tmpfs tmpfs rw\n"
    "garbage without a separator\n"
)


@pytest.mark.parametrize("path, local", [
    ("/scratch/cache", True),  # xfs
    ("/scratch", True),
    ("/scratch/shared dir/kernels", False),  # the longest mount point wins; "\040" is a space
    ("/scratch/shared dirt", True),  # a prefix of a name is not its mount point
    ("/scratch2/x", True),
    ("/tmp/a/b", True),  # tmpfs: memory on this host
    ("/home/user", False),  # under the NFS root
])
def test_a_path_is_on_this_hosts_disk_by_its_mount_points_filesystem_type(tmp_path, path, local):
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTS)
    assert fsutil.on_local_disk(path, str(table)) is local


def test_an_unreadable_mount_table_is_not_a_local_disk(tmp_path):
    assert fsutil.on_local_disk("/tmp", str(tmp_path / "absent")) is False
    assert fsutil.LOCAL_DISK_TYPES >= {"ext4", "xfs", "btrfs", "tmpfs", "overlay"}
    assert not fsutil.LOCAL_DISK_TYPES & {"nfs", "nfs4", "cifs", "lustre", "fuse", "9p", "ceph"}
