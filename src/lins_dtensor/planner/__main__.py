"""``python -m lins_dtensor.planner``: the same as the ``lins-plan`` console script."""

import sys

from lins_dtensor.planner.cli import main

sys.exit(main())
