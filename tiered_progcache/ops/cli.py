"""The ``tiered-progcache`` command: look into, fill, trim and check the cache without writing code.

Configured like the library: ``TIERED_PROGCACHE_*`` variables, overridden by flags.
Exit codes: 0 ok, 1 problems found (or a transfer or delete failed), 2 usage error.
A user's mistake is one line on stderr, never a traceback. This module parses and
prints; the work is done by the library (:mod:`~tiered_progcache.ops.prune`,
:mod:`~tiered_progcache.chain.transfer`, :mod:`~tiered_progcache.ops.supervise`) over the
:class:`~tiered_progcache.stores.store.EntryStore` protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .. import settings
from ..config import CacheConfig, masked
from ..errors import RemoteURLError, one_line
from ..stores.store import ENTRY_NAME_LENGTH, EntryStore
from ..units import format_age, format_size, is_size_unit, parse_duration, parse_size

if TYPE_CHECKING:
    from ..stores.localdir import LocalDir
    from .supervise import RunReport

__all__ = ["main"]

logger = logging.getLogger(__name__)

PROG = "tiered-progcache"

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

_MASK = "***"

#: Settings whose flag the command adds itself: ``--remote [URL]`` also selects the tier to act on.
_SELECTOR = ("remote",)

#: What ``EntryStore.verify_entry`` says of an entry that is not there (gone since listed).
_MISSING = "missing"


class UsageError(Exception):
    """A mistake in how the command was called: one line on stderr, exit 2."""


class NoSuchEntry(Exception):
    """An entry name or prefix that matches nothing in the store: one line on stderr, exit 1."""


def _iso(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- argument parsing ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Args(argparse.Namespace):
    """Parsed arguments. A bare ``--remote`` after the command keeps a URL given before it
    (``--remote URL ls --remote``): argparse would otherwise overwrite the URL with True."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "remote" and value is True and isinstance(vars(self).get("remote"), str):
            return
        super().__setattr__(name, value)


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ValueError message is the usage error (argparse drops it)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _prometheus_file(text: str) -> str:
    """``--prometheus-file``'s path, refused unless its directory exists (a typo must not create one)."""
    directory = os.path.dirname(os.path.abspath(text)) if text else ""
    if not text or os.path.isdir(text):
        raise ValueError(f"{text!r} is not a file path (give the .prom file to write, e.g. "
                         "/var/lib/node_exporter/textfile/tiered_progcache.prom)")  # fmt: skip
    if not os.path.isdir(directory):
        raise ValueError(f"the directory {directory} does not exist: create it, or fix the path "
                         "(node_exporter's textfile collector reads a directory that is there already)")  # fmt: skip
    return text


def _add_common_options(parser: argparse.ArgumentParser, *, shown: bool) -> None:
    """Options every subcommand takes, before or after its name. SUPPRESS: unset means "from env".

    The settings' flags are listed once, in ``config --help`` (``shown``); elsewhere they
    are accepted but left out of the help. Added after a command's own options, so those come first.
    """
    group = parser.add_argument_group("configuration (each overrides its TIERED_PROGCACHE_* variable)")
    settings.add_arguments(group, exclude=_SELECTOR, hidden=not shown)
    group = parser.add_argument_group("tier")
    group.add_argument("--remote", dest="remote", nargs="?", const=True, metavar="URL", default=argparse.SUPPRESS,
                       help="act on the remote tier; with URL, use that remote (s3://bucket/prefix, gs://..., "
                       "file:///...) [TIERED_PROGCACHE_REMOTE]")  # fmt: skip
    group.add_argument("--triton", action="store_true", default=argparse.SUPPRESS,
                       help="act on Triton's cache: TRITON_CACHE_DIR (or --dir; never TIERED_PROGCACHE_DIR) and the remote's "
                       "triton/ namespace")
    group.add_argument("--cupy", action="store_true", default=argparse.SUPPRESS,
                       help="act on CuPy's kernel cache: CUPY_CACHE_DIR (or --dir; never TIERED_PROGCACHE_DIR) and the remote's cupy/ namespace")
    out = parser.add_argument_group("output")
    out.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="log more (-v: info, -vv: every lookup)")


_SETTINGS_EPILOG = ("Configuration flags (--dir, --max-local-bytes, --signing-key-file, ...) go before or after "
                    "the command; tiered-progcache config --help lists them all.")


