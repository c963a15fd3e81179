#!/usr/bin/env bash
# Whole-step decode graphs on one H200, in one call (from the repository root, wheels as in two_gpu.sh):
#   bash benchmarks/gpu/decode_graphs_h200.sh OUT_DIR [E2E_DEADLINE_S]
# 1. the graph tests on real CUDA graphs (tests/engine/reference/test_graphs.py -m gpu);
# 2. decode step time at 2K context, batch 1/16/32: whole-step graphs, token-wise graphs only, no graphs;
# 3. e2e (two_gpu.py) 1p1d_host and the fair aggregated baseline at CONC (default 4,8,16), then
#    tok/s/GPU at 30 and 50 tok/s/user P90 (at_interactivity.py).
set -uo pipefail
out=${1:-results/decode-graphs-h200}
deadline=${2:-420}
mkdir -p "$out"
source benchmarks/gpu/env.sh
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$out/card.txt" 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/reference/test_graphs.py 2>&1 | tail -5 | tee "$out/tests.txt"
python3 benchmarks/engine_bench.py --device cuda --preset small --dtype bfloat16 --prefill-lens "" --context "" \
  --decode-batches "${BATCHES:-1,16,32}" --decode-context 2048 --graphs-ab --json "$out/decode.json" 2>&1 | tee "$out/decode.txt"
python3 benchmarks/gpu/two_gpu.py --out "$out/e2e" --part e2e --devices cuda:0,cuda:0 \
  --layouts "${LAYOUTS:-1p1d_host,1x_aggregated_host}" --concurrency "${CONC:-4,8,16}" \
  --requests "${REQUESTS:-32}" --deadline-s "$deadline" 2>&1 | tee "$out/e2e.txt" | grep -v "^{"
[ -f "$out/e2e/e2e.json" ] && python3 benchmarks/gpu/at_interactivity.py "$out/e2e/e2e.json" 2>&1 | tee "$out/at_interactivity.txt"
