"""``python -m kvproto_tools.bench``."""

from kvproto_tools.bench.cli import main

raise SystemExit(main())
