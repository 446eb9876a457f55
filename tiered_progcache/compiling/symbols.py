"""The symbol-map format: the small JSON document stored beside a binary compiled with name expressions.

cuda-core does not cache ``name_expressions`` compiles because the binary alone cannot
answer ``get_kernel("f<int>")``: the mapping from each expression to its mangled name
is lost. :func:`compile <tiered_progcache.compiling.compile>` stores it under :func:`symbols_key`
as a versioned JSON document, with each name tagged ``"s"`` (str) or ``"b"`` (bytes,
as latin-1) so a hit returns exactly the types the caller asked with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from ..chain.stats import MetadataKey
from ..stores.kinds import SYMBOLS_FORMAT
from ..stores.store import companion_keys, companion_keys_of_name, entry_name, is_entry_name

__all__ = ["SYMBOLS_FORMAT", "decode_symbols", "encode_symbols", "symbols_key", "symbols_name"]

_VERSION = 1

SymbolMapping = dict[str | bytes, str | bytes]


def symbols_key(key: bytes) -> bytes:
    """The key under which the symbol mapping of entry ``key`` is stored (pure; any thread).

    A :class:`~tiered_progcache.chain.stats.MetadataKey`: the chain's reads of it count no lookup.

    Derived from the binary's entry name, as the manifest's is, so a listing alone pairs them
    (:func:`symbols_name`).

    >>> cache.get(symbols_key(key))   # b'{"format": "tiered-progcache/symbols", ...}'
    """
    return MetadataKey(companion_keys(bytes(key))[1])


def symbols_name(name: str) -> str:
    """The entry name of the symbol map of entry ``name``, from the name alone (``prune`` keeps them together).

    >>> symbols_name(entry_name(key)) == entry_name(symbols_key(key))
    True
    """
    if not is_entry_name(name):
        raise ValueError(f"not an entry name (64 lowercase hex digits, as ls prints): {name!r}")
    return entry_name(companion_keys_of_name(name)[1])


def _tagged(value: str | bytes) -> list[str]:
    if isinstance(value, bytes):
        return ["b", value.decode("latin-1")]
    return ["s", value]


def _untagged(item: object) -> str | bytes:
    if not (isinstance(item, list) and len(item) == 2 and item[0] in ("s", "b") and isinstance(item[1], str)):
        raise ValueError(f"bad symbol field {item!r}")
    return item[1] if item[0] == "s" else item[1].encode("latin-1")


def encode_symbols(mapping: Mapping[str | bytes, str | bytes]) -> bytes:
    """The stored document for ``mapping`` (deterministic: equal mappings give equal bytes)."""
    symbols = [[_tagged(name), _tagged(mangled)] for name, mangled in mapping.items()]
    symbols.sort(key=lambda pair: json.dumps(pair))
    return json.dumps({"format": SYMBOLS_FORMAT, "version": _VERSION, "symbols": symbols}, sort_keys=True).encode()


def decode_symbols(data: bytes | None, names: Sequence[str | bytes]) -> SymbolMapping | None:
    """The stored mapping if it is well-formed and covers every requested name, else None."""
    if data is None:
        return None
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != SYMBOLS_FORMAT or doc.get("version") != _VERSION:
            return None
        mapping: SymbolMapping = {}
        for pair in doc["symbols"]:
            name, mangled = pair
            mapping[_untagged(name)] = _untagged(mangled)
    except (ValueError, KeyError, TypeError):
        return None
    if any(n not in mapping for n in names):
        return None
    return mapping
