#!/usr/bin/env bash
# The RL result of issue 13 on configs/tiny.toml, measured: pretrain (nvfp4-fwd, or --pretrain RUN
# to reuse one) -> SFT -> RL with the settings of scripts/rl-settings.sh, greedy held-out accuracy
# before and after RL, each phase's wall time, the machine's load while it ran, and a same-seed
# check (the RL phase twice for --check-steps steps: equal metrics minus timing fields, equal
# samples). Writes bench/results/rl_tiny.{json,txt} (or --results DIR).
#
#   scripts/rl-tiny.sh [--build DIR] [--pretrain RUN] [--rl-steps N] [--threads N] [--check-steps N]
#                      [--out DIR] [--results DIR]
set -euo pipefail
BUILD=build PRETRAIN="" RL_STEPS=100 THREADS=1 CHECK_STEPS=5 OUT=runs/rl-tiny RESULTS=bench/results
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --pretrain) PRETRAIN=$2; shift 2 ;;
    --rl-steps) RL_STEPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --check-steps) CHECK_STEPS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --results) RESULTS=$2; shift 2 ;;
    *) echo "rl-tiny.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
FB="$BUILD/fourbit"
# shellcheck source=scripts/rl-settings.sh
source "$(dirname "$0")/rl-settings.sh"
mkdir -p "$OUT" "$RESULTS"
: > "$OUT/phases.tsv"
# uptime every 15 s while the phases run: the load they shared the machine with
( while :; do echo "$(date +%s) $(uptime)"; sleep 15; done ) > "$OUT/uptime.log" &
UPTIME_PID=$!
trap 'kill $UPTIME_PID 2>/dev/null || true' EXIT
phase() {  # name command...: runs it, appends name, wall seconds and the command line
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  "$@" > "$OUT/$name.log" 2>&1
  printf '%s\t%.1f\t%s\n' "$name" "$(echo "$(date +%s.%N) - $t0" | bc)" "$*" >> "$OUT/phases.tsv"
}
if [ -z "$PRETRAIN" ]; then
  rm -rf "${OUT:?}/pretrain"
  phase pretrain "$FB" pretrain --config configs/tiny.toml --recipe nvfp4-fwd --device cpu --threads "$THREADS" \
    --out "$OUT/pretrain"
  PRETRAIN="$OUT/pretrain"
fi
rm -rf "${OUT:?}/sft" "${OUT:?}/rl" "${OUT:?}/check-a" "${OUT:?}/check-b"
phase sft "$FB" sft --init "$PRETRAIN" "${SFT_ARGS[@]}" --steps "$SFT_STEPS" --device cpu --threads "$THREADS" --out "$OUT/sft"
phase rl "$FB" rl --init "$OUT/sft" "${RL_ARGS[@]}" --steps "$RL_STEPS" --device cpu --threads "$THREADS" --out "$OUT/rl"
for c in check-a check-b; do
  phase "$c" "$FB" rl --init "$OUT/sft" "${RL_ARGS[@]}" --steps "$CHECK_STEPS" --device cpu \
    --threads "$THREADS" --out "$OUT/$c"
done
kill $UPTIME_PID 2>/dev/null || true

python3 - "$OUT" "$RESULTS" "$PRETRAIN" <<'PY'
import json, os, sys
out, results, pretrain = sys.argv[1:]
phases = []
for line in open(os.path.join(out, "phases.tsv")):
    name, wall, cmd = line.rstrip("\n").split("\t")
    phases.append({"phase": name, "wall_s": float(wall), "command": "fourbit " + cmd.split("/fourbit ", 1)[-1]})
def lines(run, f="metrics.jsonl"):
    return [json.loads(l) for l in open(os.path.join(out, run, f)) if l.strip()]
TIMING = {"sample_s", "reward_s", "reference_s", "fwd_bwd_s", "optimizer_s", "sampled_tokens_per_s"}
strip = lambda ls: [{k: v for k, v in l.items() if k not in TIMING} for l in ls]
same_metrics = strip(lines("check-a")) == strip(lines("check-b"))
same_samples = open(os.path.join(out, "check-a", "samples.jsonl"), "rb").read() == \
    open(os.path.join(out, "check-b", "samples.jsonl"), "rb").read()
