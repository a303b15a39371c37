"""What kernel boundaries cost a decode step, apart from any GEMV's arithmetic: the int4 g32 step's weight
bytes (Llama-2-7B: per layer wqkv, wo, w13, w2 at 4.5 bits a weight, 32 layers) read by plain streaming
kernels that only sum what they load, in three structures:

  chain      one launch a GEMV, each program loading one block before the PDL wait (as cuda_kernels.int4_gemv does)
  chain-nopdl  the same without programmatic dependent launch
  persistent one launch a step: programs resident on every SM take the GEMVs in turn, with a grid-wide wait
             (an atomic count) between them; with --prefetch, each program's first block of the next GEMV
             loads before that wait

Each GEMV's result depends on the one before (a value read after the wait), as in decode. Timed as CUDA graph
replays, against the copy ceiling (bench.copy_bandwidth). If the chain comes near the ceiling, the int4 step's
distance from it is inside its kernels, not between them; the persistent rows bound what carrying the
GEMVs across grid-wide waits (one program structure for a whole step) could gain.

    python benchmarks/boundaries.py [--layers 32] [--program-kb 64] [--programs-per-sm 1,2,3] [--json PATH]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuda_kernels  # noqa: E402
from bench import copy_bandwidth  # noqa: E402
from benchmarks.gemv import time_calls  # noqa: E402

# bytes a GEMV of the Llama-2-7B int4 g32 step reads (N K 4.5 / 8: words and 8-bit scale/zero codes)
GEMVS = {"wqkv": 12288 * 4096, "wo": 4096 * 4096, "w13": 22016 * 4096, "w2": 4096 * 11008}
BLOCK = 4096  # int32 words a program loads a step (16 KB, as a w13 program's block)


def words(weights: int) -> int:
    """int32 words that `weights` int4 weights take with their 8-bit scale and zero codes at group 32 (4.5 bits)."""
    return weights * 9 // 64


@triton.jit
def _stream_kernel(w_ptr, prev_ptr, out_ptr, n_words, STEPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                   EARLY: tl.constexpr = 1, HOLD: tl.constexpr = False, WORK: tl.constexpr = 0):
    """Program pid sums words [pid STEPS BLOCK, +STEPS BLOCK) of this GEMV's n_words, its first EARLY blocks
    loaded before the PDL wait, then adds the previous GEMV's value (read after the wait) and stores the sum.
    HOLD (EARLY a power of two): the early blocks stay in registers until after the wait, where each word is
    combined with the previous GEMV's value, as a GEMV's products wait for x; WORK: then that many dependent
    integer steps on each of the BLOCK sums, after the wait, as a GEMV's arithmetic holds its program's slot."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs = pid * (STEPS * BLOCK) + tl.arange(0, BLOCK)
    if HOLD:
        at = pid * (STEPS * BLOCK) + tl.arange(0, EARLY * BLOCK)
        held = tl.load(w_ptr + at, mask=at < n_words, other=0)
    else:
        acc = tl.load(w_ptr + offs, mask=offs < n_words, other=0)
        for s in tl.static_range(1, EARLY):
            acc += tl.load(w_ptr + offs + s * BLOCK, mask=offs + s * BLOCK < n_words, other=0)
    offs += (EARLY - 1) * BLOCK
    if PDL:
        tl.extra.cuda.gdc_wait()
    dep = tl.load(prev_ptr)
    if HOLD:
        acc = tl.sum(tl.reshape(held ^ dep.to(tl.int32, bitcast=True), (EARLY, BLOCK)), axis=0)
    for _ in range(WORK):
        acc = acc * 1664525 + 1013904223
    for s in range(EARLY, STEPS):
        offs += BLOCK
        acc += tl.load(w_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0).to(tl.float32) + dep)


