"""`python -m hf_lookaround.cli <command> ...`, the same as the console script `hf-lookaround`."""

import sys

from . import main

sys.exit(main())
