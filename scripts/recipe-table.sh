#!/usr/bin/env bash
# Trains one config with every recipe and several seeds on one text and tabulates the final eval
# losses against fp32's (the comparator check of docs/benchmarks.md "Recipes against fp32").
# Usage: scripts/recipe-table.sh BUILD CONFIG TEXT OUT_JSON [--device D] [--seeds "1 2"]
#                                [--recipes "fp32 bf16 ..."] [--parallel N] [--runs DIR] [--steps N]
# --parallel N trains N runs at once (on one GPU they share it; each run stays deterministic).
# Run directories go under --runs (default /tmp/recipe-table; /dev/shm on the GPU machine, whose
# disk cannot hold ten gpu-small checkpoints); each run's checkpoints are deleted once its summary
# is read, so only metrics.jsonl and summary.json remain.
set -euo pipefail
BUILD=$1 CONFIG=$2 TEXT=$3 OUT_JSON=$4
shift 4
DEVICE=auto SEEDS="1 2" RECIPES="fp32 bf16 mxfp8 nvfp4-fwd nvidia-nvfp4" PARALLEL=1 RUNS=/tmp/recipe-table STEPS=""
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=$2; shift 2 ;;
    --seeds) SEEDS=$2; shift 2 ;;
    --recipes) RECIPES=$2; shift 2 ;;
    --parallel) PARALLEL=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    *) echo "recipe-table: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -f "$TEXT" ] || { echo "recipe-table: text file $TEXT not found" >&2; exit 2; }
mkdir -p "$RUNS"

train() {  # recipe seed
  local dir="$RUNS/$1-s$2"
  rm -rf "$dir"
  "$BUILD/fourbit" pretrain --config "$CONFIG" --recipe "$1" --seed "$2" --data "text:$TEXT" \
    --device "$DEVICE" ${STEPS:+--steps "$STEPS"} --set train.checkpoint_every=0 --out "$dir" > "$dir.log" 2>&1 \
    || { echo "recipe-table: $1 seed $2 failed:"; tail -5 "$dir.log"; return 1; }
  rm -rf "$dir/checkpoints"
}

jobs_running() { jobs -rp | wc -l; }
status=0
for s in $SEEDS; do
  for r in $RECIPES; do
    while [ "$(jobs_running)" -ge "$PARALLEL" ]; do wait -n || status=1; done
    train "$r" "$s" &
  done
done
while [ "$(jobs_running)" -gt 0 ]; do wait -n || status=1; done
[ $status -eq 0 ] || exit 1

python3 - "$RUNS" "$OUT_JSON" "$CONFIG" "$TEXT" "$SEEDS" $RECIPES <<'PY'
import hashlib, json, sys
runs, out_json, config, text, seeds, recipes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(), sys.argv[6:]
def metrics(r, s):
    return [json.loads(l) for l in open(f"{runs}/{r}-s{s}/metrics.jsonl")]
table = {}
for r in recipes:
    for s in seeds:
        sm = json.load(open(f"{runs}/{r}-s{s}/summary.json"))
        at20 = next((m for m in metrics(r, s) if m["step"] == 20), None)
        table.setdefault(r, {})[s] = {"final_eval_loss": sm["final_eval_loss"], "final_train_loss": sm["final_train_loss"],
                                      "tokens_per_s": sm["tokens_per_s"], "wall_s": sm["wall_s"],
                                      "step20_loss": at20 and at20["loss"], "step20_grad_norm": at20 and at20["grad_norm"]}
ref = "fp32" if "fp32" in table else recipes[0]
print(f"{'recipe':14s}" + "".join(f"  seed {s:>3s} eval  vs {ref}" for s in seeds))
for r in recipes:
    row = f"{r:14s}"
    for s in seeds:
        e = table[r][s]["final_eval_loss"]
        rel = e / table[ref][s]["final_eval_loss"] - 1
        table[r][s]["vs_" + ref] = rel
        row += f"  {e:14.4f}  {rel*100:+6.2f}%"
    print(row)
digest = hashlib.sha256(open(text, "rb").read()).hexdigest()
json.dump({"config": config, "text": text, "text_sha256": digest, "text_bytes": len(open(text, "rb").read()),
           "seeds": seeds, "reference": ref, "runs": table}, open(out_json, "w"), indent=1)
PY
