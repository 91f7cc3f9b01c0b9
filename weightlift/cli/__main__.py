"""``python -m weightlift.cli``: the same CLI as the ``weightlift`` command."""

import sys

from weightlift.cli.main import main

sys.exit(main())
