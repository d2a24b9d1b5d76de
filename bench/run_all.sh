#!/usr/bin/env bash
# Every GPU benchmark of titan_fold in one device call, on a 2-GPU machine (nvidia-h200-x2).
#
#   bash bench/run_all.sh A     # 1-GPU work, both GPUs busy side by side:
#                               #   GPU0: train_step 1gpu eager+compiled, then torchtitan eager+compiled
#                               #   GPU1: moe_layer eager, train_step debug50 + bf16-params, moe_layer compiled
#   bash bench/run_all.sh B     # 2-GPU work: collectives, moe_layer ep2/etp2, train_step foldings
#
# Results (JSON) and a tarball of the logs go to $OUT (default bench/results/run); copy
# the JSON into bench/results/ afterwards. Each step has its own time limit so that one
# hang loses only its own figures (every script rewrites its JSON after each case).
set -u
OUT=${OUT:-bench/results/run}
LOGS=/tmp/titan_fold_bench/logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
phase=${1:-A}

note() { echo "[run_all $(date -u +%H:%M:%S)] $*"; }

if [ "$phase" = A ]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$LOGS/nvidia_smi.txt"
  (
    note "GPU0 train_step 1gpu"
    timeout 280 $PY bench/train_step.py --cases 1gpu_eager,1gpu_compiled --gpus 0 --port 29511 \
      --name train_step_1gpu --out-dir "$OUT" --case-timeout 180 > "$LOGS/gpu0_train_step.log" 2>&1
    note "GPU0 vs_torchtitan"
    timeout 250 $PY bench/vs_torchtitan.py --cases eager,compiled --gpus 0 --port 29521 \
      --ours "$OUT/train_step_1gpu.json" --out-dir "$OUT" --case-timeout 160 > "$LOGS/gpu0_vs_torchtitan.log" 2>&1
    note "GPU0 done"
  ) &
  gpu0=$!
  (
    note "GPU1 moe_layer eager"
    CUDA_VISIBLE_DEVICES=1 timeout 140 $PY bench/moe_layer.py --compile off --name moe_layer_eager \
      --out-dir "$OUT" > "$LOGS/gpu1_moe_layer_eager.log" 2>&1
    note "GPU1 train_step debug50 + bf16 params"
    timeout 160 $PY bench/train_step.py --cases debug50,1gpu_bf16params_eager --gpus 1 --port 29531 \
      --name train_step_gpu1_extra --out-dir "$OUT" --case-timeout 110 > "$LOGS/gpu1_train_step.log" 2>&1
    note "GPU1 moe_layer compiled"
    CUDA_VISIBLE_DEVICES=1 timeout 220 $PY bench/moe_layer.py --compile on --no-profile --name moe_layer_compiled \
      --out-dir "$OUT" > "$LOGS/gpu1_moe_layer_compiled.log" 2>&1
    note "GPU1 done"
  ) &
  gpu1=$!
  wait $gpu0 $gpu1
else
  note "collectives"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 90 $PY -m torch.distributed.run --nproc_per_node 2 --master_port 29541 bench/collectives.py --out-dir "$OUT" \
    > "$LOGS/collectives.log" 2>&1
  note "moe_layer 2gpu"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 150 $PY -m torch.distributed.run --nproc_per_node 2 --master_port 29542 \
    bench/moe_layer.py --dispatch ep2,etp2 --compile off --name moe_layer_2gpu --out-dir "$OUT" \
    > "$LOGS/moe_layer_2gpu.log" 2>&1
  note "train_step foldings"
  timeout 290 $PY bench/train_step.py --cases dp2_ep2,dp2_etp2,dp2_edp2 --gpus 0,1 --port 29543 \
    --name train_step_2gpu --out-dir "$OUT" --case-timeout 95 > "$LOGS/train_step_2gpu.log" 2>&1
fi
note "phase $phase finished"
cp /tmp/titan_fold_bench/*.log "$LOGS/" 2>/dev/null
tar czf "$OUT/logs_$phase.tar.gz" -C /tmp/titan_fold_bench logs $(cd /tmp/titan_fold_bench && ls -d */metrics.jsonl 2>/dev/null)
for f in "$LOGS"/*.log; do echo "== $f"; grep -E "^\[|Error|error|Traceback" "$f" | tail -6; done
ls -la "$OUT"
