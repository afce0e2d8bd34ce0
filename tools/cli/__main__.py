"""`python -m wakefl.tools.cli`: the `wakefl` command."""

import sys

from wakefl.tools.cli import main

sys.exit(main())
