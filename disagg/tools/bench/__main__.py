"""``python -m disagg.tools.bench``: the trace and bench commands without the main CLI."""

from __future__ import annotations

import sys

from disagg.tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
