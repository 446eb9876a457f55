"""The oracle of the header tests: which files NVRTC actually opens while it compiles in-process.

inotify ``IN_OPEN`` watches on every directory of a test tree (and the working directory)
record each file opened there while ``Program.compile`` runs; the kernel queues the event
inside ``open(2)``, so everything NVRTC opened is in the queue when the compile returns.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import inotify_simple
from cuda.core import Program, ProgramOptions

IN_OPEN = 0x00000020
IN_ISDIR = 0x40000000


def directories_under(roots: Iterable[str]) -> list[str]:
    """Every real directory under ``roots`` (each once), for watching."""
    found: dict[str, None] = {}
    for root in roots:
        for current, dirs, _ in os.walk(root, followlinks=True):
            real = os.path.realpath(current)
            if real in found:
                dirs[:] = []
                continue
            found[real] = None
    return list(found)


def opened_by_nvrtc(source: str, options: ProgramOptions, watch_dirs: Iterable[str]) -> tuple[set[str], bool]:
    """(real paths of the files opened under ``watch_dirs`` while NVRTC compiles ``source`` to cubin, compiled ok)."""
    with inotify_simple.INotify() as inotify:
        names = {}
        for directory in directories_under(watch_dirs):
            names[inotify.add_watch(directory, IN_OPEN)] = directory
        program = Program(source, "c++", options)
        try:
            program.compile("cubin")
            ok = True
        except Exception:
            ok = False
        finally:
            program.close()
        opened = set()
        for event in inotify.read(timeout=0):
            if event.mask & IN_ISDIR or not event.name:
                continue
            opened.add(os.path.join(names[event.wd], event.name))
    return opened, ok
