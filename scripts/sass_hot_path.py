#!/usr/bin/env python3
"""SASS instructions one thread issues on a kernel's hot path, read from `nvdisasm -gi` (line info
with inline chains) of a cubin of quantize.cu (which includes the kernels of ops/cuda/cast/), and
where they come from (innermost source function; source files found by name in ops/cuda,
ops/cuda/cast and numerics/). Hot path: cold blocks (a CALL, or mostly code of the rare paths named per kernel
below) are never taken, a branch whose successors are both hot falls through (a guard's body),
and an inner loop is left after one pass.

  nvcc <quantize.cu's flags from `ninja -t commands`> -cubin -o /tmp/q.cubin src/fourbit/ops/cuda/quantize.cu
  scripts/sass_hot_path.py /tmp/q.cubin RUNS FOS METRIC [--trace] [--by-function]
      nvfp4_row_fast_kernel<RUNS, FOS, METRIC>: RUNS 1 or 2, FOS 0 or 1, METRIC 0 (MSE) or 1 (MAE);
      one iteration of the row-group loop, every block finite (no generic fallback, no
      non-finite recount), the division fast paths, the next group's prefetch taken.
  scripts/sass_hot_path.py /tmp/q.cubin mxfp8_row_sr|mxfp8_col_sr EXP_BITS [--trace] [--by-function]
      mxfp8_row_fast_kernel<EXP_BITS, SR> / mxfp8_col_fast_kernel<EXP_BITS, SR> (EXP_BITS 4: E4M3,
      5: E5M2), entry to EXIT: one block of 32 finite values, none below the element's smallest
      normal (the SR encode's general form is cold), no report. Per element = count / 32.
  scripts/sass_hot_path.py /tmp/q.cubin requantize_transposed [--trace] [--by-function] [--by-line]
      requantize_transposed_kernel, entry to EXIT: a whole tile (two NVFP4 blocks a row in one
      16-byte load), every decoded value finite, no value below E4M3's smallest normal (the SR
      encode's general form is cold). A thread decodes 32 values and encodes 32: per element =
      count / 32.
nvdisasm from $NVDISASM or PATH."""
import os, re, subprocess, sys
from collections import Counter

args = [a for a in sys.argv[1:] if not a.startswith('--')]
trace, by_function, by_line = '--trace' in sys.argv, '--by-function' in sys.argv, '--by-line' in sys.argv
cubin = args[0]
here = os.path.dirname(os.path.abspath(__file__))
src_dir = os.path.join(here, '..', 'src/fourbit')

# Per kernel: mangled-name suffix, elements per counted path, loop (one iteration) or straight
# (entry to EXIT), and the cold source: (file, first-line substring, last-line substring or None)
# marks those lines (a one-line match, or the range from the first match to the next match of
# the second); "file>marker" marks every line after the one holding marker, and a bare file name
# the whole file.
if args[1] == 'requantize_transposed':
    key, per, mode = 'requantize_transposed_kernelENS2_13RequantParams', 32, 'straight'
    RQ = 'requantize_transposed.cuh'
    cold_spec = [
        (RQ, 'for (int b = 0; b < 2; ++b) {  // unrolled: words stays', 'words[2 * b] = uint32_t(packed)'),
        (RQ, 'for (int jj = 0; jj < kReqCols; ++jj) dst[jj * kReqRs] = 0.0f;', None),
        (RQ, '} else {  // |S_dec| >= 2^120', 'num::nvfp4_dequant('),
        (RQ, 'a = finite_amax_counting(v, nonfinite);', 'Rounding::SR, p.seed'),
        ('fast_common.cuh', 'w[q] = mxfp8_sr_word<kExpBits, true>(y, q, r);', None),
        (RQ, '// a value below E4M3\'s smallest normal (rare)', 'mxfp8_sr_block<4>(x, num::pow2f(127'),
        ('cast_common.cuh', 'if (values) atomicAdd', 'if (chose_four) atomicAdd'),
        ('fast_quant.h', 'static FOURBIT_HD uint32_t code_wide(', 'return code > uint32_t(kMaxCode)'),
        'minifloat.h', 'mxfp8.h',
    ]
    label = 'requantize_transposed_kernel'
    cold_sass = []
