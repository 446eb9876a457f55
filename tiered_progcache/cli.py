"""The ``tiered-progcache`` command: look into, fill, trim and check the cache without writing code.

Configured like the library: ``TIERED_PROGCACHE_*`` variables, overridden by flags.
Exit codes: 0 ok, 1 problems found (or a transfer or delete failed), 2 usage error.
A user's mistake is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from .config import CacheConfig
    from .localdir import LocalDir
    from .remote import RemoteProgramCache

__all__ = ["main"]

logger = logging.getLogger(__name__)

PROG = "tiered-progcache"

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

#: Flags (argparse dests) that map onto :class:`~tiered_progcache.config.CacheConfig` fields;
#: ``--remote`` is handled apart, since it also selects the tier.
_CONFIG_FLAGS = {
    "dir": "local_dir",
    "max_local_bytes": "max_local_bytes",
    "remote_options": "remote_options",
    "read_only": "remote_read_only",
    "signing_key_file": "signing_key_file",
    "compression": "compression",
    "remote_timeout": "remote_timeout",
    "strict": "strict",
}

_SECRET_OPTION = re.compile(r"secret|token|password|passwd|credential|(^|_)key$", re.IGNORECASE)


class UsageError(Exception):
    """A mistake in how the command was called: one line on stderr, exit 2."""


# -- units ------------------------------------------------------------------------------------

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``"10G"`` -> 10**9, ``"10Gi"`` -> 10 * 2**30, ``"4096"`` -> 4096: the units of the environment variables."""
    from .config import parse_size as parse

    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 500M, 10G, 10Gi, 4096)") from None


