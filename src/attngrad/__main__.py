"""``python -m attngrad``: the same as the ``attngrad`` command."""

import sys

from attngrad.cli.app import main

sys.exit(main())
