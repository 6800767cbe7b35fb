#!/usr/bin/env bash
# `make demo`: train configs/tiny.toml on the generated corpus with nvfp4-fwd and with mxfp8 on
# the CPU, compare their final eval losses, plot both curves, and sample from the nvfp4-fwd model
# through the same forward pass it was trained with.
set -euo pipefail
BUILD=${1:-build}
FB="$BUILD/fourbit"
OUT=${DEMO_OUT:-runs/demo}
STEPS=${DEMO_STEPS:-}
extra=()
[ -n "$STEPS" ] && extra+=(--steps "$STEPS")
mkdir -p "$OUT"
for recipe in nvfp4-fwd mxfp8; do
  echo "== training configs/tiny.toml with recipe $recipe (CPU) =="
  # The demo's runs are its own to replace (fourbit refuses to write over a run otherwise).
  rm -rf "${OUT:?}/$recipe"
  "$FB" pretrain --config configs/tiny.toml --recipe "$recipe" --device cpu --out "$OUT/$recipe" "${extra[@]}"
done
echo
echo "== final eval losses (nats/token) =="
"$FB" summary "$OUT/nvfp4-fwd" "$OUT/mxfp8"
echo
"$FB" plot "$OUT/nvfp4-fwd" "$OUT/mxfp8" --out "$OUT/loss.png" --title "configs/tiny.toml: nvfp4-fwd vs mxfp8"
echo
echo "== greedy samples from the nvfp4-fwd model =="
"$FB" generate --run "$OUT/nvfp4-fwd" --device cpu --max-new 40 \
  --prompt "12+35=" --prompt "7*8=" --prompt "the cat" --prompt "a dog sees"
