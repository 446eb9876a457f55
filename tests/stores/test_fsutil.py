"""fsutil.open_regular: the one safe open of a file something else may have planted."""

from __future__ import annotations

import os
import signal

import pytest

from tiered_progcache.stores import fsutil
from tiered_progcache.stores.envelope import InvalidEnvelope
from tiered_progcache.errors import EntryRejected

from support import wait_child


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


def test_keep_atime_reads_a_file_and_leaves_its_access_time(tmp_path):
    """What a look at an entry reads (``LocalDir.read_entry``) is not a use: the access time eviction sorts by stays;
    a read without ``keep_atime`` moves it, as any read does on this mount."""
    path = tmp_path / "f"
    path.write_bytes(b"1234")
    old_ns = 1_000_000_000 * 1_000_000_000  # 2001: older than its mtime allows, so relatime moves it on a read
    os.utime(path, ns=(old_ns, old_ns))
    path.read_bytes()
    if os.stat(path).st_atime_ns == old_ns:
        pytest.skip("this mount keeps no access times (noatime): a read moves none")

    def read(**keep: bool) -> int:
        os.utime(path, ns=(old_ns, old_ns))
        fd, _ = fsutil.open_regular(path, 4, **keep)
        try:
            assert os.read(fd, 10) == b"1234"
        finally:
            os.close(fd)
        return os.stat(path).st_atime_ns

    assert read(keep_atime=True) == old_ns
    assert read() > old_ns


@pytest.mark.skipif(os.geteuid() != 0, reason="reading a file of another user as a user without the right needs root")
def test_keep_atime_reads_another_users_file_as_a_plain_open_does_and_refuses_what_it_cannot_read():
    """O_NOATIME is only the owner's to ask: another user's readable file is read anyway (its atime may move), and a
    file that user cannot read is a PermissionError as before. A forked child does the reading as ``nobody``."""
    import tempfile

    shared = tempfile.mkdtemp(dir="/tmp")
    try:
        os.chmod(shared, 0o755)
        readable, private = os.path.join(shared, "readable"), os.path.join(shared, "private")
        for path, mode in ((readable, 0o644), (private, 0o600)):
            with open(path, "wb") as fh:
                fh.write(b"1234")
            os.chmod(path, mode)
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if both outcomes are as promised
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # a hang is killed, whatever the child is doing
                signal.alarm(60)
                os.setgid(65534)
                os.setuid(65534)
                fd, _ = fsutil.open_regular(readable, 4, keep_atime=True)
                data = os.read(fd, 10)
                os.close(fd)
                try:
                    fsutil.open_regular(private, 4, keep_atime=True)
                except PermissionError:
                    code = 0 if data == b"1234" else 3
                else:
                    code = 4
            finally:
                os._exit(code)
        assert wait_child(pid) == 0
    finally:
        import shutil

        shutil.rmtree(shared)


MOUNTS = (
    "garbage without a separator\n"
    "1 0 8:1 / / rw,relatime - nfs4 server:/export rw\n"
    "2 1 0:5 / /scratch rw - xfs /dev/nvme0n1 rw\n"
    "3 2 0:6 / /scratch/shared\\040dir rw shared:4 - fuse.gcsfuse bucket rw\n"
    "4 1 0:7 / /scratch2 rw - ext4 /dev/sda rw\n"
    "5 1 0:8 / /tmp rw - tmpfs tmpfs rw\n"
    "6 5 0:9 / /tmp/odd rw no separator, so not a mount line\n"
    "7 1 / - nfs4 too few fields\n"
    "8 1 0:10 / /five - btrfs /dev/sdb rw\n"
    "9 1 0:11 / /stacked rw - ext4 /dev/sdc rw\n"
    "10 9 0:12 / /stacked rw - nfs4 server:/over rw\n"
    "11 1 0:13 / /mntX rw - ext4 /dev/sdd rw\n"
)


@pytest.mark.parametrize("path, local", [
    ("/scratch/cache", True),  # xfs
    ("/scratch", True),
    ("/scratch/shared dir/kernels", False),  # the longest mount point wins; "\040" is a space
    ("/scratch/shared dirt", True),  # a prefix of a name is not its mount point
    ("/scratch2/x", True),
    ("/tmp/a/b", True),  # tmpfs: memory on this host
    ("/tmp/odd/f", True),  # a line without " - " is not a mount
    ("/five/f", True),  # five fields before " - " name a mount point
    ("/stacked/f", False),  # of two mounts on one point, the last is on top
    ("/home/user", False),  # under the NFS root
    ("/mnt/f", False),  # not under /mntX
])
def test_a_path_is_on_this_hosts_disk_by_its_mount_points_filesystem_type(tmp_path, path, local):
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTS)
    assert fsutil.on_local_disk(path, str(table)) is local


def test_under_a_local_root_every_path_is_on_this_hosts_disk(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text("1 0 8:1 / / rw - ext4 /dev/vda rw\n2 1 0:5 / /nfs rw - nfs srv:/x rw\n")
    paths = ("/", "/home/u", "/nfs/a", "/nfsx")
    assert [fsutil.on_local_disk(p, str(table)) for p in paths] == [True, True, False, True]


def test_an_unreadable_mount_table_is_not_a_local_disk(tmp_path):
    assert fsutil.on_local_disk("/tmp", str(tmp_path / "absent")) is False
    assert fsutil.LOCAL_FS_TYPES >= {"ext4", "xfs", "btrfs", "tmpfs", "overlay"}
    assert not fsutil.LOCAL_FS_TYPES & {"nfs", "nfs4", "cifs", "lustre", "fuse", "9p", "ceph"}


def test_a_mount_point_that_is_not_utf8_is_matched_as_the_path_decodes(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_bytes(b"1 0 8:1 / / rw - nfs4 srv:/ rw\n2 1 0:5 / /data\xff rw - xfs /dev/x rw\n")
    assert fsutil.on_local_disk(os.fsdecode(b"/data\xff/kernels"), str(table)) is True
    assert fsutil.on_local_disk("/data/kernels", str(table)) is False


def test_a_mount_line_is_read_by_its_fields_and_its_escapes():
    assert fsutil.MountTable("7 1 / - nfs4 too few fields\n").types == {}  # no " - " after the mount point
    table = fsutil.MountTable("1 0 0:1 / /a\\134b\\011c\\040 rw - xfs x rw\n2 0 0:2 / /d1234 rw - ext4 y rw\n")
    assert table.types == {"/a\\b\tc ": "xfs", "/d1234": "ext4"}  # backslash, tab, space; digits are no escape