rl = lines("rl")
sft_eval = [l for l in lines("sft") if "eval_accuracy" in l]
before = rl[0]["init_eval_accuracy"]
acc = {0: before}
acc.update({l["step"]: l["eval_accuracy"] for l in rl if "eval_accuracy" in l})
after = rl[-1]["eval_accuracy"]
loads = [float(l.split("load average:")[1].split(",")[0]) for l in open(os.path.join(out, "uptime.log"))]
cfg = json.load(open(os.path.join(out, "rl", "config.json")))
doc = {
    "bench": "rl_tiny",
    "pretrain": pretrain,
    "phases": phases,
    "eval_problems": cfg["source"]["eval_problems"],
    "sft_eval_accuracy": {str(l["step"]): l["eval_accuracy"] for l in sft_eval},
    "accuracy_before_rl": before,
    "accuracy_after_rl": after,
    "gain_points": round((after - before) * 100, 1),
    "best_accuracy": max(acc.values()),
    "eval_accuracy_curve": {str(k): v for k, v in acc.items()},
    "reward_curve": [l["reward"] for l in rl],
    "zero_variance_groups": [l["zero_variance_groups"] for l in rl],
    "updated": [l.get("updated", True) for l in rl],
    "weight_codes_changed": [l.get("weight_codes_changed") for l in rl],
    "logprob_mismatch_tokens": [l["logprob_mismatch_tokens"] for l in rl],
    "step_s": [round(l["sample_s"] + l["reward_s"] + l["fwd_bwd_s"] + l["optimizer_s"], 3) for l in rl],
    # where an RL step's time goes, summed over the run (the issue asks for the sampling share)
    "time_split_s": {k: round(sum(l.get(k, 0.0) for l in rl), 2)
                     for k in ("sample_s", "reward_s", "reference_s", "fwd_bwd_s", "optimizer_s")},
    "same_seed_same_metrics": same_metrics,
    "same_seed_same_samples": same_samples,
    "load_average_1min": {"min": min(loads), "max": max(loads), "mean": round(sum(loads) / len(loads), 2)},
    "uptime_samples": [l.strip() for l in open(os.path.join(out, "uptime.log"))][:: max(1, len(loads) // 12)],
}
json.dump(doc, open(os.path.join(results, "rl_tiny.json"), "w"), indent=2)
with open(os.path.join(results, "rl_tiny.txt"), "w") as f:
    ok = doc["gain_points"] >= 25
    f.write(f"RL on configs/tiny.toml (nvfp4-fwd), task {cfg['source']['task']}: greedy held-out accuracy "
            f"{before:.3f} -> {after:.3f} ({doc['gain_points']:+.1f} points; best {doc['best_accuracy']:.3f}) on "
            f"{doc['eval_problems']} problems -- target (+25 points) {'MET' if ok else 'NOT met'}\n\n")
    f.write(f"pretrain: {pretrain}\n")
    for p in phases:
        f.write(f"  {p['phase']:8} {p['wall_s']:7.1f} s  {p['command']}\n")
    f.write(f"\nSFT held-out accuracy by step: {doc['sft_eval_accuracy']}\n\n")
    f.write("step  reward  zero_var  updated  eval_acc  codes_changed  mismatch  step_s\n")
    f.write(f"   0       -         -        -   {before:7.3f}\n")
    for l, s in zip(rl, doc["step_s"]):
        ev = f"{l['eval_accuracy']:7.3f}" if "eval_accuracy" in l else "       "
        f.write(f"{l['step']:4d}  {l['reward']:6.3f}  {l['zero_variance_groups']:8d}  {str(l.get('updated', True)):>7}  "
                f"{ev}  {l.get('weight_codes_changed', 0):13.4f}  {l['logprob_mismatch_tokens']:8d}  {s:6.2f}\n")
    f.write(f"\nlogprob_mismatch_tokens: {sum(doc['logprob_mismatch_tokens'])} over all steps\n")
    split = doc["time_split_s"]
    total = sum(split.values()) or 1.0
    f.write("RL step time: " + ", ".join(f"{k[:-2]} {v:.1f} s ({100 * v / total:.0f}%)" for k, v in split.items() if v)
            + "\n")
    f.write(f"same seed, RL phase twice ({len(lines('check-a'))} steps): metrics minus timing "
            f"{'equal' if same_metrics else 'DIFFER'}, samples.jsonl {'equal' if same_samples else 'DIFFER'}\n")
    la = doc["load_average_1min"]
    f.write(f"machine: {os.cpu_count()} cores, 1-min load average {la['min']}..{la['max']} (mean {la['mean']}) "
            f"while the phases ran (uptime every 15 s in {out}/uptime.log)\n")
print(open(os.path.join(results, "rl_tiny.txt")).read())
PY
