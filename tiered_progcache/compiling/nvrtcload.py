"""NVRTC's libraries, loaded on a thread beside a process's first header work.

cuda-core's key asks NVRTC for its version, so a process's first hit loads NVRTC (6-10 ms), and
``ctypes`` holds the interpreter's lock while it does: a kernel whose header scan is validated first
pays both in turn. A node's process records the NVRTC libraries loaded once cuda-core's key has
loaded NVRTC (as cuda-pathfinder chose them: the library, and its builtins where it loads those
too), under a digest of what that choice depends on; the node's next process in the same environment
maps the same files with ``dlopen`` through libc on a thread of its own (a foreign call: the lock is
released), so the scan's memo is read and validated meanwhile, and cuda-pathfinder finds the library
loaded. Linux only; every failure costs the overlap alone.

The record names host code this process maps, so it is trusted further than the rest of the local
directory: only a regular file (never through a symbolic link) owned by this process's user and
writable by no one else (docs/security.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import stat
import sys
import threading

from ..stores import fsutil
from ..stores.ratelimit import log_once

logger = logging.getLogger(__name__)

__all__ = ["LIBRARIES_FILE", "MAX_ENVIRONMENTS", "record", "start"]

#: The file in the local directory that holds what each environment's process had mapped.
LIBRARIES_FILE = "nvrtc-libraries.json"
#: Environments kept in it (one local directory may serve several virtual environments); the newest win.
MAX_ENVIRONMENTS = 8
_FORMAT = "tiered-progcache/nvrtc-libraries"
_MAX_FILE_BYTES = 64 * 1024
#: What cuda-pathfinder's choice of library depends on, besides ``sys.path`` and the packages' versions.
_ENVIRONMENT_VARIABLES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX")
_LINUX = sys.platform.startswith("linux")
_lock = threading.Lock()
_started = _recorded = False  # once set, never cleared: every compile() reads them without the lock first


def _environment() -> str:
    """A digest of what decides which NVRTC this process loads: the interpreter, its path, the CUDA packages'
    versions and the loader's variables (read now: a process may change them before its first compile)."""
    from cuda import bindings, pathfinder

    described = [sys.executable, sys.prefix, *sys.path, bindings.__version__, pathfinder.__version__,
                 *(os.environ.get(name, "") for name in _ENVIRONMENT_VARIABLES)]  # fmt: skip
    return hashlib.sha256("\0".join(described).encode()).hexdigest()


def _signature(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _read(directory: str) -> dict[str, list[list[object]]]:
    """The recorded environments (digest -> [[path, signature], ...]); empty where there is no good file or one
    that another user could have written (a WARNING: it would choose the libraries this process maps)."""
    path = os.path.join(directory, LIBRARIES_FILE)
    try:  # a symbolic link, FIFO or device at the name, or a file over the bound: refused (OSError) unread
        fd, st = fsutil.open_regular(path, _MAX_FILE_BYTES, refuse=OSError)
        with open(fd, "rb") as fh:
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                log_once(logger, f"nvrtc-record:{path}", logging.WARNING, "ignoring %s: a file of uid %d, mode %o; "
                         "only one of this user's that no one else can write is read", path, st.st_uid,
                         stat.S_IMODE(st.st_mode))
                return {}
            data = fh.read(_MAX_FILE_BYTES + 1)
        doc = json.loads(data) if len(data) <= _MAX_FILE_BYTES else None
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("environments"), dict):
        return {}
    return doc["environments"]


def _loaded_nvrtc() -> list[str]:
    """The NVRTC library cuda-pathfinder loaded for cuda-core (asked again: its answer is cached) and the builtins
    loaded beside it (:func:`_loaded_beside`)."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return _loaded_beside(load_nvidia_dynamic_lib("nvrtc").abs_path)


def _loaded_beside(library: str) -> list[str]:
    """``library``, then each builtins library in its directory that this process has loaded (cuda-pathfinder loads
    that of NVRTC 13.0's wheel itself; later NVRTCs load theirs on their first compile)."""
    directory, loaded = os.path.dirname(library), []
    for name in sorted(os.listdir(directory)):
        if name.startswith("libnvrtc-builtins.so"):
            try:
                ctypes.CDLL(os.path.join(directory, name), mode=os.RTLD_NOLOAD)  # loads nothing: only asks
            except OSError:
                continue
            loaded.append(os.path.join(directory, name))
    return [library, *loaded]


def start(directory: str) -> threading.Thread | None:
    """Once per process: map, on a thread, the NVRTC libraries recorded in ``directory`` for this environment whose
    files are unchanged; the thread, or None where nothing is loaded. Never raises."""
    global _started, _recorded
    if _started or not _LINUX:
        return None
    with _lock:
        if _started:
            return None
        _started = True
    try:
        rows = _read(directory).get(_environment())
        paths = [str(path) for path, signature in rows or () if _signature(str(path)) == signature]
        if not rows or len(paths) != len(rows):
            return None
    except Exception as exc:  # a file gone or bad, a package without a version: no overlap, nothing else
        logger.debug("not preloading NVRTC: %r", exc)
        return None
    with _lock:
        _recorded = True  # what it loads is what this environment's record says: nothing new to record
    thread = threading.Thread(target=_load, args=(paths,), name="tiered-progcache-nvrtc-load", daemon=True)
    thread.start()
    return thread


def _load(paths: list[str]) -> None:
    libc = ctypes.CDLL(None)
    libc.dlopen.argtypes, libc.dlopen.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_void_p
    for path in paths:
        if not libc.dlopen(os.fsencode(path), os.RTLD_NOW | os.RTLD_GLOBAL):  # as cuda-pathfinder opens it
            logger.debug("not preloaded: %s", path)
            return


def record(directory: str) -> None:
    """Once per process, after NVRTC's first use (cuda-core's key): record the NVRTC libraries loaded here for this
    environment in ``directory``, where this process did not preload them and that differs from what is there.
    Never raises."""
    global _recorded
    if _recorded or not _LINUX:
        return
    with _lock:
        if _recorded:
            return
        _recorded = True
    try:
        rows = [[path, _signature(path)] for path in _loaded_nvrtc()]
        environments, environment = _read(directory), _environment()
        if environments.get(environment) == rows:
            return
        environments.pop(environment, None)
        kept = list(environments.items())[-(MAX_ENVIRONMENTS - 1):] + [(environment, rows)]
        doc = json.dumps({"format": _FORMAT, "environments": dict(kept)}).encode()
        if len(doc) <= _MAX_FILE_BYTES:
            fsutil.write_atomic(os.path.join(directory, LIBRARIES_FILE), doc, staging_dir=directory, fsync=False)
    except Exception as exc:  # no NVRTC, a full disk: the next process loads NVRTC as this one did
        logger.debug("could not record NVRTC's libraries in %s: %r", directory, exc)
