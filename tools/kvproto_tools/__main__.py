"""``python -m kvproto_tools`` is the ``kvproto`` command."""

from kvproto_tools.cli import main

raise SystemExit(main())
