from __future__ import annotations

from prefix_router.cli import main

raise SystemExit(main())
