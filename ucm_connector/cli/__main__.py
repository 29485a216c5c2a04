"""``python -m ucm_connector.cli``: the ``ucm`` command."""

import sys

from . import main

sys.exit(main())
