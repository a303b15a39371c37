"""A probe: the int4 g32 GEMV with all of each program's weights in flight before its PDL wait, written in
Gluon (Triton's lower-level language, experimental in Triton 3.6), against cuda_kernels.int4_gemv, as the 7B step
chains them (per layer wqkv, wo, w13, w2; 32 layers; CUDA graph replays with PDL).

Why: benchmarks/boundaries.py found that chained streaming programs read the step's GEMV bytes at the copy
ceiling when each has asked for all its bytes before its PDL wait, and at 61-87% when only the first block is
asked for there, as cuda_kernels.int4_gemv does. Larger first blocks made that Triton kernel slower (BENCHMARKS.md,
session 18): its tiles grow with them. Here each program copies all its rows' words and codes into shared
memory with TMA before the wait (one mbarrier), then computes on them in blocks of 32 groups, as small as the
Triton kernel's.

The arithmetic is cuda_kernels.int4_gemv's with x already in int8 (int4_quantize_x, groups of 16: its XQ form,
which decode uses for wo): per word two dp4a, per group of 32 its scale and zero from the row's codes and
units; RMSNorm's scale from x's sums of squares (wqkv, w13), SwiGLU (w13), the residual (wo, w2). Each shape
is checked against cuda_kernels.int4_gemv on the same inputs, then three chains are timed:

  triton       cuda_kernels.int4_gemv as the step runs it (x in bf16 for wqkv, w13, w2; in int8 for wo)
  triton-xq    cuda_kernels.int4_gemv with x in int8 everywhere (the arithmetic the Gluon kernel does)
  gluon        this file's kernel, x in int8 everywhere (--fast 4: in bf16 where decode has it), at --rows
               rows a program

The chains read the same x each time (decode's data flow is not needed for the timing: each kernel still
waits for the one before at its PDL wait). On the H200 (sm_90) only.

What it found (BENCHMARKS.md, sessions 18-19): the copies alone stream the step's GEMV bytes at 87-90% of the
copy ceiling; with the products the best form (--fast 2, one mbarrier a box, 16 rows, 8 warps) reached 69.9%,
against the Triton kernel's 68.4%, and only with x in int8 for every GEMV. With x in bf16 (--fast 4) it took
1.5x the Triton kernel's time at best. The persistent ring kernel (--ring 6 --per-sm 3) took 1128.2-1139.9 us
a step of GEMVs against the Triton kernel's 1242.7-1243.4 (75% of the ceiling), again only with x in int8; with
x in bf16 rounded in each program, for w13 and w2 only (--mix), 1217.4. Session 20 (--int8-flow, run 100): each
GEMV also writing its y in int8 for the next (as decode can hand x on), 1142.5 against 1242.2. The ring kernel
then moved to int4_ring.py, which decode runs (model.TransformerBlock.forward_int8; on by default since session
21, with the attention kernel at 32 positions a loop step: 686.5-689.2 tok/s against 673-675, runs 104-106); this
file times it from there, and keeps the one-program-a-tile kernel (_int4_gemv_tma_kernel) as the probe it was.

    python benchmarks/gluon_gemv.py [--layers 32] [--rows 8,16] [--warps 4] [--each 0,1] [--fast 0,1,2,3,4]
        [--ring 6 --per-sm 3 [--ring-only] [--int8-flow]] [--by-shape] [--load-only] [--json PATH]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import int4_ring  # noqa: E402
import cuda_kernels  # noqa: E402
import model as M  # noqa: E402
from bench import PRESETS, copy_bandwidth  # noqa: E402
from benchmarks.gemv import shapes, time_calls  # noqa: E402
from benchmarks.gemv_int4 import FUSED, file_weights  # noqa: E402

from int4_ring import CHUNK, G, XG, _dp4a, _layouts, _products_fast, _x_smem, _x_stage, descriptors  # noqa: E402
STEP = ("wqkv", "wo", "w13", "w2")  # a layer's GEMVs, in decode's order


@gluon.jit
def _chunk(acc, w_smem, c_smem, c, unit_s, unit_z, xw_ptr, xs_ptr, n_words, n_groups, n_x,
           L3: gl.constexpr, BN: gl.constexpr, GC: gl.constexpr):
    """acc [BN, GC] + chunk c's products: words [BN, GC, 4] and codes [BN, GC] from shared memory."""
    w = w_smem.load(L3)
    codes = c_smem.load(gl.SliceLayout(2, L3)).to(gl.int32)  # (sign-extended: >> 8 is the zero's code)
    XL: gl.constexpr = gl.SliceLayout(0, L3)
    word = c * (GC * 4) + gl.expand_dims(gl.arange(0, GC, layout=gl.SliceLayout(1, XL)), 1) * 4 \
        + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, XL)), 0)  # [GC, 4]
    ok = word < n_words
    x_lo = gl.load(xw_ptr + 2 * word, mask=ok, other=0)
    x_hi = gl.load(xw_ptr + 2 * word + 1, mask=ok, other=0)
    sx = gl.load(xs_ptr + word // 2, mask=ok, other=0)  # (XG 16: two words an x group)
    dot = _dp4a((w >> 4) & 0x0F0F0F0F, gl.expand_dims(x_hi, 0),
                _dp4a(w & 0x0F0F0F0F, gl.expand_dims(x_lo, 0), gl.zeros_like(w)))
    part = gl.sum(dot.to(gl.float32) * gl.expand_dims(sx, 0), axis=2)  # [BN, GC]: sum over x groups of sx dot
    GL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, L3))
    group = c * GC + gl.arange(0, GC, layout=GL)
    g_ok = group < n_groups
    qs = gl.load(xs_ptr + n_x + 2 * group, mask=g_ok, other=0) + gl.load(xs_ptr + n_x + 2 * group + 1, mask=g_ok,
                                                                         other=0)
    x_sum = gl.load(xs_ptr + 2 * n_x + 2 * group, mask=g_ok, other=0) + gl.load(xs_ptr + 2 * n_x + 2 * group + 1,
                                                                                mask=g_ok, other=0)
    s = (codes & 255).to(gl.float32) * gl.expand_dims(unit_s, 1)
    z = (codes >> 8).to(gl.float32) * gl.expand_dims(unit_z, 1)
    return acc + (part - 8 * gl.expand_dims(qs, 0)) * s + z * gl.expand_dims(x_sum, 0)


