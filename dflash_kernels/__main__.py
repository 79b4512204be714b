"""`python -m dflash_kernels ...`: the command line (same as the `dflash` / `dflash-kernels` scripts)."""

import sys

from dflash_kernels.model.cli import main

sys.exit(main())