@triton.jit
def _tile_kernel(w_ptr, prev_ptr, out_ptr, n_rows, row_words, ROWS: tl.constexpr, COLS: tl.constexpr,
                 TILED: tl.constexpr, PDL: tl.constexpr):
    """As _stream_kernel, over a GEMV's words as a matrix [n_rows, row_words] (row_words a multiple of COLS):
    program pid sums rows [pid ROWS, + ROWS), COLS words of each a step, as cuda_kernels.int4_gemv loads its tiles.
    TILED: each step's [ROWS, COLS] tile lies contiguous in memory (rows' blocks, then steps, then the tile's
    rows), where in the row-major layout its ROWS pieces of COLS words lie a row apart."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    ok = (rows < n_rows)[:, None]
    if TILED:
        at = pid * (ROWS * row_words) + tl.arange(0, ROWS)[:, None] * COLS + cols[None, :]
        step = ROWS * COLS
    else:
        at = rows[:, None] * row_words + cols[None, :]
        step = COLS
    acc = tl.load(w_ptr + at, mask=ok, other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    dep = tl.load(prev_ptr)
    for c in range(COLS, row_words, COLS):
        at += step
        acc += tl.load(w_ptr + at, mask=ok, other=0)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.float32) + dep)


@triton.jit
def _persistent_kernel(w_ptr, starts_ptr, sizes_ptr, out_ptr, count_ptr, n_gemvs, STEPS: tl.constexpr,
                       BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """All programs resident: GEMV g's words [starts[g], + sizes[g]) in chunks of STEPS BLOCK, chunk c to
    program c mod P; after each GEMV a grid-wide wait (every program adds 1 to count_ptr, zeroed before the
    launch, and spins until it reaches (g + 1) P); then the chunk's sum plus a value written before the wait
    by program 0 (the dependency). PREFETCH: the first block of a program's next chunk loads before the wait."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    CHUNK: tl.constexpr = STEPS * BLOCK
    dep = tl.zeros((1,), tl.float32).sum(axis=0)  # (a float32 scalar, carried by the loop)
    start = tl.load(starts_ptr)
    size = tl.load(sizes_ptr)
    offs = start + pid * CHUNK + tl.arange(0, BLOCK)
    first = tl.load(w_ptr + offs, mask=offs < start + size, other=0)
    for g in range(0, n_gemvs):
        acc = first
        c = pid
        while c * CHUNK < size:
            base = start + c * CHUNK + tl.arange(0, BLOCK)
            if c != pid:
                acc += tl.load(w_ptr + base, mask=base < start + size, other=0)
            for s in range(1, STEPS):
                at = base + s * BLOCK
                acc += tl.load(w_ptr + at, mask=at < start + size, other=0)
            c += P
        total = tl.sum(acc, axis=0).to(tl.float32) + dep
        tl.store(out_ptr + g * P + pid, total)
        if g + 1 < n_gemvs:
            start = tl.load(starts_ptr + g + 1)
            size = tl.load(sizes_ptr + g + 1)
            first = tl.zeros((BLOCK,), tl.int32)
            if PREFETCH:
                offs = start + pid * CHUNK + tl.arange(0, BLOCK)
                first = tl.load(w_ptr + offs, mask=offs < start + size, other=0)
            tl.debug_barrier()  # every thread's stores are issued before the count (a release)
            tl.atomic_add(count_ptr, 1, sem="release")
            target = (g + 1) * P
            seen = tl.atomic_add(count_ptr, 0, sem="acquire")
            while seen < target:
                seen = tl.atomic_add(count_ptr, 0, sem="acquire")
            tl.debug_barrier()
            dep = tl.load(out_ptr + g * P, cache_modifier=".cg")  # the dependency: program 0's sum
            if not PREFETCH:
                offs = start + pid * CHUNK + tl.arange(0, BLOCK)
                first = tl.load(w_ptr + offs, mask=offs < start + size, other=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--program-kb", type=int, default=64, help="bytes a program streams, in KB (a multiple of 16)")
    p.add_argument("--programs-per-sm", default="1,2,3", help="persistent programs an SM (8 warps each; a count "
                   "whose registers do not fit is skipped; 0: none)")
    p.add_argument("--early", default="1", help="comma-separated: blocks a chained program loads before the PDL wait "
                   "(runs 82-84: its loop after the wait unrolled, except at 128 KB with 1 block early)")
    p.add_argument("--hold", action="store_true", help="chained programs keep their early blocks in registers until "
                   "after the wait, where each word takes the previous GEMV's value (as a GEMV's products wait for x)")
    p.add_argument("--work", default="0", help="comma-separated: dependent integer steps on each sum after the wait "
                   "(a GEMV's arithmetic, holding the program's slot)")
    p.add_argument("--tiles", action="store_true",
                   help="instead: the GEMVs as matrices (K 4.5 / 32 words a row), each program a block of rows, 128 "
                        "words of each a step, in the row-major layout and tiled (each step's tile contiguous)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    dev = torch.device("cuda")
    ceiling = copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    steps = a.program_kb * 1024 // (BLOCK * 4)
    if a.program_kb % 16 or any(not 1 <= int(e) <= steps for e in a.early.split(",")):
        p.error(f"--program-kb must be a multiple of 16, and --early blocks 1..{steps} (its 16 KB blocks)")
    if a.hold and any(int(e) & (int(e) - 1) for e in a.early.split(",")):
        p.error("--hold takes --early blocks in powers of two")
    sizes = [words(v) for _ in range(a.layers) for v in GEMVS.values()]
    sizes = [-(-s // BLOCK) * BLOCK for s in sizes]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total_bytes = 4 * sum(sizes)
    w = torch.randint(-2**31, 2**31 - 1, (sum(sizes),), device=dev, dtype=torch.int32)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy ceiling "
          f"{ceiling:.0f} GB/s; {len(sizes)} GEMVs, {total_bytes / 1e9:.2f} GB a step, {a.program_kb} KB a program",
          flush=True)
    chunk = steps * BLOCK
    outs = [torch.zeros(-(-s // chunk), device=dev) for s in sizes]
    zero = torch.zeros(1, device=dev)
    pdl_ok = cuda_kernels.pdl(w)
    records = []

    def report(name, seconds, **extra):
        rec = dict(structure=name, us_a_step=seconds * 1e6, gb_s=total_bytes / seconds / 1e9,
                   pct_of_ceiling=100 * total_bytes / seconds / 1e9 / ceiling, ceiling_gb_s=ceiling,
                   gemvs=len(sizes), bytes=total_bytes, program_kb=a.program_kb, gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__, triton=triton.__version__, command="python " + " ".join(sys.argv), **extra)
        records.append(rec)
        print(f"{name:28s} {rec['us_a_step']:8.1f} us a step  {rec['gb_s']:6.0f} GB/s = {rec['pct_of_ceiling']:5.1f}%"
              f"  ({rec['us_a_step'] / len(sizes):.2f} us a GEMV)", flush=True)
        if a.json:
            a.json.write_text(json.dumps(records, indent=1) + "\n")

    if a.tiles:
        # (rows a program: wqkv 32, wo 16, w13 32 (16 of gate, 16 of up), w2 16, as int4_config's g32 launches)
        shapes = [(n, -(-words(k) // 128) * 128, rows) for _ in range(a.layers)
                  for n, k, rows in ((12288, 4096, 32), (4096, 4096, 16), (22016, 4096, 32), (4096, 11008, 16))]
        offsets = [sum(n * words for n, words, _ in shapes[:i]) for i in range(len(shapes))]
        total_bytes = 4 * sum(n * words for n, words, _ in shapes)
        del w
        w = torch.randint(-2**31, 2**31 - 1, (total_bytes // 4,), device=dev, dtype=torch.int32)
        outs = [torch.zeros(-(-n // r), device=dev) for n, _, r in shapes]
        for tiled in (False, True):
            def tiles(tiled=tiled):
                prev = zero
                for (n, words, r), off, out in zip(shapes, offsets, outs):
                    _tile_kernel[(out.numel(),)](w[off:], prev, out, n, words, ROWS=r, COLS=128, TILED=tiled,
                                                 PDL=pdl_ok, num_warps=8, **({"launch_pdl": True} if pdl_ok else {}))
                    prev = out
            report("tiles, " + ("tiled" if tiled else "row-major"), time_calls([tiles]), tiled=tiled, pdl=pdl_ok)
        return
    for pdl, early, work in ([(True, int(e), int(k)) for e in a.early.split(",") for k in a.work.split(",") if pdl_ok]
                             + [(False, 1, 0)]):
        def chain(pdl=pdl, early=early, work=work):
            prev = zero
            for start, size, out in zip(starts, sizes, outs):
                _stream_kernel[(out.numel(),)](w[start:], prev, out, size, STEPS=steps, BLOCK=BLOCK, PDL=pdl,
                                               EARLY=early, HOLD=a.hold, WORK=work, num_warps=8,
                                               **({"launch_pdl": True} if pdl else {}))
                prev = out
        name = f"chain, {early} early{', held' if a.hold else ''}{f', work {work}' if work else ''}"
        report(name if pdl else "chain-nopdl", time_calls([chain]), early=early, pdl=pdl, hold=a.hold, work=work)
    if a.programs_per_sm == "0":
        return

    starts_t = torch.tensor(starts, device=dev, dtype=torch.int64)
    sizes_t = torch.tensor(sizes, device=dev, dtype=torch.int64)
    count = torch.zeros(1, device=dev, dtype=torch.int32)
    for per_sm in (int(v) for v in a.programs_per_sm.split(",")):
        programs = sms * per_sm
        out = torch.zeros(len(sizes) * programs, device=dev)
        for prefetch in (False, True):
            # one program first (its wait passes at once): the build's registers say whether `per_sm` programs
            # of 8 warps fit an SM together, without which the grid-wide wait would never end
            count.zero_()
            built = _persistent_kernel[(1,)](w, starts_t, sizes_t, out, count, len(sizes), STEPS=steps, BLOCK=BLOCK,
                                             PREFETCH=prefetch, num_warps=8)
            if built.n_regs * 256 * per_sm > 65536:
                print(f"persistent {per_sm}/SM: skipped ({built.n_regs} registers a thread)", flush=True)
                continue
            def persistent(programs=programs, out=out, prefetch=prefetch):
                count.zero_()
                _persistent_kernel[(programs,)](w, starts_t, sizes_t, out, count, len(sizes), STEPS=steps,
                                                BLOCK=BLOCK, PREFETCH=prefetch, num_warps=8)
            report(f"persistent {per_sm}/SM{' prefetch' if prefetch else ''}", time_calls([persistent]),
                   programs=programs, prefetch=prefetch)


if __name__ == "__main__":
    main()