def parse_duration(text: str) -> float:
    """``"30d"`` -> seconds. Units: s, m, h, d, w."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 30d, 12h, 90m, 2w)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def format_size(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _iso(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- argument parsing ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes, before or after its name. SUPPRESS: unset means "from env"."""
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    group = common.add_argument_group("configuration (each overrides its TIERED_PROGCACHE_* variable)")
    group.add_argument("--dir", metavar="PATH", help="local cache directory [TIERED_PROGCACHE_DIR]")
    group.add_argument(
        "--remote",
        dest="remote",
        nargs="?",
        const=True,
        metavar="URL",
        help="act on the remote tier; with URL, use that remote (s3://bucket/prefix, gs://..., file:///...) "
        "[TIERED_PROGCACHE_REMOTE]",
    )
    group.add_argument(
        "--remote-options",
        metavar="JSON",
        help='fsspec storage options as a JSON object, e.g. \'{"anon": true}\' [TIERED_PROGCACHE_REMOTE_OPTIONS]',
    )
    group.add_argument(
        "--read-only", action="store_true", help="never write the remote [TIERED_PROGCACHE_READ_ONLY]"
    )
    group.add_argument(
        "--signing-key-file",
        metavar="PATH",
        help="key that signs remote entries and checks their signatures [TIERED_PROGCACHE_SIGNING_KEY_FILE]",
    )
    group.add_argument(
        "--compression", metavar="CODEC", help="compress remote entries (zstd) [TIERED_PROGCACHE_COMPRESSION]"
    )
    group.add_argument(
        "--remote-timeout",
        metavar="SECONDS",
        type=float,
        help="give up on one remote operation after this long [TIERED_PROGCACHE_REMOTE_TIMEOUT]",
    )
    group.add_argument(
        "--strict",
        action="store_true",
        help="fail at once if the remote is unreachable (default: warn, run local-only) [TIERED_PROGCACHE_STRICT]",
    )
    group.add_argument(
        "--max-local-bytes",
        metavar="SIZE",
        type=parse_size,
        help="cap on the local directory, e.g. 20G [TIERED_PROGCACHE_MAX_LOCAL_BYTES]",
    )
    out = common.add_argument_group("output")
    out.add_argument("-v", "--verbose", action="count", help="log more (-v: info, -vv: every lookup)")
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common_options()
    parser = _Parser(
        prog=PROG,
        description="Look into, fill, trim and check the tiered program cache "
        "(memory -> local directory -> remote bucket).",
        epilog="Exit codes: 0 ok, 1 problems found, 2 usage error. "
        "Flags override the TIERED_PROGCACHE_* environment variables; see docs/configuration.md.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description or help, parents=[common])

    p = command("config", "show the resolved configuration and where each value came from")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_config)

    p = command(
        "stats",
        "entries and bytes per tier; with --run, the hits and misses of one command",
        "Without --run: entries and bytes held per tier (the remote is listed only with --remote). "
        "With --run -- CMD ...: run CMD and print the hits and misses per tier of every cache "
        "it and its child processes used; exits with CMD's exit code.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--run",
        action="store_true",
        help="run the command after -- (stats --run -- CMD [ARG ...]) and report its cache activity",
    )
    p.set_defaults(func=cmd_stats)

    p = command("ls", "list entries with size and age", "List entries: name, size, and age "
                "(local: since last read; remote: since written). Local unless --remote.")  # fmt: skip
    p.add_argument("-l", "--long", action="store_true", help="exact bytes, timestamps, and a total")
    p.set_defaults(func=cmd_ls)

    for name, verb, func in (
        ("warm", "copy remote entries into the local directory (e.g. at node boot)", cmd_warm),
        ("push", "copy local entries up to the remote (e.g. at the end of a CI job)", cmd_push),
    ):
        p = command(name, verb)
        p.add_argument("names", nargs="*", metavar="NAME", help="only these entries (64-hex names from ls)")
        _progress_flag(p)
        p.set_defaults(func=func)

    p = command(
        "prune",
        "remove the oldest entries (a dry run unless --yes)",
        "Remove entries older than --older-than, then the oldest until at most --max-bytes remain. "
        "Shows what would go; --yes removes it. Local unless --remote. "
        "Age is time since last read for local entries, since written for remote ones.",
    )
    p.add_argument("--older-than", type=parse_duration, metavar="AGE", help="e.g. 30d, 12h, 2w")
    p.add_argument("--max-bytes", type=parse_size, metavar="SIZE", help="e.g. 10G (10**9), 10Gi (2**30)")
    p.add_argument("--yes", action="store_true", help="remove them (without it: only show)")
    p.set_defaults(func=cmd_prune)

    p = command(
        "verify",
        "check every entry's integrity (and signature, on the remote); exit 1 if any is bad",
        "Remote entries: digest and, with a signing key, signature (exactly as a read checks them). "
        "Local entries carry no digest: they are checked to be whole cubin, fatbin, LTO-IR or PTX.",
    )
    p.add_argument("--delete-bad", action="store_true", help="delete the entries that fail")
    _progress_flag(p)
    p.set_defaults(func=cmd_verify)

    p = command("clear", "delete every entry of the local directory, or of the remote (with --yes)")
    p.add_argument("--local", action="store_true", help="clear the local directory")
    p.add_argument("--yes", action="store_true", help="needed to clear a remote")
    p.set_defaults(func=cmd_clear)
    return parser


def _progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (needs tqdm; default: when stderr is a terminal)",
    )


# -- configuration ----------------------------------------------------------------------------


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    values = vars(args)
    overrides: dict[str, Any] = {}
    if isinstance(values.get("remote"), str):
        if re.fullmatch(r"[0-9a-f]{64}", values["remote"]):
            raise UsageError("--remote took an entry name as its URL: put entry names before --remote")
        overrides["remote"] = values["remote"]
    for flag, field in _CONFIG_FLAGS.items():
        if flag in values:
            overrides[field] = values[flag]
    if "remote_options" in overrides:
        try:
            options = json.loads(overrides["remote_options"])
        except ValueError as exc:
            raise UsageError(f"--remote-options is not valid JSON: {exc}") from None
        if not isinstance(options, dict):
            raise UsageError("--remote-options must be a JSON object, e.g. '{\"anon\": true}'")
        overrides["remote_options"] = options
    return overrides