#: Headers ``explain`` lists before it says how many more (``--all`` lists them all, ``--json`` holds them all).
EXPLAIN_HEADERS_SHOWN = 20
#: The exit code after the reader of stdout went away: 128 + SIGPIPE, as a shell reports a process it killed.
EXIT_BROKEN_PIPE = 141


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG,
                     description="Look into, fill, trim and check the tiered program cache "
                     "(memory -> local directory -> remote bucket).",
                     epilog="Exit codes: 0 ok, 1 problems found (or a remote that names nothing usable), 2 usage "
                     "error. Flags override the TIERED_PROGCACHE_* environment variables; tiered-progcache config "
                     "--help lists them; see docs/configuration.md.")  # fmt: skip
    _add_common_options(parser, shown=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    commands: list[tuple[str, argparse.ArgumentParser]] = []

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        made = sub.add_parser(name, help=help, description=description or help, epilog=_SETTINGS_EPILOG)
        commands.append((name, made))
        return made

    p = command("config", "show the resolved configuration and where each value came from",
                "Show every setting's resolved value and where it came from (default, env VARIABLE, flag --x). "
                "Every configuration flag below works on every command. With --check, also read the signing "
                "key file and reach the remote; exit 1 if either fails.")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--check", action="store_true",
                   help="read the signing key file and reach each remote (creating nothing); exit 1 on a failure")  # fmt: skip
    p.add_argument("--set", dest="set_values", action="append", default=[], metavar="NAME=VALUE",
                   help="keep a setting in the config file (TIERED_PROGCACHE_CONFIG, else "
                   "~/.config/tiered-progcache/config), e.g. --set max_local_bytes=10G; variables and flags "
                   "still win over it")  # fmt: skip
    p.add_argument("--unset", dest="unset_names", action="append", default=[], metavar="NAME",
                   help="remove a setting from the config file")  # fmt: skip
    p.set_defaults(func=cmd_config)

    p = command("stats", "entries and bytes per tier; with --run, the hits and misses of one command",
                "Without --run: entries and bytes held per tier (the remote is listed only with --remote). "
                "With --run -- CMD ...: run CMD and print the hits and misses per tier of every cache "
                "it and its child processes used; exits with CMD's exit code.")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--run", action="store_true",
                   help="run the command after -- (stats --run -- CMD [ARG ...]) and report its cache activity")  # fmt: skip
    p.add_argument("--prometheus", action="store_true",
                   help="print Prometheus text; needs prometheus_client")  # fmt: skip
    p.add_argument("--prometheus-file", metavar="PATH", type=_typed(_prometheus_file),
                   help="write Prometheus text to PATH, whole or not at all (staged beside it, then renamed), "
                   "as node_exporter's textfile collector needs; stdout stays the command's own")  # fmt: skip
    p.add_argument("--zero", action="store_true",
                   help="start the local directory's cumulative counters over")  # fmt: skip
    p.set_defaults(func=cmd_stats)

    p = command("ls", "list entries with size and age", "List entries: name, size, and age "
                "(local: since last read; remote: since written). Local unless --remote.")  # fmt: skip
    p.add_argument("-l", "--long", action="store_true",
                   help="exact bytes, timestamps, a total, and from each entry's manifest: the host that "
                   "wrote it, when, its compile seconds and code type -> target ('-' where it has none)")  # fmt: skip
    p.set_defaults(func=cmd_ls)

    p = command("explain", "show one entry's manifest: what it was compiled from, by which host, when, how long",
                "Print the manifest stored beside entry NAME (its name from ls, or a unique prefix of 8+ hex digits): compiler and version, "
                "options, headers by include root, source digest, compile seconds, host and time. "
                "Local unless --remote. Exit 1 if there is no such entry, or it has no readable manifest.")  # fmt: skip
    p.add_argument("name", metavar="NAME", help="the entry (its name from ls, or a unique prefix of 8+ hex digits)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.add_argument("--all", action="store_true",
                   help=f"list every header (without it: the first {EXPLAIN_HEADERS_SHOWN}, then how many more)")  # fmt: skip
    p.set_defaults(func=cmd_explain)

    for name, verb in (
        ("warm", "copy remote entries into the local directory (e.g. at node boot)"),
        ("push", "copy local entries up to the remote (e.g. at the end of a CI job)"),
    ):
        p = command(name, verb)
        p.add_argument("names", nargs="*", metavar="NAME", help="only these entries (names from ls, or unique prefixes of 8+ hex digits)")
        if name == "warm":
            p.add_argument("--names-from", metavar="FILE",
                           help="only the entries named in FILE, one per line as ls prints them (- for stdin); "
                           "no listing of the remote")  # fmt: skip
            p.add_argument("--max-bytes", type=_typed(parse_size), metavar="SIZE",
                           help="only the newest entries that fit in SIZE (e.g. 20G, the local cap)")  # fmt: skip
        _progress_flag(p)
        p.set_defaults(func=functools.partial(cmd_transfer, direction=name))

    p = command("prune", "remove the oldest entries (a dry run unless --yes)",
                "Remove entries older than --older-than, then the oldest until at most --max-bytes remain. "
                "Shows what would go; --yes removes it. Local unless --remote. "
                "Age is time since last read for local entries, since written for remote ones.")  # fmt: skip
    p.add_argument("--older-than", type=_typed(parse_duration), metavar="AGE", help="e.g. 30d, 12h, 2w")
    p.add_argument("--max-bytes", type=_typed(parse_size), metavar="SIZE", help="e.g. 10G (10**9), 10Gi (2**30)")
    p.add_argument("--yes", action="store_true", help="remove them (without it: only show)")
    _progress_flag(p)
    p.set_defaults(func=cmd_prune)

    p = command("verify", "check every entry's integrity (and signature, on the remote); exit 1 if any is bad",
                "Remote entries: digest and, with a signing key, signature (exactly as a read checks them). "
                "Local entries carry no digest: they are checked to be whole cubin, fatbin, LTO-IR or PTX.")  # fmt: skip
    p.add_argument("--delete-bad", action="store_true",
                   help="delete the entries that fail as corrupt or truncated; entries that fail only the "
                   "signature check are listed as BAD-SIGNATURE and kept (a wrong key would otherwise "
                   "delete every entry)")  # fmt: skip
    _progress_flag(p)
    p.set_defaults(func=cmd_verify)

    _bundle_commands(command)

    p = command("clear", "delete every entry of the local directory, or of the remote (with --yes)")
    p.add_argument("--local", action="store_true", help="clear the local directory")
    p.add_argument("--yes", action="store_true", help="needed to clear a remote")
    p.set_defaults(func=cmd_clear)
    for name, made in commands:  # after each command's own options, so those are listed first
        _add_common_options(made, shown=name == "config")
    return parser


def _progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar (needs tqdm; default: when stderr is a terminal)")  # fmt: skip


# -- configuration and the store a command works on ----------------------------------------------


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags give; ``--remote URL`` sets the remote, a bare ``--remote`` only selects it."""
    remote = vars(args).get("remote")
    overrides = settings.overrides_from_args(args, exclude=_SELECTOR)
    if isinstance(remote, str):
        overrides["remote"] = remote
    return overrides


def load_config(args: argparse.Namespace, **extra: Any) -> CacheConfig:
    return CacheConfig.from_env(None, **{**_overrides(args), **extra})


def _wants_remote(args: argparse.Namespace) -> bool:
    return vars(args).get("remote") is not None


def _local(args: argparse.Namespace) -> LocalDir:
    """The configured local directory, without building the chain (no remote is contacted); ``--triton``: Triton's."""
    from ..stores.localdir import LocalDir, default_local_dir

    config = load_config(args)
    if _namespace(args) != "entries":
        return _own_dir(args, config)  # type: ignore[return-value]  # an EntryStore
    root = config.local_dir
    return LocalDir(root if root is not None else default_local_dir())


def _own_dir(args: argparse.Namespace, config: CacheConfig) -> EntryStore:
    """``--triton``'s or ``--cupy``'s directory: ``--dir`` when given on the command line, else the tool's own
    (``TRITON_CACHE_DIR``, ``CUPY_CACHE_DIR``).

    Never the program cache's directory (``TIERED_PROGCACHE_DIR``, which a CI job sets for the whole job, or its
    default): listing, pruning or clearing that as Triton's or CuPy's would touch the program cache's files.
    """
    from ..cupy.cupydir import CupyDir, default_cupy_dir
    from ..stores.localdir import default_local_dir
    from ..triton.tritondir import TritonDir, default_triton_dir

    cupy = _namespace(args) == "cupy"
    flag, variable = ("--cupy", "CUPY_CACHE_DIR") if cupy else ("--triton", "TRITON_CACHE_DIR")
    given = vars(args).get("local_dir")
    root = Path(given) if given is not None else (default_cupy_dir() if cupy else default_triton_dir())
    program_cache = config.local_dir if given is None and config.local_dir is not None else None
    for where, path in (("TIERED_PROGCACHE_DIR", program_cache), ("the program cache's default directory", default_local_dir())):
        if path is not None and os.path.realpath(path) == os.path.realpath(root):
            raise UsageError(f"{flag} would act on {root}, which is {where}, not {'CuPy' if cupy else 'Triton'}'s "
                             f"cache: set {variable} or pass --dir with its directory")  # fmt: skip
    return CupyDir(root) if cupy else TritonDir(root)


