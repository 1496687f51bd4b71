"""``python -m kvpack``: the ``kvpack`` command (:func:`kvpack.cli.main.main`)."""

import sys

from kvpack.cli.main import main

sys.exit(main())
