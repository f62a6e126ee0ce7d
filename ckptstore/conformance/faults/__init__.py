"""Fault injection: crashes and transient faults at a storage call (``injector``), entries
the protocol did not make (``strays``), an operator's action before a call (``operators``).

``ckptstore.conformance.faults`` names the injector's public names, as it did before it was a
folder.
"""

from ckptstore.conformance.faults import injector
from ckptstore.conformance.faults.injector import *  # noqa: F403  the injector's public names

__all__ = injector.__all__