def _namespace(args: argparse.Namespace) -> str:
    """The entries a command acts on: ``triton`` (``--triton``), ``cupy`` (``--cupy``) or the program cache's."""
    triton, cupy = bool(vars(args).get("triton")), bool(vars(args).get("cupy"))
    if triton and cupy:
        raise UsageError("--triton and --cupy name two caches: pick one")
    return "triton" if triton else "cupy" if cupy else "entries"


@contextlib.contextmanager
def _remote(args: argparse.Namespace, *, writing: bool = False) -> Iterator[EntryStore]:
    """The configured shared tier (an fsspec remote or Redis), built strict: unreachable is an error now.

    Only that tier is built (no local directory, no chain). A command that only reads
    (``writing=False``: ls, stats, explain, verify, warm's side, export) never creates
    anything, whatever ``create_remote_root`` says: a missing ``file://`` root is an error.
    Where several are configured, ``--remote URL`` picks one; a bare ``--remote`` is a usage error.
    """
    from ..chain.tiered import shared_tier

    config = load_config(args, strict=True)
    urls = settings.remote_urls(config.remote)
    if not urls:
        raise UsageError("no remote configured: pass --remote URL or set TIERED_PROGCACHE_REMOTE")
    if len(urls) > 1:
        shown = ", ".join(masked(url) for url in urls)
        raise UsageError(f"{len(urls)} shared tiers are configured ({shown}): pick one with --remote URL")
    remote, _ = shared_tier(config, urls[0], signing_key=config.read_signing_key(), create_root=None if writing else False,
                            namespace=_namespace(args))
    if not isinstance(remote, EntryStore):  # pragma: no cover - every shared tier is an EntryStore
        raise UsageError(f"the remote {masked(urls[0])} is not an entry store")
    try:
        yield remote
    finally:
        remote.close()


@contextlib.contextmanager
def _store(args: argparse.Namespace, *, writing: bool = False) -> Iterator[EntryStore]:
    """The store a command acts on: the configured remote with ``--remote``, else the local directory."""
    if _wants_remote(args):
        with _remote(args, writing=writing) as remote:
            yield remote
    else:
        yield _local(args)


@contextlib.contextmanager
def _shared_for_manifests(args: argparse.Namespace) -> Iterator[Callable[[], EntryStore | None] | None]:
    """For a local read: the configured remote, opened on first use, to read manifests a promoted hit left there."""
    if _wants_remote(args) or not settings.remote_urls(load_config(args).remote):
        yield None
        return
    with contextlib.ExitStack() as opened_stores:
        opened: list[EntryStore] = []

        def shared() -> EntryStore | None:
            if not opened:
                opened.append(opened_stores.enter_context(_remote(args)))
            return opened[0]

        yield shared


def _counted(args: argparse.Namespace, entries: int, metadata: int, nbytes: int | None = None) -> str:
    """How many entries a command moved or lists: kernels apart from metadata, or Triton's files as files."""
    size = "" if nbytes is None else f", {format_size(nbytes)}"
    if _namespace(args) == "cupy":
        return f"{entries} CuPy kernels ({format_size(nbytes or 0)})" if nbytes is not None else f"{entries} CuPy kernels"
    if vars(args).get("triton"):
        return f"{entries} Triton files ({format_size(nbytes or 0)})" if nbytes is not None else f"{entries} Triton files"
    return f"{entries - metadata} kernels (+{metadata} metadata{size})"


# -- entry names as the user gives them -----------------------------------------------------------

#: The shortest prefix of an entry name the command accepts (as git accepts short hashes).
MIN_PREFIX_DIGITS = 8
_HEX_DIGITS = frozenset("0123456789abcdef")


def _is_name_or_prefix(text: str) -> bool:
    return MIN_PREFIX_DIGITS <= len(text) <= ENTRY_NAME_LENGTH and _HEX_DIGITS.issuperset(text.lower())


def _check_names(given: Sequence[str]) -> None:
    """A usage error for anything that is neither an entry name nor a prefix of one (before any store is opened)."""
    for text in given:
        if not _is_name_or_prefix(text):
            raise UsageError(f"not an entry name: {text!r} (64 hex digits as ls prints them, or a unique prefix "
                             f"of at least {MIN_PREFIX_DIGITS})")  # fmt: skip


def _resolve_names(given: Sequence[str], listing: Callable[[], Iterable[str]], where: str) -> list[str]:
    """Full entry names for ``given`` names or unique prefixes of at least 8 hex digits.

    ``listing`` (the names in the store) is called once, and only if a prefix is given.
    A prefix that several entries share is a usage error saying how many; one that
    matches none is :class:`NoSuchEntry`.
    """
    _check_names(given)
    names = [text.lower() for text in given]
    if all(len(n) == ENTRY_NAME_LENGTH for n in names):
        return names
    listed = sorted(set(listing()))
    out = []
    for n in names:
        if len(n) == ENTRY_NAME_LENGTH:
            out.append(n)
            continue
        matches = [m for m in listed if m.startswith(n)]
        if not matches:
            raise NoSuchEntry(f"no entry in {where} begins with {n}")
        if len(matches) > 1:
            raise UsageError(f"the prefix {n} is ambiguous in {where}: {len(matches)} entries begin with it "
                             f"({', '.join(m[:16] for m in matches[:3])}{', ...' if len(matches) > 3 else ''}); give more digits")  # fmt: skip
        out.append(matches[0])
    return out


def _store_names(store: EntryStore) -> Callable[[], Iterable[str]]:
    return lambda: (entry.name for entry in store.iter_entries())


def _refuse_read_only(store: EntryStore, doing: str) -> None:
    if store.read_only:
        raise UsageError(f"the remote {store.location} is read-only here: cannot {doing}")


# -- commands ---------------------------------------------------------------------------------