@gluon.jit
def _x_fast(c, xw_ptr, xs_ptr, n_x, L3: gl.constexpr, L4: gl.constexpr, LX: gl.constexpr, GC: gl.constexpr):
    """Chunk c's x for _products_fast (FAST), once for all of a program's rows (gate and up too): each group's 8
    x words in one vector load, as the (lo, hi) pairs of its 4 weight words, and its two x groups' scales, sums
    of q and sums of x in vector loads. No masks: past K the weights are TMA's zeros, and x's reads stay inside
    int4_quantize_x's buffer (its sums follow its words), so every extra product is a finite number times 0."""
    X8: gl.constexpr = gl.SliceLayout(0, LX)  # [GC, 8]
    at = c * (GC * 8) + gl.expand_dims(gl.arange(0, GC, layout=gl.SliceLayout(1, X8)), 1) * 8 \
        + gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, X8)), 0)
    x_lo, x_hi = gl.split(gl.reshape(gl.load(xw_ptr + at), [GC, 4, 2]))
    XG2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))  # [GC, 2]
    xg = c * (GC * 2) + gl.expand_dims(gl.arange(0, GC, layout=gl.SliceLayout(1, XG2)), 1) * 2 \
        + gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, XG2)), 0)
    GV: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    q8 = gl.convert_layout(8 * gl.sum(gl.load(xs_ptr + n_x + xg), axis=1), GV)
    x_sum = gl.convert_layout(gl.sum(gl.load(xs_ptr + 2 * n_x + xg), axis=1), GV)
    return (gl.convert_layout(x_lo, gl.SliceLayout(0, L3)), gl.convert_layout(x_hi, gl.SliceLayout(0, L3)),
            gl.load(xs_ptr + xg), q8, x_sum)


@gluon.jit
def _x_quantize(x_ptr, g_ptr, K, xw_s, sx_s, qs_s, xsum_s, LQ: gl.constexpr, GC: gl.constexpr, CHUNKS: gl.constexpr,
                NORM: gl.constexpr):
    """XBF16: x [K] in bf16 (NORM: times g) to int8 per group of 32 columns, as cuda_kernels.int4_gemv's dp4a path
    rounds it (_int4_dp4a_block: q = floor(x g 127 / max|x g| + 0.5)), into _x_stage's shared memory
    (allocated for a power of 2 of chunks, at least 4): an x group of 32 is stored as _x_smem's two x groups of
    16 with the same scale (sx twice; sx sum(q) and sum(x g) in the first, 0 in the second). Four chunks at a
    time, in one load of x (and g), and the squares summed across warps once at the end (run 94's form took a
    chunk at a time and summed its squares each time: it waited on L2 and on a barrier at every chunk).
    Returns x's sum of squares (the norm's, before g)."""
    XB: gl.constexpr = 4  # chunks a batch
    R: gl.constexpr = XB * GC  # groups a batch
    rg = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, LQ)))
    rw = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LQ)))
    rb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LQ)))
    at0 = gl.expand_dims(gl.expand_dims(rg, 1), 2) * 32 + gl.expand_dims(gl.expand_dims(rw, 0), 2) * 4 \
        + gl.expand_dims(gl.expand_dims(rb, 0), 1)  # [groups, 8 words, 4 bytes]
    shift = gl.expand_dims(gl.expand_dims(8 * rb, 0), 1)
    squares = gl.zeros([R, 8, 4], gl.float32, LQ)
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    ROWS: gl.constexpr = xw_s.shape[0] * GC  # (the buffers seen as 2D: a batch is a slice of rows)
    xw_2d = xw_s._reinterpret(gl.int32, [ROWS, 8], PLAIN2)
    sx_2d = sx_s._reinterpret(gl.float32, [ROWS, 2], PLAIN2)
    qs_2d = qs_s._reinterpret(gl.float32, [ROWS, 2], PLAIN2)
    xsum_2d = xsum_s._reinterpret(gl.float32, [ROWS, 2], PLAIN2)
    for c0 in gl.static_range(0, CHUNKS, XB):
        at = c0 * (GC * 32) + at0
        ok = at < K
        x = gl.load(x_ptr + at, mask=ok, other=0).to(gl.float32)
        squares += x * x
        u = x
        if NORM:
            u = x * gl.load(g_ptr + at, mask=ok, other=0).to(gl.float32)
        amax = gl.max(gl.max(gl.abs(u), axis=2), axis=1)  # [groups]
        q = gl.floor(u * gl.expand_dims(gl.expand_dims(gl.where(amax > 0, 127 / amax, 0), 1), 2) + 0.5).to(gl.int32)
        xw_2d.slice(c0 * GC, R).store(gl.sum((q & 255) << shift, axis=2))  # (bytes apart)
        sx = amax / 127
        zero = gl.zeros_like(sx)
        sx_2d.slice(c0 * GC, R).store(gl.join(sx, sx))
        qs_2d.slice(c0 * GC, R).store(gl.join(sx * gl.sum(gl.sum(q, axis=2), axis=1).to(gl.float32), zero))
        xsum_2d.slice(c0 * GC, R).store(gl.join(gl.sum(gl.sum(u, axis=2), axis=1), zero))
    return gl.sum(gl.sum(gl.sum(squares, axis=2), axis=1), axis=0)


