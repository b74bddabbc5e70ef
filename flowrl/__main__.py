"""``python -m flowrl`` is the ``flowrl`` command."""

import sys

from flowrl.cli import main

sys.exit(main())