def _edit_config_file(args: argparse.Namespace) -> None:
    """``config --set``/``--unset``: each value checked by its row, then the file rewritten whole."""
    from ..configfile import config_path, parse_lines, settable, write_config_file

    path, _ = config_path(os.environ)
    if path is None:
        raise UsageError("no config file path: set TIERED_PROGCACHE_CONFIG (or HOME or XDG_CONFIG_HOME)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the config file {path}: {exc}") from None
    fixing = {item.partition("=")[0].strip() for item in args.set_values} | {n.strip() for n in args.unset_names}
    kept = {name: typed for name, (typed, _) in parse_lines(text, str(path), fixing=fixing).items()}
    for item in args.set_values:
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not value:
            raise UsageError(f"--set takes NAME=VALUE (e.g. --set max_local_bytes=10G), got {masked(item)!r}")
        try:
            settable(name).parse_text(value)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--set {name}: {exc}" if name in settings.by_name() else f"--set: {exc}") from None
        kept[name] = value
    for name in args.unset_names:
        try:
            settable(name.strip())
        except ValueError as exc:
            raise UsageError(f"--unset: {exc}") from None
        kept.pop(name.strip(), None)
    try:
        write_config_file(path, kept)
    except OSError as exc:
        raise UsageError(f"cannot write the config file {path}: {exc}") from None
    changed = [f"{n.strip()}={masked(v.strip())}" for n, _, v in (i.partition("=") for i in args.set_values)]
    changed += [f"-{n.strip()}" for n in args.unset_names]
    print(f"wrote {path}: {', '.join(changed)}", file=sys.stderr)


def cmd_config(args: argparse.Namespace) -> int:
    if args.set_values or args.unset_names:
        _edit_config_file(args)
    config = load_config(args)
    flags = {setting.name: setting.flag for setting in settings.SETTINGS}
    unused = {setting.name for setting in settings.SETTINGS if setting.unused}
    sources, rows = config.sources(), []
    for name, value in config.as_dict().items():  # every setting, in the table's order
        source = sources[name]
        if source == "argument":  # here the overrides are the command line's flags
            source = f"flag {flags[name]}"
        if name in unused:
            source += " (unused)"
        if name == "local_dir" and value is None:  # show where "default" is on this machine
            from ..stores.localdir import default_local_dir

            value = default_local_dir()
        rows.append((name, _shown(name, value), source))
    checks = _checks(config) if args.check else []
    if args.json:
        out: dict[str, Any] = {name: {"value": value, "source": source} for name, value, source in rows}
        if args.check:
            out = {"settings": out, "checks": [{"what": what, "ok": problem is None, "problem": problem}
                                               for what, problem in checks]}  # fmt: skip
        _print_json(out)
    else:
        texts = [(name, _describe(name, value), source) for name, value, source in rows]
        width = max(len(name) for name, _, _ in texts)
        value_width = max(len(text) for _, text, _ in texts)
        for name, text, source in texts:
            print(f"{name:<{width}}  {text:<{value_width}}  {source}")
        for what, problem in checks:
            print(f"check {what}: {'ok' if problem is None else 'FAILED: ' + problem}")
    return EXIT_PROBLEMS if any(problem is not None for _, problem in checks) else EXIT_OK


def _checks(config: CacheConfig) -> list[tuple[str, str | None]]:
    """``config --check``: read the signing key file, reach each remote (strict, creating nothing); (what, problem)."""
    from ..chain.tiered import shared_tier

    out: list[tuple[str, str | None]] = []
    key: bytes | str | None = None
    if config.signing_key_file is not None:
        try:
            key = config.read_signing_key()
            out.append((f"signing key file {config.signing_key_file}", None))
        except ValueError as exc:
            out.append((f"signing key file {config.signing_key_file}", str(exc)))
    strict = _config_with(config, strict=True)
    for url in settings.remote_urls(config.remote):
        what = f"remote {masked(url)}"
        try:
            remote, _ = shared_tier(strict, url, signing_key=key, create_root=False)
        except Exception as exc:  # unreachable, missing, denied: the check's answer, not a crash
            out.append((what, one_line(exc)))
            continue
        try:
            next(iter(remote.iter_entries()), None)  # one listing request: reachable and readable
            out.append((what, None))
        except Exception as exc:
            out.append((what, one_line(exc)))
        finally:
            remote.close()
    return out


def _config_with(config: CacheConfig, **changes: Any) -> CacheConfig:
    """``config`` with some settings changed (its sources kept for the rest)."""
    return CacheConfig(**{**{k: v for k, v in config.as_dict().items() if v is not None}, **changes})


def _shown(name: str, value: Any) -> Any:
    """A setting's value as printed: secrets masked (secret settings, secret-looking options, URL passwords)."""
    if settings.by_name()[name].secret and value is not None:
        return _MASK
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return masked(value)


def _describe(field: str, value: Any) -> str:
    """A config value for people: sizes in binary units too, and what None means for each field."""
    if value is None:
        if field.endswith("_bytes"):
            return "no limit"
        if field == "remote":
            return "none (local only)"
        if field == "remote_timeout":
            return f"{settings.DEFAULT_REMOTE_TIMEOUT_S:g} s (the remote tier's default)"
        return "-"
    if field.endswith("_bytes") and isinstance(value, int):
        return f"{value} ({format_size(value)})"
    if field == "remote_timeout":
        return f"{value:g} s"
    if isinstance(value, dict):
        return json.dumps(value)
    if field == "remote" and isinstance(value, (list, tuple)):
        return ", ".join(value)
    return str(value)


