"""``python -m dal ...``: the ``dal`` console script (``dal --help``, ``dal --version``)."""
import sys

from .cli.main import main

sys.exit(main())
