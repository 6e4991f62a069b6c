"""``python -m hyperparallel ...``: the ``hyperparallel`` command (also what torchrun can run)."""

import sys

from hyperparallel.cli import main

sys.exit(main())