def cmd_stats(args: argparse.Namespace) -> int:
    if (args.prometheus or args.prometheus_file) and args.json:
        raise UsageError("--prometheus and --json are two output formats: pick one")
    if args.zero:
        if args.run or args.prometheus or args.prometheus_file or args.json:
            raise UsageError("--zero only starts the counters over: give it alone")
        from ..chain import ledger

        local = _local(args)
        if not local.root.is_dir():
            raise NoSuchEntry(f"no local directory {local.location}: nothing to zero")
        ledger.zero(local.root)
        print(f"zeroed the counters of {local.location}")
        return EXIT_OK
    if args.run:
        return _stats_of_run(args)
    config = load_config(args)
    rows = [_held("local", _local(args))]
    if _wants_remote(args):
        with _remote(args) as remote:
            rows.append(_held("remote", remote))
    else:
        urls = settings.remote_urls(config.remote)
        for n, url in enumerate(urls, start=1):  # listing a bucket can take a while: only on request
            tier = "remote" if n == 1 else f"remote{n}"
            rows.append({"tier": tier, "where": masked(url), "entries": None, "kernels": None, "metadata": None,
                         "bytes": None})  # fmt: skip
    from ..chain import ledger

    if args.prometheus or args.prometheus_file:
        import dataclasses

        from .metrics import exposition
        from ..chain.stats import CacheStats, TierStats

        counted = ledger.read_totals(rows[0]["where"]).cache_stats()  # what `stats` prints, and the tiers' gauges
        held = {r["tier"]: (r["entries"], r["bytes"]) for r in rows}
        tiers = [(name, dataclasses.replace(t, entries=held.get(name, (None, None))[0],
                                            bytes_held=held.get(name, (None, None))[1])) for name, t in counted.tiers]  # fmt: skip
        tiers += [(name, TierStats(entries=n, bytes_held=b)) for name, (n, b) in held.items() if name not in dict(tiers)]
        kernels = {r["tier"]: r["kernels"] for r in rows if r["kernels"] is not None}
        _write_prometheus(args, exposition(CacheStats(tuple(tiers), counted.compiling), kernels=kernels))
        return EXIT_OK

    local_row = rows[0]
    cap = config.max_local_bytes
    local_row["max_bytes"] = cap
    totals = ledger.read_totals(local_row["where"])
    local_row["cumulative"] = totals.as_dict()
    over = cap is not None and local_row["bytes"] > cap
    if over:
        logger.warning("the local directory %s holds %s, over its cap of %s", local_row["where"],
                       format_size(local_row["bytes"]), format_size(cap))  # fmt: skip
    if args.json:
        _print_json({row.pop("tier"): row for row in rows})
        return EXIT_OK
    _print_ccache_like(rows, totals, cap)
    return EXIT_OK


def _print_ccache_like(rows: list[dict[str, Any]], totals: Any, cap: int | None) -> None:
    """``stats`` for people, like ``ccache -s``: what this directory did since the last ``--zero``, then what each tier holds."""
    local = rows[0]
    since = _iso(totals.zeroed_at) if totals.zeroed_at is not None else "the first run"
    lookups = totals.lookups
    rate = f" ({100 * totals.hit_count / lookups:.1f}% of {lookups} lookups)" if lookups else ""
    print(f"local directory         {local['where']}")
    print(f"counted since           {since} (stats --zero starts over); {totals.reports} cache reports")
    print(f"hits                    {totals.hit_count}{rate}")
    for tier, n in totals.hits:
        print(f"  {tier:<21} {n}")
    print(f"misses                  {totals.misses}")
    print(f"NVRTC runs              {totals.compiles} ({totals.compile_seconds:.2f} s compiling)")
    print(f"compile time saved      {totals.saved_seconds:.2f} s (what the hits' entries took to compile)"
          f"{_unpriced(totals.hits_without_compile_time)}")
    print(f"flight decisions        {_flight_line(dict(totals.flight))}")
    print(f"errors                  {totals.errors} (timeouts {totals.timeouts}; a failing tier's reads count as misses too)")
    _print_uncacheable(totals.uncacheable, 24)
    size = format_size(local["bytes"])
    if cap is None:
        print(f"size                    {size} (no cap)")
    else:
        share = 100 * local["bytes"] / cap if cap else float("inf")
        warn = "  WARNING: over the cap" if local["bytes"] > cap else ""
        print(f"size                    {size} of {format_size(cap)} ({share:.1f}%){warn}")
    print()
    print(f"{'tier':<8} {'kernels':>8} {'metadata':>9} {'bytes':>12}  where")
    for row in rows:
        if row["entries"] is None:
            print(f"{row['tier']:<8} {'-':>8} {'-':>9} {'-':>12}  {row['where']} (pass --remote to list it)")
        else:
            print(f"{row['tier']:<8} {row['kernels']:>8} {row['metadata']:>9} {format_size(row['bytes']):>12}  {row['where']}")


def _print_uncacheable(by_reason: tuple[tuple[str, int], ...], width: int) -> None:
    """The ``uncacheable`` line: compiles that could not be cached, with each reason's count."""
    total = sum(n for _, n in by_reason)
    reasons = ", ".join(f"{reason} {n}" for reason, n in by_reason)
    print(f"{'uncacheable':<{width}}{total}{f' ({reasons}; compiled every time)' if total else ''}")


def _flight_line(flight: dict[str, int]) -> str:
    """The flight decisions that happened, ``raced_won 3, held 1`` (docs/cluster.md), or ``none``."""
    return ", ".join(f"{decision} {n}" for decision, n in flight.items() if n) or "none"


def _write_prometheus(args: argparse.Namespace, text: str) -> None:
    """Prometheus text on stdout (``--prometheus``) or into ``--prometheus-file`` whole (stage, rename), mode 0644."""
    if not args.prometheus_file:
        sys.stdout.write(text)
        return
    from ..stores import fsutil

    target = os.path.abspath(args.prometheus_file)
    try:
        fsutil.write_atomic(target, text.encode(), staging_dir=os.path.dirname(target), mode=0o644)
    except OSError as exc:
        raise NoSuchEntry(f"could not write {args.prometheus_file}: {exc}") from None


def _held(tier: str, store: EntryStore) -> dict[str, Any]:
    from ..stores.kinds import count_kinds
    from .classify import classify

    entries = list(store.iter_entries())
    kernels, metadata = count_kinds(classify(store, entries).values())
    return {"tier": tier, "where": store.location, "entries": len(entries), "kernels": kernels, "metadata": metadata,
            "bytes": sum(e.size for e in entries)}  # fmt: skip


def _stats_of_run(args: argparse.Namespace) -> int:
    from . import runstats, supervise
    from ..chain.stats import COUNTER_FIELDS

    if not args.child_argv:
        raise UsageError("--run needs a command: stats --run -- CMD [ARG ...]")
    load_config(args)  # a bad flag or variable is a usage error here, not a failure inside CMD
    try:  # the child sees the configuration the flags give
        run = supervise.run_command(args.child_argv, supervise.child_env(_overrides(args)))
    except supervise.CommandNotStarted as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    totals = run.totals
    compiled = runstats.compile_totals(run.reports)
    if args.prometheus or args.prometheus_file:
        from .metrics import exposition

        _write_prometheus(args, exposition(totals))
    elif args.json:
        tiers = {name: {k: v for k, v in s.as_dict().items() if k in COUNTER_FIELDS} for name, s in totals.tiers}
        _print_json({"command": list(run.argv), "exit_code": run.returncode, "seconds": round(run.seconds, 3),
                     "processes": run.processes, "caches": len(run.reports), "hits": totals.hits,
                     "misses": totals.misses, "compiles": compiled.compiles,
                     "compile_seconds": round(compiled.compile_seconds, 6),
                     "saved_seconds": round(compiled.saved_seconds, 6),
                     "hits_without_compile_time": compiled.hits_without_compile_time,
                     "uncacheable": dict(compiled.uncacheable),
                     "tiers": tiers, "flight": dict(totals.flight)})  # fmt: skip
    else:
        _print_run_table(run, compiled)
    return run.exit_code


