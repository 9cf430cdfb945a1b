"""``python -m frenzy_prefect.cli``: the same as the `frenzy` console script."""

import sys

from frenzy_prefect.cli import app

sys.exit(app())
