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
# The two pretraining runs are independent: on a machine with 2+ cores they run side by side with
# half the cores each (one OpenMP team per core is faster than two runs taking turns), mxfp8's
# progress going to its log, printed when both are done.
CORES=$(nproc)
HALF=$(( CORES >= 2 ? CORES / 2 : 1 ))
for recipe in nvfp4-fwd mxfp8; do rm -rf "${OUT:?}/$recipe" "$OUT/$recipe.log"; done  # the demo's own runs
echo "== pretraining configs/tiny.toml with recipes nvfp4-fwd and mxfp8 (CPU, $HALF thread(s) each) =="
if [ "$CORES" -ge 2 ]; then
  "$FB" pretrain --config configs/tiny.toml --recipe mxfp8 --device cpu --threads "$HALF" \
    --out "$OUT/mxfp8" "${extra[@]}" > "$OUT/mxfp8.log" 2>&1 &
  MXFP8_PID=$!
  trap 'kill $MXFP8_PID 2>/dev/null || true' EXIT
fi
"$FB" pretrain --config configs/tiny.toml --recipe nvfp4-fwd --device cpu --threads "$HALF" \
  --out "$OUT/nvfp4-fwd" "${extra[@]}"
if [ "$CORES" -ge 2 ]; then
  status=0; wait "$MXFP8_PID" || status=$?
  trap - EXIT
  echo; echo "== the mxfp8 run ($OUT/mxfp8.log) =="; cat "$OUT/mxfp8.log"
  [ "$status" -eq 0 ] || { echo "demo: the mxfp8 pretraining run failed (exit $status)" >&2; exit "$status"; }
else
  "$FB" pretrain --config configs/tiny.toml --recipe mxfp8 --device cpu --threads 1 --out "$OUT/mxfp8" "${extra[@]}"
fi
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
