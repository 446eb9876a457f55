"""CacheConfig: the settings of one cache, resolved from arguments, ``TIERED_PROGCACHE_*`` variables and defaults, and the chain they describe.

Precedence: a keyword argument (``from_env(remote=...)``, a CLI flag) beats the
environment, which beats the config file (:mod:`tiered_progcache.configfile`), which beats the default; an empty variable counts as unset; a value that
does not parse is a ``ValueError`` naming the variable, raised before anything is
built (:class:`~tiered_progcache.configvalues.ConfigValues` holds the values).
What the settings are is :data:`tiered_progcache.settings.SETTINGS`.
"""

from __future__ import annotations

from .configvalues import ConfigValues, read_key_file
from .redact import masked
from .settings import ENV_PREFIX
from .chain.tiered import TieredProgramCache, shared_chain

__all__ = ["ENV_PREFIX", "CacheConfig", "masked", "read_key_file"]


class CacheConfig(ConfigValues):
    """Every setting's value, checked, where each came from, and the cache they describe. Immutable, so safe to share.

    >>> config = CacheConfig.from_env(remote="s3://ci-kernels/cuda13")
    >>> config.remote, config.sources()["remote"], config.sources()["local_dir"]
    ('s3://ci-kernels/cuda13', 'argument', 'default')
    >>> cache = config.build()

    Each setting is an attribute (``config.max_local_bytes``). ``CacheConfig(**values)``
    checks keyword values like the cache's constructor (unknown name: ``TypeError``; bad
    value: ``TypeError``/``ValueError`` naming it); ``build()`` makes a new cache each
    call. ``local_dir=None`` means cuda-core's default directory; ``remote_timeout=None``
    the remote tier's default; ``max_*_bytes=None`` no limit.
    """

    __slots__ = ()

    def build(self) -> TieredProgramCache:
        """A new cache as configured. A signing key file is read now (and only its bytes are kept)."""
        return TieredProgramCache.from_config(self)

    def build_shared(self, *, namespace: str = "entries") -> TieredProgramCache | None:
        """A chain of the shared tiers alone (no memory, no local directory) on ``namespace``, or None if no remote is set.

        What :mod:`tiered_progcache.triton` stands behind Triton's own local directory
        (``namespace="triton"``).
        """
        specs = shared_chain(self, namespace=namespace)
        if not specs:
            return None
        return TieredProgramCache.from_config(self, tiers=specs)