def _unpriced(hits: int) -> str:
    """What the saved seconds leave out: hits whose entry's compile time no manifest on this node told."""
    if not hits:
        return ""
    return f"; and {hits} hit{'s' if hits != 1 else ''} of no known compile time (the manifest stayed on the remote)"


_RUN_COLUMNS = ("hits", "misses", "writes", "promotions", "errors", "timeouts", "skipped", "rejected", "bytes_read",
                "bytes_written")  # fmt: skip


def _print_run_table(run: RunReport, compiled: Any) -> None:
    totals, caches = run.totals, len(run.reports)
    print(f"command      {' '.join(run.argv)}")
    killed = f" (killed by {run.killed_by})" if run.killed_by else ""
    print(f"exit code    {run.returncode}{killed}")
    print(f"time         {run.seconds:.2f} s")
    print(f"caches       {caches} (in {run.processes} process{'es' if run.processes != 1 else ''})")
    if not caches:
        print("no cache reported: the command built no TieredProgramCache")
        return
    lookups = totals.tiers[0][1].lookups if totals.tiers else 0
    rate = f" ({100 * totals.hits / lookups:.1f}% of {lookups} lookups)" if lookups else ""
    print(f"hits         {totals.hits}{rate}")
    print(f"misses       {totals.misses} (missed by every tier)")
    print(f"NVRTC runs   {compiled.compiles} ({compiled.compile_seconds:.2f} s compiling; "
          f"{compiled.saved_seconds:.2f} s saved by hits{_unpriced(compiled.hits_without_compile_time)})")  # fmt: skip
    _print_uncacheable(compiled.uncacheable, 13)
    print(f"flight       {_flight_line(dict(totals.flight))}")
    header = ["tier"] + [c.replace("_", " ") for c in _RUN_COLUMNS]
    rows = [[name] + [format_size(v) if c.startswith("bytes") else str(v) for c, v in ((c, s.as_dict()[c]) for c in _RUN_COLUMNS)]
            for name, s in totals.tiers]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))))


def cmd_ls(args: argparse.Namespace) -> int:
    from ..stores.kinds import count_kinds
    from .classify import classify

    now = time.time()
    with _store(args) as store:
        entries = sorted(store.iter_entries(), key=lambda e: e.name)
        where = store.location
        kinds = classify(store, entries, names=True)
        if args.long:
            from ..compiling.manifest import manifest_columns

            with _shared_for_manifests(args) as shared:
                columns = manifest_columns(store, entries, shared=shared)
    if args.long:
        host_width = max([len("HOST")] + [len(c[0]) for c in columns.values()])
        print(f"{'NAME':<64}  {'BYTES':>10}  {'MODIFIED':<20}  {'LAST READ':<20}  {'AGE':>5}  "
              f"{'HOST':<{host_width}}  {'WRITTEN':<20}  {'COMPILE':>9}  {'CODE':<12}  {'KIND':<8}  KERNELS")  # fmt: skip
    if vars(args).get("triton"):  # Triton's files by the compile they belong to, each compile's group first
        entries.sort(key=lambda e: (kinds[e.name].names, e.name))
        if not args.long:
            _print_triton_files(entries, kinds, now)
            return EXIT_OK
    for e in entries:
        age = format_age(None if e.last_used is None else now - e.last_used)
        kind = kinds[e.name]
        if args.long:
            host, written, seconds, code = columns[e.name]
            print(f"{e.name}  {e.size:>10}  {_iso(e.mtime):<20}  {_iso(e.atime):<20}  {age:>5}  "
                  f"{host:<{host_width}}  {written:<20}  {seconds:>9}  {code:<12}  {kind.kind:<8}  {kind.shown_names()}")  # fmt: skip
        else:
            print(f"{e.name}  {format_size(e.size):>10}  {age:>5}  {kind.kind:<8}  {kind.shown_names()}")
    if args.long:
        kernels, metadata = count_kinds(kinds.values())
        print(f"total {_counted(args, kernels + metadata, metadata)}, {format_size(sum(e.size for e in entries))} in {where}")
    return EXIT_OK


def _print_triton_files(entries: list[Any], kinds: dict[str, Any], now: float) -> None:
    """``ls --triton``: one line per Triton kernel (its key, files, bytes), then its files by name."""
    groups: dict[str, list[Any]] = {}
    for e in entries:
        names = kinds[e.name].names
        key = names[0].split("/", 1)[0] if names else "-"
        groups.setdefault(key, []).append(e)
    for key, files in groups.items():
        kernels = [kinds[e.name].names[0].split("/", 1)[1][len("__grp__"):] for e in files
                   if kinds[e.name].is_kernel]  # fmt: skip
        label = ", ".join(k.rsplit(".", 1)[0] for k in kernels) or "no group index"
        print(f"kernel {key}  {label}  {len(files)} files, {format_size(sum(e.size for e in files))}")
        for e in files:
            age = format_age(None if e.last_used is None else now - e.last_used)
            names = kinds[e.name].names
            shown = names[0].split("/", 1)[1] if names else "-"
            print(f"  {e.name}  {format_size(e.size):>10}  {age:>5}  {shown}")


def cmd_explain(args: argparse.Namespace) -> int:
    from ..compiling.explain import stored_manifest

    _check_names([args.name])
    with _store(args) as store, _shared_for_manifests(args) as shared:
        where = store.location
        (name,) = _resolve_names([args.name], _store_names(store), where)
        found = stored_manifest(store, name, shared=shared)
    if found.manifest is None:
        if found.problem == "no entry":
            message = f"no entry {found.name} in {where}"
        elif found.problem == "no manifest":
            message = (f"entry {found.name} in {where} has no manifest (stored by Program.compile(cache=...), "
                       "or before manifests)")  # fmt: skip
        else:
            message = f"entry {found.name} in {where}: {found.problem}"
        print(f"{PROG} explain: {message}", file=sys.stderr)
        return EXIT_PROBLEMS
    if found.read_from is not None:  # the entry was promoted from the remote without it
        print(f"{PROG} explain: manifest read from {found.read_from} (none beside the entry in {where})", file=sys.stderr)
    if args.json:
        _print_json(found.manifest.as_dict())
    else:
        print("\n".join(found.manifest.lines(max_headers=None if args.all else EXPLAIN_HEADERS_SHOWN)))
    return EXIT_OK


