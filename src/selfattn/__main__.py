"""``python -m selfattn``: the command-line interface."""

import sys

from selfattn.cli.main import main

sys.exit(main())
