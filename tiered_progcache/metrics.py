"""``tiered_progcache.metrics``, kept where users import it: the module is :mod:`tiered_progcache.ops.metrics`."""

from .ops.metrics import *  # noqa: F401,F403
from .ops.metrics import __all__  # noqa: F401
