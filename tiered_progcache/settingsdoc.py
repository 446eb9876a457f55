"""The settings table of docs/configuration.md, written from :data:`~tiered_progcache.settings.SETTINGS`.

The page holds the table between :data:`BEGIN` and :data:`END`; ``python -m
tiered_progcache.settingsdoc [PATH]`` rewrites it there (``--check``: exit 1 if it is
stale, writing nothing), and a test fails while the page and the rows disagree, so a new
setting reaches the docs from its row rather than by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from . import settings
from .units import format_size

__all__ = ["BEGIN", "END", "DOC_PATH", "default_text", "markdown_table", "rewrite"]

BEGIN = "<!-- settings table: written by `python -m tiered_progcache.settingsdoc` from the rows in settings.py -->"
END = "<!-- end of the settings table -->"
#: The page in a source checkout.
DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

_HEADER = (
    "| setting (`from_env`/`CacheConfig` field) | environment variable | `TieredProgramCache` argument | CLI flag "
    "| default | meaning |\n| --- | --- | --- | --- | --- | --- |"
)
#: The constructor's one positional alias (``TieredProgramCache(path)``).
_ARGUMENTS = {"local_dir": "`path` (first positional) or `local_dir`"}
_CHAIN_WIDE = "chain-wide, so it applies with `tiers=[...]` too"


def default_text(setting: settings.Setting) -> str:
    """The default as the page shows it: ``256 MiB (`268435456`)``, ``5 s``, ``no limit``, ``false``."""
    if setting.doc_default:
        return setting.doc_default
    value: Any = setting.default
    if value is None:
        return "no limit" if setting.kind.name == "size" else "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if setting.kind.name == "size":
        return f"{format_size(value).replace('.0 ', ' ')} (`{value}`)"
    number = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{number} s" if setting.kind.name == "seconds" else number


def _flag_text(setting: settings.Setting) -> str:
    if setting.flag is None:
        return "-"
    if setting.kind.switch:
        off = f" / `--no-{setting.flag.removeprefix('--')}`" if setting.default else ""
        return f"`{setting.flag}`{off}"
    return f"`{setting.flag} {setting.kind.metavar}`" if setting.kind.metavar else f"`{setting.flag}`"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def markdown_table() -> str:
    """The table, one row per setting in the table's order, then ``tiers`` and the run-stats variable."""
    rows = [_HEADER]
    for setting in settings.SETTINGS:
        meaning = setting.doc or setting.help
        if not setting.builds_tiers:
            meaning = f"{meaning}; {_CHAIN_WIDE}"
        rows.append(_row([
            f"`{setting.name}`",
            f"`{setting.variable}`" if setting.variable else "-",
            _ARGUMENTS.get(setting.name, f"`{setting.name}`"),
            _flag_text(setting),
            default_text(setting),
            meaning,
        ]))  # fmt: skip
    rows.append(_row([
        "-", "-", "`tiers`", "-", "memory -> local (-> remote)",
        "build the chain yourself: a list of `EntryStore`, `ProgramCacheResource` or `(either, TierPolicy)`, "
        "fastest first ([writing-a-tier.md](writing-a-tier.md)); every setting above that is not chain-wide "
        "shapes the default chain, so giving one with `tiers` is a `ValueError` naming it",
    ]))  # fmt: skip
    rows.append(_row([
        "-", f"`{settings.STATS_FILE_ENV}`", "-", "set by `stats --run`", "unset",
        "not a setting: when set, every `TieredProgramCache` (however built) appends what it counted since its last "
        "report to this file as one JSON line, once at `close()` or else at exit; the command sums them",
    ]))  # fmt: skip
    return "\n".join(rows)


def _replaced(text: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no settings table between {BEGIN!r} and {END!r}")
    return text[: start + len(BEGIN)] + "\n" + markdown_table() + "\n" + text[end:]


def rewrite(path: Path = DOC_PATH, *, check: bool = False) -> bool:
    """Write the table into the page at ``path``; True if it was current already (``check``: write nothing)."""
    text = path.read_text(encoding="utf-8")
    wanted = _replaced(text)
    if wanted == text:
        return True
    if not check:
        path.write_text(wanted, encoding="utf-8")
    return False


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(arg) for arg in argv if arg != "--check"] or [DOC_PATH]
    stale = [path for path in paths if not rewrite(path, check=check)]
    if check and stale:
        sys.stderr.write(f"stale settings table in {', '.join(map(str, stale))}: run python -m {__name__}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
