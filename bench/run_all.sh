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
#   bash bench/run_all.sh G     # 2 GPUs: shared-expert overlap on/off (MoE layer, ep2); dp2_ep2
#                               #   with the experts out of FSDP against the code before
#                               #   ($BASE: a checkout of it), bf16 parameters at local batch 4
#                               #   (profiled), and torchtitan dp2_ep2 beside it
#   bash bench/run_all.sh H     # 1 GPU (nvidia-h200): eager and compiled, titan_fold then torchtitan,
#                               #   bf16 parameters (recompiles logged)
#   bash bench/run_all.sh I     # 1 GPU (nvidia-h200): row movement (indexing / gathers / embedding_bag),
#                               #   then the trainer against $BASE twice, interleaved, and compiled
#   bash bench/run_all.sh J     # 1 GPU (nvidia-h200): local batch 2 and 4, eager and compiled,
#                               #   titan_fold then torchtitan, bf16 parameters
#   bash bench/run_all.sh K     # J again after the sum over k became gather + sum (no embedding_bag),
#                               #   row movement first
#   bash bench/run_all.sh L     # 1 GPU (nvidia-h200): row movement; the trainer with the sum's dtype
#                               #   pinned against $BASE (embedding_bag), interleaved, local batch 2 and 4
#   bash bench/run_all.sh M     # J again with the code as it stands (the sum's dtype pinned)
#   bash bench/run_all.sh N     # 1 GPU (nvidia-h200): MoE layer at Qwen3-30B-A3B shapes, the fused SwiGLU
#                               #   and gather-sum against $BASE (interleaved), then every shape
#                               #   beside torchtitan 0.2.2's MoE layer, eager and compiled
#   bash bench/run_all.sh O     # 1 GPU (nvidia-h200): Qwen3-30B-A3B layer against $BASE again (sum over k
#                               #   as k gathers); trainer at local batch 4: autocast over fp32 weights,
#                               #   bf16 weights with fp32 masters, bf16 weights alone; masters compiled
#   bash bench/run_all.sh P     # 1 GPU (nvidia-h200): O's trainer cases again (no autocast inside the fused
#                               #   kernels), then every MoE-layer shape beside torchtitan's layer, eager,
#                               #   and the fine-grained shapes compiled
#   bash bench/run_all.sh Q     # 1 GPU (nvidia-h200): P's trainer cases again (rows gathered in the experts'
#                               #   dtype, fused kernels fed detached tensors: no recompile), Qwen3 layer
#   bash bench/run_all.sh R     # 1 GPU (nvidia-h200): fp32 masters with the one-pass master AdamW step,
#                               #   beside bf16 weights alone
#   bash bench/run_all.sh S     # 1 GPU: the trainer after issues 14-17 and 19 (executed placement plan,
#                               #   torchtitan adapter, NaN guard, signals, logging) against $BASE (the
#                               #   code before them), interleaved; then fp32 masters and autocast
#   bash bench/run_all.sh T     # 2 GPUs (nvidia-h200-x2): the same trainer's dp2 x ep2 and tp2 x ep2 foldings
#   bash bench/run_all.sh U     # 1 GPU (nvidia-h200), issue 18 round 3: the FP8 tests on the GPU; every MoE
#                               #   shape with FP8 routed experts beside bf16 (eager); the proxy 200 steps bf16
#                               #   vs FP8; the routers (seq_aux_loss, aux_free, none) 200 steps each
#   bash bench/run_all.sh V     # U again (its trainer cases had no pyarrow), the FP8 layer profiled, and the
#                               #   Qwen2-57B-A14B layer compiled, bf16 and FP8
#   bash bench/run_all.sh W     # FP8 with the amax as torch's reduction (V's single generated quantizing kernel
#                               #   ran 4-5x under the bandwidth): every MoE shape bf16 vs FP8, profiled; the proxy
#                               #   200 steps with each router (aux_loss, seq_aux_loss, aux_free, none) and FP8
#   bash bench/run_all.sh X     # the same Qwen3-MoE model in both trainers (issue 18 target 4): qwen3_moe at
#                               #   Qwen3-30B-A3B widths (12 layers) and at Qwen2-57B-A14B widths (2 layers), aux-free
#                               #   bias, bf16 weights, eager and compiled, titan_fold then torchtitan 0.2.2
#   bash bench/run_all.sh Y     # FP8 quantization as Triton kernels (one read of each operand) and the GEMMs as
#                               #   custom ops (compiled layouts): the FP8 tests on the GPU, every MoE shape bf16
#                               #   vs FP8 eager (profiled), Qwen2-57B-A14B compiled, the proxy 200 steps bf16 vs FP8
#   bash bench/run_all.sh Z     # Y again (its kernels read a global that Triton wants as a constexpr), and the
#                               #   proxy compiled with FP8 experts (30 steps)
#   bash bench/run_all.sh ZA    # 1 GPU, the integrated code of 2026-11-24: the pipeline, dry-run and config tests
#                               #   on the CPU under the image's torch (2.11; pipeline stages get their shapes up
#                               #   front since then), the FP8 tests on the GPU, and the proxy at local batch 4
#                               #   (bf16 weights, eager) as in phases S and Z
#   bash bench/run_all.sh ZB    # 2 GPUs (nvidia-h200-x2), issue 18's 2-GPU targets, first call: fp32 masters at
#                               #   local batch 4 beside bf16 weights (1 GPU each side by side: GPU0 compiled,
#                               #   GPU1 eager), pp2 (stages given their shapes up front), masters under FSDP2 on
#                               #   both meshes (dp2 x edp2) and dp2 x ep2, and the MoE layer at ep2 with a set
#                               #   share of the routed assignments on EP rank 0 (the time lost to imbalance)
#   bash bench/run_all.sh ZC    # 2 GPUs, second call: the routers over 200 steps under dp2 x ep2, and the same
#                               #   Qwen3-MoE model (Qwen3-30B-A3B widths, 12 layers) in both trainers, dp2 x ep2
#   bash bench/run_all.sh ZD    # 2 GPUs, third call: earlier 2-GPU cases again (foldings, collectives, the MoE
#                               #   layer at ep2 / etp2) and the same Qwen3-MoE model at Qwen2-57B-A14B widths, dp2 x ep2
#   bash bench/run_all.sh ZE    # 2 GPUs, after the recompiles ZB-ZD found were fixed (scalar capture in compiled
#                               #   blocks, the reduce-scatter-v's dtype, tiny tensors in the fused kernels): the
#                               #   fused-kernel tests on the GPU, tp2 x etp2, masters under dp2, and the same Qwen3-MoE
#                               #   model compiled in both trainers, dp2 x ep2, at both widths
#   bash bench/run_all.sh ZF    # 1 GPU (nvidia-h200), the code of the end of 2026-11-24: fp32 masters beside bf16
#                               #   weights at local batch 4 compiled, on a GPU of their own, bf16 eager (no
#                               #   regression), and the MoE layer eager at every shape and mode (profiled)
#   bash bench/run_all.sh ZG    # 1 GPU: ZF's MoE layer again, each case with its own compile of the fused kernels
#                               #   (in ZF the shapes after the first ran kernels recompiled for dynamic widths)
#   bash bench/run_all.sh ZH    # 1 GPU (nvidia-h200): the fused SwiGLU in the dense FFN and the shared expert:
#                               #   fused-kernel tests on the GPU, the Qwen2-57B-A14B layer against $BASE
#                               #   (interleaved), and the routed grouped GEMMs alone (the bound they set, issue 18
#                               #   target 1)
#   bash bench/run_all.sh ZI    # 1 GPU: the trainer at local batch 4, bf16 eager against $BASE (interleaved),
#                               #   then fp32 masters and bf16 weights compiled (issue 18 target 2)
#   bash bench/run_all.sh ZJ    # 1 GPU: earlier cases again (issue 18 target 6): the MoE layer eager at every
#                               #   shape and mode (profiled), then compiled beside torchtitan's
#   bash bench/run_all.sh ZK    # 1 GPU: row movement, the MoE layer bf16 beside FP8 at every shape, and the same
#                               #   Qwen3-MoE model in both trainers (eager and compiled) at both widths
#   bash bench/run_all.sh ZL    # 1 GPU: ZK's Qwen3-MoE model at Qwen2-57B-A14B widths again (ZK's torchtitan
#                               #   file did not come back: a call returns at most 8 files), then fp32 masters
#                               #   and bf16 weights compiled at local batch 4, profiled
#   bash bench/run_all.sh ZM    # 1 GPU: the clip's gradient norm one reduction per tensor in float32
#                               #   (bench/grad_norm.py), then fp32 masters compiled at local batch 4 with it,
#                               #   $BASE (torch's foreach norm) between, and bf16 weights compiled
#   bash bench/run_all.sh ZN    # 1 GPU: the MoE layer eager at every shape and mode with the timed loops run
#                               #   without automatic GC (as the trainer), then Qwen3-30B-A3B alone, twice
#   bash bench/run_all.sh ZO    # 1 GPU: the fp32 master step alone beside streaming kernels (bench/master_step.py)
#   bash bench/run_all.sh ZP    # 1 GPU: CPU tests under the image's torch (2.11) of this day's changes: the
#                               #   float32 gradient norm on DTensor gradients (the equivalence tests), the SwiGLU
#
# Packages the GPU image lacks (torchtitan, tyro, torchdata, datasets and its pyarrow, pandas,
# dill, multiprocess, xxhash, docstring_parser, typeguard, einops) travel as wheels in .whl/
# (`carry: [".whl"]`; pyarrow repacked without its Flight, Substrait and header files to fit
# the 64 MiB a call carries): they are unpacked into /tmp/site here.
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
if [ -d .whl ]; then
  $PY -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/tmp/site') for w in sorted(glob.glob('.whl/*'))]"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-$PWD}
fi

note() { echo "[run_all $(date -u +%H:%M:%S)] $*"; }
# every log and metrics file of the call (trainer cases write theirs under the work dir) as one tarball
save_logs() {
  local out
  out=$(cd "$OUT" && pwd)
  (cd /tmp/titan_fold_bench && find . \( -name '*.log' -o -name '*.jsonl' \) -print0 | tar czf "$out/logs_$1.tgz" --null -T -)
}

# issue 18 round 3 (phases U to Z): the proxy 200 steps (tag, cases, time limit), and the MoE
# layer bf16 beside FP8 (name, shapes, time limit, more moe_layer.py arguments)
ROUTERS_FP8=1gpu_bf16params,1gpu_bf16params_fp8,1gpu_bf16params_seqaux,1gpu_bf16params_auxfree,1gpu_bf16params_lbnone
ALL_SHAPES=qwen3_30b_a3b,mixtral_8x22b_g8t8,qwen2_57b_a14b,mixtral_8x22b
proxy200() {
  note "proxy 200 steps: $2"
  timeout "$3" $PY bench/train_step.py --cases "$2" --gpus 0 --port 29511 --steps 200 --warmup-steps 10 \
    --name "train_step_1gpu_$1" --out-dir "$OUT" --case-timeout 80 > "$LOGS/train_step_$1.log" 2>&1
}
# the same Qwen3-MoE model in both trainers on 2 GPUs, dp2 x ep2 (tag, proxy, cases, time limit, case limit)
same_model_2gpu() {
  note "qwen3_moe $2 dp2 x ep2 ($3): titan_fold, then torchtitan"
  timeout "$4" $PY bench/train_step.py --cases "$3" --family qwen3_moe --proxy "$2" --gpus 0,1 --port 29544 \
    --steps 15 --name "train_step_2gpu_$1" --out-dir "$OUT" --case-timeout "$5" > "$LOGS/train_step_$1.log" 2>&1
  timeout "$4" $PY bench/vs_torchtitan.py --cases "$3" --family qwen3_moe --proxy "$2" --gpus 0,1 --port 29521 \
    --steps 15 --ours "$OUT/train_step_2gpu_$1.json" --name "vs_torchtitan_2gpu_$1" --out-dir "$OUT" \
    --case-timeout "$5" > "$LOGS/vs_torchtitan_$1.log" 2>&1
}
layer_fp8() {
  note "moe_layer bf16 vs FP8: $1"
  timeout "$3" $PY bench/moe_layer.py --modes dropless --impl titan_fold,titan_fold_fp8 --shapes "$2" \
    --name "moe_layer_$1" --out-dir "$OUT" "${@:4}" > "$LOGS/moe_layer_$1.log" 2>&1
}

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
elif [ "$phase" = G ]; then
  # seventh call (2026-11-23), 2 GPUs
  note "moe_layer ep2, shared expert overlapped or not"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 100 $PY -m torch.distributed.run --nproc_per_node 2 \
    --master_port 29542 bench/moe_layer.py --dispatch ep2 --shapes qwen2_57b_a14b --modes dropless \
    --compile off --no-profile --shared-overlap on,off --name moe_layer_2gpu_overlap \
    --out-dir "$OUT" > "$LOGS/moe_layer_overlap.log" 2>&1
  if [ -n "${BASE:-}" ]; then
    note "dp2_ep2 with the code before (experts FSDP-wrapped on their one-rank edp mesh)"
    (cd "$BASE" && timeout 100 $PY bench/train_step.py --cases dp2_ep2 --gpus 0,1 --port 29544 --steps 15 \
      --name train_step_2gpu_base --out-dir "$OUT" --work-dir /tmp/titan_fold_bench/base --case-timeout 95 \
      > "$LOGS/train_step_2gpu_base.log" 2>&1)
  fi
  note "titan_fold 2 GPUs"
  timeout 260 $PY bench/train_step.py --cases dp2_ep2,dp2_ep2_bf16params_b4_profile --gpus 0,1 --port 29543 \
    --steps 15 --name train_step_2gpu_g --out-dir "$OUT" --case-timeout 125 > "$LOGS/train_step_2gpu.log" 2>&1
  note "torchtitan 2 GPUs"
  timeout 200 $PY bench/vs_torchtitan.py --cases dp2_ep2,dp2_ep2_bf16params_b4 --gpus 0,1 --port 29521 --steps 15 \
    --ours "$OUT/train_step_2gpu_g.json" --name vs_torchtitan_2gpu --out-dir "$OUT" --case-timeout 100 \
    > "$LOGS/vs_torchtitan_2gpu.log" 2>&1
elif [ "$phase" = H ]; then
  # eighth call (2026-11-23), one GPU: eager and compiled side by side with torchtitan
  export TORCH_LOGS=recompiles,graph_breaks
  if [ -n "${BASE:-}" ]; then
    note "1gpu_bf16params_eager with the code before (row gather/combine by indexing and index_add)"
    (cd "$BASE" && timeout 60 $PY bench/train_step.py --cases 1gpu_bf16params_eager --gpus 0 --port 29544 \
      --steps 15 --name train_step_1gpu_base --out-dir "$OUT" --work-dir /tmp/titan_fold_bench/base \
      --case-timeout 58 > "$LOGS/train_step_1gpu_base.log" 2>&1)
  fi
  timeout 300 $PY bench/train_step.py --cases 1gpu_bf16params,1gpu_bf16params_b4,1gpu_bf16params_compiled \
    --gpus 0 --port 29511 --steps 15 --name train_step_1gpu_h --out-dir "$OUT" --case-timeout 200 \
    > "$LOGS/train_step.log" 2>&1
  timeout 225 $PY bench/vs_torchtitan.py --cases 1gpu_bf16params,1gpu_bf16params_compiled --gpus 0 --port 29521 \
    --steps 15 --ours "$OUT/train_step_1gpu_h.json" --name vs_torchtitan_1gpu_h --out-dir "$OUT" \
    --case-timeout 170 > "$LOGS/vs_torchtitan.log" 2>&1
elif [ "$phase" = I ]; then
  # ninth call (2026-11-23), one GPU: the sum over k as one embedding_bag, A/B against the code before
  note "row_movement"
  timeout 60 $PY bench/row_movement.py --out-dir "$OUT" > "$LOGS/row_movement.log" 2>&1
  for i in 1 2; do
    if [ -n "${BASE:-}" ]; then
      (cd "$BASE" && timeout 60 $PY bench/train_step.py --cases 1gpu_bf16params_eager --gpus 0 --port 29544 \
        --steps 20 --name train_step_1gpu_ab_base_$i --out-dir "$OUT" --work-dir /tmp/titan_fold_bench/base \
        --case-timeout 58 > "$LOGS/train_step_ab_base_$i.log" 2>&1)
    fi
    timeout 60 $PY bench/train_step.py --cases 1gpu_bf16params --gpus 0 --port 29511 --steps 20 \
      --name train_step_1gpu_ab_new_$i --out-dir "$OUT" --case-timeout 58 > "$LOGS/train_step_ab_new_$i.log" 2>&1
  done
  timeout 150 $PY bench/train_step.py --cases 1gpu_bf16params_compiled,1gpu_bf16params_b4 --gpus 0 --port 29511 \
    --steps 20 --name train_step_1gpu_i --out-dir "$OUT" --case-timeout 120 > "$LOGS/train_step.log" 2>&1
elif [ "$phase" = J ] || [ "$phase" = K ] || [ "$phase" = M ]; then
  # tenth, eleventh and thirteenth calls (2026-11-23), one GPU: every 1-GPU setting against
  # torchtitan in one call
  tag=$(echo "$phase" | tr JKM jkm)
  if [ "$phase" = K ]; then
    note "row_movement"
    timeout 60 $PY bench/row_movement.py --out-dir "$OUT" > "$LOGS/row_movement.log" 2>&1
  fi
  cases=1gpu_bf16params,1gpu_bf16params_b4,1gpu_bf16params_compiled,1gpu_bf16params_b4_compiled
  timeout 280 $PY bench/train_step.py --cases $cases --gpus 0 --port 29511 --steps 20 --name train_step_1gpu_$tag \
    --out-dir "$OUT" --case-timeout 120 > "$LOGS/train_step.log" 2>&1
  timeout 280 $PY bench/vs_torchtitan.py --cases $cases --gpus 0 --port 29521 --steps 20 \
    --ours "$OUT/train_step_1gpu_$tag.json" --name vs_torchtitan_1gpu_$tag --out-dir "$OUT" --case-timeout 120 \
    > "$LOGS/vs_torchtitan.log" 2>&1
elif [ "$phase" = L ]; then
  # twelfth call (2026-11-23), one GPU
  note "row_movement"
  timeout 60 $PY bench/row_movement.py --out-dir "$OUT" > "$LOGS/row_movement.log" 2>&1
  for b in 2 4; do
    case=1gpu_bf16params; [ $b = 4 ] && case=1gpu_bf16params_b4
    (cd "$BASE" && timeout 70 $PY bench/train_step.py --cases $case --gpus 0 --port 29544 --steps 20 \
      --name train_step_1gpu_l_base_b$b --out-dir "$OUT" --work-dir /tmp/titan_fold_bench/base \
      --case-timeout 68 > "$LOGS/train_step_l_base_b$b.log" 2>&1)
    timeout 70 $PY bench/train_step.py --cases $case --gpus 0 --port 29511 --steps 20 \
      --name train_step_1gpu_l_b$b --out-dir "$OUT" --case-timeout 68 > "$LOGS/train_step_l_b$b.log" 2>&1
  done
elif [ "$phase" = N ]; then
  # fourteenth call (2026-11-23), one GPU
  (cd "$PWD" && timeout 120 $PY -m pytest -q tests/test_moe_layer.py -k fused > "$LOGS/test_fused.log" 2>&1)
  for i in 1 2; do
    if [ -n "${BASE:-}" ]; then
      (cd "$BASE" && timeout 60 $PY bench/moe_layer.py --shapes qwen3_30b_a3b --modes dropless --compile off \
        --name moe_layer_n_base_$i --out-dir "$OUT" > "$LOGS/moe_layer_base_$i.log" 2>&1)
    fi
    timeout 60 $PY bench/moe_layer.py --shapes qwen3_30b_a3b --modes dropless --compile off \
      --name moe_layer_n_new_$i --out-dir "$OUT" > "$LOGS/moe_layer_new_$i.log" 2>&1
  done
  timeout 150 $PY bench/moe_layer.py --modes dropless --impl titan_fold,torchtitan --compile off \
    --shapes qwen3_30b_a3b,mixtral_8x22b_g8t8,qwen2_57b_a14b,mixtral_8x22b --name moe_layer_n_eager --out-dir "$OUT" \
    > "$LOGS/moe_layer_n_eager.log" 2>&1
  timeout 200 $PY bench/moe_layer.py --modes dropless --impl titan_fold,torchtitan --compile on --no-profile \
    --shapes qwen3_30b_a3b --name moe_layer_n_compiled --out-dir "$OUT" > "$LOGS/moe_layer_n_compiled.log" 2>&1
elif [ "$phase" = O ]; then
  # fifteenth call (2026-11-23), one GPU
  export TORCH_LOGS=recompiles
  for i in 1 2; do
    (cd "$BASE" && timeout 60 $PY bench/moe_layer.py --shapes qwen3_30b_a3b --modes dropless --compile off \
      --name moe_layer_o_base_$i --out-dir "$OUT" > "$LOGS/moe_layer_o_base_$i.log" 2>&1)
    timeout 60 $PY bench/moe_layer.py --shapes qwen3_30b_a3b --modes dropless --compile off \
      --name moe_layer_o_new_$i --out-dir "$OUT" > "$LOGS/moe_layer_o_new_$i.log" 2>&1
  done
  timeout 320 $PY bench/train_step.py --cases 1gpu_b4,1gpu_masters_b4,1gpu_bf16params_b4 --gpus 0 --port 29511 \
    --steps 20 --name train_step_1gpu_o --out-dir "$OUT" --case-timeout 105 > "$LOGS/train_step.log" 2>&1
  timeout 140 $PY bench/train_step.py --cases 1gpu_masters_b4_compiled --gpus 0 --port 29512 \
    --steps 20 --name train_step_1gpu_o_compiled --out-dir "$OUT" --case-timeout 135 > "$LOGS/train_step_c.log" 2>&1
elif [ "$phase" = P ]; then
  # sixteenth call (2026-11-23), one GPU
  export TORCH_LOGS=recompiles
  timeout 300 $PY bench/train_step.py --cases 1gpu_b4,1gpu_masters_b4,1gpu_bf16params_b4 --gpus 0 --port 29511 \
    --steps 20 --name train_step_1gpu_p --out-dir "$OUT" --case-timeout 95 > "$LOGS/train_step.log" 2>&1
  timeout 120 $PY bench/moe_layer.py --modes dropless --impl titan_fold,torchtitan --compile off \
    --shapes qwen3_30b_a3b,mixtral_8x22b_g8t8,qwen2_57b_a14b,mixtral_8x22b --name moe_layer_p_eager --out-dir "$OUT" \
    > "$LOGS/moe_layer_p_eager.log" 2>&1
  timeout 160 $PY bench/moe_layer.py --modes dropless --impl titan_fold,torchtitan --compile on --no-profile \
    --shapes qwen3_30b_a3b,mixtral_8x22b_g8t8 --name moe_layer_p_compiled --out-dir "$OUT" \
    > "$LOGS/moe_layer_p_compiled.log" 2>&1
elif [ "$phase" = Q ]; then
  # seventeenth call (2026-11-23), one GPU
  export TORCH_LOGS=recompiles
  timeout 300 $PY bench/train_step.py --cases 1gpu_b4,1gpu_masters_b4,1gpu_bf16params_b4 --gpus 0 --port 29511 \
    --steps 20 --name train_step_1gpu_q --out-dir "$OUT" --case-timeout 95 > "$LOGS/train_step.log" 2>&1
  timeout 60 $PY bench/moe_layer.py --modes dropless --compile off --shapes qwen3_30b_a3b --name moe_layer_q \
    --out-dir "$OUT" > "$LOGS/moe_layer_q.log" 2>&1
elif [ "$phase" = R ]; then
  # eighteenth call (2026-11-23), one GPU
  export TORCH_LOGS=recompiles
  timeout 200 $PY bench/train_step.py --cases 1gpu_masters_b4,1gpu_bf16params_b4 --gpus 0 --port 29511 \
    --steps 20 --name train_step_1gpu_r --out-dir "$OUT" --case-timeout 95 > "$LOGS/train_step.log" 2>&1
elif [ "$phase" = S ]; then
  # nineteenth call (2026-11-23), one GPU
  export TORCH_LOGS=recompiles
  (cd "$BASE" && timeout 75 $PY bench/train_step.py --cases 1gpu_bf16params_b4 --gpus 0 --port 29544 \
    --steps 20 --name train_step_1gpu_s_base --out-dir "$OUT" --work-dir /tmp/titan_fold_bench/base \
    --case-timeout 73 > "$LOGS/train_step_s_base.log" 2>&1)
  timeout 75 $PY bench/train_step.py --cases 1gpu_bf16params_b4 --gpus 0 --port 29511 --steps 20 \
    --name train_step_1gpu_s_new --out-dir "$OUT" --case-timeout 73 > "$LOGS/train_step_s_new.log" 2>&1
  (cd "$BASE" && timeout 75 $PY bench/train_step.py --cases 1gpu_bf16params_b4 --gpus 0 --port 29545 \
    --steps 20 --name train_step_1gpu_s_base2 --out-dir "$OUT" --work-dir /tmp/titan_fold_bench/base \
    --case-timeout 73 > "$LOGS/train_step_s_base2.log" 2>&1)
  timeout 75 $PY bench/train_step.py --cases 1gpu_bf16params_b4 --gpus 0 --port 29512 --steps 20 \
    --name train_step_1gpu_s_new2 --out-dir "$OUT" --case-timeout 73 > "$LOGS/train_step_s_new2.log" 2>&1
  timeout 150 $PY bench/train_step.py --cases 1gpu_masters_b4,1gpu_b4 --gpus 0 --port 29513 --steps 20 \
    --name train_step_1gpu_s --out-dir "$OUT" --case-timeout 73 > "$LOGS/train_step_s.log" 2>&1
elif [ "$phase" = T ]; then
  # twentieth call (2026-11-23), two GPUs
  export TORCH_LOGS=recompiles
  timeout 280 $PY bench/train_step.py --cases dp2_ep2,tp2_ep2 --gpus 0,1 --port 29543 --steps 15 \
    --name train_step_2gpu_t --out-dir "$OUT" --case-timeout 130 > "$LOGS/train_step_2gpu_t.log" 2>&1
elif [ "$phase" = U ]; then
  # twenty-first call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  note "FP8 tests on the GPU"
  timeout 60 $PY -m pytest -q tests/test_fp8.py > "$LOGS/test_fp8.log" 2>&1
  layer_fp8 u_fp8 $ALL_SHAPES 120 --compile off --no-profile
  proxy200 u $ROUTERS_FP8 380
elif [ "$phase" = V ]; then
  # twenty-second call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  proxy200 v $ROUTERS_FP8 380
  layer_fp8 v_fp8_profile qwen3_30b_a3b,qwen2_57b_a14b 60 --compile off
  layer_fp8 v_fp8_compiled qwen2_57b_a14b 150 --compile on --no-profile
elif [ "$phase" = W ]; then
  # twenty-third call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  layer_fp8 w_fp8 $ALL_SHAPES 110 --compile off
  proxy200 w $ROUTERS_FP8 400
elif [ "$phase" = X ]; then
  # twenty-fourth call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  cases=1gpu_bf16params_auxfree,1gpu_bf16params_auxfree_compiled
  for proxy in 30B-A3B-L12 57B-A14B-L2; do
    tag=$(echo $proxy | tr -d '-' | tr 'A-Z' 'a-z')
    note "qwen3_moe $proxy: titan_fold, then torchtitan"
    timeout 150 $PY bench/train_step.py --cases $cases --family qwen3_moe --proxy $proxy --gpus 0 --port 29511 \
      --steps 15 --name train_step_1gpu_x_$tag --out-dir "$OUT" --case-timeout 85 > "$LOGS/train_step_x_$tag.log" 2>&1
    timeout 150 $PY bench/vs_torchtitan.py --cases $cases --family qwen3_moe --proxy $proxy --gpus 0 --port 29521 \
      --steps 15 --ours "$OUT/train_step_1gpu_x_$tag.json" --name vs_torchtitan_1gpu_x_$tag --out-dir "$OUT" \
      --case-timeout 85 > "$LOGS/vs_torchtitan_x_$tag.log" 2>&1
  done
elif [ "$phase" = Y ] || [ "$phase" = Z ]; then
  # twenty-fifth and twenty-sixth calls (2026-11-24), one GPU
  tag=$(echo "$phase" | tr YZ yz)
  export TORCH_LOGS=recompiles
  note "FP8 tests on the GPU"
  timeout 60 $PY -m pytest -q tests/test_fp8.py > "$LOGS/test_fp8_$tag.log" 2>&1
  layer_fp8 "${tag}_fp8" $ALL_SHAPES 110 --compile off
  proxy200 "$tag" 1gpu_bf16params,1gpu_bf16params_fp8 170
  layer_fp8 "${tag}_fp8_compiled" qwen2_57b_a14b 150 --compile on --no-profile
  if [ "$phase" = Z ]; then
    note "proxy compiled with FP8 experts"
    timeout 120 $PY bench/train_step.py --cases 1gpu_bf16params_fp8_compiled --gpus 0 --port 29512 --steps 30 \
      --name train_step_1gpu_z_compiled --out-dir "$OUT" --case-timeout 115 > "$LOGS/train_step_z_c.log" 2>&1
  fi
elif [ "$phase" = ZA ]; then
  # twenty-seventh call (2026-11-24), one GPU: the pytest logs come back in $OUT
  export TORCH_LOGS=recompiles
  note "CPU tests under the image's torch"
  CUDA_VISIBLE_DEVICES= timeout 300 $PY -m pytest -q -n 4 tests/test_pipeline.py tests/test_dryrun.py \
    tests/test_dryrun_match.py tests/test_config.py > "$OUT/pytest_cpu_torch211.log" 2>&1
  note "op-level selective AC under PP with FSDP-sharded experts (fails on torch 2.13's CPU build)"
  CUDA_VISIBLE_DEVICES= timeout 120 $PY -m torch.distributed.run --nproc_per_node 4 -m titan_fold.train \
    --job.config_file debug_moe.toml --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule 1F1B \
    --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op \
    --training.local_batch_size 2 --training.steps 1 --job.dump_folder /tmp/sac_pp > "$OUT/sac_pp_torch211.log" 2>&1
  echo "exit code $?" >> "$OUT/sac_pp_torch211.log"
  note "FP8 tests on the GPU"
  timeout 60 $PY -m pytest -q -n 0 tests/test_fp8.py > "$OUT/pytest_fp8_gpu.log" 2>&1
  note "proxy, local batch 4"
  timeout 100 $PY bench/train_step.py --cases 1gpu_bf16params_b4 --gpus 0 --port 29511 --steps 20 \
    --name train_step_1gpu_za --out-dir "$OUT" --case-timeout 95 > "$LOGS/train_step_za.log" 2>&1
elif [ "$phase" = ZB ]; then
  # twenty-eighth call (2026-11-24), two GPUs
  export TORCH_LOGS=recompiles
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
  note "1 GPU each: fp32 masters beside bf16 weights at local batch 4 (GPU0 compiled, GPU1 eager)"
  timeout 250 $PY bench/train_step.py --cases 1gpu_masters_b4_compiled,1gpu_bf16params_b4_compiled --gpus 0 \
    --port 29511 --steps 20 --name train_step_1gpu_zb_compiled --out-dir "$OUT" --case-timeout 120 \
    > "$LOGS/train_step_zb_compiled.log" 2>&1 &
  timeout 250 $PY bench/train_step.py --cases 1gpu_masters_b4,1gpu_bf16params_b4 --gpus 1 \
    --port 29512 --steps 20 --name train_step_1gpu_zb --out-dir "$OUT" --case-timeout 120 \
    > "$LOGS/train_step_zb.log" 2>&1 &
  wait
  note "pp2, masters under FSDP2 on both meshes, dp2 x ep2"
  timeout 260 $PY bench/train_step.py --cases pp2,dp2_edp2_masters_b4,dp2_edp2_bf16params_b4,dp2_ep2_masters_b4,dp2_ep2_bf16params_b4 \
    --gpus 0,1 --port 29543 --steps 15 --name train_step_2gpu_zb --out-dir "$OUT" --case-timeout 75 \
    > "$LOGS/train_step_2gpu_zb.log" 2>&1
  note "MoE layer ep2, a set share of the routed assignments on EP rank 0"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 100 $PY -m torch.distributed.run --nproc_per_node 2 \
    --master_port 29542 bench/moe_layer.py --dispatch ep2 --shapes qwen3_30b_a3b,qwen2_57b_a14b --modes dropless \
    --compile off --no-profile --ep-rank-share natural,0.5,0.55,0.6,0.7 --name moe_layer_2gpu_zb_share \
    --out-dir "$OUT" > "$LOGS/moe_layer_zb_share.log" 2>&1
  save_logs zb
elif [ "$phase" = ZC ]; then
  # twenty-ninth call (2026-11-24), two GPUs
  export TORCH_LOGS=recompiles
  note "routers, 200 steps, dp2 x ep2"
  timeout 230 $PY bench/train_step.py --cases dp2_ep2_bf16params_auxloss,dp2_ep2_bf16params_auxfree,dp2_ep2_bf16params_lbnone \
    --gpus 0,1 --port 29543 --steps 200 --warmup-steps 10 --name train_step_2gpu_zc_routers --out-dir "$OUT" \
    --case-timeout 75 > "$LOGS/train_step_2gpu_zc_routers.log" 2>&1
  same_model_2gpu zc_30ba3bl12 30B-A3B-L12 dp2_ep2_bf16params_auxfree,dp2_ep2_bf16params_auxfree_compiled 160 95
  save_logs zc
elif [ "$phase" = ZD ]; then
  # thirtieth call (2026-11-24), two GPUs
  export TORCH_LOGS=recompiles
  note "foldings"
  timeout 230 $PY bench/train_step.py --cases dp2_ep2,dp2_etp2,tp2_ep2,tp2_etp2 --gpus 0,1 --port 29543 --steps 15 \
    --name train_step_2gpu_zd --out-dir "$OUT" --case-timeout 60 > "$LOGS/train_step_2gpu_zd.log" 2>&1
  note "collectives"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 60 $PY -m torch.distributed.run --nproc_per_node 2 \
    --master_port 29541 bench/collectives.py --name collectives_zd --out-dir "$OUT" > "$LOGS/collectives_zd.log" 2>&1
  note "MoE layer ep2 / etp2"
  BENCH_LAUNCHER="torchrun --nproc_per_node 2" timeout 100 $PY -m torch.distributed.run --nproc_per_node 2 \
    --master_port 29542 bench/moe_layer.py --dispatch ep2,etp2 --modes dropless --compile off --no-profile \
    --name moe_layer_2gpu_zd --out-dir "$OUT" > "$LOGS/moe_layer_2gpu_zd.log" 2>&1
  same_model_2gpu zd_57ba14bl2 57B-A14B-L2 dp2_ep2_bf16params_auxfree 70 65
  save_logs zd
elif [ "$phase" = ZE ]; then
  # thirty-first call (2026-11-24), two GPUs
  export TORCH_LOGS=recompiles
  note "fused-kernel tests on the GPU"
  timeout 60 $PY -m pytest -q -n 0 tests/test_moe_layer.py -k fused > "$OUT/pytest_fused_gpu.log" 2>&1
  note "tp2 x etp2, masters under dp2"
  timeout 200 $PY bench/train_step.py --cases tp2_etp2,dp2_edp2_masters_b4,dp2_ep2_masters_b4 --gpus 0,1 --port 29543 \
    --steps 15 --name train_step_2gpu_ze --out-dir "$OUT" --case-timeout 65 > "$LOGS/train_step_2gpu_ze.log" 2>&1
  for proxy in 30B-A3B-L12 57B-A14B-L2; do
    same_model_2gpu "ze_$(echo $proxy | tr -d '-' | tr 'A-Z' 'a-z')" $proxy dp2_ep2_bf16params_auxfree_compiled 100 95
  done
  save_logs ze
elif [ "$phase" = ZF ]; then
  # thirty-second call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  note "masters and bf16 weights at local batch 4, compiled, then bf16 eager"
  timeout 260 $PY bench/train_step.py --cases 1gpu_masters_b4_compiled,1gpu_bf16params_b4_compiled,1gpu_bf16params_b4 \
    --gpus 0 --port 29511 --steps 30 --name train_step_1gpu_zf --out-dir "$OUT" --case-timeout 120 \
    > "$LOGS/train_step_zf.log" 2>&1
  note "MoE layer eager, every shape and mode"
  timeout 200 $PY bench/moe_layer.py --compile off --name moe_layer_eager --out-dir "$OUT" > "$LOGS/moe_layer_zf.log" 2>&1
  save_logs zf
elif [ "$phase" = ZG ]; then
  # thirty-third call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  timeout 200 $PY bench/moe_layer.py --compile off --name moe_layer_eager --out-dir "$OUT" > "$OUT/moe_layer_zg.log" 2>&1
elif [ "$phase" = ZH ]; then
  # thirty-fourth call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  note "fused-kernel tests on the GPU"
  timeout 90 $PY -m pytest -q -n 0 tests/test_moe_layer.py -k fused > "$OUT/pytest_fused_gpu_zh.log" 2>&1
  for i in 1 2; do
    note "Qwen2-57B-A14B layer: \$BASE then this code ($i)"
    (cd "$BASE" && timeout 60 $PY bench/moe_layer.py --shapes qwen2_57b_a14b --modes dropless --compile off \
      --no-profile --name "moe_layer_zh_base_$i" --out-dir "$OUT" > "$LOGS/moe_layer_zh_base_$i.log" 2>&1)
    timeout 60 $PY bench/moe_layer.py --shapes qwen2_57b_a14b --modes dropless --compile off --no-profile \
      --name "moe_layer_zh_new_$i" --out-dir "$OUT" > "$LOGS/moe_layer_zh_new_$i.log" 2>&1
  done
  note "routed grouped GEMMs alone"
  timeout 330 $PY bench/grouped_gemm.py --autotune qwen3_30b_a3b --out-dir "$OUT" > "$LOGS/grouped_gemm.log" 2>&1
  save_logs zh
elif [ "$phase" = ZI ]; then
  # thirty-fifth call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  note "bf16 eager, local batch 4: \$BASE then this code"
  (cd "$BASE" && timeout 80 $PY bench/train_step.py --cases 1gpu_bf16params_b4 --gpus 0 --port 29544 --steps 20 \
    --name train_step_1gpu_zi_base --out-dir "$OUT" --work-dir /tmp/titan_fold_bench/base \
    --case-timeout 78 > "$LOGS/train_step_zi_base.log" 2>&1)
  timeout 80 $PY bench/train_step.py --cases 1gpu_bf16params_b4 --gpus 0 --port 29511 --steps 20 \
    --name train_step_1gpu_zi_new --out-dir "$OUT" --case-timeout 78 > "$LOGS/train_step_zi_new.log" 2>&1
  note "fp32 masters and bf16 weights, local batch 4, compiled"
  timeout 290 $PY bench/train_step.py --cases 1gpu_masters_b4_compiled,1gpu_bf16params_b4_compiled \
    --gpus 0 --port 29512 --steps 30 --name train_step_1gpu_zi --out-dir "$OUT" --case-timeout 140 \
    > "$LOGS/train_step_zi.log" 2>&1
  save_logs zi
elif [ "$phase" = ZJ ]; then
  # thirty-sixth call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  note "MoE layer eager, every shape and mode"
  timeout 220 $PY bench/moe_layer.py --compile off --name moe_layer_eager --out-dir "$OUT" > "$LOGS/moe_layer_zj.log" 2>&1
  note "MoE layer compiled, titan_fold and torchtitan"
  timeout 300 $PY bench/moe_layer.py --compile on --no-profile --name moe_layer_compiled --out-dir "$OUT" \
    > "$LOGS/moe_layer_zj_compiled.log" 2>&1
  save_logs zj
elif [ "$phase" = ZK ] || [ "$phase" = ZL ]; then
  # thirty-seventh and thirty-eighth calls (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  if [ "$phase" = ZK ]; then
    note "row_movement"
    timeout 60 $PY bench/row_movement.py --out-dir "$OUT" > "$LOGS/row_movement.log" 2>&1
    layer_fp8 zk_fp8 $ALL_SHAPES 120 --compile off --no-profile
  fi
  cases=1gpu_bf16params_auxfree,1gpu_bf16params_auxfree_compiled
  proxies="57B-A14B-L2 30B-A3B-L12"
  tag_phase=$(echo "$phase" | tr 'A-Z' 'a-z')
  [ "$phase" = ZL ] && proxies=57B-A14B-L2
  for proxy in $proxies; do
    tag=$(echo $proxy | tr -d '-' | tr 'A-Z' 'a-z')
    note "qwen3_moe $proxy: titan_fold, then torchtitan"
    timeout 150 $PY bench/train_step.py --cases $cases --family qwen3_moe --proxy $proxy --gpus 0 --port 29511 \
      --steps 15 --name train_step_1gpu_${tag_phase}_$tag --out-dir "$OUT" --case-timeout 85 > "$LOGS/train_step_${tag_phase}_$tag.log" 2>&1
    timeout 150 $PY bench/vs_torchtitan.py --cases $cases --family qwen3_moe --proxy $proxy --gpus 0 --port 29521 \
      --steps 15 --ours "$OUT/train_step_1gpu_${tag_phase}_$tag.json" --name vs_torchtitan_1gpu_${tag_phase}_$tag \
      --out-dir "$OUT" --case-timeout 85 > "$LOGS/vs_torchtitan_${tag_phase}_$tag.log" 2>&1
  done
  if [ "$phase" = ZL ]; then
    note "fp32 masters and bf16 weights compiled, local batch 4, step 10 profiled"
    timeout 230 $PY bench/train_step.py --cases 1gpu_masters_b4_compiled_profile,1gpu_bf16params_b4_compiled_profile \
      --gpus 0 --port 29513 --steps 12 --name train_step_1gpu_zl_profile --out-dir "$OUT" --case-timeout 110 \
      > "$LOGS/train_step_zl_profile.log" 2>&1
  fi
  save_logs "$tag_phase"
elif [ "$phase" = ZM ]; then
  # thirty-ninth call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  note "gradient norm: foreach against one reduction per tensor"
  timeout 90 $PY bench/grad_norm.py --out-dir "$OUT" > "$LOGS/grad_norm.log" 2>&1
  note "masters compiled, local batch 4: this code, \$BASE, this code; bf16 weights compiled"
  timeout 130 $PY bench/train_step.py --cases 1gpu_masters_b4_compiled --gpus 0 --port 29511 --steps 30 \
    --name train_step_1gpu_zm_new --out-dir "$OUT" --case-timeout 125 > "$LOGS/train_step_zm_new.log" 2>&1
  (cd "$BASE" && timeout 130 $PY bench/train_step.py --cases 1gpu_masters_b4_compiled --gpus 0 --port 29544 \
    --steps 30 --name train_step_1gpu_zm_base --out-dir "$OUT" --work-dir /tmp/titan_fold_bench/base \
    --case-timeout 125 > "$LOGS/train_step_zm_base.log" 2>&1)
  timeout 250 $PY bench/train_step.py --cases 1gpu_masters_b4_compiled,1gpu_bf16params_b4_compiled --gpus 0 \
    --port 29512 --steps 30 --name train_step_1gpu_zm --out-dir "$OUT" --case-timeout 125 > "$LOGS/train_step_zm.log" 2>&1
  save_logs zm
elif [ "$phase" = ZN ]; then
  # fortieth call (2026-11-24), one GPU
  export TORCH_LOGS=recompiles
  note "MoE layer eager, every shape and mode"
  timeout 220 $PY bench/moe_layer.py --compile off --name moe_layer_eager --out-dir "$OUT" > "$LOGS/moe_layer_zn.log" 2>&1
  for i in 1 2; do
    note "Qwen3-30B-A3B alone ($i)"
    timeout 60 $PY bench/moe_layer.py --shapes qwen3_30b_a3b --compile off --no-profile --name "moe_layer_zn_qwen3_$i" \
      --out-dir "$OUT" > "$LOGS/moe_layer_zn_qwen3_$i.log" 2>&1
  done
  save_logs zn
elif [ "$phase" = ZO ]; then
  # forty-second call (2026-11-24; the forty-first, a probe of the same, left nothing in the repository)
  timeout 120 $PY bench/master_step.py --out-dir "$OUT" > "$OUT/master_step_zo.log" 2>&1
elif [ "$phase" = ZP ]; then
  # forty-third call (2026-11-24), one GPU: the pytest log comes back in $OUT
  CUDA_VISIBLE_DEVICES= timeout 400 $PY -m pytest -q -n 8 tests/test_equivalence.py tests/test_clip.py \
    tests/test_optimizer.py tests/test_moe_layer.py tests/test_attention_parallel.py > "$OUT/pytest_cpu_torch211_zp.log" 2>&1
  timeout 60 $PY -m pytest -q -n 0 tests/test_moe_layer.py -k fused > "$OUT/pytest_fused_gpu_zp.log" 2>&1
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
