"""``python -m tiered_progcache``: the same command as the ``tiered-progcache`` console script."""

from __future__ import annotations

import sys

from .ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
