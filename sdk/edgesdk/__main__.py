"""`python -m edgesdk`: the command line, as the `edgesdk` script runs it."""

import sys

from .cli import main

sys.exit(main())
