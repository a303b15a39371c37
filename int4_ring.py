"""The int4 GEMV of decode's int8 flow: one row of x in int8 times int4 weights at group 32, as persistent
programs that stream the weights through a ring of shared-memory stages (Gluon, Triton's lower-level
language; NVIDIA Hopper, sm_90). model.TransformerBlock.forward_int8 runs it for every GEMV of a layer on
one token of int4 decode, where it applies (usable): each GEMV reads its x in int8 and writes its output in
int8 too, for the GEMV after it.

Why a second int4 GEMV beside cuda_kernels.int4_gemv (Triton): decode reads each weight once a token, so a GEMV
is as fast as its weights stream. cuda_kernels.int4_gemv gives each program a few rows and asks for only its first
block of weights before its PDL wait (the wait for the kernel before it); the step's chain of GEMVs read
their bytes at 68% of the copy ceiling on the H200. Here each SM's programs (3 an SM) take tiles of 16
rows in turn, and copy their boxes (16 rows by 1024 columns of words and codes) by TMA into a ring of 6
stages, each issued 6 boxes ahead of its products, the first 6 before the PDL wait: memory stays busy
while the products run, and there are no waves of programs. The chain of the 7B step's 128 GEMVs took
1142.5 us against the Triton kernel's 1242.2 (benchmarks/gluon_gemv.py --int8-flow, run 100, BENCHMARKS.md).
In the decode step that gain did not show at first (675 against 673 tok/s, run 101): the attention kernel
between wqkv and wo took 254 registers a thread at 8 warps, all of an SM's, so no GEMV program could share
its SM. At 32 cache positions a loop step (ATTENTION_BLOCK_L, 146 registers) the step runs 689 tok/s against
676-678 (runs 104-105, BENCHMARKS.md session 21); the Triton kernel's step does not gain from that (671
against 675), so only this flow asks for it.

Its one demand: x in int8 already (cuda_kernels.int4_quantize_x's layout, groups of 16), staged in shared memory
once a program; rounding bf16 x in each program lost what the ring gained (run 98). The attention kernel
writes wo's x so; this kernel writes its own y so for the next GEMV (XQ_OUT: each tile of 16 rows is one
group, times the next RMSNorm's weight), so that x stays in int8 from GEMV to GEMV, beside the bf16 y
that the residual stream keeps.

The arithmetic is cuda_kernels.int4_gemv's XQ form (_int4_dp4a_block): per weight word two dp4a of x's bytes,
per group of 32 its scale and zero from the row's codes and units, RMSNorm's scale from x's sums of
squares, SwiGLU, the residual. The tests hold it to that kernel (tests/test_kernels.py, -m cuda).
Needs Triton 3.6 or newer (Gluon's TMA and mbarriers) on sm_90; model.py checks `usable` and falls back to
cuda_kernels.int4_gemv elsewhere (and where ENABLED, below, is off).
"""
import functools
import os
from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

import cuda_kernels

