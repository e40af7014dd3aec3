"""`python -m quantplan ...`: the same as the `quantplan` command."""

import sys

from quantplan.cli import main

sys.exit(main())
