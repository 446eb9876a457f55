"""The arguments ``compile()`` and ``explain()`` share: checked at the door, and the knobs left out taken from the cache.

A caller's bug is a ``TypeError``/``ValueError`` naming the argument, raised before
anything is looked up, built or compiled. ``compile()``'s knobs (``single_flight``,
``wait_timeout``, ``lease_ttl``, ``header_recheck_s``, ``portable_keys``) are settings,
rows of :data:`~tiered_progcache.settings.SETTINGS`, checked by their rows. Precedence:
an argument given (not None) wins; else the cache's value (``cache.settings``: its
constructor's argument, or its ``TIERED_PROGCACHE_*`` variable where it was built by
``from_env``, as the default cache is); else the row's default (a cache that is not a
chain has no settings).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cuda.core import ProgramOptions
from cuda.core.utils import ProgramCacheResource

from .. import settings
from ..chain.tiered import TieredProgramCache
from ..stores.store import EntryStore

__all__ = ["CODE_TYPES", "KNOBS", "TARGET_TYPES", "check_arguments", "knob_for", "knobs_for"]

CODE_TYPES = ("c++", "ptx", "nvvm")
TARGET_TYPES = ("cubin", "ptx", "ltoir")
#: compile()'s arguments that are settings too, in the order :func:`knobs_for` returns them.
KNOBS = ("single_flight", "wait_timeout", "lease_ttl", "header_recheck_s", "portable_keys")


def check_arguments(
    source: object, code_type: object, options: object, target_type: object, cache: object,
    name_expressions: object, extra_digest: object, single_flight: object = None, wait_timeout: object = None,
    lease_ttl: object = None, header_recheck_s: object = None, portable_keys: object = None,
) -> tuple[str | bytes, ...]:
    """Every argument of :func:`~tiered_progcache.compiling.compile` checked up front; returns the name expressions as a tuple.

    A knob given as None is not given (the cache's setting applies, :func:`knobs_for`);
    one given is checked by its settings row (``lease_ttl: must be a positive, finite
    number of seconds, got inf``).
    """
    if not isinstance(code_type, str):
        raise TypeError(f"code_type must be a str, got {type(code_type).__name__}")
    if code_type.lower() not in CODE_TYPES:
        raise ValueError(f"code_type must be one of {', '.join(CODE_TYPES)}, got {code_type!r}")
    if code_type.lower() == "nvvm":
        if not isinstance(source, (str, bytes, bytearray)):
            raise TypeError(f"source must be str or bytes for code_type='nvvm', got {type(source).__name__}")
    elif not isinstance(source, str):
        raise TypeError(f"source must be a str for code_type={code_type!r}, got {type(source).__name__}")
    if options is not None and not isinstance(options, ProgramOptions):
        raise TypeError(f"options must be a cuda.core ProgramOptions or None, got {type(options).__name__}")
    if not isinstance(target_type, str):
        raise TypeError(f"target_type must be a str, got {type(target_type).__name__}")
    if target_type.lower() not in TARGET_TYPES:
        raise ValueError(f"target_type must be one of {', '.join(TARGET_TYPES)}, got {target_type!r}")
    if cache is not None and not isinstance(cache, (ProgramCacheResource, EntryStore)):
        raise TypeError(f"cache must be a cuda.core ProgramCacheResource (a TieredProgramCache, say), a "
                        f"tiered_progcache EntryStore or None, got {type(cache).__name__}")  # fmt: skip
    if isinstance(name_expressions, (str, bytes)) or not isinstance(name_expressions, Iterable):
        raise TypeError("name_expressions must be a sequence of str or bytes (not one string), "
                        f"got {type(name_expressions).__name__}")  # fmt: skip
    names = tuple(name_expressions)
    if not all(isinstance(n, (str, bytes)) for n in names):
        raise TypeError(f"name_expressions must hold str or bytes, got {[type(n).__name__ for n in names]}")
    if extra_digest is not None and not isinstance(extra_digest, (bytes, bytearray, memoryview)):
        raise TypeError(f"extra_digest must be bytes or None, got {type(extra_digest).__name__}")
    knobs = (single_flight, wait_timeout, lease_ttl, header_recheck_s, portable_keys)
    for name, value in zip(KNOBS, knobs):  # a knob left out (the usual call) costs nothing
        if value is None or (name in _SWITCHES and (value is True or value is False)):
            continue  # a switch given as a bool passes its row's check as it is (a hit's fast path)
        settings.check({name: value})  # its row's check, naming the knob
    return names


#: The knobs that are switches: True and False pass their rows' check as they are (a hit's fast path).
_SWITCHES = frozenset({"single_flight", "portable_keys"})


def knobs_for(
    cache: TieredProgramCache, single_flight: Any, wait_timeout: Any, lease_ttl: Any, header_recheck_s: Any,
    portable_keys: Any,
) -> tuple[bool, float, float, float, bool]:
    """The knobs (in :data:`KNOBS` order) with each left out (None) taken from ``cache``'s settings or the table.

    The arguments are checked already (:func:`check_arguments`); so are the settings. A bare
    resource wrapped into a chain (:func:`~tiered_progcache.chain.tiered.as_chain`) has every row's default.
    """
    values = cache.settings
    return (
        values.single_flight if single_flight is None else single_flight,
        values.wait_timeout if wait_timeout is None else float(wait_timeout),
        values.lease_ttl if lease_ttl is None else float(lease_ttl),
        values.header_recheck_s if header_recheck_s is None else float(header_recheck_s),
        values.portable_keys if portable_keys is None else portable_keys,
    )


def knob_for(cache: TieredProgramCache, name: str, given: Any) -> Any:
    """One knob: ``given`` unless it is None, else ``cache``'s setting ``name`` or the row's default."""
    if given is not None:
        return given
    return getattr(cache.settings, name)
