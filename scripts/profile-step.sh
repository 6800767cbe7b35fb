#!/usr/bin/env bash
# Where a training step's GPU time goes: bench/train_bench over a few steps per recipe under the
# kprof injection library (bench/kprof: CUPTI activity records), which prints GPU time per kernel,
# launch counts, the share of the wall-clock span the GPU was busy, and the idle gaps charged to
# the activity that ended each (what the GPU waited for the host before).
# Usage (device machine, after `scripts/device-run.sh build`): scripts/profile-step.sh [recipes]
# KEEP_FFN=on|off (default on, as the step tables in docs/cuda.md run): the FFN interiors kept or
# recomputed in backward. The recipe `torch` profiles the PyTorch peer instead
# (bench/torch_reference.py --mode graphs: its compiled, graph-captured step, whose kernels CUPTI
# reports too); its totals include the warm-up and compile runs, so divide by a kernel that runs
# once per step per layer (the SDPA backward: layers x steps) for per-step times.
# GRAD_QUANT=apart|decodes|fused (default: train_bench's): how the step makes its MXFP8 operands
# (train_bench --grad-quant); the files are then named kprof_<recipe>_<variant>.
# scripts/kprof-diff.py compares the JSON files of two runs kernel by kernel.
set -uo pipefail
OUT=$(realpath -m "${OUT:-out}")
mkdir -p "$OUT"
BUILD=${BUILD:-build-dev}
ninja -C "$BUILD" fourbit_kprof > /dev/null || exit 1
for r in ${1:-bf16 nvfp4-fwd}; do
  if [ "$r" = torch ]; then
    CUDA_INJECTION64_PATH="$(realpath "$BUILD/bench/libfourbit_kprof.so")" KPROF_OUT="$OUT/kprof_torch.json" \
      KPROF_TOP=${KPROF_TOP:-45} python3 bench/torch_reference.py --config ${CONFIG:-configs/gpu-small.toml} \
      --mode graphs --warmup 3 --steps ${STEPS:-3} > "$OUT/kprof_torch.log" 2>&1
    echo "== torch"; sed -n '/^kprof: GPU busy/,$p' "$OUT/kprof_torch.log"
    continue
  fi
  name=$r${GRAD_QUANT:+_$GRAD_QUANT}
  CUDA_INJECTION64_PATH="$BUILD/bench/libfourbit_kprof.so" KPROF_OUT="$OUT/kprof_$name.json" KPROF_TOP=${KPROF_TOP:-45} \
    "$BUILD/bench/train_bench" --config ${CONFIG:-configs/gpu-small.toml} --device cuda --recipes "$r" \
    --keep-ffn "${KEEP_FFN:-on}" ${GRAD_QUANT:+--grad-quant "$GRAD_QUANT"} --warmup 1 --steps ${STEPS:-2} \
    > "$OUT/kprof_$name.log" 2>&1
  echo "== $name"; sed -n '/^kprof: GPU busy/,$p' "$OUT/kprof_$name.log"
done