@gluon.jit
def _int4_gemv_tma_kernel(w_desc, c_desc, xw_ptr, xs_ptr, u_ptr, r_ptr, y_ptr, N, K, eps, w_unscale, x_ptr, g_ptr,
                          NORM: gl.constexpr, RESIDUAL: gl.constexpr, SWIGLU: gl.constexpr, BN: gl.constexpr,
                          CHUNKS: gl.constexpr, NX_P2: gl.constexpr, EACH: gl.constexpr,
                          LOAD_ONLY: gl.constexpr = False, FAST: gl.constexpr = 0, XBF16: gl.constexpr = False):
    """y [N] for one row of x in int8 (int4_quantize_x, groups of 16) times int4 words [N (2N: SWIGLU, gate
    above up), K / 8] with int16 codes [., K / 32] and units [., 2] (cuda_kernels.int4_layout with units, dp4a):
    cuda_kernels.int4_gemv's XQ arithmetic. All of the program's words and codes are copied into shared memory by
    TMA before the PDL wait: behind one mbarrier, or (EACH) one a box, each chunk's products then starting as
    soon as its box has landed. LOAD_ONLY (a timing probe, wrong results): each chunk's words and codes are
    read from shared memory and summed, without x or any products. FAST (1, 2, 3): the products by _x_fast and
    _products_fast; 2: each chunk's x loaded one chunk ahead (chunk 0's before the weights are waited for),
    the rows' units before the PDL wait and the residual right after it; 3: as 2, but all of x is copied
    into shared memory once, right after the PDL wait (_x_stage), and each chunk reads it there. XBF16 (FAST 3
    only): x is x_ptr's [K] bf16, times g_ptr's norm weight, rounded to int8 by each program (_x_quantize), as
    cuda_kernels.int4_gemv takes x without xq (decode's wqkv, w13 and w2); xw_ptr and xs_ptr are not read.
    (Run 88-93's kernel, FAST 0, loads each chunk's x from L2 where its products begin, after the copies.)"""
    gl.static_assert(not (FAST and LOAD_ONLY))
    gl.static_assert(FAST == 3 or not XBF16)
    GC: gl.constexpr = 32  # groups a chunk (CHUNK / 4 words)
    L3: gl.constexpr = _layouts(gl.num_warps())[0]
    L4: gl.constexpr = _layouts(gl.num_warps())[1]
    LX: gl.constexpr = _layouts(gl.num_warps())[2]
    LG: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))
    RG: gl.constexpr = gl.SliceLayout(1, LG)
    PLAIN3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    HALVES: gl.constexpr = 2 if SWIGLU else 1
    pid = gl.program_id(0)
    gdc_launch_dependents()
    row0 = pid * BN
    w_smem = gl.allocate_shared_memory(gl.int32, [HALVES * CHUNKS, BN, 4 * GC], w_desc.layout)
    c_smem = gl.allocate_shared_memory(gl.int16, [HALVES * CHUNKS, BN, GC], c_desc.layout)
    BARS: gl.constexpr = HALVES * CHUNKS if EACH else 1
    bars = gl.allocate_shared_memory(gl.int64, [BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(BARS):
        mbarrier.init(bars.index(i), count=1)
    BOX: gl.constexpr = w_desc.block_type.nbytes + c_desc.block_type.nbytes
    if not EACH:
        mbarrier.expect(bars.index(0), HALVES * CHUNKS * BOX)
    for i in gl.static_range(HALVES * CHUNKS):  # (in the order the products take them: FAST chunk by chunk,
        h = i % HALVES if FAST else i // CHUNKS  # gate and up together; else all of gate, then up)
        c = i // HALVES if FAST else i % CHUNKS
        bar = bars.index(h * CHUNKS + c if EACH else 0)
        if EACH:
            mbarrier.expect(bar, BOX)
        tma.async_copy_global_to_shared(w_desc, [row0 + h * N, c * 4 * GC], bar, w_smem.index(h * CHUNKS + c))
        tma.async_copy_global_to_shared(c_desc, [row0 + h * N, c * GC], bar, c_smem.index(h * CHUNKS + c))
    RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    rn = row0 + gl.arange(0, BN, layout=RL)
    rows = gl.minimum(rn, N - 1)
    if FAST >= 2:  # the rows' units before the wait (weights), the residual right after it: not at the end
        units = (gl.load(u_ptr + rows * 2), gl.load(u_ptr + rows * 2 + 1),
                 gl.load(u_ptr + (rows + (HALVES - 1) * N) * 2), gl.load(u_ptr + (rows + (HALVES - 1) * N) * 2 + 1))
    gdc_wait()  # x and the residual were written by the kernel before
    if FAST >= 2 and RESIDUAL:
        r_early = gl.load(r_ptr + rn, mask=rn < N, other=0).to(gl.float32)
    n_words = K // 8
    n_groups = K // 32
    n_x = gl.multiple_of(K // 16, 16)  # (gluon_gemv asserts K % 256 == 0: x's sums load as vectors)
    if FAST == 2:  # chunk 0's x asked for before the weights are waited for (and before the norm's sum)
        x_next = _x_fast(0, xw_ptr, xs_ptr, n_x, L3, L4, LX, GC)
    if FAST == 3:  # all of x into shared memory, asked for before the norm's sum
        X3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])  # (a chunk's)
        # (chunks a power of 2, at least 4: _x_quantize's batches of 4, in 2D views of power-of-2 shapes)
        CHUNKS4: gl.constexpr = 4 if CHUNKS <= 4 else 8 if CHUNKS <= 8 else 16 if CHUNKS <= 16 else 32
        xw_s = gl.allocate_shared_memory(gl.int32, [CHUNKS4, GC, 8], X3)
        sx_s = gl.allocate_shared_memory(gl.float32, [CHUNKS4, GC, 2], X3)
        qs_s = gl.allocate_shared_memory(gl.float32, [CHUNKS4, GC, 2], X3)
        xsum_s = gl.allocate_shared_memory(gl.float32, [CHUNKS4, GC, 2], X3)
        if XBF16:
            LQ: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2, 4], threads_per_warp=[8, 4, 1],
                                                warps_per_cta=[gl.num_warps(), 1, 1], order=[2, 1, 0])
            squares = _x_quantize(x_ptr, g_ptr, K, xw_s, sx_s, qs_s, xsum_s, LQ, GC, CHUNKS, NORM)
        else:
            _x_stage(xw_ptr, xs_ptr, n_x, xw_s, sx_s, qs_s, xsum_s, LX, L4, GC, CHUNKS)
    unscale = w_unscale
    if NORM and XBF16:
        unscale = unscale * gl.rsqrt(squares / K + eps)
    elif NORM:
        SL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                            warps_per_cta=[gl.num_warps()], order=[0])
        xg = gl.arange(0, NX_P2, layout=SL)
        squares = gl.load(xs_ptr + 3 * n_x + xg, mask=xg < n_x, other=0)
        unscale = unscale * gl.rsqrt(gl.sum(squares, axis=0) / K + eps)
    if FAST == 3 and not XBF16:
        async_copy.wait_group(0)
    if not EACH:
        mbarrier.wait(bars.index(0), 0)
    out = gl.zeros([BN], gl.float32, RL)
    if FAST:  # chunk by chunk, x's work once for gate and up
        acc_s = gl.zeros([BN, GC], gl.float32, LG)
        acc_z = gl.zeros([BN, GC], gl.float32, LG)
        up_s = gl.zeros([BN, GC], gl.float32, LG)
        up_z = gl.zeros([BN, GC], gl.float32, LG)
        for c in gl.static_range(CHUNKS):
            if FAST == 2:  # (each chunk's x loads issued a chunk ahead of its products: their latency hidden)
                x_lo, x_hi, sx, q8, x_sum = x_next
                if c + 1 < CHUNKS:
                    x_next = _x_fast(c + 1, xw_ptr, xs_ptr, n_x, L3, L4, LX, GC)
            elif FAST == 3:
                x_lo, x_hi, sx, q8, x_sum = _x_smem(c, xw_s, sx_s, qs_s, xsum_s, L3, L4, LX, GC)
            else:
                x_lo, x_hi, sx, q8, x_sum = _x_fast(c, xw_ptr, xs_ptr, n_x, L3, L4, LX, GC)
            for h in gl.static_range(HALVES):
                if EACH:
                    mbarrier.wait(bars.index(h * CHUNKS + c), 0)
                # (the boxes are unswizzled, so each is plain row-major: its words viewed as [BN, GC, 4])
                w_c = w_smem.index(h * CHUNKS + c)._reinterpret(gl.int32, [BN, GC, 4], PLAIN3)
                c_c = c_smem.index(h * CHUNKS + c)._reinterpret(gl.int16, [BN, GC], PLAIN2)
                if h == 0:
                    acc_s, acc_z = _products_fast(acc_s, acc_z, w_c, c_c, x_lo, x_hi, sx, q8, x_sum, L3, L4, BN, GC)
                else:
                    up_s, up_z = _products_fast(up_s, up_z, w_c, c_c, x_lo, x_hi, sx, q8, x_sum, L3, L4, BN, GC)
        for h in gl.static_range(HALVES):  # the rows' units, once a row
            if FAST >= 2:
                unit_s = gl.convert_layout(units[2 * h], RG)
                unit_z = gl.convert_layout(units[2 * h + 1], RG)
            else:
                unit_s = gl.convert_layout(gl.load(u_ptr + (rows + h * N) * 2), RG)
                unit_z = gl.convert_layout(gl.load(u_ptr + (rows + h * N) * 2 + 1), RG)
            if h == 0:
                out = gl.convert_layout(unit_s * gl.sum(acc_s, axis=1) + unit_z * gl.sum(acc_z, axis=1), RL) * unscale
            else:
                up = gl.convert_layout(unit_s * gl.sum(up_s, axis=1) + unit_z * gl.sum(up_z, axis=1), RL) * unscale
                out = out / (1 + gl.exp(-out)) * up
    for h in gl.static_range(HALVES if not FAST else 0):
        unit_s = gl.load(u_ptr + (rows + h * N) * 2)
        unit_z = gl.load(u_ptr + (rows + h * N) * 2 + 1)
        acc = gl.zeros([BN, GC], gl.float32, gl.SliceLayout(2, L3))
        for c in gl.static_range(CHUNKS):
            if EACH:
                mbarrier.wait(bars.index(h * CHUNKS + c), 0)
            w_c = w_smem.index(h * CHUNKS + c)._reinterpret(gl.int32, [BN, GC, 4], PLAIN3)
            c_c = c_smem.index(h * CHUNKS + c)._reinterpret(gl.int16, [BN, GC], PLAIN2)
            if LOAD_ONLY:
                acc += gl.sum(w_c.load(L3), axis=2).to(gl.float32) + c_c.load(gl.SliceLayout(2, L3)).to(gl.float32)
            else:
                acc = _chunk(acc, w_c, c_c, c, unit_s, unit_z, xw_ptr, xs_ptr, n_words, n_groups, n_x, L3, BN, GC)
        if h == 0:
            out = gl.sum(acc, axis=1) * unscale
        else:
            out = out / (1 + gl.exp(-out)) * (gl.sum(acc, axis=1) * unscale)
    for i in gl.static_range(BARS):
        mbarrier.invalidate(bars.index(i))
    if RESIDUAL:
        if FAST >= 2:
            out += r_early
        else:
            out += gl.load(r_ptr + rn, mask=rn < N, other=0).to(gl.float32)
    gl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=rn < N)


