#!/usr/bin/env bash
# One call on the GPU machine: build with CUDA, run the GPU tests, the GPU benchmarks and the
# PyTorch peers (training step, sampler decode), leaving logs and JSON in $OUT (the device tool
# brings $OUT back).
# Usage (device machine, repo root): scripts/device-run.sh [build|tests|bench|torch|interop|all|table|dist|ncu|gradquant]... [pack]
# `table` (not part of `all`): the recipes-against-fp32 table of gpu-small on .carry/text/en.txt
# (scripts/make-text-corpus.sh), SEEDS (default "1 2") x every recipe, 300 steps, PARALLEL runs at once.
# `dist` (2 GPUs, not part of `all`): expert/data-parallel checks, failure drills and benchmarks.
# `ncu` (not part of `all`): Nsight Compute's full section set on the grouped kernel's first TMA-form
# launches in gpu_grouped_gemm (gpu-small's expert shape), on the streaming decode kernel at batch 1
# and 16, and on the fused attention's three wgmma kernels in gpu_attention, their details pages and
# source views (stall samples per SASS instruction); it reads hardware counters on the Firecracker
# runtime only (the device library's KINDS.md), with the clocks left alone.
# `gradquant` (not part of `all`): the training producers' quantizers, the SwiGLU rows of gpu_quant and
# train_bench --grad-quant decodes,fused,apart,decodes,fused.
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
  ninja -C "$BUILD" -j 16 fourbit_tests fourbit_cli train_bench gpu_quant gpu_attention gpu_sampler gpu_grouped_gemm gpu_chain fourbit_kprof > "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
  log build done
fi
if has tests; then
  log gpu tests
  # several at once: each test is small and deterministic whatever else shares the GPU
  (cd "$BUILD" && OMP_NUM_THREADS=2 ctest --output-on-failure -j "${TEST_JOBS:-6}" -R "${TESTS:-Cuda}" > "$OUT/gpu_tests.log" 2>&1)
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
  log gpu_chain
  "$BUILD/bench/gpu_chain" --json "$OUT/gpu_chain.json" 2>&1 | tee "$OUT/gpu_chain.log" | tail -10
  log gpu_grouped_gemm
  "$BUILD/bench/gpu_grouped_gemm" --json "$OUT/gpu_grouped_gemm.json" 2>&1 | tee "$OUT/gpu_grouped_gemm.log" | tail -9
  log train_bench
  "$BUILD/bench/train_bench" --config configs/gpu-small.toml --device cuda --recipes bf16,mxfp8,nvfp4-fwd --expert-gemms all \
    --warmup 2 --steps 5 --json "$OUT/gpu_train.json" 2>&1 | tee "$OUT/gpu_train.log" | tail -8
fi
if [[ " ${steps[*]} " == *" gradquant "* ]]; then
  # The training producers that quantize what they compute (not part of `all`): the quantizer
  # bench's SwiGLU rows and the training step A/B, interleaved in one process (docs/model.md).
  log gradquant
  for c in "mxfp8-e4m3 row+col one pass +bf16" "mxfp8-e4m3 row+col one pass, bf16 alone" "swiglu_forward, then row+col" \
           "swiglu_forward_row_col" "swiglu_backward, then two row+col" "swiglu_backward_row_col"; do
    "$BUILD/bench/gpu_quant" --case "$c" 2>&1 | grep -E "row\+col|swiglu" | tail -1
  done | tee "$OUT/gpu_quant_grad.log"
  "$BUILD/bench/train_bench" --config configs/gpu-small.toml --device cuda --recipes bf16,mxfp8,nvfp4-fwd \
    --grad-quant decodes,fused,apart,decodes,fused --warmup 2 --steps 5 --json "$OUT/gpu_train_grad_quant.json" 2>&1 \
    | tee "$OUT/gpu_train_grad_quant.log" | tail -18
  log gradquant done
