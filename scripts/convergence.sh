#!/usr/bin/env bash
# `make convergence`: train configs/tiny.toml for its 300 steps with every recipe on the CPU and
# check the issue's claims: each recipe's final eval loss far below the corpus's unigram entropy
# (< 0.75 of it), and nvfp4-fwd within 3% of mxfp8 and of bf16. About 10 minutes on 2 cores.
set -euo pipefail
BUILD=${1:-build}
OUT=${CONVERGENCE_OUT:-runs/convergence}
recipes=(fp32 bf16 mxfp8 nvfp4-fwd nvidia-nvfp4)
# One run per core at a time, one thread each (the runs are independent; their results do not
# depend on the thread count).
JOBS=$(nproc)
mkdir -p "$(dirname "$OUT")"
pids=()
for r in "${recipes[@]}"; do
  rm -rf "${OUT:?}/$r"  # this script's own runs: replaced on every call
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
  "$BUILD/fourbit" pretrain --config configs/tiny.toml --recipe "$r" --device cpu --threads 1 --out "$OUT/$r" \
    > "$OUT.$r.log" 2>&1 &
  pids+=("$!")
done
for i in "${!recipes[@]}"; do
  wait "${pids[$i]}" || { echo "convergence: ${recipes[$i]} failed (see $OUT.${recipes[$i]}.log)"; exit 1; }
done
"$BUILD/fourbit" summary "${recipes[@]/#/$OUT/}"
python3 - "$OUT" "${recipes[@]}" <<'PY'
import json, sys
out, recipes = sys.argv[1], sys.argv[2:]
s = {r: json.load(open(f"{out}/{r}/summary.json")) for r in recipes}
ok = True
for r, j in s.items():
    ratio = j["final_eval_loss"] / j["unigram_entropy_nats"]
    good = ratio < 0.75
    ok &= good
    print(f"{r:13s} eval {j['final_eval_loss']:.4f}  unigram {j['unigram_entropy_nats']:.4f}  ratio {ratio:.3f}  {'ok' if good else 'NOT far below unigram'}")
nv = s["nvfp4-fwd"]["final_eval_loss"]
for ref in ("mxfp8", "bf16"):
    rel = nv / s[ref]["final_eval_loss"] - 1
    good = abs(rel) <= 0.03
    ok &= good
    print(f"nvfp4-fwd vs {ref}: {rel*100:+.2f}%  {'ok' if good else 'outside 3%'}")
json.dump({r: {k: j[k] for k in ("final_eval_loss", "final_train_loss", "unigram_entropy_nats", "tokens_per_s", "wall_s")} for r, j in s.items()},
          open(f"{out}/convergence.json", "w"), indent=1)
sys.exit(0 if ok else 1)
PY
