"""``python -m dal.cli ...``: the ``dal`` console script without it being on PATH."""
import sys

from .main import main

sys.exit(main())
