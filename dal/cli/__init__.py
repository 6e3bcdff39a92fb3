"""The ``dal`` command line: export, verify, report, inspect. See ``dal --help``."""
from .main import main

__all__ = ["main"]
