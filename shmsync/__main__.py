"""``python -m shmsync``: the ``shmsync`` command."""

import sys

from shmsync.tools.cli import main

sys.exit(main())
