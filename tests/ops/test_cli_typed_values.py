"""Issue 28 items 10-15: what a person types either works or is refused at once, naming the fix.

10: a size with a space before its unit (``--max-bytes 10 GB``) is one value; 11: ``--prometheus-file``
into a missing directory is refused (nothing created); 12: every command refuses a missing, empty or
directory key file; 13: the missing ``file://`` root error names what a constructor caller passes;
14: docs/cluster.md says exactly what is stripped from a key file, and read_key_file does that;
15: prune, export and import draw a progress bar as push, warm and verify do.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from support import assert_one_line_error, run_cli_here

from tiered_progcache import TieredProgramCache
from tiered_progcache.config import read_key_file
from tiered_progcache.ops.bundle import export_bundle, import_bundle
from tiered_progcache.ops.prune import prune
from tiered_progcache.stores.localdir import LocalDir


@pytest.fixture
def cli(capsys):
    """The command's main in this process (tests/support.py, run_cli_here): no interpreter start per run."""
    return functools.partial(run_cli_here, capsys)


DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture
def node(tmp_path) -> Path:
    """A local directory with three entries."""
    directory = tmp_path / "node"
    with TieredProgramCache(directory) as cache:
        for n in range(3):
            cache[f"k{n}".encode()] = bytes([n]) * 1000
    return directory


# -- 10: sizes with a space ----------------------------------------------------------------------


def test_a_size_with_a_space_before_its_unit_is_one_value(cli, node, tmp_path):
    """Before: warm took GB for an entry name ("give it or entry names, not both"), prune said "unrecognized"."""
    pruned = cli("prune", "--max-bytes", "10", "G", "--dir", str(node))
    assert pruned.returncode == 0, pruned.stderr
    joined = cli("prune", "--max-bytes=10", "G", "--dir", str(node))
    assert joined.returncode == 0, joined.stderr
    assert joined.stdout.splitlines()[-1] == pruned.stdout.splitlines()[-1]
    remote = tmp_path / "remote"
    remote.mkdir()
    warmed = cli("warm", "--max-bytes", "10", "GB", "--dir", str(node), "--remote", f"file://{remote}")
    assert warmed.returncode == 0 and warmed.stdout.startswith("warmed 0 kernels"), warmed.stderr
    shown = cli("config", "--json", "--max-local-bytes", "1.5", "Ki")
    assert shown.returncode == 0, shown.stderr
    assert '"value": 1536' in shown.stdout


def test_a_spaced_size_prunes_to_its_value(cli, node):
    pruned = cli("prune", "--max-bytes", "2", "K", "--dir", str(node))  # 2000 bytes: one of three goes
    assert pruned.returncode == 0 and "would remove 1 of 3 entries" in pruned.stdout, pruned.stdout


def test_a_word_that_is_no_unit_is_still_refused(cli, node):
    line = assert_one_line_error(cli("prune", "--max-bytes", "10", "parsecs", "--dir", str(node)))
    assert "parsecs" in line


# -- 11: --prometheus-file into a missing directory ------------------------------------------------


def test_prometheus_file_into_a_missing_directory_is_refused_and_nothing_is_created(cli, tmp_path):
    target = tmp_path / "typo" / "dir" / "x.prom"
    line = assert_one_line_error(cli("stats", "--dir", str(tmp_path / "n"), "--prometheus-file", str(target)))
    assert "does not exist" in line and str(target.parent) in line
    assert not (tmp_path / "typo").exists()
    ok = cli("stats", "--dir", str(tmp_path / "n"), "--prometheus-file", str(tmp_path / "x.prom"))
    assert ok.returncode == 0 and (tmp_path / "x.prom").is_file(), ok.stderr


