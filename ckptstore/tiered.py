"""The same module as ``ckptstore.tiers.tiered``, under the import path users know.

Not a copy: the module itself, so that every name (and a test's monkeypatch) is shared.
"""

import sys

from ckptstore.tiers import tiered as _module
from ckptstore.tiers.tiered import *  # noqa: F403 - the names, for type checkers

sys.modules[__name__] = _module