fi
if has torch; then
  log torch reference
  # the strong peer of train_bench: grouped experts (no host sync), eager / compiled / compiled and
  # captured whole in one CUDA graph;
  # --selftest first (grouped == the per-expert loop, and no host sync in the grouped step)
  python3 bench/torch_reference.py --selftest --device cuda > "$OUT/torch_ref.log" 2>&1; tail -2 "$OUT/torch_ref.log"
  for mode in eager compile graphs; do
    python3 bench/torch_reference.py --config configs/gpu-small.toml --mode $mode --warmup 5 --steps 10 \
      --json "$OUT/torch_ref_$mode.json" >> "$OUT/torch_ref.log" 2>&1
    grep -h '"step_ms"\|"impl"' "$OUT/torch_ref_$mode.json" | tr -d '\n'; echo
  done
  log torch decode
  python3 bench/torch_decode.py --config configs/gpu-small.toml --json "$OUT/torch_decode.json" > "$OUT/torch_decode.log" 2>&1; tail -12 "$OUT/torch_decode.log"
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
if [[ " ${steps[*]} " == *" table "* ]]; then
  log "recipe table, seeds ${SEEDS:-1 2}"
  scripts/recipe-table.sh "$BUILD" configs/gpu-small.toml .carry/text/en.txt "$OUT/recipe_table_gpu_small.json" \
    --device cuda --steps 300 --seeds "${SEEDS:-1 2}" --parallel "${PARALLEL:-5}" --runs /dev/shm/recipe-table \
    > "$OUT/recipe_table.log" 2>&1; tail -12 "$OUT/recipe_table.log"
  for f in /dev/shm/recipe-table/*/metrics.jsonl; do cp "$f" "$OUT/$(basename "$(dirname "$f")").metrics.jsonl"; done
  log recipe table done
fi
if [[ " ${steps[*]} " == *" dist "* ]]; then
  # Expert and data parallelism on the 2-GPU machine (nvidia-h200-x2; not part of `all`):
  # docs/distributed.md "On the GPU machine" says what each line must show.
  log dist build
  nccl_root=${NCCL_ROOT:-$(python3 -c "import glob, os, sys
for p in sys.path:
    for f in glob.glob(os.path.join(p, 'nvidia', '**', 'libnccl.so*'), recursive=True): print(os.path.dirname(os.path.dirname(f))); sys.exit()")}
  cmake -S . -B "$BUILD" -DFOURBIT_NCCL=ON ${nccl_root:+-DNCCL_ROOT=$nccl_root} >> "$OUT/cmake.log" 2>&1 \
    || { tail -30 "$OUT/cmake.log"; exit 1; }
  ninja -C "$BUILD" -j 16 fourbit_tests dist_check dist_exchange >> "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
  nvidia-smi topo -m > "$OUT/gpu_topo.txt" 2>&1
  log dist gpu codec tests
  (cd "$BUILD" && ctest --output-on-failure -R CudaDist > "$OUT/dist_tests.log" 2>&1); tail -3 "$OUT/dist_tests.log"
  run2="torchrun --standalone --nproc-per-node 2 --no-python"
  log dist_check
  $run2 "$BUILD/bench/dist_check" --device cuda > "$OUT/dist_check.log" 2>&1; echo "exit $?" >> "$OUT/dist_check.log"
  tail -6 "$OUT/dist_check.log"
  # Failure drills with the launcher's variables set by hand (torchrun would kill the survivors
  # itself and hide whether fourbit stops them): rank 1 exits, throws, or hangs after the first
  # checks; rank 0 must stop with a message naming rank 1 (exit code 3) well inside the timeout.
  for mode in exit throw hang; do
    log "dist drill: rank 1 $mode"
    port=$((29600 + RANDOM % 1000))
    for r in 0 1; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        FOURBIT_DIST_TIMEOUT_S=30 timeout 120 "$BUILD/bench/dist_check" --device cuda --fail-rank 1 --fail-mode $mode \
        > "$OUT/drill_${mode}_rank$r.log" 2>&1 &
    done
    wait
    grep -h "stopped after\|injected" "$OUT"/drill_${mode}_rank*.log | cut -c1-240
  done
  log dist_exchange
  $run2 "$BUILD/bench/dist_exchange" --device cuda --json "$OUT/dist_exchange_gpu_small.json" \
    > "$OUT/dist_exchange.log" 2>&1; tail -14 "$OUT/dist_exchange.log"
  $run2 "$BUILD/bench/dist_exchange" --device cuda --tokens 131072 --iters 10 --json "$OUT/dist_exchange_512mib.json" \
    >> "$OUT/dist_exchange.log" 2>&1; tail -14 "$OUT/dist_exchange.log"
  "$BUILD/bench/dist_exchange" --device cuda --json "$OUT/dist_exchange_1gpu.json" >> "$OUT/dist_exchange.log" 2>&1
  tail -14 "$OUT/dist_exchange.log"
  log dist done
fi
if [[ " ${steps[*]} " == *" ncu "* ]]; then
  log ncu
  ncu --clock-control none --kernel-name regex:tma_kernel --launch-count "${NCU_LAUNCHES:-2}" --set full \
    -o "$OUT/ncu_grouped" "$BUILD/bench/gpu_grouped_gemm" --reps 1 > "$OUT/ncu.log" 2>&1; tail -3 "$OUT/ncu.log"
  ncu --import "$OUT/ncu_grouped.ncu-rep" --page details > "$OUT/ncu_grouped.txt" 2>&1
  # stall samples per SASS instruction (CSV): where the warps wait, line by line
  ncu --import "$OUT/ncu_grouped.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_grouped_sass.csv" 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Stall" \
    "$OUT/ncu_grouped.txt" | head -30
  # the fused attention's three kernels on the default wgmma CTA (gpu_attention's last variant): the
  # filter reads demangled names, since the engine and CTA shape are template arguments (matched
  # against the plain function name, a regex on them selects nothing); ncu writes a demangled
  # template argument with its type ("(int)64", "(bool)0"), hence the dots
  ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:flash_.*Wgmma, .int.64, .int.1, .int.2>" \
    --launch-count 3 --set full --import-source yes -o "$OUT/ncu_attention" "$BUILD/bench/gpu_attention" --reps 1 \
    > "$OUT/ncu_attention.log" 2>&1; tail -3 "$OUT/ncu_attention.log"
  ncu --import "$OUT/ncu_attention.ncu-rep" --page details > "$OUT/ncu_attention.txt" 2>&1
  ncu --import "$OUT/ncu_attention.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_attention_sass.csv" 2>&1
  grep -E "flash_|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|No Eligible" \
    "$OUT/ncu_attention.txt" | head -30
  # the streaming decode kernel (gpu_grouped_gemm --decode-only, gpu-small's w1|w3): the first launch
  # of each instance is batch 1 (2 rows, 8-row warps) for NVFP4 and BF16, and batch 16 (32 rows,
  # 16-row warps) for NVFP4. Template arguments: format (BF16 1, NVFP4 4), n8 token blocks, rows a warp.
  for spec in "stream_nvfp4_1:4, (.int.)?1, (.int.)?8>" "stream_bf16_1:1, (.int.)?1, (.int.)?8>" \
              "stream_nvfp4_16:4, (.int.)?1, (.int.)?16>"; do
    name=${spec%%:*}
    ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:stream_kernel<.fourbit::Format.${spec#*:}" \
      --launch-count 1 --set full --import-source yes -o "$OUT/ncu_$name" "$BUILD/bench/gpu_grouped_gemm" \
      --decode-only --reps 1 > "$OUT/ncu_$name.log" 2>&1; tail -1 "$OUT/ncu_$name.log"
    ncu --import "$OUT/ncu_$name.ncu-rep" --page details > "$OUT/ncu_$name.txt" 2>&1
    ncu --import "$OUT/ncu_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${name}_sass.csv" 2>&1
    grep -E "Duration|DRAM Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|No Eligible" \
      "$OUT/ncu_$name.txt" | head -8
  done
  log ncu done
fi
if [ "${steps[${#steps[@]}-1]}" = pack ]; then
  (cd "$OUT" && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz all.tgz)
fi
