#!/usr/bin/env python3
"""SASS instructions one thread issues per iteration of nvfp4_row_fast_kernel's row-group loop on
the hot path: every block finite (no generic fallback, no non-finite recount), the division fast
paths (no slow-path CALL), the next group's prefetch taken, the team max's loop left after one
pass. Read from `nvdisasm -gi` (line info with inline chains) of a cubin of quantize.cu; blocks
mostly made of nvfp4.h past nvfp4_s_dec or of minifloat.h (the generic quantizer) are the cold ones.

  nvcc <quantize.cu's flags from `ninja -t commands`> -cubin -o /tmp/q.cubin src/fourbit/ops/cuda/quantize.cu
  scripts/sass_hot_path.py /tmp/q.cubin RUNS FOS METRIC [QUANTIZE_CU] [--trace]
      RUNS 1 or 2, FOS 0 or 1, METRIC 0 (MSE) or 1 (MAE); nvdisasm from $NVDISASM or PATH."""
import os, re, subprocess, sys
args = [a for a in sys.argv[1:] if not a.startswith('--')]
cubin, runs, fos, metric = args[0], int(args[1]), args[2], args[3]
src_path = args[4] if len(args) > 4 else os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'src/fourbit/ops/cuda/quantize.cu')
trace = '--trace' in sys.argv
NVD = os.environ.get('NVDISASM', 'nvdisasm')
txt = subprocess.run([NVD, '-gi', cubin], capture_output=True, text=True).stdout
key = f'nvfp4_row_fast_kernelILi{runs}ELb{fos}ELNS_3num11ScaleMetricE{metric}EEEvNS2_13FastRowParamsE'
sec = None
for m in re.finditer(r'^\.text\.(\S+):', txt, re.M):
    if m.group(1).endswith(key):
        s = m.end()
        ends = [x for x in (txt.find('\n.section', s), txt.find('\n.text.', s)) if x > 0]
        sec = txt[s:min(ends) if ends else len(txt)]
        break
src = open(src_path).read().split('\n')
def line_of(pat): return [i + 1 for i, l in enumerate(src) if pat in l]
# quantize.cu lines of the rare paths: the non-finite recount and the generic fallback block
# and the prefetch of warps whose runs reach past the row's end (the bench's rows are whole)
cold_q = set(line_of('finite_amax_counting(v[k], nonfinite)') + line_of('copy[i] = v[k][i]') +
             line_of('out = num::nvfp4_quantize_block(copy') +
             line_of('prefetch_run<B>(b + k * kFastRunBlocks * B, xrow'))
ins, labels, chain, fresh = [], {}, [], True
for l in sec.split('\n'):
    m = re.match(r'\s*//## File "([^"]+)", line (\d+)', l)
    if m:
        if fresh: chain, fresh = [], False
        chain.append((m.group(1).split('/')[-1], int(m.group(2))))
        continue
    m = re.match(r'^(\.L_x_\d+|\$[^:]+):', l)
    if m: labels[m.group(1)] = len(ins); continue
    m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*$', l)
    if m:
        ins.append((int(m.group(1), 16), m.group(2), tuple(chain)))
        fresh = True
# Cold code: the generic block quantizer (nvfp4.h past nvfp4_s_dec, minifloat.h), the non-finite
# recount, the division slow paths (CALL).
def cold(i):
    a, t, c = ins[i]
    if 'CALL' in t: return True
    for f, ln in c:
        if f == 'minifloat.h': return True
        if f == 'nvfp4.h' and ln > 24: return True
        if f == 'quantize.cu' and ln in cold_q: return True
    return False
lead = {0}
for i, (a, t, c) in enumerate(ins):
    if re.search(r'\b(BRA|EXIT|RET|CALL\.\S+|BRX)\b', t): lead.add(i + 1)
for v in labels.values(): lead.add(v)
lead = sorted(x for x in lead if x < len(ins))
blk_of, blocks = {}, []
for k, s in enumerate(lead):
    e = lead[k + 1] if k + 1 < len(lead) else len(ins)
    blocks.append((s, e))
    for i in range(s, e): blk_of[i] = k
def succ(k):
    s, e = blocks[k]
    t = ins[e - 1][1]
    m = re.search(r'\bBRA\b.*`\((\.L_x_\d+)\)', t)
    if re.match(r'(@\S+ )?BRA\.DIV\b', t):  # taken only by a diverged warp: not the hot path
        out = [k + 1]
    elif m:
        tgt = blk_of[labels[m.group(1)]]
        out = [k + 1, tgt] if t.startswith('@') else [tgt]
    elif re.search(r'\b(EXIT|RET)\b', t) and not t.startswith('@'): out = []
    else: out = [k + 1]
    return [x for x in out if x < len(blocks)]
def is_cold_block(s, e):  # a CALL, or mostly generic code (merge points share a few lines)
    real = [i for i in range(s, e) if not re.match(r'(BSYNC|BSSY|NOP)\b', ins[i][1])]
    if any('CALL' in ins[i][1] for i in real): return True
    return bool(real) and 2 * sum(cold(i) for i in real) > len(real)
coldblk = [is_cold_block(s, e) for (s, e) in blocks]
# the row-group loop: the backward branch spanning the most blocks, among those reachable
reach, todo = set(), [0]
while todo:
    k = todo.pop()
    if k not in reach:
        reach.add(k)
        todo += succ(k)
back, head = max(((k, x) for k in reach for x in succ(k) if x <= k),
                 key=lambda p: p[0] - p[1])
k, count, seen = head, 0, {}
while True:
    s, e = blocks[k]
    count += e - s
    if k == back: break
    ss = succ(k)
    hot = [x for x in ss if not coldblk[x]]
    if not hot: raise SystemExit(f'no hot successor of block {k}')
    nk = max(hot) if min(hot) <= k else hot[0]  # leave inner loops; else fall through
    seen[k] = seen.get(k, 0) + 1
    if seen[k] > 2: raise SystemExit(f'stuck in a loop at block {k}')
    if trace: print(f'block {k} @{ins[s][0]:#x} n={e-s} -> {[(x, coldblk[x]) for x in ss]} took {nk}')
    k = nk
print(f'nvfp4_row_fast_kernel<{runs}, fos={fos}, metric={"MSE" if metric == "0" else "MAE"}>: '
      f'{count} SASS instructions per loop iteration on the hot path, {count / (16 * runs):.2f} per element')
