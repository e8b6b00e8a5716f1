"""``python -m kvlab``: the same as the ``kvlab`` command (:func:`kvlab.cli.main`)."""

import sys

from kvlab.cli import main

sys.exit(main())
