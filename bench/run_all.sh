#!/usr/bin/env bash
# Every GPU benchmark of titan_fold in one device call, on a 2-GPU machine (nvidia-h200-x2).
#
#   bash bench/run_all.sh A     # 1-GPU work, both GPUs busy side by side:
#                               #   GPU0: train_step 1gpu eager+compiled, then torchtitan eager+compiled
#                               #   GPU1: moe_layer eager, train_step debug50 + bf16-params, moe_layer compiled
#   bash bench/run_all.sh B     # torchtitan vs titan_fold (eager; AMP / bf16 params), then 2-GPU work:
#                               #   collectives, moe_layer ep2/etp2, train_step foldings
#   bash bench/run_all.sh C     # moe_layer eager on 1 GPU and ep2/etp2 on 2 GPUs (breakdowns)
#   bash bench/run_all.sh D     # trainer: profiled step, and local batch 4 (bf16 parameters)
#   bash bench/run_all.sh E     # 2-GPU trainer foldings side by side, all in bf16 compute
#                               #   (tp-only layouts autocast since 2026-11-22), and pp2
#   bash bench/run_all.sh F     # 1 GPU: the clip applied inside the fused AdamW; titan_fold
#                               #   (local batch 2 and 4) then torchtitan, bf16 parameters
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
  # first call (2026-11-22): every 1-GPU benchmark, both GPUs busy side by side
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$LOGS/nvidia_smi.txt"
  (
    note "GPU0 train_step 1gpu"
    timeout 280 $PY bench/train_step.py --cases 1gpu_eager,1gpu_compiled --gpus 0 --port 29511 \
      --name train_step_1gpu --out-dir "$OUT" --case-timeout 180 > "$LOGS/gpu0_train_step.log" 2>&1
    note "GPU0 vs_torchtitan"
    timeout 250 $PY bench/vs_torchtitan.py --cases eager,compiled --gpus 0 --port 29521 \
      --ours "$OUT/train_step_1gpu.json" --out-dir "$OUT" --case-timeout 160 > "$LOGS/gpu0_vs_torchtitan.log" 2>&1
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
  ) &
  gpu1=$!
  wait $gpu0 $gpu1
elif [ "$phase" = C ]; then
  # third call: the MoE-layer breakdowns again (the first runs double-counted the
  # profiler's GPU-side range spans; fixed in profile_step)
  note "moe_layer eager 1 GPU"
  CUDA_VISIBLE_DEVICES=0 timeout 120 $PY bench/moe_layer.py --compile off --name moe_layer_eager \
    --out-dir "$OUT" > "$LOGS/moe_layer_eager.log" 2>&1
  note "moe_layer 2gpu"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 120 $PY -m torch.distributed.run --nproc_per_node 2 \
    --master_port 29542 bench/moe_layer.py --dispatch ep2,etp2 --compile off --name moe_layer_2gpu \
    --out-dir "$OUT" > "$LOGS/moe_layer_2gpu.log" 2>&1
elif [ "$phase" = D ]; then
  # fourth call: a profiled trainer step (bf16 parameters) and local batch 4, one GPU each
  timeout 100 $PY bench/train_step.py --cases 1gpu_bf16params_profile --steps 12 --gpus 0 --port 29511 \
    --name train_step_1gpu_profile --out-dir "$OUT" --case-timeout 95 > "$LOGS/gpu0_train_step.log" 2>&1 &
  timeout 100 $PY bench/train_step.py --cases 1gpu_bf16params_b4_eager --gpus 1 --port 29531 \
    --name train_step_1gpu_b4 --out-dir "$OUT" --case-timeout 95 > "$LOGS/gpu1_train_step.log" 2>&1 &
  wait
elif [ "$phase" = F ]; then
  # sixth call, one GPU: the optimizer step without the separate clip multiply
  timeout 170 $PY bench/train_step.py --cases 1gpu_bf16params_eager,1gpu_bf16params_b4_eager --gpus 0 --port 29511 \
    --steps 15 --name train_step_1gpu_fusedclip --out-dir "$OUT" --case-timeout 80 > "$LOGS/train_step.log" 2>&1
  timeout 110 $PY bench/vs_torchtitan.py --cases bf16params_eager --gpus 0 --port 29521 --steps 15 \
    --ours "$OUT/train_step_1gpu_fusedclip.json" --name vs_torchtitan_fusedclip --out-dir "$OUT" \
    --case-timeout 100 > "$LOGS/vs_torchtitan.log" 2>&1
elif [ "$phase" = E ]; then
  # fifth call: the 2-GPU foldings with bf16 compute in every layout, and pipelining
  timeout 480 $PY bench/train_step.py --cases tp2_ep2,tp2_etp2,dp2_ep2,pp2 --gpus 0,1 --port 29543 --steps 15 \
    --name train_step_2gpu_bf16 --out-dir "$OUT" --case-timeout 115 > "$LOGS/train_step_2gpu.log" 2>&1
else
  # second call: torchtitan beside titan_fold on one GPU each (eager; AMP and bf16 params),
  # then the 2-GPU work
  (
    note "GPU0 torchtitan eager (AMP, fp32 weights)"
    timeout 130 $PY bench/vs_torchtitan.py --cases eager --gpus 0 --port 29521 --name vs_torchtitan_amp \
      --out-dir "$OUT" --case-timeout 120 > "$LOGS/gpu0_vs_torchtitan.log" 2>&1
  ) &
  gpu0=$!
  (
    note "GPU1 titan_fold bf16 params, then torchtitan bf16 params"
    timeout 80 $PY bench/train_step.py --cases 1gpu_bf16params_eager --gpus 1 --port 29531 \
      --name train_step_1gpu_bf16params --out-dir "$OUT" --case-timeout 75 > "$LOGS/gpu1_train_step.log" 2>&1
    timeout 100 $PY bench/vs_torchtitan.py --cases bf16params_eager --gpus 1 --port 29532 \
      --ours "$OUT/train_step_1gpu_bf16params.json" --name vs_torchtitan_bf16params \
      --out-dir "$OUT" --case-timeout 95 > "$LOGS/gpu1_vs_torchtitan.log" 2>&1
  ) &
  gpu1=$!
  wait $gpu0 $gpu1
  note "collectives"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 60 $PY -m torch.distributed.run --nproc_per_node 2 \
    --master_port 29541 bench/collectives.py --out-dir "$OUT" > "$LOGS/collectives.log" 2>&1
  note "moe_layer 2gpu"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 100 $PY -m torch.distributed.run --nproc_per_node 2 \
    --master_port 29542 bench/moe_layer.py --dispatch ep2,etp2 --compile off --name moe_layer_2gpu \
    --out-dir "$OUT" > "$LOGS/moe_layer_2gpu.log" 2>&1
  note "train_step foldings"
  timeout 200 $PY bench/train_step.py --cases dp2_ep2,dp2_etp2,dp2_edp2 --gpus 0,1 --port 29543 --steps 15 \
    --name train_step_2gpu --out-dir "$OUT" --case-timeout 65 > "$LOGS/train_step_2gpu.log" 2>&1
fi
note "phase $phase finished"
cp /tmp/titan_fold_bench/*.log "$LOGS/" 2>/dev/null
tar czf "$OUT/logs_$phase.tar.gz" -C /tmp/titan_fold_bench logs $(cd /tmp/titan_fold_bench && ls -d */metrics.jsonl 2>/dev/null)
for f in "$LOGS"/*.log; do echo "== $f"; grep -E "^\[|Error|error|Traceback" "$f" | tail -6; done
ls -la "$OUT"
