"""The same module as ``ckptstore.adapters.directory``, under the import path users know.

Not a copy: the module itself, so that every name (and a test's monkeypatch) is shared.
"""

import sys

from ckptstore.adapters import directory as _module
from ckptstore.adapters.directory import *  # noqa: F403 - the names, for type checkers

sys.modules[__name__] = _module
