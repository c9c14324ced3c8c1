"""Plain-Python runner of kvproto's benchmark suite (the same suite as ``kvproto bench``).

    python benchmarks/run.py                       # full run, < 5 minutes
    python benchmarks/run.py --quick               # tiny sizes, seconds
    python benchmarks/run.py --json out.json --plot scaling.png

Method and how to read the figures: spec/benchmarks.md.
"""

from __future__ import annotations

import sys

from kvproto_tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
