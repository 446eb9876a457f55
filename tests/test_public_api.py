"""Every public name resolves, and the package imports without the remote stack (fsspec) until asked."""

from __future__ import annotations

import subprocess
import sys

import tiered_progcache


def test_every_public_name_resolves():
    for name in tiered_progcache.__all__:
        assert getattr(tiered_progcache, name) is not None, name


def test_plain_import_leaves_fsspec_unloaded():
    code = "import sys, tiered_progcache; print('fsspec' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_a_local_only_chain_and_its_config_leave_fsspec_unloaded(tmp_path):
    """Checking the settings of a chain without a remote never reaches for the remote stack."""
    code = (
        "import sys, tiered_progcache as t\n"
        "cache = t.TieredProgramCache(sys.argv[1]); t.CacheConfig.from_env({})\n"
        "print('fsspec' in sys.modules, t.stores_of(cache).shared)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False None"
