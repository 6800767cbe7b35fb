#!/usr/bin/env bash
# `make bench`: the CPU benchmarks, each printing a table and writing JSON to bench/results/.
# (GPU benchmarks run on the device machine: scripts/device-run.sh.)
set -euo pipefail
BUILD=${1:-build}
mkdir -p bench/results
"$BUILD/bench/cpu_quant" --rows 2048 --cols 4096 --json bench/results/cpu_quant.json
if [ -x "$BUILD/bench/cpu_gemm" ]; then "$BUILD/bench/cpu_gemm" --json bench/results/cpu_gemm.json; fi
"$BUILD/bench/train_bench" --config configs/tiny.toml --device cpu \
  --recipes bf16,fp32,mxfp8,nvfp4-fwd,nvidia-nvfp4 --warmup 1 --steps 3 --json bench/results/cpu_train.json