def cmd_transfer(args: argparse.Namespace, direction: str) -> int:
    """``warm`` (remote -> local) or ``push`` (local -> remote)."""
    from ..chain import transfer

    given = list(args.names)
    max_bytes = None
    if direction == "warm":
        if args.names_from is not None:
            given += _names_from(args.names_from)
        max_bytes = args.max_bytes
        if max_bytes is not None and given:
            raise UsageError("--max-bytes picks from the remote's listing: give it or entry names, not both")
    _check_names(given)
    local = _local(args)
    with _remote(args, writing=direction == "push") as remote:
        if direction == "push":
            _refuse_read_only(remote, "push")
        source_store = remote if direction == "warm" else local
        names = _resolve_names(given, _store_names(source_store), source_store.location) or None
        with _progress_bar(args, direction) as progress:
            if direction == "warm":
                report = transfer.warm(remote, local, names, max_bytes=max_bytes, progress=progress)
            else:
                report = transfer.push(local, remote, names, progress=progress)
        source, target = (remote.location, local.location) if direction == "warm" else (local.location, remote.location)
    verb = "warmed" if direction == "warm" else "pushed"
    rate = f", {format_size(int(report.bytes / report.seconds))}/s" if report.seconds > 0 and report.bytes else ""
    print(
        f"{verb} {_counted(args, report.entries, report.metadata, report.bytes)} "
        f"from {source} to {target} in {report.seconds:.2f} s{rate}; {report.skipped} entries already there, "
        f"{report.failures} failed"
    )
    return EXIT_PROBLEMS if report.failures else EXIT_OK


def _names_from(path: str) -> list[str]:
    """Entry names (or prefixes) from a file (or ``-``: stdin), the first field of each line, as ``ls`` prints them.

    Blank lines, ``#`` comments, and the header and total lines of ``ls -l`` are skipped;
    anything else that is not an entry name or prefix is a usage error.
    """
    try:
        if path == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--names-from {path}: {exc}") from None
    fields = []
    for line in lines:
        words = line.split()
        if not words or words[0].startswith("#") or words[0] == "NAME" or (words[0] == "total" and len(words) > 1):
            continue
        if not _is_name_or_prefix(words[0]):
            raise UsageError(f"--names-from {path}: {words[0]!r} is not an entry name (64 hex digits as ls prints "
                             f"them, or a unique prefix of at least {MIN_PREFIX_DIGITS})")  # fmt: skip
        fields.append(words[0])
    return fields


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
    from .prune import prune

    if args.older_than is None and args.max_bytes is None:
        raise UsageError("say what to prune: --older-than AGE and/or --max-bytes SIZE")
    with _store(args, writing=args.yes) as store:
        if args.yes:
            _refuse_read_only(store, "prune it")
        with _progress_bar(args, "prune") as progress:
            report = prune(store, older_than=args.older_than, max_bytes=args.max_bytes, dry_run=not args.yes,
                           progress=progress)  # fmt: skip
    verb = "would remove" if report.dry_run else "remove"
    for doomed in report.doomed:
        print(f"{verb} {doomed.entry.name}  {format_size(doomed.size):>10}  {format_age(doomed.age):>5}")
    if report.dry_run:
        print(
            f"would remove {len(report.doomed)} of {report.listed} entries ({format_size(report.doomed_bytes)} "
            f"of {format_size(report.listed_bytes)}) in {report.location}; pass --yes to remove them"
        )
        return EXIT_OK
    for name, reason in report.failed:
        print(f"{PROG}: could not remove {name}: {reason}", file=sys.stderr)
    print(
        f"removed {report.removed} of {report.listed} entries in {report.location}"
        + (f"; {report.changed} changed or gone since listed, left alone" if report.changed else "")
        + (f"; {len(report.failed)} failed" if report.failed else "")
    )
    return EXIT_PROBLEMS if report.failed else EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    bad: list[tuple[str, str]] = []
    unsigned: list[tuple[str, str]] = []  # failed the signature check: never deleted here
    deleted = 0
    with _store(args, writing=args.delete_bad) as store:
        if args.delete_bad:
            _refuse_read_only(store, "delete from it")
        entries = list(store.iter_entries())
        with _progress_bar(args, "verify") as progress:
            for done, entry in enumerate(entries, start=1):
                reason = store.verify_entry(entry.name)
                if reason is None or reason == _MISSING:  # missing: gone since listed, nothing to check
                    pass
                elif _is_signature_failure(reason):
                    unsigned.append((entry.name, reason))
                else:
                    bad.append((entry.name, reason))
                    if args.delete_bad:
                        try:
                            deleted += store.delete_listed(entry)
                        except Exception as exc:  # report it and go on with the rest
                            print(f"{PROG}: could not delete {entry.name}: {exc}", file=sys.stderr)
                if progress:
                    progress(done, len(entries))
        where = store.location
    for name, reason in bad:
        print(f"BAD {name}: {reason}")
    for name, reason in unsigned:
        print(f"BAD-SIGNATURE {name}: {reason}")
    tail = f"; deleted {deleted}" if args.delete_bad else ""
    if unsigned:
        tail += f"; {len(unsigned)} failed the signature check only"
        if args.delete_bad:
            tail += ", kept (a wrong key is likelier than forgery: check the key, then delete them with clear or prune)"
    print(f"checked {len(entries)} entries in {where}: {len(bad) + len(unsigned)} bad{tail}")
    return EXIT_PROBLEMS if bad or unsigned else EXIT_OK


def _is_signature_failure(reason: str) -> bool:
    """A reason from the envelope's signature check (wrong key, or unsigned under a key), not corruption.

    The texts are the envelope's (tiered_progcache/stores/envelope.py); tests/ops/test_cli_remote.py
    pins them through real entries signed with another key.
    """
    return reason.startswith(("bad signature", "unsigned entry"))


def cmd_clear(args: argparse.Namespace) -> int:
    wants_remote = _wants_remote(args)
    if args.local == wants_remote:
        raise UsageError("say which tier to clear: --local, or --remote [URL] --yes")
    if wants_remote and not args.yes:
        raise UsageError("clearing a remote deletes it for every node that shares it: add --yes")
    with _store(args, writing=True) as store:
        _refuse_read_only(store, "clear it")
        removed = store.delete_entries(list(store.iter_entries()))
        store.sweep_staged()  # and what writers that died over an hour ago staged
        print(f"cleared {store.location} ({removed} entries)")
    return EXIT_OK


