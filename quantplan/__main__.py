import sys

from quantplan.cli import main

sys.exit(main())
