#!/usr/bin/env python3
"""One steady training step from kprof traces, and where two recipes' steps differ.

bench/kprof writes a trace of the last KPROF_TRACE_MS milliseconds of a run (KPROF_TRACE=FILE): one
line per GPU activity (start, duration, the idle gap before it, how long after its launch call it
started, its name) and the host's waits for the GPU. Run train_bench under it with --steps 1 and
the trace's last step lies between its last two cudaDeviceSynchronize waits (train_bench syncs
after the warm-up and after each timed step). For that step this prints its kernel count, its span
(first start to last end), the sum of the kernels' durations (more than the span where
programmatic dependent launches overlap a kernel with the one before), the idle gaps summed, and
for every trace after the first the kernels whose time a step differs most from the first's:
time, launch counts in both, name.

Usage: scripts/trace-step.py BASE_TRACE OTHER_TRACE [OTHER_TRACE ...] [--top 25]   (a trace may be gzipped: .gz)
       (on the device: CUDA_INJECTION64_PATH=build-dev/bench/libfourbit_kprof.so KPROF_OUT=k.json
        KPROF_TRACE=trace_mxfp8.txt KPROF_TRACE_MS=75 build-dev/bench/train_bench ... --warmup 2 --steps 1)
"""
import argparse
import collections
import gzip
import re
import sys


def last_step(path):
    """The activities (start ms, duration us, gap us, name) of the trace's last timed step."""
    acts, syncs = [], []
    with (gzip.open(path, 'rt') if path.endswith('.gz') else open(path)) as f:
        for line in f:
            if line.startswith('#'):
                continue
            cols = line.rstrip('\n').split('\t')
            if '[host waits:' in line:
                if 'cudaDeviceSynchronize' in line:
                    syncs.append(float(cols[0]) + float(cols[1]) / 1000.0)
                continue
            if len(cols) < 5:
                continue
            acts.append((float(cols[0]), float(cols[1]), float(cols[2] or 0.0), cols[4]))
    if len(syncs) < 2:
        sys.exit(f'{path}: fewer than two cudaDeviceSynchronize waits in the trace; run with --warmup 1 '
                 f'or more and a KPROF_TRACE_MS that covers a whole step')
    begin, end = syncs[-2], syncs[-1]
    return [a for a in acts if begin <= a[0] <= end]


def short(name):
    name = re.sub(r'fourbit::ops::cuda::', '', name)
    return re.sub(r'^void ', '', name)[:100]


def summary(path):
    step = last_step(path)
    if not step:
        sys.exit(f'{path}: no activity in the last step')
    by = collections.defaultdict(lambda: [0.0, 0])
    for _, dur, _, name in step:
        by[short(name)][0] += dur / 1000.0
        by[short(name)][1] += 1
    span = step[-1][0] + step[-1][1] / 1000.0 - step[0][0]
    busy = sum(a[1] for a in step) / 1000.0
    gaps = sum(a[2] for a in step[1:]) / 1000.0
    print(f'{path}: {len(step)} activities, span {span:.2f} ms, kernels summed {busy:.2f} ms, '
          f'idle gaps {gaps:.2f} ms')
    return by


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('traces', nargs='+')
    ap.add_argument('--top', type=int, default=25)
    args = ap.parse_args()
    base = summary(args.traces[0])
    for path in args.traces[1:]:
        other = summary(path)
        diffs = sorted(((other.get(k, [0.0, 0])[0] - base.get(k, [0.0, 0])[0], k) for k in set(base) | set(other)),
                       reverse=True)
        print(f'== {path} against {args.traces[0]} (ms a step, launches there / in the base)')
        shown = diffs[:args.top] + [d for d in diffs[-(args.top // 2):] if d not in diffs[:args.top]]
        for d, k in shown:
            print(f'  {d:+8.3f}  {other.get(k, [0, 0])[1]:5d} / {base.get(k, [0, 0])[1]:5d}  {k}')


if __name__ == '__main__':
    main()
