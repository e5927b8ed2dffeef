"""``python -m fxpipe ...``: the ``fxpipe`` command (:mod:`fxpipe.cli`)."""

import sys

from .cli import main

sys.exit(main())
