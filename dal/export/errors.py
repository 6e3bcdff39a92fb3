"""The one error type the exporter raises for a model it will not write."""
from __future__ import annotations


class ExportError(ValueError):
    """The model cannot be exported as asked; the message names every offender and what to do.

    A ``ValueError`` so that callers who validate user input catch it with the usual clause.
    """
