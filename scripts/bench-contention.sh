#!/usr/bin/env bash
# CPU training throughput of `make demo`'s run (configs/tiny.toml, nvfp4-fwd, 2048 tokens a step,
# whole-command tokens/s) alone and with busy-loop competitors on all cores but one (whatever
# else the machine runs is in both: compare the columns, not other days' numbers), under each way the
# OpenMP threads can wait: passive (what fourbit sets for itself), spinning (libgomp's default,
# GOMP_SPINCOUNT=300000: what fourbit did before) and one thread. Prints a table and writes
# bench/results/cpu_contention.json. Usage: scripts/bench-contention.sh [BUILD] (STEPS=8, REPS=3;
# SPIN=0 leaves out the spinning row, which is slow under load; BEFORE=/path/to/an/older/fourbit
# adds that binary's default behaviour as one more row).
set -euo pipefail
BUILD=${1:-build}
STEPS=${STEPS:-8}
REPS=${REPS:-3}
FB="$BUILD/fourbit"
OUT=bench/results/cpu_contention.json
work=$(mktemp -d)
busy_pids=()
cleanup() {
  for p in "${busy_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# tokens/s of one run over the whole command (start-up, data set-up and the end included), from
# the wall clock around it: the same measure for any fourbit binary, old or new. The config is
# the demo's with evaluation off, so only training steps are timed beyond the set-up.
sed 's/^eval_batches = .*/eval_batches = 0/' configs/tiny.toml > "$work/tiny.toml"
one_run() {  # binary, env assignments...
  local bin=$1; shift
  rm -rf "$work/run"
  local t0 t1
  t0=$(date +%s.%N)
  env "$@" "$bin" pretrain --config "$work/tiny.toml" --recipe nvfp4-fwd --device cpu --steps "$STEPS" \
    --out "$work/run" >/dev/null 2>&1
  t1=$(date +%s.%N)
  python3 -c "import sys; print($STEPS * 16 * 128 / ($t1 - $t0))"
}

median_of() {  # label, binary, env...
  local vals=()
  for _ in $(seq "$REPS"); do vals+=("$(one_run "$@")"); done
  printf '%s\n' "${vals[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'
}

start_busy() {
  local n=$(( $(nproc) - 1 )); [ "$n" -lt 1 ] && n=1
  for _ in $(seq "$n"); do sh -c 'while :; do :; done' & busy_pids+=($!); done
}
stop_busy() {
  for p in "${busy_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  busy_pids=()
}

declare -A result
rows=("passive:$FB:")
[ "${SPIN:-1}" != 0 ] && rows+=("spin:$FB:GOMP_SPINCOUNT=300000")
rows+=("1 thread:$FB:OMP_NUM_THREADS=1")
[ -n "${BEFORE:-}" ] && rows+=("before (its default):$BEFORE:")
for load in alone competing; do
  [ "$load" = competing ] && start_busy
  for row in "${rows[@]}"; do
    IFS=: read -r label bin envs <<<"$row"
    result["$load/$label"]=$(median_of "$bin" ${envs:+$envs})
  done
  stop_busy
done

printf '\n%-22s %14s %14s %16s\n' "threads wait" "alone tok/s" "competing tok/s" "alone/competing"
json="{\"config\": \"configs/tiny.toml with eval_batches = 0\", \"recipe\": \"nvfp4-fwd\", \"steps\": $STEPS, \"reps\": $REPS, \"nproc\": $(nproc), \"measure\": \"whole-command tokens/s, median of reps\", \"load_average_at_end\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"rows\": ["
sep=""
for row in "${rows[@]}"; do
  IFS=: read -r label _ _ <<<"$row"
  i=${result["alone/$label"]}; b=${result["competing/$label"]}
  printf '%-22s %14.0f %14.0f %16.2f\n' "$label" "$i" "$b" "$(python3 -c "print($i / $b)")"
  json+="$sep{\"wait\": \"$label\", \"alone_tokens_per_s\": $i, \"competing_tokens_per_s\": $b}"
  sep=", "
done
mkdir -p bench/results
echo "$json]}" | python3 -m json.tool > "$OUT"
echo "wrote $OUT"