# On by default since session 21 (the 7B int4 g32 step 688.6-689.2 tok/s against 675.3-675.5 without, runs 104-105);
# GRAPHDECODE_INT4_RING=0 (bench.py --no-int4-ring) turns it off; read when an int4 layer loads (model.py).
ENABLED = os.environ.get("GRAPHDECODE_INT4_RING", "1") == "1"
# cache positions a loop step of the attention kernel in this flow (cuda_kernels.decode_attention's block_l): at 8 warps
# 146 registers a thread instead of the rule's 64 positions' 254, so the ring's programs (78-80 registers, 4 warps)
# share its SMs (runs 104-105: 32 positions 688.6 and 689.2 tok/s, 16 678.4, 64 676.1 and 678.0). The grouped kernel's
# only: where a KV head has one query head, cuda_kernels._attention_one_kernel runs at its own launch (session 23)
ATTENTION_BLOCK_L = 32
G, XG = 32, 16  # int4 groups, x's int8 groups
CHUNK = 128  # words a TMA box takes along a row (32 groups): also the block the products take
ROWS, STAGES, PER_SM, WARPS = 16, 6, 3, 4  # a tile's rows, boxes in flight a program, programs an SM, warps
# (run 98: 6 boxes and 3 an SM were the best of 5-7 boxes, 1-4 an SM; 16 rows: XQ_OUT's tile is one group)
# Launches by shape (cuda_kernels.int4_shape: "wide" is wqkv where N > 8192, as in Llama-2-7B; "square" wo, and wqkv
# of grouped-head models; "gate/up" w13; "long" w2): (programs an SM, boxes in flight, rows a tile, warps), in place
# of (PER_SM, STAGES, ROWS, WARPS). Rows apply only where a GEMV writes no y in int8 (XQ_OUT takes 16): in decode's
# int8 flow, wqkv and the last layer's w2. Timed in the whole 7B int4 g32 step (benchmarks/ring_launch.py, session
# 25): wqkv at 5 boxes 723.8-725.4 tok/s against 715.2-715.5 at 6 on two machines, +0.7 to +6 on a third (graphs
# 718.8-720.2 against 715.8); at 3 or 4 boxes, 2 or 4 an SM, 8 or 32 rows, 2 or 8 warps it lost (633-719); no
# other shape gained from another launch.
LAUNCHES: dict[str, tuple[int, int, int, int]] = {"wide": (3, 5, ROWS, WARPS)}
# GRAPHDECODE_INT4_RING_LAUNCH: launches by shape in place of LAUNCHES', "gate/up=4,6;wide=3,5,32,8" (rows and warps
# optional), for timing them in the whole step (benchmarks/ring_launch.py). Read at each launch, as the step is
# traced or captured.
LAUNCH = os.environ.get("GRAPHDECODE_INT4_RING_LAUNCH", "")
# The products' integer dots by _dot_masked (MASKED: the same numbers, 16 fewer instructions a thread and chunk step)
# and a tile's rows summed across the warp's lanes once (ONE_SUM, _row_sums: 20 shuffles and adds a thread and tile
# fewer; the units are powers of two, so the same sums in another order). On by default since session 30: in the 7B
# int4 g32 step (benchmarks/ring_launch.py, run 146, by hand-captured graph) MASKED alone 719.2-719.4 tok/s against
# 718.7-719.5, ONE_SUM alone 729.9-730.4, both 732.8 (graphs: 738.2 against 724.9). GRAPHDECODE_INT4_RING_MASKED=0 and
# GRAPHDECODE_INT4_RING_ONE_SUM=0 turn them off; read at each launch, as the step is traced or captured.
MASKED = os.environ.get("GRAPHDECODE_INT4_RING_MASKED", "1") == "1"
ONE_SUM = os.environ.get("GRAPHDECODE_INT4_RING_ONE_SUM", "1") == "1"
MAX_BOX_ROWS = 256  # rows x boxes in flight at most: 147 KB of shared memory a program, beside x's


@functools.lru_cache(maxsize=16)
def launch_override(text: str) -> dict[str, tuple[int, int, int, int]]:
    """GRAPHDECODE_INT4_RING_LAUNCH's launches: {shape: (programs an SM, boxes in flight, rows a tile, warps)}
    (cached: do not change the dict)."""
    launches = {}
    for shape, values in cuda_kernels.launch_parts(text):
        if len(values) == 2:  # (rows and warps left out)
            values = values + [ROWS, WARPS]
        per_sm, stages, rows, warps = values if len(values) == 4 else (0, 0, 0, 0)
        if shape not in cuda_kernels.INT4_LAUNCHES or not (1 <= per_sm <= 8 and 2 <= stages <= 16) \
                or rows not in (8, 16, 32) or warps not in (2, 4, 8) or rows * stages > MAX_BOX_ROWS:
            raise ValueError(f"GRAPHDECODE_INT4_RING_LAUNCH: {shape}={','.join(map(str, values))} is not "
                             f"SHAPE=PROGRAMS_AN_SM,BOXES[,ROWS,WARPS] (shapes {', '.join(cuda_kernels.INT4_LAUNCHES)}; "
                             f"1-8 programs an SM, 2-16 boxes, 8, 16 or 32 rows, 2, 4 or 8 warps, rows x boxes at "
                             f"most {MAX_BOX_ROWS})")
        launches[shape] = (per_sm, stages, rows, warps)
    return launches


def launch(N: int, K: int, swiglu: bool) -> tuple[int, int, int, int]:
    """(programs an SM, boxes in flight, rows a tile, warps) for a layer [N (2N: swiglu), K]."""
    shape = cuda_kernels.int4_shape(N, K, swiglu)
    return launch_override(LAUNCH).get(shape) or LAUNCHES.get(shape, (PER_SM, STAGES, ROWS, WARPS))


@gluon.jit
def _dp4a(w, x, acc):
    return gl.inline_asm_elementwise(asm="dp4a.u32.s32 $0, $1, $2, $3;", constraints="=r,r,r,r",
                                     args=[w, x, acc], dtype=gl.int32, is_pure=True, pack=1)


@gluon.constexpr_function
def _layouts(warps):
    """Both kernels' register layouts at `warps` warps: the words of a box [BN, GC, 4] (a thread a group, the
    warps over rows); FAST's view of the same threads' words as [BN, GC, x group, word]; x's words [BN, GC, 8]."""
    return (gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 32, 1], warps_per_cta=[warps, 1, 1],
                             order=[2, 1, 0]),
            gl.BlockedLayout(size_per_thread=[1, 1, 2, 2], threads_per_warp=[1, 32, 1, 1],
                             warps_per_cta=[warps, 1, 1, 1], order=[3, 2, 1, 0]),
            gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 32, 1], warps_per_cta=[warps, 1, 1],
                             order=[2, 1, 0]))


