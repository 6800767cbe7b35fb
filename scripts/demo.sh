#!/usr/bin/env bash
# `make demo`: the whole pipeline on configs/tiny.toml on the CPU. Pretrain with nvfp4-fwd and
# with mxfp8 and compare their final eval losses (loss.png); then, on the nvfp4-fwd model, SFT on
# a task and on-policy RL on it, through the same forward pass it was pretrained with (rl.png:
# reward and held-out accuracy); greedy samples at the end. DEMO_STEPS=N shortens every stage
# for a quick look (pretrain N steps, SFT and RL at most N).
set -euo pipefail
BUILD=${1:-build}
FB="$BUILD/fourbit"
OUT=${DEMO_OUT:-runs/demo}
STEPS=${DEMO_STEPS:-}
# shellcheck source=scripts/rl-settings.sh
source "$(dirname "$0")/rl-settings.sh"
RL_STEPS=${RL_STEPS:-60}
extra=()
if [ -n "$STEPS" ]; then
  extra+=(--steps "$STEPS")
  [ "$SFT_STEPS" -gt "$STEPS" ] && SFT_STEPS=$STEPS
  [ "$RL_STEPS" -gt "$STEPS" ] && RL_STEPS=$STEPS
fi
mkdir -p "$OUT"
for recipe in nvfp4-fwd mxfp8; do
  echo "== pretraining configs/tiny.toml with recipe $recipe (CPU) =="
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
echo "== SFT of the nvfp4-fwd model on the task '$RL_TASK' =="
rm -rf "${OUT:?}/sft" "${OUT:?}/rl"
"$FB" sft --init "$OUT/nvfp4-fwd" "${SFT_ARGS[@]}" --steps "$SFT_STEPS" --device cpu --out "$OUT/sft"
echo
echo "== RL (group baseline, $RL_STEPS steps) on '$RL_TASK', sampling with the training forward =="
"$FB" rl --init "$OUT/sft" "${RL_ARGS[@]}" --steps "$RL_STEPS" --device cpu --out "$OUT/rl"
"$FB" plot "$OUT/rl" --out "$OUT/rl.png" --title "configs/tiny.toml nvfp4-fwd: RL on $RL_TASK (reward, held-out accuracy)"
echo
echo "== greedy samples from the RL model =="
"$FB" generate --run "$OUT/rl" --device cpu --max-new 12 --sep \
  --prompt "sort 5281=" --prompt "sort 97031=" --prompt "sort 882="
