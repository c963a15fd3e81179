"""Make the shared helpers (kvt_util) importable from the test modules."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config) -> None:
    # zero-copy decodes over read-only bytes are deliberate (see kv_transfer.codec)
    config.addinivalue_line("filterwarnings", "ignore:The given buffer is not writable:UserWarning")