def load_config(args: argparse.Namespace, **extra: Any) -> CacheConfig:
    from .config import CacheConfig

    return CacheConfig.from_env(None, **_overrides(args), **extra)


def _local_dir(args: argparse.Namespace) -> LocalDir:
    """The configured local directory, without building the chain (no remote is contacted)."""
    from .localdir import LocalDir, default_local_dir

    root = load_config(args).local_dir
    return LocalDir(root if root is not None else default_local_dir())


@contextlib.contextmanager
def _remote(args: argparse.Namespace) -> Iterator[RemoteProgramCache]:
    """The configured remote tier, built strict: an unreachable bucket is an error now, not a warning."""
    config = load_config(args, strict=True)
    if not config.remote:
        raise UsageError("no remote configured: pass --remote URL or set TIERED_PROGCACHE_REMOTE")
    with config.build() as cache:
        remote = cache.remote
        if remote is None:  # pragma: no cover - build() always adds the configured remote
            raise UsageError("the configured chain has no remote tier")
        yield remote


def _wants_remote(args: argparse.Namespace) -> bool:
    return getattr(args, "remote", None) is not None


def _shown(field: str, value: Any) -> Any:
    """A config value as printed: secrets in storage options are masked."""
    if field == "remote_options" and isinstance(value, dict):
        return {k: ("***" if _SECRET_OPTION.search(str(k)) and v else v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


# -- commands ---------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> int:
    config = load_config(args)
    sources = config.sources()
    fields = list(sources)  # every setting, in config.py's order
    rows = [(name, _shown(name, getattr(config, name)), sources.get(name, "default")) for name in fields]
    if "local_dir" in fields and config.local_dir is None:  # show where "default" is on this machine
        from .localdir import default_local_dir

        rows[fields.index("local_dir")] = ("local_dir", str(default_local_dir()), sources.get("local_dir", "default"))
    if args.json:
        _print_json({name: {"value": value, "source": source} for name, value, source in rows})
        return EXIT_OK
    texts = [(name, _describe(name, value), source) for name, value, source in rows]
    width = max(len(name) for name, _, _ in texts)
    value_width = max(len(text) for _, text, _ in texts)
    for name, text, source in texts:
        print(f"{name:<{width}}  {text:<{value_width}}  {source}")
    return EXIT_OK


def _describe(field: str, value: Any) -> str:
    """A config value for people: sizes in binary units too, and what None means for each field."""
    if value is None:
        if field.endswith("_bytes"):
            return "no limit"
        if field == "remote":
            return "none (local only)"
        if field == "remote_timeout":
            from .remote import DEFAULT_TIMEOUT_S

            return f"{DEFAULT_TIMEOUT_S:g} s (the remote tier's default)"
        return "-"
    if field.endswith("_bytes") and isinstance(value, int):
        return f"{value} ({format_size(value)})"
    if field == "remote_timeout":
        return f"{value:g} s"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def cmd_stats(args: argparse.Namespace) -> int:
    if args.run:
        return _stats_of_run(args)
    local = _local_dir(args)
    entries = list(local.iter_entries())
    rows: list[dict[str, Any]] = [
        {"tier": "local", "where": str(local.root), "entries": len(entries), "bytes": sum(e.size for e in entries)}
    ]
    if _wants_remote(args):
        with _remote(args) as remote:
            listed = list(remote.iter_entries())
            rows.append({"tier": "remote", "where": remote.url, "entries": len(listed), "bytes": sum(e.size for e in listed)})
    else:
        url = load_config(args).remote
        if url:  # listing a bucket can take a while: only on request
            rows.append({"tier": "remote", "where": url, "entries": None, "bytes": None})
    if args.json:
        _print_json({row.pop("tier"): row for row in rows})
        return EXIT_OK
    print(f"{'tier':<8} {'entries':>8} {'bytes':>12}  where")
    for row in rows:
        if row["entries"] is None:
            print(f"{row['tier']:<8} {'-':>8} {'-':>12}  {row['where']} (pass --remote to list it)")
        else:
            print(f"{row['tier']:<8} {row['entries']:>8} {format_size(row['bytes']):>12}  {row['where']}")
    return EXIT_OK


def _stats_of_run(args: argparse.Namespace) -> int:
    from . import runstats

    argv = list(args.child_argv)
    if not argv:
        raise UsageError("--run needs a command: stats --run -- CMD [ARG ...]")
    load_config(args)  # a bad flag or variable is a usage error here, not a failure inside CMD
    env = dict(os.environ)
    for field, value in _overrides(args).items():  # the child sees the configuration the flags give
        env.update(_env_for(field, value))
    fd, path = tempfile.mkstemp(prefix="tiered-progcache-stats-", suffix=".jsonl")
    os.close(fd)
    env[runstats.STATS_FILE_ENV] = path
    try:
        started = time.perf_counter()
        try:
            child = subprocess.Popen(argv, env=env)
            # Ctrl-C reaches CMD too (same process group): let it decide, and report after it exits.
            with _sigint_ignored():
                returncode = child.wait()
        except FileNotFoundError:
            print(f"{PROG}: error: command not found: {argv[0]}", file=sys.stderr)
            return 127
        except PermissionError:
            print(f"{PROG}: error: command not executable: {argv[0]}", file=sys.stderr)
            return 126
        seconds = time.perf_counter() - started
        reports = runstats.read_reports(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    totals = runstats.sum_reports(reports)
    processes = len(list(runstats.pids(reports)))
    if args.json:
        _print_json(
            {
                "command": argv,
                "exit_code": returncode,
                "seconds": round(seconds, 3),
                "processes": processes,
                "caches": len(reports),
                "hits": totals.hits,
                "misses": totals.misses,
                "tiers": {name: _counters(s) for name, s in totals.tiers},
            }
        )
    else:
        _print_run_table(argv, returncode, seconds, processes, len(reports), totals)
    return returncode if returncode >= 0 else 128 - returncode


def _env_for(field: str, value: Any) -> dict[str, str]:
    """The TIERED_PROGCACHE_* variable that carries a flag's value to a child process."""
    from .config import _SETTINGS, ENV_PREFIX

    name = ENV_PREFIX + _SETTINGS[field][0]
    if isinstance(value, bool):
        text = "1" if value else "0"
    elif isinstance(value, dict):
        text = json.dumps(value)
    else:
        text = str(value)
    return {name: text}


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore Ctrl-C in this process while the child runs; the child gets it too and decides what to do."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


_RUN_COLUMNS = ("hits", "misses", "writes", "promotions", "errors", "timeouts", "rejected", "bytes_read", "bytes_written")


def _counters(s: Any) -> dict[str, int]:
    from .stats import COUNTER_FIELDS

    return {name: getattr(s, name) for name in COUNTER_FIELDS}


def _print_run_table(argv: Sequence[str], returncode: int, seconds: float, processes: int, caches: int, totals: Any) -> None:
    print(f"command      {' '.join(argv)}")
    killed = f" (killed by {_signal_name(-returncode)})" if returncode < 0 else ""
    print(f"exit code    {returncode}{killed}")
    print(f"time         {seconds:.2f} s")
    print(f"caches       {caches} (in {processes} process{'es' if processes != 1 else ''})")
    if not caches:
        print("no cache reported: the command built no TieredProgramCache")
        return
    lookups = totals.tiers[0][1].lookups if totals.tiers else 0
    rate = f" ({100 * totals.hits / lookups:.1f}% of {lookups} lookups)" if lookups else ""
    print(f"hits         {totals.hits}{rate}")
    print(f"misses       {totals.misses} (missed by every tier)")
    header = ["tier"] + [c.replace("_", " ") for c in _RUN_COLUMNS]
    rows = [[name] + [format_size(getattr(s, c)) if c.startswith("bytes") else str(getattr(s, c)) for c in _RUN_COLUMNS]
            for name, s in totals.tiers]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def cmd_ls(args: argparse.Namespace) -> int:
    now = time.time()
    if _wants_remote(args):
        with _remote(args) as remote:
            rows = [(e.name, e.size, e.mtime, None) for e in remote.iter_entries()]
            where = remote.url
    else:
        local = _local_dir(args)
        rows = [(e.name, e.size, e.mtime, e.atime) for e in local.iter_entries()]
        where = str(local.root)
    rows.sort()
    if args.long:
        print(f"{'NAME':<64}  {'BYTES':>10}  {'MODIFIED':<20}  {'LAST READ':<20}  {'AGE':>5}")
    for name, size, mtime, atime in rows:
        age = format_age(_age(now, mtime, atime))
        if args.long:
            print(f"{name}  {size:>10}  {_iso(mtime):<20}  {_iso(atime):<20}  {age:>5}")
        else:
            print(f"{name}  {format_size(size):>10}  {age:>5}")
    if args.long:
        print(f"total {len(rows)} entries, {format_size(sum(r[1] for r in rows))} in {where}")
    return EXIT_OK


def _age(now: float, mtime: float | None, atime: float | None) -> float | None:
    """Seconds since last use: last read or write for local entries, write for remote ones."""
    last = max((t for t in (mtime, atime) if t is not None), default=None)
    return None if last is None else now - last


def cmd_warm(args: argparse.Namespace) -> int:
    return _transfer(args, "warm")


def cmd_push(args: argparse.Namespace) -> int:
    return _transfer(args, "push")


def _transfer(args: argparse.Namespace, direction: str) -> int:
    names = _entry_names(args.names)
    local = _local_dir(args)
    with _remote(args) as remote:
        if direction == "push" and remote.read_only:
            raise UsageError(f"the remote {remote.url} is read-only here: cannot push")
        run = remote.warm if direction == "warm" else remote.push
        with _progress_bar(args, direction) as progress:
            report = run(local, names, progress=progress)
    source, target = (remote.url, local.root) if direction == "warm" else (local.root, remote.url)
    verb = "warmed" if direction == "warm" else "pushed"
    rate = f", {format_size(int(report.bytes / report.seconds))}/s" if report.seconds > 0 and report.bytes else ""
    print(
        f"{verb} {report.entries} entries ({format_size(report.bytes)}) from {source} to {target} "
        f"in {report.seconds:.2f} s{rate}; {report.skipped} already there, {report.failures} failed"
    )
    return EXIT_PROBLEMS if report.failures else EXIT_OK


def _entry_names(names: Sequence[str]) -> list[str] | None:
    if not names:
        return None
    bad = [n for n in names if not re.fullmatch(r"[0-9a-f]{64}", n)]
    if bad:
        raise UsageError(f"not an entry name (64 lowercase hex digits, as ls prints): {bad[0]}")
    return list(names)


@contextlib.contextmanager
def _progress_bar(args: argparse.Namespace, desc: str) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` callback drawing a tqdm bar on stderr, or None for no bar."""
    wanted = args.progress if args.progress is not None else sys.stderr.isatty()
    if not wanted:
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        if args.progress:
            logger.warning("no progress bar: tqdm is not installed (pip install 'tiered-progcache[cli]')")
        yield None
        return
    lock = threading.Lock()
    bars: list[Any] = []  # made on the first report, once the total is known

    def progress(done: int, total: int) -> None:
        with lock:  # transfers may report from worker threads
            if not bars:
                bars.append(tqdm(desc=desc, unit="entry", total=total, file=sys.stderr, dynamic_ncols=True))
            bar = bars[0]
            if bar.total != total:
                bar.total = total
                bar.refresh()
            if done > bar.n:
                bar.update(done - bar.n)

    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        with logging_redirect_tqdm(loggers=[logging.getLogger("tiered_progcache")]):  # log lines above the bar
            yield progress
    finally:
        for bar in bars:
            bar.close()


def cmd_prune(args: argparse.Namespace) -> int:
    older_than = getattr(args, "older_than", None)
    max_bytes = getattr(args, "max_bytes", None)
    if older_than is None and max_bytes is None:
        raise UsageError("say what to prune: --older-than AGE and/or --max-bytes SIZE")
    now = time.time()
    with contextlib.ExitStack() as stack:
        if _wants_remote(args):
            remote = stack.enter_context(_remote(args))
            if args.yes and remote.read_only:
                raise UsageError(f"the remote {remote.url} is read-only here: cannot prune it")
            entries = [(e, e.size, _age(now, e.mtime, None)) for e in remote.iter_entries()]
            where = remote.url

            def delete(entry: Any) -> bool:
                try:
                    remote.delete_entry(entry.name)
                except KeyError:
                    return False  # gone since listed
                return True
        else:
            local = _local_dir(args)
            entries = [(e, e.size, _age(now, e.mtime, e.atime)) for e in local.iter_entries()]
            where = str(local.root)
            delete = local.delete
        doomed = plan_prune(entries, older_than=older_than, max_bytes=max_bytes)
        total_bytes = sum(size for _, size, _ in entries)
        doomed_bytes = sum(size for _, size, _ in doomed)
        verb = "remove" if args.yes else "would remove"
        for entry, size, age in doomed:
            print(f"{verb} {entry.name}  {format_size(size):>10}  {format_age(age):>5}")
        summary = (
            f"{len(doomed)} of {len(entries)} entries ({format_size(doomed_bytes)} of {format_size(total_bytes)}) "
            f"in {where}"
        )
        if not args.yes:
            print(f"would remove {summary}; pass --yes to remove them")
            return EXIT_OK
        removed = failed = changed = 0
        for entry, _, _ in doomed:
            try:
                if delete(entry):
                    removed += 1
                else:
                    changed += 1
            except Exception as exc:
                failed += 1
                print(f"{PROG}: could not remove {entry.name}: {exc}", file=sys.stderr)
    print(
        f"removed {removed} of {len(entries)} entries in {where}"
        + (f"; {changed} changed or gone since listed, left alone" if changed else "")
        + (f"; {failed} failed" if failed else "")
    )
    return EXIT_PROBLEMS if failed else EXIT_OK


def plan_prune(
    entries: Sequence[tuple[Any, int, float | None]],
    *,
    older_than: float | None = None,
    max_bytes: int | None = None,
) -> list[tuple[Any, int, float | None]]:
    """Which ``(entry, size, age)`` go: all older than ``older_than``, then the oldest until ``max_bytes`` fit.

    An entry of unknown age is never "older than" anything and goes last for ``max_bytes``.
    """
    doomed = [e for e in entries if older_than is not None and e[2] is not None and e[2] > older_than]
    if max_bytes is not None:
        gone = {id(e) for e in doomed}
        rest = [e for e in entries if id(e) not in gone]
        held = sum(size for _, size, _ in rest)
        rest.sort(key=lambda e: -1.0 if e[2] is None else e[2], reverse=True)  # oldest first
        for e in rest:
            if held <= max_bytes:
                break
            doomed.append(e)
            held -= e[1]
    return sorted(doomed, key=lambda e: -1.0 if e[2] is None else e[2], reverse=True)


def cmd_verify(args: argparse.Namespace) -> int:
    bad: list[tuple[str, str]] = []
    deleted = 0
    with contextlib.ExitStack() as stack:
        if _wants_remote(args):
            remote = stack.enter_context(_remote(args))
            if args.delete_bad and remote.read_only:
                raise UsageError(f"the remote {remote.url} is read-only here: cannot delete from it")
            names = [e.name for e in remote.iter_entries()]
            where = remote.url
            with _progress_bar(args, "verify") as progress:
                for done, name in enumerate(names, start=1):
                    reason = remote.verify_entry(name)
                    if reason is not None:
                        bad.append((name, reason))
                        if args.delete_bad:
                            with _reported(f"could not delete {name}"):
                                remote.delete_entry(name)
                                deleted += 1
                    if progress:
                        progress(done, len(names))
        else:
            local = _local_dir(args)
            entries = list(local.iter_entries())
            names = [e.name for e in entries]
            where = str(local.root)
            with _progress_bar(args, "verify") as progress:
                for done, entry in enumerate(entries, start=1):
                    try:
                        reason = check_code_object(entry.path.read_bytes())
                    except FileNotFoundError:
                        reason = None  # evicted or replaced since listed: nothing to check
                    except OSError as exc:
                        reason = f"unreadable: {exc.strerror or exc}"
                    if reason is not None:
                        bad.append((entry.name, reason))
                        if args.delete_bad and local.delete(entry):
                            deleted += 1
                    if progress:
                        progress(done, len(entries))
    for name, reason in bad:
        print(f"BAD {name}: {reason}")
    tail = f"; deleted {deleted}" if args.delete_bad else ""
    print(f"checked {len(names)} entries in {where}: {len(bad)} bad{tail}")
    return EXIT_PROBLEMS if bad else EXIT_OK


@contextlib.contextmanager
def _reported(what: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        print(f"{PROG}: {what}: {exc}", file=sys.stderr)


def check_code_object(data: bytes) -> str | None:
    """None if ``data`` is a whole cubin (ELF), fatbin, LTO-IR or PTX; else why not.

    Local entries carry no digest, so this checks framing only: it catches truncation
    and foreign files, not a flipped byte inside a well-formed cubin.
    """
    if not data:
        return "empty"
    if data[:4] == b"\x7fELF":
        if len(data) < 64 or data[4] != 2 or data[5] != 1:
            return "truncated or not a 64-bit little-endian ELF"
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
            return f"truncated ELF ({len(data)} bytes; its headers reach past the end)"
        return None
    if data[:4] == b"\x50\xed\x55\xba":  # fatbin
        if len(data) < 16:
            return "truncated fatbin"
        header_size, body_size = struct.unpack_from("<HQ", data, 6)
        if header_size + body_size > len(data):
            return f"truncated fatbin ({len(data)} bytes of {header_size + body_size})"
        return None
    if data[:4] == b"\xedCN\x7f":  # NVRTC/nvJitLink LTO-IR
        return None
    if b"\0" not in data[:4096] and b".version" in data[:4096] and b".target" in data[:4096]:
        return None  # PTX
    return "not a cubin, fatbin, LTO-IR or PTX (unknown format)"


def cmd_clear(args: argparse.Namespace) -> int:
    wants_remote = _wants_remote(args)
    if args.local == wants_remote:
        raise UsageError("say which tier to clear: --local, or --remote [URL] --yes")
    if wants_remote and not args.yes:
        raise UsageError("clearing a remote deletes it for every node that shares it: add --yes")
    if wants_remote:
        with _remote(args) as remote:
            if remote.read_only:
                raise UsageError(f"the remote {remote.url} is read-only here: cannot clear it")
            count = sum(1 for _ in remote.iter_entries())
            remote.clear()
            print(f"cleared {remote.url} ({count} entries)")
        return EXIT_OK
    local = _local_dir(args)
    removed = sum(1 for entry in local.iter_entries() if local.delete(entry))
    print(f"cleared {local.root} ({removed} entries)")
    return EXIT_OK


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


# -- entry point ------------------------------------------------------------------------------


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
    root = logging.getLogger("tiered_progcache")
    root.addHandler(handler)
    root.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (the console script passes it to ``sys.exit``)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is the command of `stats --run`, whatever it looks like.
    child_argv: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, child_argv = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    args.child_argv = child_argv
    if child_argv and not getattr(args, "run", False):
        parser.error(f"arguments after -- are only for stats --run: {' '.join(child_argv)}")
    verbosity = getattr(args, "verbose", 0) or 0
    _configure_logging(verbosity)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError) as exc:  # bad configuration values, from config.py or a tier's constructor
        if verbosity >= 2:
            raise
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the remote is down, a bucket is missing, access is denied, ...
        if verbosity >= 2:
            raise
        print(f"{PROG} {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_PROBLEMS


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, OSError) else f"{type(exc).__name__}: {text}"
