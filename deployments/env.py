"""The environment every replica of the Serve application runs with (no Ray import here).

``deployments.app`` puts it in each deployment's ``runtime_env``; the launchers
(``disagg serve`` through ``disagg.launch.local``, the cluster YAMLs, the Helm chart)
set the same variables for the whole cluster.
"""

from __future__ import annotations

# Ray Serve's latency-oriented settings: user code and handle routing on the replica's own event
# loop (no cross-thread hop per streamed token), gRPC between deployments, no per-request logs
# on stderr. Measured on the CPU machine: per-token overhead 5.6 ms -> 0.4 ms (benchmarks/serve_bench.py).
SERVE_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_LOG_TO_STDERR": "0",
}
