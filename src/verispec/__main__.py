"""`python -m verispec` (and `torchrun -m verispec train ...`): the command line."""

import sys

from verispec.cli import main

sys.exit(main())
