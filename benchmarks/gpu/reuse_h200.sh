#!/usr/bin/env bash
# State reuse under load on one H200, in one call (from the repository root, wheels as in two_gpu.sh):
#   bash benchmarks/gpu/reuse_h200.sh OUT_DIR [DEADLINE_S]
# - e2e (benchmarks/gpu/two_gpu.py): 1p1d_host before (engine.learned_checkpoints off) and after, and the
#   fair aggregated baseline (one engine, same host tier, step budget 2048 for ITL), at c4/c16/c32;
#   TTFT, ITL, tok/s/GPU, realized vs theoretical hit (prompt tokens) and the miss-reason table;
#   then tok/s/GPU per layout at 30 and 50 tok/s/user P90 (benchmarks/gpu/at_interactivity.py);
#   layouts not started before DEADLINE_S (default 420) are skipped and say so.
# - overlap: benchmarks/overlap_bench.py, prefill with publishing off / on / node (ratio goal <= 1.05).
# Env knobs: REQUESTS (default 48), CONC (4,16,32), LAYOUTS, OVERLAP_ROUNDS (4), SKIP_E2E=1, SKIP_OVERLAP=1.
set -uo pipefail
out=${1:-results/reuse-h200}
deadline=${2:-420}
mkdir -p "$out"
source benchmarks/gpu/env.sh
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import fla; print('fla-core', fla.__version__)" 2>&1
  git rev-parse HEAD 2>/dev/null || true
} > "$out/card.txt" 2>&1
cat "$out/card.txt"
[ -n "${SKIP_E2E:-}" ] || python3 benchmarks/gpu/two_gpu.py --out "$out/e2e" --part e2e --devices cuda:0,cuda:0 \
  --layouts "${LAYOUTS:-1p1d_host:before,1p1d_host,1x_aggregated_host}" --concurrency "${CONC:-4,16,32}" \
  --requests "${REQUESTS:-48}" --deadline-s "$deadline" 2>&1 | tee "$out/e2e.txt" | grep -v "^{"
[ -f "$out/e2e/e2e.json" ] && python3 benchmarks/gpu/at_interactivity.py "$out/e2e/e2e.json" 2>&1 | tee "$out/at_interactivity.txt"
[ -n "${SKIP_OVERLAP:-}" ] || python3 benchmarks/overlap_bench.py --device cuda --preset small --dtype bfloat16 --prompt 8192 --batch 4 \
  --rounds "${OVERLAP_ROUNDS:-4}" --modes off,on,node --json "$out/overlap.json" 2>&1 | tee "$out/overlap.txt"