elif args[1] in ('mxfp8_row_sr', 'mxfp8_col_sr'):
    exp_bits = args[2]
    kernel = 'mxfp8_row_fast_kernel' if args[1] == 'mxfp8_row_sr' else 'mxfp8_col_fast_kernel'
    key, per, mode = f'{kernel}ILi{exp_bits}ELb1EE', 32, 'straight'
    cold_spec = [
        ('fast_common.cuh', 'a = finite_amax_counting(v, nonfinite);', 'index0, w);'),
        ('fast_common.cuh', 'w[q] = mxfp8_sr_word<kExpBits, true>(y, q, r);', None),
        ('fast_common.cuh', 'const uint8_t scale = num::mxfp8_quantize_block(copy, n, amax, elem, rule', None),
        ('cast_common.cuh', 'values = __reduce_add_sync', 'if (chose_four) atomicAdd'),
        ('fast_quant.h', 'static FOURBIT_HD uint32_t code_wide(', 'return code > uint32_t(kMaxCode)'),
        ('mxfp8.h', 'FOURBIT_HD uint8_t mxfp8_quantize_block(', 'return scale;'),
        'minifloat.h',
    ]
    label = f'{kernel}<{exp_bits}, SR>'
    cold_sass = []
else:
    runs, fos, metric = int(args[1]), args[2], args[3]
    key = f'nvfp4_row_fast_kernelILi{runs}ELb{fos}ELNS_3num11ScaleMetricE{metric}EEEvNS2_13FastRowParamsE'
    per, mode = 16 * runs, 'loop'
    # the non-finite recount, the generic fallback block, the prefetch of warps whose runs reach
    # past the row's end (the bench's rows are whole), the generic quantizer
    cold_spec = [
        ('nvfp4_row_fast.cuh', 'finite_amax_counting(v[k], nonfinite)', None),
        ('nvfp4_row_fast.cuh', 'copy[i] = v[k][i]', None),
        ('nvfp4_row_fast.cuh', 'out = num::nvfp4_quantize_block(copy', None),
        ('nvfp4_row_fast.cuh', 'prefetch_run<B>(half(h) + k * kFastRunBlocks * B, xrow', None),
        'minifloat.h', 'nvfp4.h>// s_b = E4M3_rne_satfinite',
    ]
    # the clamped Four Over Six quantizer (runs holding a subnormal block scale, see fos_bounded):
    # ptxas gives most of its lines to the unclamped copy's, so it is told by its clamp at
    # 6 * 2^-104 (FosCandidate::code22), which no other code has
    cold_sass = [r'FMNMX R\d+, \|R\d+\|, 2\.958228394']
    label = f'nvfp4_row_fast_kernel<{runs}, fos={fos}, metric={"MSE" if metric == "0" else "MAE"}>'

NVD = os.environ.get('NVDISASM', 'nvdisasm')
txt = subprocess.run([NVD, '-gi', cubin], capture_output=True, text=True).stdout
sec = None
for m in re.finditer(r'^\.text\.(\S+):', txt, re.M):
    if key in m.group(1):  # the mangled name holds it
        s = m.end()
        ends = [x for x in (txt.find('\n.section', s), txt.find('\n.text.', s)) if x > 0]
        sec = txt[s:min(ends) if ends else len(txt)]
        break
if sec is None: raise SystemExit(f'no kernel named like {key} in {cubin}')

sources = {}
def lines_of(fname):  # a source file by its base name, as nvdisasm's line info gives it
    if fname not in sources:
        dirs = [os.path.join(src_dir, d) for d in ('ops/cuda', 'ops/cuda/cast', 'numerics')]
        path = next((os.path.join(d, fname) for d in dirs if os.path.exists(os.path.join(d, fname))), None)
        sources[fname] = open(path).read().split('\n') if path else []
    return sources[fname]
cold_lines, cold_after, cold_files = set(), {}, set()
for spec in cold_spec:
    if isinstance(spec, str):
        if '>' in spec:
            f, marker = spec.split('>', 1)
            hits = [i for i, l in enumerate(lines_of(f)) if marker in l]
            if not hits: raise SystemExit(f'cold marker not found in {f}: {marker!r}')
            cold_after[f] = hits[0] + 1  # the marker's line number (1-based): the lines after it
        else:
            cold_files.add(spec)
        continue
    f, first, last = spec
    src = lines_of(f)
    hits = [i for i, l in enumerate(src) if first in l]
    if not hits: raise SystemExit(f'cold marker not found in {f}: {first!r}')
    found = False
    for i in hits:  # a range ends within 30 lines of its start (another use of the first line
        j = i       # elsewhere in the file is not a range)
        if last is not None:
            j = next((k for k in range(i, min(i + 30, len(src))) if last in src[k]), None)
            if j is None: continue
        found = True
        cold_lines.update((f, k + 1) for k in range(i, j + 1))
    if not found: raise SystemExit(f'cold range end not found in {f}: {last!r}')

