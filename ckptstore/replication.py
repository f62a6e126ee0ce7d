"""The same module as ``ckptstore.tiers.replication``, under the import path users know.

Not a copy: the module itself, so that every name (and a test's monkeypatch) is shared.
"""

import sys

from ckptstore.tiers import replication as _module
from ckptstore.tiers.replication import *  # noqa: F403 - the names, for type checkers

sys.modules[__name__] = _module
