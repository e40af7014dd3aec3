"""`python -m quantplan.cli ...`: the same as the `quantplan` command."""

import sys

from quantplan.cli.main import main

sys.exit(main())
