"""``python -m weightlift``: the same CLI as the ``weightlift`` command."""

import sys

from weightlift.cli import main

sys.exit(main())