ins, labels, chain, fresh = [], {}, [], True
for l in sec.split('\n'):
    m = re.match(r'\s*//## File "([^"]+)", line (\d+)', l)
    if m:
        if fresh: chain, fresh = [], False
        # the inline chain, innermost first: 'File A, line x inlined at B, line y ...'
        chain.append(tuple((f.split('/')[-1], int(n)) for f, n in re.findall(r'"([^"]+)", line (\d+)', l)))
        continue
    m = re.match(r'^(\.L_x_\d+|\$[^:]+):', l)
    if m: labels[m.group(1)] = len(ins); continue
    m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*$', l)
    if m:
        frames = tuple(fr for c in chain for fr in c)
        ins.append((int(m.group(1), 16), m.group(2), frames, chain[0][0] if chain else ('?', 0)))
        fresh = True

def cold(i):
    a, t, frames, inner = ins[i]
    if 'CALL' in t: return True
    for f, ln in frames:
        if f in cold_files or (f, ln) in cold_lines: return True
        if f in cold_after and ln > cold_after[f]: return True
    return False
lead = {0}
for i, (a, t, c, _) in enumerate(ins):
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
def is_cold_block(s, e):  # a CALL or a cold instruction, or mostly cold code (merge points share a few lines)
    real = [i for i in range(s, e) if not re.match(r'(BSYNC|BSSY|NOP)\b', ins[i][1])]
    if any('CALL' in ins[i][1] or any(re.search(p, ins[i][1]) for p in cold_sass) for i in real): return True
    return bool(real) and 2 * sum(cold(i) for i in real) > len(real)
coldblk = [is_cold_block(s, e) for (s, e) in blocks]

if mode == 'loop':  # the backward branch spanning the most blocks, among those reachable
    reach, todo = set(), [0]
    while todo:
        k = todo.pop()
        if k not in reach:
            reach.add(k)
            todo += succ(k)
    back, head = max(((k, x) for k in reach for x in succ(k) if x <= k), key=lambda p: p[0] - p[1])
else:
    back, head = None, 0
k, path, seen = head, [], {}
while True:
    s, e = blocks[k]
    path += range(s, e)
    if k == back: break
    ss = succ(k)
    if not ss and mode == 'straight': break
    hot = [x for x in ss if not coldblk[x]]
    if not hot and mode == 'straight' and re.search(r'\bEXIT\b', ins[e - 1][1]): break  # @P EXIT, then cold code
    if not hot: raise SystemExit(f'no hot successor of block {k}')
    nk = max(hot) if min(hot) <= k else hot[0]  # leave inner loops; else fall through
    seen[k] = seen.get(k, 0) + 1
    if seen[k] > 2: raise SystemExit(f'stuck in a loop at block {k}')
    if trace: print(f'block {k} @{ins[s][0]:#x} n={e-s} -> {[(x, coldblk[x]) for x in ss]} took {nk}')
    k = nk
count = len(path)
if by_function:
    # innermost source function of each instruction: the nearest line above it that opens one
    fn_re = re.compile(r'^\s*(?:template\s*<.*>\s*)?(?:static\s+)?(?:FOURBIT_HD|__device__|__global__)[^;=]*?\b(\w+)\s*\(')
    def func(f, ln):
        src = lines_of(f)
        for i in range(min(ln, len(src)) - 1, -1, -1):
            m = fn_re.match(src[i])
            if m: return f'{m.group(1)} ({f})'
        return f
    by = Counter(func(*ins[i][3]) for i in path)
    ops = Counter(ins[i][1].split()[0].lstrip('@!P0123456789T ').split('.')[0] if not ins[i][1].startswith('@')
                  else ins[i][1].split()[1].split('.')[0] for i in path)
    for f, n in by.most_common(): print(f'  {n:5d} {n / per:6.2f}/elem  {f}')
    print('  opcodes: ' + ', '.join(f'{o} {n}' for o, n in ops.most_common()))
if by_line:  # innermost source line of each instruction
    for (f, ln), n in sorted(Counter(ins[i][3] for i in path).items(), key=lambda p: -p[1]):
        print(f'  {n:5d} {f}:{ln}: {lines_of(f)[ln - 1].strip() if 0 < ln <= len(lines_of(f)) else ""}')
print(f'{label}: {count} SASS instructions per {"loop iteration" if mode == "loop" else "thread"} '
      f'on the hot path, {count / per:.2f} per element')