@gluon.jit
def _x_stage(xw_ptr, xs_ptr, n_x, xw_s, sx_s, qs_s, xsum_s, LX: gl.constexpr, L4: gl.constexpr, GC: gl.constexpr,
             CHUNKS: gl.constexpr, ZEROS: gl.constexpr):
    """FAST 3: all of x's words and its groups' scales, sx sums of q and sums into shared memory ([CHUNKS, GC, 8]
    and [CHUNKS, GC, 2] each), by cp.async, in one group: one L2 round trip for all chunks (zeros past K). Without
    ZEROS, x's sums are never read, so they are not copied: a buffer that is never read is dead to the compiler's
    shared-memory allocator, which then lays scratch (the norm's cross-warp sum) over it while the copy into it is
    still in flight (session 28: the norm's GEMVs with one-byte codes gave wrong numbers; seen offline, Triton 3.9,
    in the allocation offsets)."""
    X8: gl.constexpr = gl.SliceLayout(0, LX)
    XG2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))
    for c in gl.static_range(CHUNKS):
        at = c * (GC * 8) + gl.expand_dims(gl.arange(0, GC, layout=gl.SliceLayout(1, X8)), 1) * 8 \
            + gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, X8)), 0)
        async_copy.async_copy_global_to_shared(xw_s.index(c), xw_ptr + at, mask=at < 4 * n_x)  # (K / 4 words)
        xg = c * (GC * 2) + gl.expand_dims(gl.arange(0, GC, layout=gl.SliceLayout(1, XG2)), 1) * 2 \
            + gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, XG2)), 0)
        ok = xg < n_x
        async_copy.async_copy_global_to_shared(sx_s.index(c), xs_ptr + xg, mask=ok)
        async_copy.async_copy_global_to_shared(qs_s.index(c), xs_ptr + n_x + xg, mask=ok)
        if ZEROS:
            async_copy.async_copy_global_to_shared(xsum_s.index(c), xs_ptr + 2 * n_x + xg, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _x_smem(c, xw_s, sx_s, qs_s, xsum_s, L3: gl.constexpr, L4: gl.constexpr, LX: gl.constexpr, GC: gl.constexpr):
    """_x_fast's values for chunk c, from _x_stage's shared memory."""
    X8: gl.constexpr = gl.SliceLayout(0, LX)
    x_lo, x_hi = gl.split(gl.reshape(xw_s.index(c).load(X8), [GC, 4, 2]))
    XG2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))
    GV: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    q8 = gl.convert_layout(8 * gl.sum(qs_s.index(c).load(XG2), axis=1), GV)
    x_sum = gl.convert_layout(gl.sum(xsum_s.index(c).load(XG2), axis=1), GV)
    return (gl.convert_layout(x_lo, gl.SliceLayout(0, L3)), gl.convert_layout(x_hi, gl.SliceLayout(0, L3)),
            sx_s.index(c).load(XG2), q8, x_sum)


@gluon.jit
def _products_fast(acc_s, acc_z, w_smem, c_smem, x_lo, x_hi, sx, q8, x_sum, L3: gl.constexpr, L4: gl.constexpr,
                   BN: gl.constexpr, GC: gl.constexpr, ZEROS: gl.constexpr, MASKED: gl.constexpr = False):
    """_chunk with fewer instructions (FAST), on _x_fast's x: the dp4a of an x group's two words summed in
    integers before one conversion, and the codes' units left for the end, once a row (acc_s: the sum over
    groups of the scale code times (sum of sx dot - 8 sx sum(q)); acc_z: of the zero code times sum(x)). Without
    ZEROS the codes are one byte each, the scale's, and acc_z stays zero."""
    if MASKED:  # (the same integers with fewer instructions: _dot_masked)
        dot = _dot_masked(w_smem, x_lo, x_hi, L3, L4, BN, GC)
    else:
        w = w_smem.load(L3)  # [BN, GC, 4]
        dot = _dp4a((w >> 4) & 0x0F0F0F0F, gl.expand_dims(x_hi, 0),
                    _dp4a(w & 0x0F0F0F0F, gl.expand_dims(x_lo, 0), gl.zeros_like(w)))
        dot = gl.sum(gl.convert_layout(gl.reshape(dot, [BN, GC, 2, 2]), L4), axis=3)  # [BN, GC, 2]: an x group's
    part = gl.sum(dot.to(gl.float32) * gl.expand_dims(sx, 0), axis=2)  # [BN, GC]
    codes = c_smem.load(gl.SliceLayout(2, gl.SliceLayout(3, L4))).to(gl.int32)  # (sign-extended: >> 8 the zero's)
    acc_s += (part - gl.expand_dims(q8, 0)) * (codes & 255).to(gl.float32)
    if ZEROS:
        acc_z += (codes >> 8).to(gl.float32) * gl.expand_dims(x_sum, 0)
    return acc_s, acc_z


