"""``python -m ot_bounds``: see :mod:`ot_bounds.cli`."""

import sys

from .cli import main

sys.exit(main())
