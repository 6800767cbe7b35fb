#!/usr/bin/env bash
# One call on the GPU machine: build with CUDA, run the GPU tests, the GPU benchmarks and the
# PyTorch peer, leaving logs and JSON in $OUT (the device tool brings $OUT back).
# Usage (device machine, repo root): scripts/device-run.sh [build|tests|bench|torch|interop|all]... [pack]
# `pack` (last) folds everything in $OUT into $OUT/all.tgz: the device tool brings back 8 files.
# The machine has no toml++: carry .carry/include/toml++ (copied from Debian's package).
set -uo pipefail
OUT=$(realpath -m "${OUT:-out}")
mkdir -p "$OUT"
BUILD=${BUILD:-build-dev}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
has() { for s in "${steps[@]}"; do { [ "$s" = "$1" ] || [ "$s" = all ]; } && return 0; done; return 1; }
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.log"; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
if has build; then
  log build
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFOURBIT_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a-real > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  ninja -C "$BUILD" -j 16 fourbit_tests fourbit_cli train_bench gpu_quant gpu_attention gpu_sampler fourbit_kprof > "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
  log build done
fi
if has tests; then
  log gpu tests
  (cd "$BUILD" && OMP_NUM_THREADS=8 ctest --output-on-failure -j 1 -R "${TESTS:-Cuda}" > "$OUT/gpu_tests.log" 2>&1)
  grep -E "tests passed|Failed|FAILED|\*\*\*" "$OUT/gpu_tests.log" | tail -30
  log gpu tests done
fi
if has bench; then
  log gpu_quant
  "$BUILD/bench/gpu_quant" --json "$OUT/gpu_quant.json" 2>&1 | tee "$OUT/gpu_quant.log" | tail -14
  log gpu_attention
  "$BUILD/bench/gpu_attention" --json "$OUT/gpu_attention.json" 2>&1 | tee "$OUT/gpu_attention.log" | tail -7
  log gpu_sampler
  "$BUILD/bench/gpu_sampler" --config configs/gpu-small.toml --device cuda --json "$OUT/gpu_sampler.json" 2>&1 \
    | tee "$OUT/gpu_sampler.log" | tail -16
  log train_bench
  "$BUILD/bench/train_bench" --config configs/gpu-small.toml --device cuda --recipes bf16,mxfp8,nvfp4-fwd \
    --warmup 2 --steps 5 --json "$OUT/gpu_train.json" 2>&1 | tee "$OUT/gpu_train.log" | tail -8
fi
if has torch; then
  log torch reference
  python3 bench/torch_reference.py --config configs/gpu-small.toml --warmup 3 --steps 8 \
    --json "$OUT/torch_ref.json" > "$OUT/torch_ref.log" 2>&1; tail -5 "$OUT/torch_ref.log"
  log done
fi
if has interop; then
  # fourbit against transformers (docs/export.md); fourbit scores on the GPU, transformers on the CPU
  log interop
  python3 tests/interop/interop_test.py --fourbit "$BUILD/fourbit" --device cuda --work "$OUT/interop-work" \
    --log "$OUT/interop-h200.log" > "$OUT/interop.out" 2>&1; tail -4 "$OUT/interop-h200.log"
  rm -rf "$OUT/interop-work"
  log interop done
fi
if [ "${steps[${#steps[@]}-1]}" = pack ]; then
  (cd "$OUT" && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz all.tgz)
fi
