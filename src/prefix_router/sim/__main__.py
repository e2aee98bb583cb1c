"""`python -m prefix_router.sim`: the same fleet as `prefix-router sim`."""

from __future__ import annotations

import sys

from prefix_router.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
