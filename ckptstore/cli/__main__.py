"""``python -m ckptstore.cli``: the ``ckptstore`` command."""

import sys

from ckptstore.cli.commands import main

sys.exit(main())
