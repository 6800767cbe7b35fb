#!/usr/bin/env bash
# nvfp4-fwd vs mxfp8 in RL on the tiny model, from ONE shared SFT checkpoint: --seeds runs of
# each recipe plus an A/A pair (a second set of mxfp8 runs with other seeds), the final greedy
# held-out accuracy of each run, mean with 95% t intervals per set, wall-clock per step, into
# bench/results/rl_compare.{json,txt} (or --results DIR), with a plain sentence on whether a
# difference is visible.
#
#   scripts/rl-compare.sh [--build DIR] [--device cpu|cuda] [--parallel N] [--steps N] [--seeds N]
#                         [--init SFT_RUN] [--out DIR] [--results DIR]
#
# Without --init it first makes the shared checkpoint the way `make demo` does (pretrain
# configs/tiny.toml with nvfp4-fwd, then SFT). --parallel runs that many RL runs at once, each
# with (cores / N) CPU threads; on one GPU they share it. The RL settings are the demo's
# (RL_ARGS below); --steps overrides its length.
set -euo pipefail
BUILD=build DEVICE=cpu PARALLEL=1 STEPS=60 SEEDS=5 INIT="" OUT=runs/rl-compare RESULTS=bench/results
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --parallel) PARALLEL=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --seeds) SEEDS=$2; shift 2 ;;
    --init) INIT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --results) RESULTS=$2; shift 2 ;;
    *) echo "rl-compare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cpu|cuda) ;; *) echo "rl-compare.sh: --device cpu|cuda, got $DEVICE" >&2; exit 2 ;; esac
FB="$BUILD/fourbit"
# shellcheck source=scripts/rl-settings.sh
source "$(dirname "$0")/rl-settings.sh"
THREADS=$(( $(nproc) / PARALLEL )); [ "$THREADS" -ge 1 ] || THREADS=1
mkdir -p "$OUT" "$RESULTS"

if [ -z "$INIT" ]; then
  rm -rf "${OUT:?}/pretrain" "${OUT:?}/sft"
  echo "== the shared checkpoint: pretrain configs/tiny.toml (nvfp4-fwd), then SFT on $RL_TASK =="
  "$FB" pretrain --config configs/tiny.toml --recipe nvfp4-fwd --device "$DEVICE" --out "$OUT/pretrain"
  "$FB" sft --init "$OUT/pretrain" "${SFT_ARGS[@]}" --steps "$SFT_STEPS" --device "$DEVICE" --out "$OUT/sft"
  INIT="$OUT/sft"
fi

# One line per run: set recipe seed. Set B is the A/A control (mxfp8 again, other seeds).
jobs_file="$OUT/jobs.txt"
: > "$jobs_file"
for i in $(seq 1 "$SEEDS"); do
  echo "nvfp4-fwd nvfp4-fwd $i" >> "$jobs_file"
  echo "mxfp8 mxfp8 $i" >> "$jobs_file"
  echo "mxfp8-b mxfp8 $((100 + i))" >> "$jobs_file"
done
run_one() {  # set recipe seed
  local dir="$OUT/$1-seed$3"
  rm -rf "$dir"
  "$FB" rl --init "$INIT" --recipe "$2" --seed "$3" "${RL_ARGS[@]}" --steps "$STEPS" --device "$DEVICE" \
    --threads "$THREADS" --out "$dir" > "$dir.log" 2>&1 || { echo "failed: $dir (see $dir.log)" >&2; return 1; }
  echo "done: $dir"
}
export -f run_one
export FB INIT STEPS DEVICE THREADS OUT
export RL_ARGS_STR="${RL_ARGS[*]}"
t0=$(date +%s)
# xargs runs --parallel at once; each run's arguments are its line of jobs.txt.
xargs -P "$PARALLEL" -L 1 bash -c 'RL_ARGS=($RL_ARGS_STR); run_one "$@"' _ < "$jobs_file"
t1=$(date +%s)

python3 - "$OUT" "$RESULTS" "$INIT" "$DEVICE" "$PARALLEL" "$STEPS" "$((t1 - t0))" "${RL_ARGS[*]}" <<'PY'
import json, math, os, sys
out, results, init, device, parallel, steps, wall, rl_args = sys.argv[1:]
# two-sided 95% t quantiles, df 1..30
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
       2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