def bf16_x(layer, fast):
    """Whether `fast` (4: decode's forms of x) gives this layer x in bf16: all but wo, whose x the attention
    kernel writes in int8."""
    return fast == 4 and layer["name"] != "wo"


def gluon_gemv(layer, xq, residual, rows, warps, each=False, load_only=False, fast=0, x=None, g=None, eps=1e-5):
    """One call of the Gluon kernel on `layer` (make_layer's) with x in int8 `xq`, or (fast 4, but for wo) x in
    bf16 `x` [K] with the norm weight `g` [K] (FAST 3 with XBF16)."""
    N, K, fused = layer["N"], layer["K"], layer["fused"]
    # (K a multiple of 256: x's sums are 16-aligned; at least 512: FAST's reads past K stay in xq's buffer)
    assert K % 256 == 0 and K >= 512, f"gluon_gemv takes K a multiple of 256, at least 512 (got {K})"
    y = torch.empty(N, device=xq.device, dtype=torch.bfloat16)
    n_x = K // XG
    chunks = -(-(K // 8) // CHUNK)
    _int4_gemv_tma_kernel[(triton.cdiv(N, rows),)](
        *layer["desc"][rows], xq[:K // 4], xq[K // 4:].view(torch.float32), layer["units"],
        residual if residual is not None else y, y, N, K, eps, layer["w_unscale"],
        x if bf16_x(layer, fast) else y, g if bf16_x(layer, fast) else y,
        NORM=fused in ("norm", "swiglu"), RESIDUAL=fused == "residual", SWIGLU=fused == "swiglu", BN=rows,
        CHUNKS=chunks, NX_P2=triton.next_power_of_2(n_x), EACH=each, LOAD_ONLY=load_only, FAST=min(fast, 3),
        XBF16=bf16_x(layer, fast), num_warps=warps, launch_pdl=True)
    return y


def gluon_ring_gemv(layer, xq, x, residual, rows, warps, stages, per_sm, out_q=False, g_out=None, eps=1e-5):
    """(y, y in int8 or None): one call of the ring kernel (int4_ring.gemv, decode's int8 flow) on `layer`, x in
    int8 `xq` (x [1, K] in bf16 gives the shape), per_sm programs an SM (at most one a tile); out_q (rows 16): y
    also in int8, times g_out if given."""
    return int4_ring.gemv(x, xq, layer["words"], layer["codes"], layer["units"], layer["w_unscale"],
                          norm=layer["fused"] in ("norm", "swiglu"), eps=eps,
                          residual=residual if layer["fused"] == "residual" else None,
                          swiglu=layer["fused"] == "swiglu", out_q=out_q, out_norm_weight=g_out, rows=rows,
                          stages=stages, per_sm=per_sm, warps=warps)


def make_layer(name, R, K, dev, rows_list):
    """One GEMV's int4 g32 weights [R, K] as quantize.py writes them (gemv_int4.file_weights: scales and
    zeros on its grid) in cuda_kernels.int4_gemv's integer layout with codes (model.int4_gemv_layout), with TMA
    descriptors for each rows a program. R holds gate above up for w13."""
    fused = FUSED[name]
    words, codes, w_unscale, _, units = M.int4_gemv_layout(*file_weights(R, K, G, dev), G, dp4a=True, codes=True)
    assert units is not None, "file_weights' scales and zeros lie on the grid, so they take codes"
    layer = dict(name=name, N=R // 2 if fused == "swiglu" else R, K=K, fused=fused, words=words, codes=codes,
                 units=units, w_unscale=w_unscale)
    layer["desc"] = {r: descriptors(words, codes, r) for r in rows_list}
    return layer


def triton_gemv(layer, x, xq, residual, ones):
    """cuda_kernels.int4_gemv on `layer`, x in int8 (xq) or in bf16 (x, xq None), with the layer's fusions."""
    fused = layer["fused"]
    return cuda_kernels.int4_gemv(x, layer["words"], layer["codes"], layer["w_unscale"], G, units=layer["units"],
                             norm_weight=ones if fused in ("norm", "swiglu") else None, eps=1e-5,
                             residual=residual if fused == "residual" else None, swiglu=fused == "swiglu",
                             ones=ones, dp4a=True, xq=xq)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rows", default="8,16", help="comma-separated: rows a program of the Gluon kernel")
    p.add_argument("--warps", default="4", help="comma-separated: warps a program of the Gluon kernel")
    p.add_argument("--each", default="0", help="comma-separated: 0 one mbarrier a program, 1 one a box")
    p.add_argument("--fast", default="0", help="comma-separated: 0 the first products (_chunk), 1 _x_fast and "
                   "_products_fast (fewer instructions), 2 those with each chunk's x loaded a chunk ahead, 3 those with "
                   "all of x copied into shared memory once, after the PDL wait, 4 as 3 but x in bf16 where decode has it so "
                   "(all but wo), rounded to int8 by each program (against the Triton kernel on the same forms)")
    p.add_argument("--ring", default="", help="comma-separated: boxes in flight a program of the ring kernel "
                   "(persistent programs, each box's copy issued that many boxes ahead of its products), at each "
                   "--rows, --warps and --per-sm (int4_ring.py's kernel: x in int8 staged in shared memory, as "
                   "--fast 3; sessions 19-20 also timed it with bf16 x, rounded in each program: commit 1eb065c)")
    p.add_argument("--per-sm", default="1", help="comma-separated: ring kernel programs an SM")
    p.add_argument("--ring-only", action="store_true", help="time the ring kernel, not _int4_gemv_tma_kernel")
    p.add_argument("--int8-flow", action="store_true", help="also each ring form at 16 rows with x in int8 (--fast 3) "
                   "in decode's data flow: wo, w13 and w2 write their y in int8 for the GEMV after them (wo's and w2's "
                   "times a norm weight), wqkv the Triton kernel or the ring reading w2's; checked against int4_quantize_x")
    p.add_argument("--mix", action="store_true", help="also each Gluon form in the chain for w13 and w2 only, with "
                   "the Triton kernel in the step's forms for wqkv and wo")
    p.add_argument("--by-shape", action="store_true", help="also each shape's layers alone, chained")
    p.add_argument("--load-only", action="store_true", help="with --by-shape and in the chain: also the Gluon kernel "
                   "with its products left out (its copies, waits and shared-memory reads alone; wrong results)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if any(v not in ("0", "1", "2", "3", "4") for v in a.fast.split(",")):
        p.error("--fast takes 0, 1, 2, 3 or 4")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("gluon_gemv.py needs a CUDA GPU with TMA (Hopper, sm_90, or later)")
    dev = torch.device("cuda")
    rows_list = [int(v) for v in a.rows.split(",")]
    warps_list = [int(v) for v in a.warps.split(",")]
    each_list = [bool(int(v)) for v in a.each.split(",")]
    configs = [(r, w, e, int(f), None) for r in rows_list for w in warps_list for e in each_list
               for f in a.fast.split(",") if not a.ring_only]
    configs += [(r, w, False, 3, (int(st), int(ps))) for r in rows_list for w in warps_list
                for st in a.ring.split(",") if st for ps in a.per_sm.split(",")]
    ceiling = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy ceiling "
          f"{ceiling:.0f} GB/s", flush=True)
    torch.manual_seed(0)
    step = {name: shape for name, shape in shapes(PRESETS[a.model]).items() if name in STEP}  # [R, K]
    ks = {k for _, k in step.values()}
    ones = torch.ones(max(ks), device=dev, dtype=torch.bfloat16)
    xs = {k: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for k in ks}
    xqs = {k: cuda_kernels.int4_quantize_x(x, None, XG) for k, x in xs.items()}
    outs = {r // 2 if FUSED[name] == "swiglu" else r for name, (r, _) in step.items()}  # each GEMV's N
    res = {n: torch.randn(1, n, device=dev, dtype=torch.bfloat16) for n in outs}
    records = []

    def gluon(layer, rows, warps, each, fast, ring=None, load_only=False):
        K = layer["K"]
        if ring:
            return gluon_ring_gemv(layer, xqs[K], xs[K], res[layer["N"]], rows, warps, *ring)[0].flatten()
        return gluon_gemv(layer, xqs[K], res[layer["N"]], rows, warps, each, load_only, fast, xs[K].flatten(),
                          ones[:K])

    def label(rows, warps, each, fast, ring):
        form = f"ring {ring[0]} x{ring[1]}" if ring else f"each {int(each)}"
        return f"gluon rows {rows} warps {warps} {form}{f' fast {fast}' if fast else ''}"

    # 1. each shape: the Gluon kernel against cuda_kernels.int4_gemv with x in int8, same inputs
    failed = set()
    for name, (R, K) in step.items():
        layer = make_layer(name, R, K, dev, rows_list)
        N, K = layer["N"], layer["K"]
        expect_int8 = triton_gemv(layer, xs[K], xqs[K], res[N], ones[:K]).float().flatten()
        expect_bf16 = triton_gemv(layer, xs[K], None, res[N], ones[:K]).float().flatten()  # (fast 4)
        for config in configs:
            got = gluon(layer, *config).float()
            expect = expect_bf16 if bf16_x(layer, config[3]) else expect_int8
            err = ((got - expect).abs().max() / expect.abs().max()).item()
            print(f"check {name:5s} {label(*config)}: max error {err:.1e} of max |y| "
                  f"{expect.abs().max().item():.3g}", flush=True)
            if not err < 2e-2:  # (not timed; the others still are)
                print(f"gluon_gemv: {name}, {label(*config)}, differs from cuda_kernels.int4_gemv by {err:.1e}: left out "
                      "of the timings", flush=True)
                failed.add(config)
        del layer
    configs = [config for config in configs if config not in failed]

    # 1b. the ring's y in int8 (--int8-flow) against int4_quantize_x of its bf16 y
    flow = [c for c in configs if c[4] and c[0] == XG and c[3] == 3] if a.int8_flow else []
    for name, (R, K) in step.items():
        if not flow or name == "wqkv":
            continue
        layer = make_layer(name, R, K, dev, rows_list)
        N, K = layer["N"], layer["K"]
        g_out = ones[:N] * 0.5 if name != "w13" else None  # (a norm weight: w13's output has none)
        for config in list(flow):
            y, yq = gluon_ring_gemv(layer, xqs[K], xs[K], res[N], *config[:2], *config[4], out_q=True, g_out=g_out)
            ref = cuda_kernels.int4_quantize_x(y.view(1, N), g_out, XG)
            # codes within 1 of int4_quantize_x's (a tie at .5 may round either way), and each row of the
            # groups' numbers (sx, sx sum(q), sum(u), sum(v^2)) within 1e-3 of its own largest value
            codes = yq[:N // 4].view(torch.int8).int() - ref[:N // 4].view(torch.int8).int()
            off = (codes.abs() > 1).sum().item()
            stats, stats_ref = yq[N // 4:].view(torch.float32).view(4, -1), ref[N // 4:].view(torch.float32).view(4, -1)
            err = ((stats - stats_ref).abs().amax(1) / stats_ref.abs().amax(1)).max().item()
            print(f"check {name:5s} {label(*config)} y in int8: {off} codes off by more than 1, group numbers max "
                  f"error {err:.1e} (each row against its largest)", flush=True)
            if not (off == 0 and err < 1e-3):
                print(f"gluon_gemv: the ring's int8 y differs from int4_quantize_x ({name}, {label(*config)}): left "
                      "out of the int8 flow", flush=True)
                flow.remove(config)
        del layer

    # 2. the step's chain of GEMVs, each implementation on the same weights
    layers = [make_layer(name, R, K, dev, rows_list) for _ in range(a.layers) for name, (R, K) in step.items()]
    total = sum(layer["words"].numel() * 4 + layer["codes"].numel() * 2 for layer in layers)

    def report(name, seconds, **extra):
        rec = dict(chain=name, us_a_step=seconds * 1e6, gb_s=total / seconds / 1e9,
                   pct_of_ceiling=100 * total / seconds / 1e9 / ceiling, ceiling_gb_s=ceiling, bytes=total,
                   gemvs=len(layers), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, command="python " + " ".join(sys.argv), **extra)
        records.append(rec)
        print(f"{name:26s} {rec['us_a_step']:8.1f} us a step  {rec['gb_s']:6.0f} GB/s = "
              f"{rec['pct_of_ceiling']:5.1f}%", flush=True)
        if a.json:
            a.json.write_text(json.dumps(records, indent=1) + "\n")

    print(f"{len(layers)} GEMVs, {total / 1e9:.2f} GB a step", flush=True)

    def triton_chain(int8_x):
        for layer in layers:
            K, N = layer["K"], layer["N"]
            int8 = int8_x or layer["name"] == "wo"
            triton_gemv(layer, xs[K], xqs[K] if int8 else None, res[N], ones[:K])

    if a.by_shape:  # each shape's 32 layers alone, chained: where the time goes
        for name in step:
            group = [layer for layer in layers if layer["name"] == name]
            for form, call in [("triton (the step's form)", lambda layer: triton_gemv(
                                    layer, xs[layer["K"]], xqs[layer["K"]] if layer["name"] == "wo" else None,
                                    res[layer["N"]], ones[:layer["K"]])),
                                ("triton-xq", lambda layer: triton_gemv(layer, xs[layer["K"]], xqs[layer["K"]],
                                                                        res[layer["N"]], ones[:layer["K"]]))] + [
                    (label(*config), lambda layer, config=config: gluon(layer, *config))
                    for config in configs] + [
                    (f"gluon-load-only rows {r} warps {warps_list[0]} each {int(e)}",
                     lambda layer, r=r, e=e: gluon(layer, r, warps_list[0], e, 0, None, True))
                    for r in rows_list for e in each_list if a.load_only]:
                t = time_calls([lambda: [call(layer) for layer in group]]) / len(group)
                nbytes = group[0]["words"].numel() * 4 + group[0]["codes"].numel() * 2
                print(f"  {name:5s} {form:26s} {t * 1e6:6.1f} us a GEMV  {nbytes / t / 1e9:5.0f} GB/s", flush=True)
                records.append(dict(shape=name, chain=form, us_a_gemv=t * 1e6, gb_s=nbytes / t / 1e9,
                                    command="python " + " ".join(sys.argv)))
    report("triton (the step's forms)", time_calls([lambda: triton_chain(False)]))
    report("triton-xq", time_calls([lambda: triton_chain(True)]))
    def flow_buffers():
        return {"wo": cuda_kernels.int4_quantize_x(res[step["wo"][0]], None, XG),
                "w13": cuda_kernels.int4_quantize_x(torch.randn(1, step["w13"][0] // 2, device=dev,
                                                           dtype=torch.bfloat16), None, XG),
                "w2": cuda_kernels.int4_quantize_x(res[step["w2"][0]], None, XG)}

    for config in flow:  # decode's data flow with x in int8 throughout
        rows, warps, _, _, ring = config
        for epilogues, ring_wqkv in ((False, False), (True, False), (False, True), (True, True)):
            bufs = flow_buffers()
            def flow_chain(config=config, bufs=bufs, epilogues=epilogues, ring_wqkv=ring_wqkv):
                for layer in layers:
                    name, K, N = layer["name"], layer["K"], layer["N"]
                    if name == "wqkv" and not ring_wqkv:
                        triton_gemv(layer, xs[K], bufs["w2"], res[N], ones[:K])
                    else:
                        x_in = {"wqkv": bufs["w2"], "wo": xqs[K], "w13": bufs["wo"], "w2": bufs["w13"]}[name]
                        _, yq = gluon_ring_gemv(layer, x_in, xs[K], res[N], rows, warps, *ring,
                                                out_q=epilogues and name != "wqkv",
                                                g_out=ones[:N] if epilogues and name in ("wo", "w2") else None)
                        if yq is not None:
                            bufs[name] = yq
            wqkv_form = "ring" if ring_wqkv else "triton"
            report(f"int8 flow{' with epilogues' if epilogues else ''}: {wqkv_form} wqkv, {label(*config)}",
                   time_calls([flow_chain]), rows=rows, warps=warps, ring=list(ring), int8_flow=True,
                   epilogues=epilogues, wqkv=wqkv_form)

    loaded_only = set()
    for config in configs:
        rows, warps, each, fast, ring = config
        def gluon_chain(config=config):
            for layer in layers:
                gluon(layer, *config)
        report(label(*config), time_calls([gluon_chain]), rows=rows, warps=warps, each=each, fast=fast,
               **({"ring": list(ring)} if ring else {}))
        if a.mix:
            def mixed_chain(config=config):
                for layer in layers:
                    if layer["name"] in ("w13", "w2"):
                        gluon(layer, *config)
                    else:
                        K, N = layer["K"], layer["N"]
                        triton_gemv(layer, xs[K], xqs[K] if layer["name"] == "wo" else None, res[N], ones[:K])
            report("mix: triton wqkv, wo; " + label(*config), time_calls([mixed_chain]), rows=rows, warps=warps,
                   each=each, fast=fast, mix=True, **({"ring": list(ring)} if ring else {}))
        if a.load_only and not ring and (rows, warps, each) not in loaded_only:  # (once for FAST and not)
            loaded_only.add((rows, warps, each))
            def load_chain(rows=rows, warps=warps, each=each):
                for layer in layers:
                    gluon(layer, rows, warps, each, 0, None, True)
            report(f"gluon-load-only rows {rows} warps {warps} each {int(each)}", time_calls([load_chain]),
                   rows=rows, warps=warps, each=each, load_only=True)


if __name__ == "__main__":
    main()
