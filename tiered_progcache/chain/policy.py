"""How the chain treats one tier: the write, promotion and sharing policy, in one place.

The default chain is ``memory`` (promote, write at once) -> ``local`` (promote, write
at once) -> ``remote`` (shared, written in the background, optionally read-only).
A user tier (Redis, NFS, ...) takes any :class:`TierPolicy`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["TierPolicy", "WriteMode"]

WriteMode = Literal["sync", "background"]


@dataclasses.dataclass(frozen=True)
class TierPolicy:
    """The chain's rules for one tier.

    name:
        How ``stats()`` and the logs call the tier; unique within a chain.
    read_only:
        Never written, promoted into or deleted from (a fleet reading what CI wrote).
    promote:
        A hit in a slower tier is copied into this one.
    write:
        ``"sync"``: ``cache[key] = value`` writes it before returning. ``"background"``:
        the write is queued for a worker thread (bounded queue; a full queue drops and
        counts), so a slow network never holds up a compile.
    shared:
        The tier is shared beyond this node: ``clear()`` leaves it alone and ``len()``
        does not count it (listing a bucket is slow and not this node's business).
    """

    name: str
    read_only: bool = False
    promote: bool = True
    write: WriteMode = "sync"
    shared: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tier name must be a non-empty str, got {self.name!r}")
        if self.write not in ("sync", "background"):
            raise ValueError(f"tier write mode must be 'sync' or 'background', got {self.write!r}")
