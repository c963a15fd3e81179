"""``python -m disagg``: the ``disagg`` command."""

from __future__ import annotations

import sys

from disagg.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
