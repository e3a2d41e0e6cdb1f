#!/usr/bin/env bash
# The first GPU run, as ONE prepared script for a session lent a GPU.
#
#   bash benchmarks/gpu_session.sh OUT_DIR        # writes JSON + logs to OUT_DIR (53 s on one H200 before
#                                                 # the exact / moe runs were added; about 3 min expected)
#
# 1. benchmarks/gpu_check.py: NS TFLOP/s (standard, batched, Gram; bf16 and fp32) next to a square
#    matmul measured in the same run, and the 1-rank training check (dmuon with CUDA streams vs no
#    streams must agree to 1e-5; vs torch.optim.Muon + AdamW within 2e-3). Exit 1 = a check failed.
# 2. benchmarks/step_time.py on ONE GPU (N = 1: no dmuon broadcast/reduce is issued, so this times
#    forward/backward + NS only), the 1-GPU table: adamw, dmuon_z3 (batched NS, the default),
#    dmuon_z3_exact (ns_batching="exact": one NS call per matrix, as before batching), dmuon_z3_auto;
#    sizes small, large and moe (8 experts: expert stacks as one batched call per range); bf16 NS.
# 3. benchmarks/optimizer_ops.py (CPU, one process): aten ops per optimizer step, batched vs exact,
#    on the main job's model and a 32-expert MoE (the host-side op counts the GPU step launches).
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
    --rounds 4 --variants adamw dmuon_z3 dmuon_z3_exact dmuon_z3_auto --no-hook-overhead \
    --json "$OUT/step_time_1gpu.json" > "$OUT/step_time_1gpu.txt" 2>&1
echo "step_time exit $?" | tee -a "$OUT/status.txt"
timeout 200 python benchmarks/step_time.py --device cuda --nproc 1 --sizes moe --steps 8 --warmup 2 \
    --rounds 4 --variants adamw dmuon_z3 dmuon_z3_exact --no-hook-overhead \
    --json "$OUT/step_time_1gpu_moe.json" > "$OUT/step_time_1gpu_moe.txt" 2>&1
echo "step_time moe exit $?" | tee -a "$OUT/status.txt"
OMP_NUM_THREADS=1 timeout 120 python benchmarks/optimizer_ops.py --ns-batching batched exact \
    --json "$OUT/optimizer_ops.json" > "$OUT/optimizer_ops.txt" 2>&1
echo "optimizer_ops exit $?" | tee -a "$OUT/status.txt"
tail -n 30 "$OUT/gpu_check.txt" "$OUT/step_time_1gpu.txt" "$OUT/step_time_1gpu_moe.txt" "$OUT/optimizer_ops.txt"
