"""`python -m labkit ...` (and `torchrun ... -m labkit replay ...`): the command line."""

import sys

from labkit.cli import main

sys.exit(main())
