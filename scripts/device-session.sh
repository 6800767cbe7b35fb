#!/usr/bin/env bash
# One device call of measurements for the open issues (run from the repo root on the GPU machine,
# after `scripts/device-run.sh build`): the exclusive-GPU benchmarks first (quantizer GB/s, the
# sampler's decode and its PyTorch peer), then, sharing the GPU, the interop check, the verbose
# GPU lockstep/gradient tests and an fp32 A/A run of the recipe table (seed 1, lr x (1 + 1e-4)).
set -uo pipefail
OUT=$(realpath -m "${OUT:-out}"); B=${BUILD:-build-dev}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.log"; }
log gpu_quant
timeout 120 "$B/bench/gpu_quant" --json "$OUT/gpu_quant.json" > "$OUT/gpu_quant.log" 2>&1; tail -16 "$OUT/gpu_quant.log"
log gpu_sampler
timeout 150 "$B/bench/gpu_sampler" --config configs/gpu-small.toml --device cuda --json "$OUT/gpu_sampler.json" \
  > "$OUT/gpu_sampler.log" 2>&1; tail -14 "$OUT/gpu_sampler.log"
log torch_decode
timeout 200 python3 bench/torch_decode.py --config configs/gpu-small.toml --json "$OUT/torch_decode.json" \
  > "$OUT/torch_decode.log" 2>&1; tail -14 "$OUT/torch_decode.log"
log shared phase
(timeout 200 python3 tests/interop/interop_test.py --fourbit "$B/fourbit" --device cuda --work /tmp/interop-work \
  --log "$OUT/interop-h200.log" > "$OUT/interop.out" 2>&1) &
(cd "$B" && timeout 240 ctest -V -j 6 -R "Lockstep|RecipeGrad.*Cuda" > "$OUT/lockstep_grad.log" 2>&1) &
(timeout 240 "$B/fourbit" pretrain --config configs/gpu-small.toml --recipe fp32 --seed 1 --data text:.carry/text/en.txt \
  --steps 300 --set train.lr=0.0010001 --set train.checkpoint_every=0 --device cuda --out /dev/shm/aa > "$OUT/aa.log" 2>&1;
 cp /dev/shm/aa/metrics.jsonl "$OUT/aa.metrics.jsonl"; cp /dev/shm/aa/summary.json "$OUT/aa.summary.json") &
wait
tail -4 "$OUT/interop-h200.log"; grep -E "lockstep over|1 - cos|tests passed|Failed" "$OUT/lockstep_grad.log" | head -40
grep -E "final eval" "$OUT/aa.log"
log done