def _bundle_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("export", "write entries into one bundle file (tar, zstd when available) to ship or carry",
                "Write the entries of the local directory (or, with --remote, of the remote) into one file, "
                "each in its verifiable envelope (signed with the configured signing key, if any).")  # fmt: skip
    p.add_argument("out", metavar="OUT", help="the bundle file to write (replaced whole)")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these entries (names from ls, or unique prefixes of 8+ hex digits)")
    p.add_argument("--arch", metavar="SM", help="only cubins and PTX for this SM, e.g. sm_90")
    p.add_argument("--max-age", type=_typed(parse_duration), metavar="AGE", help="only entries used within AGE, e.g. 30d")
    p.add_argument("--format", dest="bundle_format", choices=("auto", "zstd", "tar"), default="auto",
                   help="the bundle's form: tar.zst, plain tar, or auto (zstd when zstandard is installed)")  # fmt: skip
    _progress_flag(p)
    p.set_defaults(func=cmd_export)
    p = command("import", "verify every entry of a bundle file, then land them (all or nothing)",
                "Verify every entry of the bundle (digest; signature with the configured signing key, which "
                "then refuses unsigned entries) before any lands, then land those missing into the local "
                "directory (or, with --remote, push them to the remote). Exit 1 if it is refused.")  # fmt: skip
    p.add_argument("bundle", metavar="IN", help="the bundle file to read")
    _progress_flag(p)
    p.set_defaults(func=cmd_import)


def cmd_export(args: argparse.Namespace) -> int:
    from .bundle import export_bundle

    compression = None if args.bundle_format == "tar" else args.bundle_format
    _check_names(args.names)
    key = load_config(args).read_signing_key()
    with _store(args) as store:
        names = _resolve_names(args.names, _store_names(store), store.location) or None
        with _progress_bar(args, "export") as progress:
            report = export_bundle(store, args.out, names=names, max_age=args.max_age, arch=args.arch,
                                   signing_key=key, compression=compression, progress=progress)  # fmt: skip
        where = store.location
    kind = "zstd" if report.compressed else "tar"
    print(f"exported {_counted(args, report.entries, report.metadata, report.bytes)} "
          f"from {where} to {report.path} ({kind}); "
          f"{report.skipped} filtered out, {report.failures} unreadable")  # fmt: skip
    return EXIT_PROBLEMS if report.failures else EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from .bundle import BundleRefused, import_bundle

    key = load_config(args).read_signing_key()
    with _store(args, writing=True) as store:
        _refuse_read_only(store, "import into it")
        try:
            with _progress_bar(args, "import") as progress:
                report = import_bundle(args.bundle, store, signing_key=key, progress=progress)
        except BundleRefused as exc:
            print(f"{PROG} import: refused {args.bundle}: {exc}; nothing landed", file=sys.stderr)
            return EXIT_PROBLEMS
        where = store.location
    print(f"imported {_counted(args, report.entries, report.metadata, report.bytes)} "
          f"from {report.path} to {where}; "
          f"{report.skipped} already there, {report.failures} failed")  # fmt: skip
    return EXIT_PROBLEMS if report.failures else EXIT_OK


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


def _bare_remote_last(argv: list[str]) -> list[str]:
    """``--remote NAME`` (an entry name or prefix, which no URL is) means a bare ``--remote`` and NAME.

    argparse would take NAME as the URL (``--remote`` takes an optional value), so each
    such ``--remote`` moves to the end, where nothing follows it.
    """
    out, bare = [], 0
    for i, token in enumerate(argv):
        if token == "--remote" and i + 1 < len(argv) and _is_name_or_prefix(argv[i + 1]):
            bare += 1
            continue
        out.append(token)
    return out + ["--remote"] * min(bare, 1)


#: Options that take a size: ``--max-bytes`` and every size setting's flag (``--max-local-bytes``).
_SIZE_OPTIONS = frozenset({"--max-bytes"} | {s.flag for s in settings.SETTINGS if s.kind.name == "size" and s.flag})


def _sizes_joined(argv: list[str]) -> list[str]:
    """A size written with a space before its unit (``--max-bytes 10 GB``) as one value (``10GB``).

    argparse would take the unit for the next argument (an entry name to ``warm``, an
    unrecognized argument to ``prune``). Only a unit word follows a number this way, and no
    unit is an entry name (names are 8 or more hex digits), so nothing else is joined.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        out.append(token)
        option, eq, value = token.partition("=")
        if option == "--set" and not eq and i + 1 < len(argv):  # --set max_local_bytes=10 G
            i += 1
            out.append(argv[i])
            value = argv[i].partition("=")[2]
            if i + 1 < len(argv) and _is_number(value) and is_size_unit(argv[i + 1]):
                out[-1] += argv[i + 1]
                i += 1
        elif option in _SIZE_OPTIONS:
            if not eq and i + 1 < len(argv):  # --max-bytes 10 GB: the value is the next token
                i += 1
                value = argv[i]
                out.append(value)
            if i + 1 < len(argv) and _is_number(value) and is_size_unit(argv[i + 1]):
                out[-1] += argv[i + 1]
                i += 1
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (the console script passes it to ``sys.exit``)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is the command of `stats --run`, whatever it looks like.
    child_argv: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, child_argv = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(_bare_remote_last(_sizes_joined(argv)), namespace=_Args())
    args.child_argv = child_argv
    if child_argv and not vars(args).get("run", False):
        parser.error(f"arguments after -- are only for stats --run: {' '.join(child_argv)}")
    verbosity = vars(args).get("verbose", 0) or 0
    _configure_logging(verbosity)
    try:
        if args.command != "config":  # config shows the settings whatever they are; config --check reads the key
            load_config(args).read_signing_key(warn=False)  # a missing, empty or directory key file: refused now
        code = args.func(args)
        sys.stdout.flush()  # here, so a reader that went away (`| head`) is caught below, not at exit
        return code
    except BrokenPipeError:
        # The reader stopped reading: no traceback, and nothing more to stdout (exit flushes it again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NoSuchEntry as exc:
        print(f"{PROG} {args.command}: {exc}", file=sys.stderr)
        return EXIT_PROBLEMS
    except RemoteURLError as exc:  # a remote that names nothing usable: a configuration problem, like a missing bucket
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_PROBLEMS
    except (ValueError, TypeError) as exc:  # bad configuration values, from the settings table or a tier
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
        print(f"{PROG} {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_PROBLEMS
