#!/usr/bin/env bash
# One-GPU performance run (H200). Run from the repository root on a CUDA machine
# with the wheels it lacks in .whl/ (benchmarks/gpu/fetch_wheels.sh: fla-core, google-crc32c; pydantic, fastapi,
# opentelemetry-api, starlette, uvicorn for the e2e part):
#   bash benchmarks/gpu/h200_perf.sh OUT_DIR engine   publishing on vs off (in-process tier; node store
#                                                     process), resume vs recompute at 8K/32K/128K from
#                                                     memory and through the host tier (staged, direct)
#                                                     with a load profile, the GIL probe, state copies,
#                                                     engine (fla vs torch), a resumed follow-up's profile
#   bash benchmarks/gpu/h200_perf.sh OUT_DIR state    the state path's open figures alone: the CUDA tests,
#                                                     publishing on / off with its partial paths (hold,
#                                                     export), the GIL probe, the MoE loop A/B on prefill,
#                                                     the resume breakdown at 8K/32K
#   bash benchmarks/gpu/h200_perf.sh OUT_DIR e2e      agentic trace, prefill + decode engines sharing the GPU
#   bash benchmarks/gpu/h200_perf.sh OUT_DIR resume   the graph and device-checksum tests, then resume vs recompute
#                                                     at 8K/32K/128K with the A/B variants (host checks, no CUDA
#                                                     graphs), decode steps with and without CUDA graphs, then
#                                                     the agentic trace over HTTP on one GPU (prefill
#                                                     and decode engine processes sharing it, host tier) against
#                                                     one aggregated engine without a host tier
set -uo pipefail
out=${1:-results/h200}
part=${2:-engine}
mkdir -p "$out"
source benchmarks/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv > "$out/card.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/card.txt"
python3 -c "import fla; print('fla-core', fla.__version__)" >> "$out/card.txt" 2>&1
if [ "$part" = state ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/kv_transfer/test_kvt_direct.py tests/engine/reference/test_kda.py \
    2>&1 | tail -4
  python3 benchmarks/overlap_bench.py --device cuda --preset small --dtype bfloat16 --prompt 8192 --batch 8 \
    --rounds 4 --chunk 8192 --budget-mb 20000 --modes off,on,hold,export --json "$out/overlap.json" 2>&1 \
    | grep -E "^round|Error|ratio" | head -40
  python3 benchmarks/overlap_bench.py --gil --prompt 8192 --rounds 12 --json "$out/gil.json" 2>&1 | grep -E "progress|Error"
  python3 benchmarks/engine_bench.py --device cuda --preset small --dtype bfloat16 --budget-mb 30000 --chunk 8192 \
    --reps 3 --prefill-lens 8192,32768 --moe-ab --decode-batches "" --context "" --json "$out/moe_ab.json" 2>&1 \
    | grep -E "^prefill|Error"
  python3 benchmarks/gpu/resume_breakdown.py --context 8192,32768 --reps 3 --json "$out/resume_breakdown.json" \
    2>&1 | grep -E "^@|Error"
elif [ "$part" = engine ]; then  # the open goals first, so a run cut short still has them
  python3 benchmarks/overlap_bench.py --device cuda --preset small --dtype bfloat16 --prompt 8192 --batch 8 \
    --rounds 6 --chunk 8192 --budget-mb 20000 --modes off,on,node --json "$out/overlap.json" 2>&1 \
    | grep -E "^round|Error" | head -40
  python3 benchmarks/gpu/resume_breakdown.py --context 8192,32768,131072 --reps 3 --json "$out/resume_breakdown.json" \
    --profile-load "$out/profile_load" 2>&1 | grep -E "^@|Error"
  python3 benchmarks/overlap_bench.py --gil --prompt 8192 --rounds 8 --json "$out/gil.json" 2>&1 | grep -E "progress|Error"
  python3 benchmarks/gpu_transfer_bench.py --json "$out/transfer.json" 2>&1 | grep -E "vs_ceiling|bit_exact"
  common=(--device cuda --preset small --dtype bfloat16 --budget-mb 30000 --chunk 8192 --followup 256 --reps 3)
  python3 benchmarks/engine_bench.py "${common[@]}" --prefill-lens 8192,32768 --decode-batches 1,16,64 \
    --decode-context 2048 --context 32768 --profile-resume "$out/profile_resume_32k.txt" \
    --json "$out/engine_fla.json" 2>&1 | grep -E "^(prefill|decode|resume)|Error" | head -20
  DISAGG_KDA_BACKEND=torch python3 benchmarks/engine_bench.py "${common[@]}" --prefill-lens 8192,32768 \
    --decode-batches 1,16,64 --decode-context 2048 --context "" --json "$out/engine_torch.json" 2>&1 \
    | grep -E "^(prefill|decode)|Error" | head -10
elif [ "$part" = resume ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/reference/test_graphs.py \
    tests/kv_transfer/test_kvt_device_crc.py 2>&1 | tail -2
  timeout 170 python3 benchmarks/gpu/resume_breakdown.py --context 8192,32768,131072 --reps 3 --ab \
    --json "$out/resume_breakdown.json" 2>&1 | grep -E "^@|Error"
  timeout 80 python3 benchmarks/engine_bench.py --device cuda --preset small --dtype bfloat16 --budget-mb 30000 \
    --chunk 8192 --reps 2 --prefill-lens "" --decode-batches 1,16,64 --decode-context 2048 --graphs-ab --context "" \
    --json "$out/decode.json" 2>&1 | grep -E "^decode|Error"
  timeout 210 python3 benchmarks/gpu/two_gpu.py --out "$out/e2e" --part e2e --devices cuda:0,cuda:0 \
    --layouts 1p1d_host,1x_aggregated_nohost --concurrency 2,8,16 --requests 12 2>&1 | tail -14
else
  python3 benchmarks/gpu/e2e_inprocess.py --out "$out/e2e" 2>&1 | tail -30
  cp "$out/e2e/e2e.json" "$out/e2e.json" 2>/dev/null
  cp "$out/e2e/trace.jsonl" "$out/trace.jsonl" 2>/dev/null
fi
