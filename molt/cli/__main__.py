"""``python -m molt.cli``: the ``molt`` command."""

import sys

from molt.cli import main

sys.exit(main())
