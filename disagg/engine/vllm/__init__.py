"""vLLM 0.33 backend: ``AsyncLLM`` + the K3 state connector, behind the same deployments.

```
options.py   engine.vllm options -> vLLM AsyncEngineArgs (connector, roles, per-role overrides)
engine.py    VLLMEngine: the engine protocol over AsyncLLM (token streaming, abort, health)
```

The serving worker over it (``disagg.flow`` with the connector as its state) is
``disagg.workers.vllm``. vLLM is imported only when an engine is built
(``vllm`` extra). See docs/vllm.md.
"""

from __future__ import annotations