# -- 12: key files -------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "command"), [
    ("missing", ["ls"]), ("empty", ["ls"]), ("directory", ["ls"]), ("missing", ["stats"]),
    ("empty", ["prune", "--older-than", "1d"]), ("directory", ["verify"]), ("missing", ["export", "OUT"]),
    ("empty", ["clear", "--local"]),
])  # fmt: skip
def test_every_command_refuses_a_bad_key_file(cli, tmp_path, node, shape, command):
    key = tmp_path / "key"
    if shape == "empty":
        key.write_bytes(b"")
    elif shape == "directory":
        key.mkdir()
    args = [str(tmp_path / "out.tar") if word == "OUT" else word for word in command]
    result = cli(*args, "--dir", str(node), env={"TIERED_PROGCACHE_SIGNING_KEY_FILE": str(key)})
    line = assert_one_line_error(result, 2)
    assert "TIERED_PROGCACHE_SIGNING_KEY_FILE" in line and str(key) in line
    assert {"missing": "No such file", "empty": "is empty", "directory": "is a directory"}[shape] in line
    assert len(list((node / "entries").rglob("*"))) > 0  # clear --local did not run


# -- 13: the missing file:// root ------------------------------------------------------------------


def test_the_missing_root_error_names_what_a_constructor_caller_passes(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        TieredProgramCache(tmp_path / "node", remote=f"file://{tmp_path / 'absent'}", strict=True)
    message = str(raised.value)
    assert "TieredProgramCache(..., create_remote_root=True)" in message
    assert "TIERED_PROGCACHE_CREATE_REMOTE_ROOT=1 for from_env() and the command" in message


# -- 14: what a key file loses ---------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "key"), [
    (b"abc\n", b"abc"), (b"abc\r\n", b"abc"), (b"abc", b"abc"), (b"  abc\n", b"  abc"), (b"abc\n\n", b"abc\n"),
    (b"abc \n", b"abc "), (b"\tabc", b"\tabc"),
])  # fmt: skip
def test_a_key_file_loses_one_trailing_line_ending_and_nothing_else(tmp_path, raw, key):
    path = tmp_path / "key"
    path.write_bytes(raw)
    assert read_key_file(path) == key


def test_cluster_md_says_what_read_key_file_does():
    text = " ".join((DOCS / "cluster.md").read_text().split())
    assert "read as bytes less one trailing line ending (`\\n` or `\\r\\n`" in text
    assert "leading whitespace, other trailing whitespace and a second line ending are part of the key" in text
    assert "surrounding whitespace stripped" not in text


# -- 15: progress of prune, export and import ------------------------------------------------------


def test_prune_export_and_import_report_progress_to_the_end(node, tmp_path):
    calls: dict[str, list[tuple[int, int]]] = {"export": [], "import": [], "prune": []}
    export_bundle(LocalDir(node), tmp_path / "b.tar", compression=None,
                  progress=lambda done, total: calls["export"].append((done, total)))  # fmt: skip
    import_bundle(tmp_path / "b.tar", LocalDir(tmp_path / "other"),
                  progress=lambda done, total: calls["import"].append((done, total)))  # fmt: skip
    prune(LocalDir(node), max_bytes=1, dry_run=False, progress=lambda done, total: calls["prune"].append((done, total)))
    assert calls["export"] == [(1, 3), (2, 3), (3, 3)]
    assert calls["import"][-1] == (3, 3)
    assert calls["prune"] == [(1, 3), (2, 3), (3, 3)]


def test_the_command_draws_their_progress_bars(cli, node, tmp_path):
    bundle = str(tmp_path / "b.tar")
    for args, desc in ((["export", bundle, "--format", "tar"], "export"),
                       (["import", bundle, "--dir", str(tmp_path / "other")], "import"),
                       (["prune", "--max-bytes", "1", "--yes"], "prune")):  # fmt: skip
        result = cli(*args, "--progress", "--dir", str(node)) if desc != "import" else cli(*args, "--progress")
        assert result.returncode == 0, result.stderr
        assert f"{desc}: 100%" in result.stderr and "3/3" in result.stderr, result.stderr
    quiet = cli("export", bundle, "--no-progress", "--dir", str(node))
    assert quiet.returncode == 0 and "100%" not in quiet.stderr