def stats(xs):
    n = len(xs); m = sum(xs) / n
    if n < 2: return m, float("nan"), float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = (T95[n - 2] if n - 1 <= 30 else 1.96) * sd / math.sqrt(n)
    return m, m - h, m + h
runs, sets = [], {}
for name in sorted(os.listdir(out)):
    d = os.path.join(out, name)
    if not (os.path.isdir(d) and "-seed" in name): continue
    summ = json.load(open(os.path.join(d, "summary.json")))
    lines = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl")) if l.strip()]
    first = next(l for l in lines if "init_eval_accuracy" in l)
    step_s = [l["sample_s"] + l["reward_s"] + l["fwd_bwd_s"] + l["optimizer_s"] + l.get("reference_s", 0) for l in lines]
    s, seed = name.rsplit("-seed", 1)
    r = {"set": s, "recipe": json.load(open(os.path.join(d, "config.json")))["recipe"], "seed": int(seed),
         "init_accuracy": first["init_eval_accuracy"], "final_accuracy": summ["final_eval"]["eval_accuracy"],
         "final_reward": lines[-1]["reward"], "step_s": sum(step_s) / len(step_s), "wall_s": summ["wall_s"],
         "logprob_mismatch_tokens": sum(l["logprob_mismatch_tokens"] for l in lines)}
    runs.append(r); sets.setdefault(s, []).append(r)
summary = {}
for s, rs in sets.items():
    m, lo, hi = stats([r["final_accuracy"] for r in rs])
    summary[s] = {"runs": len(rs), "final_accuracy_mean": m, "ci95": [lo, hi],
                  "step_s_mean": sum(r["step_s"] for r in rs) / len(rs),
                  "init_accuracy": rs[0]["init_accuracy"]}
def overlap(a, b):
    return not (summary[a]["ci95"][1] < summary[b]["ci95"][0] or summary[b]["ci95"][1] < summary[a]["ci95"][0])
diff = summary["nvfp4-fwd"]["final_accuracy_mean"] - summary["mxfp8"]["final_accuracy_mean"]
aa = summary["mxfp8-b"]["final_accuracy_mean"] - summary["mxfp8"]["final_accuracy_mean"]
visible = not overlap("nvfp4-fwd", "mxfp8") and abs(diff) > abs(aa)
sentence = (f"nvfp4-fwd minus mxfp8 final held-out accuracy: {diff*100:+.1f} points; the A/A pair (mxfp8 vs mxfp8, "
            f"other seeds) differs by {aa*100:+.1f} points. " +
            ("A difference is visible: the 95% intervals of nvfp4-fwd and mxfp8 do not overlap and the gap exceeds the A/A gap."
             if visible else
             "No difference is visible: the 95% intervals overlap or the gap is within what the A/A pair shows."))
doc = {"bench": "rl_compare", "init": init, "device": device, "parallel": parallel, "steps": int(steps),
       "rl_args": rl_args, "wall_s_all_runs": int(wall), "sets": summary, "runs": runs, "conclusion": sentence}
json.dump(doc, open(os.path.join(results, "rl_compare.json"), "w"), indent=2)
with open(os.path.join(results, "rl_compare.txt"), "w") as f:
    f.write(f"RL nvfp4-fwd vs mxfp8 from one SFT checkpoint ({init}), {steps} steps, device {device}, "
            f"{parallel} runs at once, {wall} s for all runs\nsettings: {rl_args}\n\n")
    f.write(f"{'set':10} {'recipe':10} {'seed':>5} {'init acc':>9} {'final acc':>10} {'final reward':>13} {'s/step':>8} {'mismatch':>9}\n")
    for r in runs:
        f.write(f"{r['set']:10} {r['recipe']:10} {r['seed']:5d} {r['init_accuracy']:9.3f} {r['final_accuracy']:10.3f} "
                f"{r['final_reward']:13.3f} {r['step_s']:8.3f} {r['logprob_mismatch_tokens']:9d}\n")
    f.write("\n")
    for s, v in summary.items():
        f.write(f"{s:10} n={v['runs']}  final accuracy {v['final_accuracy_mean']:.3f}  95% CI [{v['ci95'][0]:.3f}, "
                f"{v['ci95'][1]:.3f}]  {v['step_s_mean']:.3f} s/step\n")
    f.write("\n" + sentence + "\n")
print(open(os.path.join(results, "rl_compare.txt")).read())
PY
