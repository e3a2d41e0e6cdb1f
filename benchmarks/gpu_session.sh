#!/usr/bin/env bash
# The first GPU run, as ONE prepared script for a session lent a GPU.
#
#   bash benchmarks/gpu_session.sh OUT_DIR        # 53 s on one H200 (measured); writes JSON + logs to OUT_DIR
#
# 1. benchmarks/gpu_check.py: NS TFLOP/s (standard, batched, Gram; bf16 and fp32) next to a square
#    matmul measured in the same run, and the 1-rank training check (dmuon with CUDA streams vs no
#    streams must agree to 1e-5; vs torch.optim.Muon + AdamW within 2e-3). Exit 1 = a check failed.
# 2. benchmarks/step_time.py on ONE GPU (N = 1: no dmuon broadcast/reduce is issued, so this times
#    forward/backward + NS only): adamw, dmuon_z3, dmuon_z3_auto, both sizes, bf16 NS.
# Not prepared: two processes on the one GPU (gloo over CUDA tensors, to exercise the broadcast /
# reduce streams): step_time.py maps rank i to cuda:i and refuses N > device_count.
set -u
OUT=${1:-gpu_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
{ nvidia-smi; python -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } \
    > "$OUT/device.txt" 2>&1
timeout 240 python benchmarks/gpu_check.py --json "$OUT/gpu_check.json" > "$OUT/gpu_check.txt" 2>&1
echo "gpu_check exit $?" | tee -a "$OUT/status.txt"
timeout 300 python benchmarks/step_time.py --device cuda --nproc 1 --sizes small large --steps 8 --warmup 2 \
    --rounds 4 --variants adamw dmuon_z3 dmuon_z3_auto --no-hook-overhead --json "$OUT/step_time_1gpu.json" \
    > "$OUT/step_time_1gpu.txt" 2>&1
echo "step_time exit $?" | tee -a "$OUT/status.txt"
tail -n 30 "$OUT/gpu_check.txt" "$OUT/step_time_1gpu.txt"
