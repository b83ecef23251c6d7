"""`python -m moe_ep.cli`: the `moe-ep` command."""

import sys

from moe_ep.cli import main

if __name__ == "__main__":  # spawned ranks re-import the main module: they must not run it
    sys.exit(main())