@gluon.jit
def _dot_masked(w_smem, x_lo, x_hi, L3: gl.constexpr, L4: gl.constexpr, BN: gl.constexpr, GC: gl.constexpr):
    """MASKED: _products_fast's integer dots of each x group [BN, GC, 2], with the high nibbles masked in place (16
    times their value: dp4a takes the weight's bytes unsigned) instead of shifted down, the two words of an x group
    chained in one dp4a sum for the low nibbles and one for the high, and the high sum shifted down once (it is a
    multiple of 16): two masks a word and a shift an x group, against a shift and two masks a word and an add."""
    w = gl.convert_layout(gl.reshape(w_smem.load(L3), [BN, GC, 2, 2]), L4)  # (the same registers)
    w0, w1 = gl.split(w)  # [BN, GC, 2]: an x group's first and second word
    xl0, xl1 = gl.split(gl.reshape(x_lo, [GC, 2, 2]))
    xh0, xh1 = gl.split(gl.reshape(x_hi, [GC, 2, 2]))
    WL: gl.constexpr = w0.type.layout
    XL: gl.constexpr = gl.SliceLayout(0, WL)
    lo = _dp4a(w1 & 0x0F0F0F0F, gl.expand_dims(gl.convert_layout(xl1, XL), 0),
               _dp4a(w0 & 0x0F0F0F0F, gl.expand_dims(gl.convert_layout(xl0, XL), 0), gl.zeros_like(w0)))
    hi = _dp4a(w1 & -252645136, gl.expand_dims(gl.convert_layout(xh1, XL), 0),  # (0xF0F0F0F0)
               _dp4a(w0 & -252645136, gl.expand_dims(gl.convert_layout(xh0, XL), 0), gl.zeros_like(w0)))
    return gl.convert_layout(lo + (hi >> 4), gl.SliceLayout(3, L4))


@gluon.jit
def _row_sums(acc_s, acc_z, unit_s, unit_z, RG: gl.constexpr, ZEROS: gl.constexpr, ONE_SUM: gl.constexpr):
    """A tile's rows [BN] from its products [BN, GC]: the scale products' sum over groups times the row's scale unit
    plus the zero products' times its zero unit. The sum over groups crosses the warp's lanes (a shuffle and an add
    each of 5 steps, a row held); ONE_SUM weighs the products by the units first, so with ZEROS one sum crosses
    them instead of two (and without, the same numbers as with zeros all 0). The units are powers of two
    (model.int4_grid_unit), so each weighing is exact: the same additions, in another order."""
    u_s = gl.convert_layout(unit_s, RG)
    u_z = gl.convert_layout(unit_z, RG)
    if ONE_SUM and ZEROS:
        rows = gl.sum(acc_s * gl.expand_dims(u_s, 1) + acc_z * gl.expand_dims(u_z, 1), axis=1)
    elif ONE_SUM:
        rows = gl.sum(acc_s * gl.expand_dims(u_s, 1), axis=1)
    else:
        rows = u_s * gl.sum(acc_s, axis=1) + u_z * gl.sum(acc_z, axis=1)
    return rows


@gluon.jit
def _ring_issue(i, w_desc, c_desc, w_smem, c_smem, bars, pid, P, N, HALVES: gl.constexpr, CHUNKS: gl.constexpr,
                STAGES: gl.constexpr, BN: gl.constexpr, GC: gl.constexpr):
    """RING: box i of this program's sequence (its tiles pid, pid + P, ...; in each, chunk by chunk, gate then up)
    copied by TMA into stage i % STAGES, behind that stage's mbarrier."""
    s = i % STAGES
    h = i % HALVES
    k = i // HALVES  # the chunk step
    row0 = (pid + (k // CHUNKS) * P) * BN
    c = k % CHUNKS
    bar = bars.index(s)
    mbarrier.expect(bar, w_desc.block_type.nbytes + c_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [row0 + h * N, c * 4 * GC], bar, w_smem.index(s))
    tma.async_copy_global_to_shared(c_desc, [row0 + h * N, c * GC], bar, c_smem.index(s))


@gluon.jit
def _ring_tile_inputs(u_ptr, r_ptr, t, pid, P, N, RL: gl.constexpr, BN: gl.constexpr, HALVES: gl.constexpr,
                      RESIDUAL: gl.constexpr):
    """Local tile t's rows' units (scale's and zero's; gate's then up's) and residual."""
    rn = (pid + t * P) * BN + gl.arange(0, BN, layout=RL)
    rows = gl.minimum(rn, N - 1)
    units = (gl.load(u_ptr + rows * 2), gl.load(u_ptr + rows * 2 + 1),
             gl.load(u_ptr + (rows + (HALVES - 1) * N) * 2), gl.load(u_ptr + (rows + (HALVES - 1) * N) * 2 + 1))
    if RESIDUAL:
        r = gl.load(r_ptr + rn, mask=rn < N, other=0).to(gl.float32)
    else:
        r = gl.zeros([BN], gl.float32, RL)
    return units, r


@gluon.jit
def _ring_tile_go(go_ptr, t, pid, P, N, LA: gl.constexpr):
    """XQ_OUT with GO: local tile t's 16 values of the next norm's weight, [4, 4] in layout LA."""
    rn = ((pid + t * P) * 16 + 4 * gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, LA)), 1)
          + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, LA)), 0))
    return gl.load(go_ptr + rn, mask=rn < N, other=0).to(gl.float32)


