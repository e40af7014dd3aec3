"""The ``quantplan`` command, one module per command group (models, jobs, run, scores, plans, system), the options
they share in :mod:`quantplan.cli.options`; the console script is ``quantplan.cli:main``."""

from quantplan.cli.main import main

__all__ = ["main"]
