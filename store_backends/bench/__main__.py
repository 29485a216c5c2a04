"""``python -m store_backends.bench``: the ``ucm-bench`` command."""

import sys

from . import main

sys.exit(main())
