#!/usr/bin/env bash
# Two-GPU disaggregation run (two H200s of one host). From the repository root,
# with the wheels the machine lacks in .whl/ (benchmarks/gpu/fetch_wheels.sh: fla-core, google-crc32c; pydantic, fastapi,
# opentelemetry-api, starlette, uvicorn for the HTTP front):
#   bash benchmarks/gpu/two_gpu.sh OUT_DIR [two_gpu.py options...]
# NVLink multicast stays off (plain peer copies and CUDA IPC only).
set -uo pipefail
out=${1:-results/two-gpu}
shift || true
mkdir -p "$out"
source benchmarks/gpu/env.sh
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); print('peer access 1->0:', torch.cuda.can_device_access_peer(1, 0))"
  python3 -c "import fla; print('fla-core', fla.__version__)" 2>&1
} > "$out/card.txt" 2>&1
cat "$out/card.txt"
python3 benchmarks/gpu/two_gpu.py --out "$out" "$@" 2>&1 | tee "$out/log.txt" | grep -v "^{"