@gluon.jit
def _int4_gemv_ring_kernel(w_desc, c_desc, xw_ptr, xs_ptr, u_ptr, r_ptr, y_ptr, N, K, eps, w_unscale,
                           yw_ptr, ys_ptr, go_ptr,
                           NORM: gl.constexpr, RESIDUAL: gl.constexpr, SWIGLU: gl.constexpr, BN: gl.constexpr,
                           CHUNKS: gl.constexpr, NX_P2: gl.constexpr, STAGES: gl.constexpr,
                           XQ_OUT: gl.constexpr, GO: gl.constexpr, ZEROS: gl.constexpr, MASKED: gl.constexpr,
                           ONE_SUM: gl.constexpr):
    """y [N] = residual + [SwiGLU of] RMSNorm(x) @ W.T for one row of x in int8 (int4_quantize_x, groups of 16;
    times the norm's weight already: NORM takes only its scale, from x's sums of squares) and int4 words
    [N (2N: SWIGLU, gate above up), K / 8] with int16 codes [., K / 32] and units [., 2] (cuda_kernels.int4_layout
    with units, dp4a), as cuda_kernels.int4_gemv's XQ form computes it. x is staged in shared memory once a program
    (_x_stage), the products are _products_fast's. Persistent programs: each takes tiles of BN rows pid, pid + P, ... (P programs), their words and codes a box (BN rows, one
    chunk of K, gate or up) at a time through a ring of STAGES boxes in shared memory, each box's copy issued
    STAGES boxes ahead of its products, the first STAGES before the PDL wait. Memory stays busy while the
    products run, and an SM's boxes stream without waves of programs. XQ_OUT (BN 16): y also in int8 for the
    next int4 GEMV (int4_quantize_x's layout, groups of 16, at yw_ptr and ys_ptr), each tile one group, of y times
    go_ptr's norm weight (GO) with y's squares, as the attention kernel writes wo's x. ZEROS off: codes [., K / 32]
    in int8, the scale's alone, for layers whose zeros are all 0 (one code byte a group instead of two)."""
    GC: gl.constexpr = 32
    HALVES: gl.constexpr = 2 if SWIGLU else 1
    gl.static_assert(STAGES >= HALVES)  # (a chunk step waits for gate and up at once)
    gl.static_assert(BN == 16 or not XQ_OUT)  # (a tile is one group of y in int8)
    L3: gl.constexpr = _layouts(gl.num_warps())[0]
    L4: gl.constexpr = _layouts(gl.num_warps())[1]
    LX: gl.constexpr = _layouts(gl.num_warps())[2]
    LG: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))
    RG: gl.constexpr = gl.SliceLayout(1, LG)
    RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    PLAIN3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    gdc_launch_dependents()
    my_tiles = (gl.cdiv(N, BN) - pid + P - 1) // P
    total = my_tiles * (CHUNKS * HALVES)  # boxes
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 4 * GC], w_desc.layout)
    CT: gl.constexpr = gl.int16 if ZEROS else gl.int8
    c_smem = gl.allocate_shared_memory(CT, [STAGES, BN, GC], c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):  # the first STAGES boxes, before the wait
        if i < total:
            _ring_issue(i, w_desc, c_desc, w_smem, c_smem, bars, pid, P, N, HALVES, CHUNKS, STAGES, BN, GC)
    gdc_wait()  # x and the residual were written by the kernel before
    X3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    # (x's buffers for a power of 2 of chunks, at least 4, as measured: benchmarks/gluon_gemv.py's rounding of bf16 x
    # needed it; w2's K = 11008 then takes 84 KB a program, 2 an SM)
    CHUNKS4: gl.constexpr = 4 if CHUNKS <= 4 else 8 if CHUNKS <= 8 else 16 if CHUNKS <= 16 else 32
    xw_s = gl.allocate_shared_memory(gl.int32, [CHUNKS4, GC, 8], X3)
    sx_s = gl.allocate_shared_memory(gl.float32, [CHUNKS4, GC, 2], X3)
    qs_s = gl.allocate_shared_memory(gl.float32, [CHUNKS4, GC, 2], X3)
    xsum_s = gl.allocate_shared_memory(gl.float32, [CHUNKS4, GC, 2], X3)
    n_x = gl.multiple_of(K // 16, 16)
    _x_stage(xw_ptr, xs_ptr, n_x, xw_s, sx_s, qs_s, xsum_s, LX, L4, GC, CHUNKS, ZEROS)
    units, r = _ring_tile_inputs(u_ptr, r_ptr, 0, pid, P, N, RL, BN, HALVES, RESIDUAL)
    # XQ_OUT: a tile's 16 values of y as [4, 4], all in every thread (its sums without barriers)
    LA: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 4], threads_per_warp=[32, 1],
                                        warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
    go = gl.zeros([4, 4], gl.float32, LA)
    if GO:
        go = _ring_tile_go(go_ptr, 0, pid, P, N, LA)
    unscale = w_unscale
    if NORM:  # RMSNorm's scale, from x's sums of squares (x was rounded times the norm's weight already)
        SL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                            warps_per_cta=[gl.num_warps()], order=[0])
        xg = gl.arange(0, NX_P2, layout=SL)
        sq = gl.load(xs_ptr + 3 * n_x + xg, mask=xg < n_x, other=0)
        unscale = unscale * gl.rsqrt(gl.sum(sq, axis=0) / K + eps)
    async_copy.wait_group(0)
    gl.thread_barrier()  # x in shared memory, for every warp
    acc_s = gl.zeros([BN, GC], gl.float32, LG)
    acc_z = gl.zeros([BN, GC], gl.float32, LG)
    up_s = gl.zeros([BN, GC], gl.float32, LG)
    up_z = gl.zeros([BN, GC], gl.float32, LG)
    for k in range(my_tiles * CHUNKS):  # chunk steps
        c = k % CHUNKS
        x_lo, x_hi, sx, q8, x_sum = _x_smem(c, xw_s, sx_s, qs_s, xsum_s, L3, L4, LX, GC)
        for h in gl.static_range(HALVES):
            box = k * HALVES + h
            s = box % STAGES
            mbarrier.wait(bars.index(s), (box // STAGES) & 1)
            w_c = w_smem.index(s)._reinterpret(gl.int32, [BN, GC, 4], PLAIN3)
            c_c = c_smem.index(s)._reinterpret(CT, [BN, GC], PLAIN2)
            if h == 0:
                acc_s, acc_z = _products_fast(acc_s, acc_z, w_c, c_c, x_lo, x_hi, sx, q8, x_sum, L3, L4, BN, GC,
                                              ZEROS, MASKED)
            else:
                up_s, up_z = _products_fast(up_s, up_z, w_c, c_c, x_lo, x_hi, sx, q8, x_sum, L3, L4, BN, GC,
                                            ZEROS, MASKED)
        gl.thread_barrier()  # every warp has read this step's stages before they are refilled
        for h in gl.static_range(HALVES):
            box = k * HALVES + h
            if box + STAGES < total:
                _ring_issue(box + STAGES, w_desc, c_desc, w_smem, c_smem, bars, pid, P, N, HALVES, CHUNKS, STAGES, BN,
                            GC)
        if c == CHUNKS - 1:  # the tile's last chunk: its rows out, then the next tile's inputs asked for
            t = k // CHUNKS
            out = gl.convert_layout(_row_sums(acc_s, acc_z, units[0], units[1], RG, ZEROS, ONE_SUM), RL) * unscale
            if SWIGLU:
                up = gl.convert_layout(_row_sums(up_s, up_z, units[2], units[3], RG, ZEROS, ONE_SUM), RL) * unscale
                out = out / (1 + gl.exp(-out)) * up
            if RESIDUAL:
                out += r
            rn = (pid + t * P) * BN + gl.arange(0, BN, layout=RL)
            gl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=rn < N)
            if XQ_OUT:  # (the group is the tile: its 16 values, rounded as stored, all in each thread)
                yv = gl.convert_layout(gl.reshape(out.to(y_ptr.dtype.element_ty).to(gl.float32), [4, 4]), LA)
                yu = yv * go if GO else yv
                y_amax = gl.max(gl.max(gl.abs(yu), axis=1), axis=0)
                yq = gl.floor(yu * gl.where(y_amax > 0, 127 / y_amax, 0) + 0.5).to(gl.int32)
                words = gl.sum((yq & 255) << gl.expand_dims(8 * gl.arange(0, 4, layout=gl.SliceLayout(0, LA)), 0),
                               axis=1)
                tile = pid + t * P
                rw = tile * 4 + gl.arange(0, 4, layout=gl.SliceLayout(1, LA))
                gl.store(yw_ptr + rw, words, mask=rw * 4 < N)
                n_y = N // 16
                y_sx = y_amax / 127
                gl.store(ys_ptr + tile, y_sx)
                gl.store(ys_ptr + n_y + tile, y_sx * gl.sum(gl.sum(yq, axis=1), axis=0).to(gl.float32))
                gl.store(ys_ptr + 2 * n_y + tile, gl.sum(gl.sum(yu, axis=1), axis=0))
                gl.store(ys_ptr + 3 * n_y + tile, gl.sum(gl.sum(yv * yv, axis=1), axis=0))
            units, r = _ring_tile_inputs(u_ptr, r_ptr, gl.minimum(t + 1, my_tiles - 1), pid, P, N, RL, BN, HALVES,
                                         RESIDUAL)
            if GO:
                go = _ring_tile_go(go_ptr, gl.minimum(t + 1, my_tiles - 1), pid, P, N, LA)
            acc_s = gl.zeros([BN, GC], gl.float32, LG)
            acc_z = gl.zeros([BN, GC], gl.float32, LG)
            up_s = gl.zeros([BN, GC], gl.float32, LG)
            up_z = gl.zeros([BN, GC], gl.float32, LG)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def descriptors(words: torch.Tensor, codes: torch.Tensor, rows: int):
    """TMA descriptors of a layer's words [R, K/8] int32 and codes [R, K/32] int16 (or int8: scales only), a box of
    `rows` rows by one chunk (128 words, 32 codes); reads past the end give zeros."""
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    c_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * codes.element_size(), rank=2)
    return (TensorDescriptor(words, list(words.shape), list(words.stride()), [rows, CHUNK], w_layout),
            TensorDescriptor(codes, list(codes.shape), list(codes.stride()), [rows, CHUNK // 4], c_layout))


def usable(words: torch.Tensor, codes: Optional[torch.Tensor], groupsize: int) -> bool:
    """Whether an int4 layer in cuda_kernels.int4_gemv's layout (words [R, K/8] int32, codes [R, K/32] int16, or
    None for float16 scales) can run here: ENABLED, CUDA sm_90 (the only GPU measured; TMA from sm_90 on),
    group 32 with codes, K a multiple of 256 and at least 512 (x's staging), R a multiple of 32 (tiles of 16 rows
    that never straddle SwiGLU's gate and up halves)."""
    if not (ENABLED and words.is_cuda and torch.version.hip is None and codes is not None and groupsize == G):
        return False
    K = words.shape[1] * 8
    return (torch.cuda.get_device_capability(words.device)[0] == 9 and K % 256 == 0 and K >= 512
            and words.shape[0] % 32 == 0 and codes.dtype == torch.int16 and codes.shape == (words.shape[0], K // G))


def code_bytes(codes: torch.Tensor) -> torch.Tensor:
    """A layer's int16 codes [R, K/32] whose zeros' codes are all 0 -> the scales' codes alone, int8 (0..255 as
    two's complement), each row padded to a multiple of 16 bytes for TMA (a view [R, K/32] of it). For layers
    quantized without zeros (symmetric): one code byte a group of 32 weights instead of two."""
    if codes.dtype != torch.int16 or bool((codes.int() >> 8).ne(0).any()):
        raise ValueError("int4_ring.code_bytes: codes must be int16 with every zero's code 0")
    R, n = codes.shape
    padded = torch.zeros(R, -(-n // 16) * 16, dtype=torch.int8, device=codes.device)
    padded[:, :n] = (codes.int() & 255).to(torch.uint8).view(torch.int8)
    return padded[:, :n]


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv(x: torch.Tensor, xq: torch.Tensor, words: torch.Tensor, codes: torch.Tensor, units: torch.Tensor,
         w_unscale: float, norm: bool = False, eps: float = 0.0, residual: Optional[torch.Tensor] = None,
         swiglu: bool = False, out_q: bool = False, out_norm_weight: Optional[torch.Tensor] = None,
         rows: Optional[int] = None, stages: Optional[int] = None, per_sm: Optional[int] = None,
         warps: Optional[int] = None):
    """(y [..., N] in x's dtype, y in int8 or None): residual + [SwiGLU of] RMSNorm @ W.T of one row, x in int8
    `xq` (int4_quantize_x(x, norm's weight), groups of 16; norm: apply RMSNorm's scale, eps), x giving only
    the shape and dtype. out_q: y also in int8 (int4_quantize_x(y, out_norm_weight), groups of 16, as this
    kernel rounds it: codes within 1 of that function's). rows, stages, per_sm, warps: launch()'s where None
    (rows 16 with out_q). codes: int16 (scale's code in the low byte, zero's in the high), or, for a layer whose
    zeros are all 0, int8 scale codes (0..255 as two's complement), rows 16 bytes apart (TMA's rule), a view of a
    padded tensor where K / 32 is not a multiple of 16 (code_bytes)."""
    K = x.shape[-1]
    R = words.shape[0]
    N = R // 2 if swiglu else R
    shape_launch = launch(N, K, swiglu)
    per_sm = shape_launch[0] if per_sm is None else per_sm
    stages = shape_launch[1] if stages is None else stages
    rows = (XG if out_q else shape_launch[2]) if rows is None else rows
    warps = shape_launch[3] if warps is None else warps
    if per_sm < 1 or stages < (2 if swiglu else 1):
        raise ValueError(f"int4_ring.gemv takes at least 1 program an SM and {2 if swiglu else 1} boxes in flight "
                         f"(got {per_sm}, {stages})")
    if x.numel() != K or xq.dtype != torch.int32 or xq.numel() != K // 2 or not xq.is_contiguous():
        raise ValueError(f"int4_ring.gemv takes one row of x and its int8 form in groups of 16 "
                         f"(got x {tuple(x.shape)}, xq {xq.dtype} {xq.numel()})")
    if words.shape[1] * 8 != K or codes.shape != (R, K // G) or units.shape != (R, 2) or units.dtype != torch.float32:
        raise ValueError(f"int4_ring.gemv: words {tuple(words.shape)}, codes {tuple(codes.shape)} and units "
                         f"{tuple(units.shape)} do not fit K={K} at group {G}")
    if K % 256 or K < 512 or (out_q and (rows != XG or N % XG)):
        raise ValueError(f"int4_ring.gemv takes K a multiple of 256 from 512 (got {K}), and for y in int8 "
                         f"16 rows a tile and N a multiple of 16 (got {rows}, {N})")
    if codes.dtype not in (torch.int16, torch.int8) or codes.stride(1) != 1 or codes.stride(0) * codes.element_size() % 16:
        raise ValueError(f"int4_ring.gemv takes codes in int16, or in int8 for scales alone, their rows 16 bytes apart "
                         f"(got {codes.dtype}, strides {codes.stride()})")
    y = torch.empty(N, device=x.device, dtype=x.dtype)
    yq = torch.empty(N // 2, device=x.device, dtype=torch.int32) if out_q else None
    programs = min(triton.cdiv(N, rows), per_sm * _sms(x.device.index or 0))
    _int4_gemv_ring_kernel[(programs,)](
        *descriptors(words, codes, rows), xq[:K // 4], xq[K // 4:].view(torch.float32), units,
        residual.reshape(N) if residual is not None else y, y, N, K, eps, w_unscale,
        yq[:N // 4] if out_q else xq, yq[N // 4:].view(torch.float32) if out_q else xq,
        out_norm_weight if out_norm_weight is not None else y,
        NORM=norm, RESIDUAL=residual is not None, SWIGLU=swiglu, BN=rows, CHUNKS=-(-(K // 8) // CHUNK),
        NX_P2=triton.next_power_of_2(K // XG), STAGES=stages, XQ_OUT=out_q, GO=out_q and out_norm_weight is not None,
        ZEROS=codes.dtype == torch.int16, MASKED=MASKED, ONE_SUM=ONE_SUM, num_warps=warps,
        **({"launch_pdl": True} if cuda_kernels.pdl(x) else {}))
    return y.view(*x.shape[:-1], N), yq


def matmul(x, xq, words, codes, units, w_unscale, norm=False, eps=0.0, residual=None, swiglu=False, out_q=False,
           out_norm_weight=None):
    """gemv, through the custom op (cuda_kernels.OPAQUE, as cuda_kernels.int4_matmul; always inside torch.compile, which
    cannot trace a Gluon launch) or directly."""
    if cuda_kernels.OPAQUE or torch.compiler.is_compiling():
        y, yq = gemv_op(x, xq, words, codes, units, w_unscale, norm, eps, residual, swiglu, out_q, out_norm_weight)
        return y, yq if out_q else None
    return gemv(x, xq, words, codes, units, w_unscale, norm, eps, residual, swiglu, out_q, out_norm_weight)


@torch.library.custom_op("graphdecode::int4_ring_gemv", mutates_args=())
def gemv_op(x: torch.Tensor, xq: torch.Tensor, words: torch.Tensor, codes: torch.Tensor, units: torch.Tensor,
            w_unscale: float, norm: bool, eps: float, residual: Optional[torch.Tensor], swiglu: bool, out_q: bool,
            out_norm_weight: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    y, yq = gemv(x, xq, words, codes, units, w_unscale, norm, eps, residual, swiglu, out_q, out_norm_weight)
    return y, yq if out_q else xq.new_empty(0)  # (an op's outputs are tensors, never its inputs)


@gemv_op.register_fake
def _(x, xq, words, codes, units, w_unscale, norm, eps, residual, swiglu, out_q, out_norm_weight):
    N = words.shape[0] // (2 if swiglu else 1)
    return x.new_empty((*x.shape[:-1], N)), xq.new_empty(N // 2 if out_q else 0)
