"""vLLM tests: collected only where vllm==0.33 imports (the ``vllm`` extra's venv).

Run them with ``python -m pytest -m vllm tests/vllm -q`` in an environment made
with ``pip install -e '.[vllm,test]'``. Elsewhere nothing here is collected, so
the default suite never imports vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import sys

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny configs are local; never reach the hub
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, os.path.dirname(__file__))  # k3_harness
