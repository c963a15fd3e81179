#!/usr/bin/env bash
# One H200 run for the reference engine and the state-copy figures.
# Run from the repository root on a CUDA machine with fla-core (+ einops) wheels in .whl/:
#   bash benchmarks/gpu/h200_engine_transfer.sh OUT_DIR
# Writes card.txt, transfer.json, engine_fla.json, engine_torch.json and their logs to OUT_DIR.
set -uo pipefail
out=${1:-results/h200}
mkdir -p "$out"
source benchmarks/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv > "$out/card.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/card.txt"
python3 -c "import fla; print('fla-core', fla.__version__)" >> "$out/card.txt" 2>&1
python3 benchmarks/gpu_transfer_bench.py --json "$out/transfer.json" 2>&1 | tail -4 | tee "$out/transfer.log"
common=(--device cuda --preset small --dtype bfloat16 --budget-mb 16000 --chunk 8192
        --prefill-lens 8192,32768 --decode-batches 1,16,64 --decode-context 2048
        --context 8192,32768 --followup 256 --reps 2)
python3 benchmarks/engine_bench.py "${common[@]}" --json "$out/engine_fla.json" > "$out/engine_fla.log" 2>&1
tail -8 "$out/engine_fla.log"
DISAGG_KDA_BACKEND=torch python3 benchmarks/engine_bench.py "${common[@]}" --context 8192 \
  --json "$out/engine_torch.json" > "$out/engine_torch.log" 2>&1
tail -8 "$out/engine_torch.log"
