"""Exploration: faster Triton kernels for the one-row int8 weight-only GEMV, y = (x @ W.T) * scale,
x [1, K] bf16, W [N, K] int8, one bf16 scale per row. Self-contained (does not use cuda_kernels.py), so it
can be run while cuda_kernels.py changes. Each candidate kernel is checked against a float32 reference
on every shape, then timed over a grid of launch configurations as CUDA graph replays over >= 1 GiB
of weight copies (as benchmarks/gemv.py does), the best of each re-timed with 10 replays.

Variants (all accumulate in float32; the weight stream is the only large read). Compiled for sm_90
with Triton 3.9 offline, the current formulation's K loop holds 8 shared-memory barriers per
iteration: Triton loads x [BK] in a 1D layout and moves it into the weight tile's layout through
shared memory every iteration ("xload" removes that), and ~5.2 instructions per weight; fold gets ~3.
  base         cuda_kernels.py's current one-row formulation (copied): acc[BN, BK] += float(w) * x,
               int8 -> float through 2^23 + 128 + w (int add + float subtract), one reduction at the end
  fold         xload + int8 -> float by inline PTX without the float subtract: one xor per 4 weights
               and one prmt per weight build f = 1 + (w + 128) / 2^15 (w + 128 in mantissa bits
               8..15 of 1.0); sum f x = sum x + sum (w + 128) x / 2^15, so y = 2^15 (S - X) - 128 X
               with X = sum x from one extra pass over x per program (relative error ~1e-4);
               ~3.3 instructions per weight (PRMT + FFMA + 1/4 LOP3 + x and addressing); xsum=1
               sums x inside the main loop instead of after it. conv=4: the same with plain integer
               ops (what the interpreter checks)
  xload        base's math with x loaded as a [BN, BK] tile of row stride 0 and 8-byte weight vectors
               (tl.max_contiguous 8), which gives x the weight tile's layout: no shared memory, no
               barrier; also an unmasked main loop (the K tail, e.g. w2's K = 11008, in a separate
               masked loop) and UNROLL in {1, 2, 4} weight tiles loaded per iteration before use
  prmt         xload with int8 -> float by PTX: xor per 4, prmt per weight to 2^23 + (w + 128)
               (CUTLASS's trick), then the float subtract; a few configs with the 1D x load
  rowsum       per-iteration reduction, acc[BN] += sum(float(w) * x, 1): the accumulator no longer
               grows with the tile, so larger tiles fit in registers (Triton emits FMUL + a FADD tree,
               not FFMA chains: ~6.5 instructions per weight)
  rowsum_prmt  rowsum with the prmt conversion
  mma          tensor cores: acc[BN, 16] += W_tile(fp16, via xor + prmt + sub.f16x2) @ [x | 0] in
               float16, float32 accumulation; Triton pipelines the weight tiles with cp.async
               (num_stages) and uses wgmma for BN >= 64, mma.sync below; x goes through fp16
  words        weights as int32 words [N, K/4], x as int64 words (4 bf16), unpacked with shifts and
               masks; xload 1 / 0 as above
  unroll       base's 1D x load (barriers kept) with the unmasked main loop and UNROLL 1, 2, 4
  hints        xload, UNROLL 2, with .cg or evict_first on the weight loads (both at once is an
               invalid PTX combination)
  cvt          references for the slow paths: plain w.to(float32), and w.to(float16).to(float32)

    python benchmarks/int8_variants.py [--quick] [--json PATH] [--variants a,b] [--budget-s 330]
    TRITON_INTERPRET=1 python benchmarks/int8_variants.py --interpret-check   # CPU, correctness only
"""
import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from gemv import time_calls  # noqa: E402  (CUDA-graph replays over weight copies)

L2_MULTIPLE_BYTES = 1 << 30  # each timed graph reads at least this much weight
SHAPES = {"wqkv": (12288, 4096), "wo": (4096, 4096), "w13": (22016, 4096), "w2": (4096, 11008),
          "output": (32000, 4096)}
LAYER = ("wqkv", "wo", "w13", "w2")  # one transformer layer


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _to_f32(w, CONV: tl.constexpr):
    """int8 tensor -> float32. 0: bit pattern of 2^23 + 128 + w (cuda_kernels.py). 1: PTX xor + prmt,
    4 weights per 32-bit register, then the float subtract. 2: plain int-to-float. 3: through
    float16. 4, 5: "fold", NOT w itself but 1 + (w + 128) / 2^15 (see _x_sum): 4 with integer ops,
    5 with one prmt per weight and no float subtract."""
    if CONV == 0:
        f = (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    elif CONV == 1:
        f = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 u;
            xor.b32 u, $4, 0x80808080;
            prmt.b32 $0, u, 0x4B000000, 0x7440;
            prmt.b32 $1, u, 0x4B000000, 0x7441;
            prmt.b32 $2, u, 0x4B000000, 0x7442;
            prmt.b32 $3, u, 0x4B000000, 0x7443;
            }
            """,
            constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4) - 8388736.0
    elif CONV == 2:
        f = w.to(tl.float32)
    elif CONV == 3:
        f = w.to(tl.float16).to(tl.float32)
    elif CONV == 4:  # fold, plain integer ops: 1 + (w + 128) / 2^15
        f = (((w.to(tl.int32) + 128) << 8) | 0x3F800000).to(tl.float32, bitcast=True)
    else:  # CONV 5, fold, PTX: one prmt per weight places w + 128 in bits 8..15 of the float 1.0
        f = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 u;
            xor.b32 u, $4, 0x80808080;
            prmt.b32 $0, u, 0x3F800000, 0x7604;
            prmt.b32 $1, u, 0x3F800000, 0x7614;
            prmt.b32 $2, u, 0x3F800000, 0x7624;
            prmt.b32 $3, u, 0x3F800000, 0x7634;
            }
            """,
            constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4)
    return f


@triton.jit
def _x_sum(x_ptr, K, BLOCK_K: tl.constexpr):
    """X = sum of x (float32), one pass over x: for the fold conversions (CONV 4, 5), whose floats
    are f = 1 + (w + 128) / 2^15 with no subtraction per weight: S = sum f x, and
    y = sum w x = 2^15 (S - X) - 128 X. The cancellation costs ~8 of float32's 24 bits: relative
    error ~1e-4, under bf16's rounding of y."""
    rk = tl.arange(0, BLOCK_K)
    xs = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xs += tl.load(x_ptr + k0 + rk, mask=(k0 + rk) < K, other=0).to(tl.float32)
    return tl.sum(xs, axis=0)


@triton.jit
def _load_w(p, HINT: tl.constexpr):
    if HINT == 1:
        w = tl.load(p, cache_modifier=".cg")
    elif HINT == 2:
        w = tl.load(p, eviction_policy="evict_first")
    else:
        w = tl.load(p)
    return w


@triton.jit
def gemv_base(x_ptr, w_ptr, scale_ptr, y_ptr, N, K, EVEN: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """cuda_kernels.py's _gemv_kernel for one row, int8, no split/norm/residual (a copy)."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for b in range(0, tl.cdiv(K, BLOCK_K)):
        rk = b * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        if EVEN:
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
            x = tl.load(x_ptr + rk).to(tl.float32)
        else:
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            x = tl.load(x_ptr + rk, mask=k_ok, other=0).to(tl.float32)
        acc += ((w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0) * x[None, :]
    out = tl.sum(acc, axis=1)
    out *= tl.load(scale_ptr + rn, mask=n_ok, other=0).to(tl.float32)
    tl.store(y_ptr + rn, out, mask=n_ok)


@triton.jit
def _load_x(x_ptr, offs, rn, XLOAD: tl.constexpr, mask=None):
    """x[offs] in float32, shaped to multiply a [BN, BK] weight tile. XLOAD 0: a 1D load broadcast
    over rows (Triton moves it into the tile's layout through shared memory, with barriers, every
    iteration). XLOAD 1: a 2D load with row stride 0, which gets the weight tile's own layout (the
    caller limits the weight vectors to 8 bytes so both have 8 elements per thread): no shared
    memory; the compiler loads each x vector once per thread."""
    if XLOAD == 1:
        if mask is None:
            x = tl.load(x_ptr + offs[None, :] + 0 * rn[:, None]).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs[None, :] + 0 * rn[:, None], mask=mask[None, :], other=0).to(tl.float32)
    else:
        if mask is None:
            x = tl.load(x_ptr + offs).to(tl.float32)[None, :]
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.float32)[None, :]
    return x


@triton.jit
def gemv_tiled2d(x_ptr, w_ptr, scale_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UNROLL: tl.constexpr, CONV: tl.constexpr, HINT: tl.constexpr, XLOAD: tl.constexpr,
                 XSUM: tl.constexpr):
    """acc[BN, BK] += float(w) * x with UNROLL weight tiles loaded per iteration before use; rows past
    N are clamped to N - 1 for the loads (no mask in the main loop) and not stored; the K tail that
    does not fill a whole UNROLL * BK chunk goes through a masked loop of BK steps. Fold (CONV 4, 5)
    needs X = sum x: XSUM 0 in a pass after the loop, 1 inside it (an extra 1D x load, from L1)."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = w_ptr + tl.minimum(rn, N - 1)[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    if XLOAD == 1:
        rk = tl.max_contiguous(rk, 8)  # 8-byte weight vectors: the same layout as 8 bf16 of x
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if XSUM == 1:
        r1 = tl.arange(0, BLOCK_K)
        xs = tl.zeros((BLOCK_K,), tl.float32)
    k_full = (K // (BLOCK_K * UNROLL)) * (BLOCK_K * UNROLL)
    for k0 in range(0, k_full, BLOCK_K * UNROLL):
        p = rows + (k0 + rk)[None, :]
        w0 = _load_w(p, HINT)
        if UNROLL >= 2:
            w1 = _load_w(p + BLOCK_K, HINT)
        if UNROLL >= 4:
            w2 = _load_w(p + 2 * BLOCK_K, HINT)
            w3 = _load_w(p + 3 * BLOCK_K, HINT)
        if XSUM == 1:
            xs += tl.load(x_ptr + k0 + r1).to(tl.float32)
            if UNROLL >= 2:
                xs += tl.load(x_ptr + k0 + BLOCK_K + r1).to(tl.float32)
            if UNROLL >= 4:
                xs += tl.load(x_ptr + k0 + 2 * BLOCK_K + r1).to(tl.float32)
                xs += tl.load(x_ptr + k0 + 3 * BLOCK_K + r1).to(tl.float32)
        acc += _to_f32(w0, CONV) * _load_x(x_ptr, k0 + rk, rn, XLOAD)
        if UNROLL >= 2:
            acc += _to_f32(w1, CONV) * _load_x(x_ptr, k0 + BLOCK_K + rk, rn, XLOAD)
        if UNROLL >= 4:
            acc += _to_f32(w2, CONV) * _load_x(x_ptr, k0 + 2 * BLOCK_K + rk, rn, XLOAD)
            acc += _to_f32(w3, CONV) * _load_x(x_ptr, k0 + 3 * BLOCK_K + rk, rn, XLOAD)
    for k0 in range(k_full, K, BLOCK_K):  # tail (none when UNROLL * BK divides K)
        k_ok = (k0 + rk) < K
        w = tl.load(rows + (k0 + rk)[None, :], mask=k_ok[None, :], other=0)
        acc += _to_f32(w, CONV) * _load_x(x_ptr, k0 + rk, rn, XLOAD, k_ok)
        if XSUM == 1:
            xs += tl.load(x_ptr + k0 + r1, mask=(k0 + r1) < K, other=0).to(tl.float32)
    out = tl.sum(acc, axis=1)
    if CONV >= 4:
        if XSUM == 1:
            x_sum = tl.sum(xs, axis=0)
        else:
            x_sum = _x_sum(x_ptr, K, BLOCK_K)
        out = (out - x_sum) * 32768.0 - 128.0 * x_sum
    out *= tl.load(scale_ptr + rn, mask=n_ok, other=0).to(tl.float32)
    tl.store(y_ptr + rn, out, mask=n_ok)


@triton.jit
def gemv_rowsum(x_ptr, w_ptr, scale_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                CONV: tl.constexpr, XLOAD: tl.constexpr):
    """acc[BN] += sum(float(w) * x, 1) each iteration: large tiles with a small accumulator."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = w_ptr + tl.minimum(rn, N - 1)[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    if XLOAD == 1:
        rk = tl.max_contiguous(rk, 8)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    k_full = (K // BLOCK_K) * BLOCK_K
    for k0 in range(0, k_full, BLOCK_K):
        w = tl.load(rows + (k0 + rk)[None, :])
        acc += tl.sum(_to_f32(w, CONV) * _load_x(x_ptr, k0 + rk, rn, XLOAD), axis=1)
    if k_full < K:
        k_ok = (k_full + rk) < K
        w = tl.load(rows + (k_full + rk)[None, :], mask=k_ok[None, :], other=0)
        acc += tl.sum(_to_f32(w, CONV) * _load_x(x_ptr, k_full + rk, rn, XLOAD, k_ok), axis=1)
    out = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0).to(tl.float32)
    tl.store(y_ptr + rn, out, mask=n_ok)


@triton.jit
def _words_fma(acc, w, xw):
    """acc[BN, BW] += sum over the 4 bytes i of word w of float(byte i) * x[4 * word + i]; xw holds
    those 4 bf16 of x as one int64 (little-endian: x[4j] in the low 16 bits), [BW] or [BN, BW]."""
    u = w ^ -0x7F7F7F80  # 0x80808080 as int32: byte b -> b + 128 (unsigned)
    lo = xw.to(tl.int32)
    hi = (xw >> 32).to(tl.int32)
    x0 = (lo << 16).to(tl.float32, bitcast=True)
    x1 = (lo & -65536).to(tl.float32, bitcast=True)
    x2 = (hi << 16).to(tl.float32, bitcast=True)
    x3 = (hi & -65536).to(tl.float32, bitcast=True)
    f0 = ((u & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    f1 = (((u >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    f2 = (((u >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    f3 = (((u >> 24) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    acc += f0 * x0
    acc += f1 * x1
    acc += f2 * x2
    acc += f3 * x3
    return acc


@triton.jit
def gemv_words(x_ptr, w_ptr, scale_ptr, y_ptr, N, K4, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
               XLOAD: tl.constexpr):
    """w_ptr: int32 [N, K4] (4 int8 each), x_ptr: int64 [K4] (4 bf16 each). XLOAD as in _load_x
    (2 words per weight vector, 2 int64 per x vector)."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = w_ptr + tl.minimum(rn, N - 1)[:, None] * K4
    rw = tl.arange(0, BLOCK_W)
    if XLOAD == 1:
        rw = tl.max_contiguous(rw, 2)
    acc = tl.zeros((BLOCK_N, BLOCK_W), tl.float32)
    k_full = (K4 // BLOCK_W) * BLOCK_W
    for k0 in range(0, k_full, BLOCK_W):
        w = tl.load(rows + (k0 + rw)[None, :])
        if XLOAD == 1:
            xw = tl.load(x_ptr + (k0 + rw)[None, :] + 0 * rn[:, None])
        else:
            xw = tl.load(x_ptr + k0 + rw)[None, :]
        acc = _words_fma(acc, w, xw)
    if k_full < K4:
        k_ok = (k_full + rw) < K4
        w = tl.load(rows + (k_full + rw)[None, :], mask=k_ok[None, :], other=0)
        xw = tl.load(x_ptr + (k_full + rw)[None, :] + 0 * rn[:, None], mask=k_ok[None, :], other=0)
        acc = _words_fma(acc, w, xw)
    out = tl.sum(acc, axis=1) * tl.load(scale_ptr + rn, mask=n_ok, other=0).to(tl.float32)
    tl.store(y_ptr + rn, out, mask=n_ok)


@triton.jit
def _to_f16(w, CONV: tl.constexpr):
    """int8 -> float16, exact. CONV 1: PTX xor + 2 prmt build 1024 + (w + 128) as two f16x2, then one
    sub.f16x2 each (~0.6 integer/half ops per weight). CONV 2: plain conversion."""
    if CONV == 1:
        f = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 u, m;
            mov.b32 m, 0x64806480;
            xor.b32 u, $2, 0x80808080;
            prmt.b32 $0, u, 0x64646464, 0x5140;
            prmt.b32 $1, u, 0x64646464, 0x5342;
            sub.f16x2 $0, $0, m;
            sub.f16x2 $1, $1, m;
            }
            """,
            constraints="=r,=r,r", args=[w], dtype=tl.float16, is_pure=True, pack=4)
    else:
        f = w.to(tl.float16)
    return f


@triton.jit
def gemv_mma(x_ptr, w_ptr, scale_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             CONV: tl.constexpr):
    """Tensor cores: acc[BN, 16] += W_tile(f16) @ X[BK, 16], X = x in column 0 and zeros elsewhere,
    float32 accumulation, y = row sums. x goes through float16 (exact for bf16 values of normal fp16
    range; overflows past 65504). Triton pipelines the weight loads (cp.async, num_stages) and
    picks wgmma for BN >= 64 with 4 or 8 warps, mma.sync below."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = w_ptr + tl.minimum(rn, N - 1)[:, None] * K
    rk = tl.arange(0, BLOCK_K)
    col0 = (tl.arange(0, 16) == 0)[None, :]
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    k_full = (K // BLOCK_K) * BLOCK_K
    for k0 in range(0, k_full, BLOCK_K):
        w = tl.load(rows + (k0 + rk)[None, :])
        x = tl.load(x_ptr + k0 + rk).to(tl.float16)
        acc = tl.dot(_to_f16(w, CONV), tl.where(col0, x[:, None], 0.0).to(tl.float16), acc)
    if k_full < K:
        k_ok = (k_full + rk) < K
        w = tl.load(rows + (k_full + rk)[None, :], mask=k_ok[None, :], other=0)
        x = tl.load(x_ptr + k_full + rk, mask=k_ok, other=0).to(tl.float16)
        acc = tl.dot(_to_f16(w, CONV), tl.where(col0, x[:, None], 0.0).to(tl.float16), acc)
    out = tl.sum(acc, axis=1) * tl.load(scale_ptr + rn, mask=n_ok, other=0).to(tl.float32)
    tl.store(y_ptr + rn, out, mask=n_ok)


# ----------------------------------------------------------------------------------------------
# Launchers. A config is a dict: bn, bk (in int8 elements), warps, stages, plus variant extras.
# ----------------------------------------------------------------------------------------------

def launch_base(x, q, s, y, c):
    N, K = q.shape
    even = N % c["bn"] == 0 and K % c["bk"] == 0
    gemv_base[(triton.cdiv(N, c["bn"]),)](x, q, s, y, N, K, EVEN=even, BLOCK_N=c["bn"], BLOCK_K=c["bk"],
                                          num_warps=c["warps"], num_stages=c["stages"])


def launch_tiled2d(x, q, s, y, c):
    N, K = q.shape
    gemv_tiled2d[(triton.cdiv(N, c["bn"]),)](x, q, s, y, N, K, BLOCK_N=c["bn"], BLOCK_K=c["bk"],
                                             UNROLL=c.get("unroll", 1), CONV=c.get("conv", 0),
                                             HINT=c.get("hint", 0), XLOAD=c.get("xload", 0),
                                             XSUM=c.get("xsum", 0), num_warps=c["warps"], num_stages=c["stages"])


def launch_rowsum(x, q, s, y, c):
    N, K = q.shape
    gemv_rowsum[(triton.cdiv(N, c["bn"]),)](x, q, s, y, N, K, BLOCK_N=c["bn"], BLOCK_K=c["bk"],
                                            CONV=c.get("conv", 0), XLOAD=c.get("xload", 0),
                                            num_warps=c["warps"], num_stages=c["stages"])


def launch_words(x, q, s, y, c):
    N, K = q.shape
    gemv_words[(triton.cdiv(N, c["bn"]),)](x.view(torch.int64), q.view(torch.int32), s, y, N, K // 4,
                                           BLOCK_N=c["bn"], BLOCK_W=c["bk"] // 4, XLOAD=c.get("xload", 0),
                                           num_warps=c["warps"], num_stages=c["stages"])


def launch_mma(x, q, s, y, c):
    N, K = q.shape
    gemv_mma[(triton.cdiv(N, c["bn"]),)](x, q, s, y, N, K, BLOCK_N=c["bn"], BLOCK_K=c["bk"],
                                         CONV=c.get("conv", 1), num_warps=c["warps"], num_stages=c["stages"])


def cfgs(pairs, launches, **extra):
    """Grid: (bn, bk) pairs x (warps, stages) x each combination of the extra lists (the first
    value of each extra outermost), configs with the first pair and launch first."""
    out = [dict(bn=bn, bk=bk, warps=w, stages=st) for bn, bk in pairs for w, st in launches]
    for key, values in reversed(list(extra.items())):
        out = [dict(c, **{key: v}) for v in values for c in out]
    return out


# Grids, most promising first (--quick takes the first two; the time budget cuts from the end).
# Non-dot kernels: Triton does not pipeline their loads through shared memory, so num_stages
# should not matter there; it is varied a little in base and unroll to check.
P2D = [(4, 1024), (8, 512), (16, 256), (8, 1024), (16, 512), (4, 2048)]
VARIANTS = {
    "base": (launch_base, cfgs([(4, 1024), (8, 512), (16, 256), (8, 1024)], [(4, 4), (4, 2)])),
    "fold": (launch_tiled2d, cfgs(P2D[:5], [(4, 2), (8, 2)], unroll=[2, 1, 4], xload=[1], conv=[5])
             + cfgs([(4, 1024), (8, 512), (16, 256)], [(4, 2)], unroll=[2, 1], xload=[1], conv=[5], xsum=[1])
             + cfgs([(4, 1024), (8, 512)], [(4, 2)], unroll=[2], xload=[1], conv=[4])),
    "xload": (launch_tiled2d, cfgs(P2D, [(4, 2), (8, 2)], unroll=[2, 1, 4], xload=[1])),
    "prmt": (launch_tiled2d, cfgs(P2D[:5], [(4, 2), (8, 2)], unroll=[2, 1, 4], xload=[1], conv=[1])
             + cfgs([(4, 1024), (8, 512)], [(4, 2)], unroll=[2, 1], xload=[0], conv=[1])),
    "rowsum": (launch_rowsum, cfgs([(16, 512), (32, 256), (32, 512), (16, 1024), (64, 256), (8, 1024)],
                                   [(4, 2), (8, 2)], xload=[1])
               + cfgs([(32, 512), (16, 1024)], [(8, 2)], xload=[0])),
    "rowsum_prmt": (launch_rowsum, cfgs([(16, 512), (32, 256), (32, 512), (16, 1024), (64, 256), (8, 1024)],
                                        [(4, 2), (8, 2)], xload=[1], conv=[1])
                    + cfgs([(32, 512), (16, 1024)], [(8, 2)], xload=[0], conv=[1])),
    "mma": (launch_mma, cfgs([(64, 256), (32, 256), (128, 128), (64, 128), (32, 512), (16, 512)],
                             [(4, 3), (4, 2), (8, 3)], conv=[1])
            + cfgs([(128, 256)], [(8, 3), (8, 2)], conv=[1]) + cfgs([(64, 256), (32, 256)], [(4, 3)], conv=[2])),
    "words": (launch_words, cfgs([(4, 1024), (8, 512), (16, 256)], [(4, 2), (8, 2)], xload=[1, 0])),
    "unroll": (launch_tiled2d, cfgs([(4, 1024), (8, 512), (16, 256)], [(4, 2)], unroll=[2, 1, 4])),
    "hints": (launch_tiled2d, cfgs([(4, 1024), (8, 512), (16, 256)], [(4, 2)], unroll=[2], xload=[1],
                                   hint=[2, 1])),
    "cvt": (launch_tiled2d, cfgs([(4, 1024), (8, 512)], [(4, 2)], xload=[1], conv=[2, 3])),
}
USES_ASM = {"fold", "prmt", "rowsum_prmt", "mma"}  # inline PTX: not in the CPU interpreter (mma: checked with conv 2)


def cfg_str(c):
    return " ".join(f"{k}={v}" for k, v in c.items())


# ----------------------------------------------------------------------------------------------
# Data, reference, timing
# ----------------------------------------------------------------------------------------------

def make_weights(N, K, device, gen):
    w = torch.randn(N, K, device=device, dtype=torch.float32, generator=gen) / math.sqrt(K)
    scales = w.abs().amax(1) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(torch.bfloat16)


def reference(x, q, s):
    return x.float() @ (q.float() * s.float()[:, None]).T


def rel_err(y, expect):
    return ((y.float() - expect).abs().max() / expect.abs().max()).item()


def get_copy_bandwidth(device):
    from bench import copy_bandwidth  # noqa: E402

    return copy_bandwidth(device)


# ----------------------------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------------------------

def interpret_check():
    """Every variant, 2-3 small configs, two small shapes (one with N and K tails), on the CPU, with
    a float32 output so that the check (relative error < 1e-3) sees the kernel's own error."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run as: TRITON_INTERPRET=1 python benchmarks/int8_variants.py --interpret-check")
    gen = torch.Generator().manual_seed(0)
    small = {"base": [dict(bn=8, bk=256, warps=4, stages=2), dict(bn=4, bk=128, warps=4, stages=2)],
             "fold": [dict(bn=8, bk=128, warps=4, stages=2, xload=1, unroll=u, conv=4, xsum=xs)
                      for u in (1, 4) for xs in (0, 1)],
             "xload": [dict(bn=8, bk=128, warps=4, stages=2, xload=1, unroll=u) for u in (1, 2, 4)],
             "rowsum": [dict(bn=16, bk=256, warps=4, stages=2, xload=1), dict(bn=32, bk=128, warps=4, stages=2)],
             "mma": [dict(bn=16, bk=128, warps=4, stages=2, conv=2), dict(bn=32, bk=256, warps=4, stages=2, conv=2)],
             "words": [dict(bn=8, bk=256, warps=4, stages=2, xload=1), dict(bn=4, bk=512, warps=4, stages=2)],
             "unroll": [dict(bn=8, bk=128, warps=4, stages=2, unroll=u) for u in (1, 2, 4)],
             "hints": [dict(bn=8, bk=128, warps=4, stages=2, unroll=2, xload=1, hint=h) for h in (1, 2)],
             "cvt": [dict(bn=8, bk=128, warps=4, stages=2, xload=1, conv=cv) for cv in (2, 3)]}
    failed = 0
    for name in VARIANTS:
        if name not in small:
            print(f"{name:12s} skipped: inline PTX cannot run in the interpreter (the GPU run verifies it)",
                  flush=True)
            continue
        if name in USES_ASM:
            print(f"{name:12s} only its plain-integer form here (conv 4 for fold, 2 for mma); the PTX form "
                  "runs on the GPU only",
                  flush=True)
        launch = VARIANTS[name][0]
        for N, K in ((64, 1024), (72, 1344)):  # 1344: 5 x 256 + 64, a K tail for every block size
            x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
            q, s = make_weights(N, K, "cpu", gen)
            expect = reference(x, q, s)[0]
            for c in small[name]:
                y = torch.empty(N, dtype=torch.float32)  # float32 out: the error is the kernel's own
                try:
                    launch(x, q, s, y, c)
                    err = rel_err(y, expect)
                    ok = err < 1e-3
                except Exception as e:
                    err, ok = f"{type(e).__name__}: {e}", False
                    traceback.print_exc()
                failed += not ok
                print(f"{name:12s} N={N:<3d} K={K:<5d} {cfg_str(c):46s} {'ok  ' if ok else 'FAIL'} err {err}",
                      flush=True)
    print("all passed" if not failed else f"{failed} FAILED", flush=True)
    return 1 if failed else 0


def gpu_run(a):
    dev = torch.device("cuda")
    t_start = time.time()
    ceiling = get_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy ceiling {ceiling:.0f} GB/s", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    data = {}  # shape -> x, copies [(q, s)], y, expect, nbytes
    for name, (N, K) in SHAPES.items():
        if a.shapes and name not in a.shapes.split(","):
            continue
        x = torch.randn(1, K, device=dev, dtype=torch.float32, generator=gen).to(torch.bfloat16)
        q, s = make_weights(N, K, dev, gen)
        nbytes = N * K + 2 * N
        copies = [(q, s)] + [(q.clone(), s.clone()) for _ in range(max(2, -(-L2_MULTIPLE_BYTES // nbytes)) - 1)]
        data[name] = dict(x=x, copies=copies, y=torch.empty(N, device=dev, dtype=torch.bfloat16),
                          expect=reference(x, q, s)[0], nbytes=nbytes, N=N, K=K)
    print(f"weights ready ({sum(len(d['copies']) * d['nbytes'] for d in data.values()) / 2**30:.1f} GiB)",
          flush=True)

    names = [v for v in (a.variants.split(",") if a.variants else VARIANTS) if v in VARIANTS]
    records, best = [], {}  # best[variant][shape] = dict(cfg, us, gb_s)

    def save():
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(dict(ceiling_gb_s=ceiling, gpu=torch.cuda.get_device_name(),
                                              torch=torch.__version__, triton=triton.__version__,
                                              records=records, best=best), indent=1))

    deadline = t_start + a.budget_s
    grids = {v: VARIANTS[v][1][:2] if a.quick else VARIANTS[v][1] for v in names}
    broken = False  # a CUDA error (e.g. an illegal address) leaves the context unusable: stop, report
    for vi, vname in enumerate(names):
        if broken:
            break
        launch, grid = VARIANTS[vname][0], grids[vname]
        t_var = time.time()
        # this variant's share of the time left, in proportion to its number of configs
        share = (deadline - t_var) * len(grid) / sum(len(grids[v]) for v in names[vi:])
        v_deadline = t_var + max(15.0, share)
        print(f"\n== {vname}: {len(grid)} configs (time share {max(15.0, share):.0f} s)", flush=True)
        cand = {}  # shape -> (t, cfg)
        try:
            for ci, c in enumerate(grid):
                if time.time() > v_deadline:
                    print(f"   time budget: skipped the last {len(grid) - ci} configs", flush=True)
                    break
                if broken:
                    break
                line = []
                for sname, d in data.items():
                    rec = dict(variant=vname, shape=sname, N=d["N"], K=d["K"], cfg=c)
                    try:
                        d["y"].zero_()
                        launch(d["x"], *d["copies"][0], d["y"], c)
                        torch.cuda.synchronize()
                        err = rel_err(d["y"], d["expect"])
                        rec["err"] = err
                        if not err < 1e-2:
                            rec["status"] = "FAIL"
                            line.append(f"{sname} FAIL({err:.1e})")
                        else:
                            t = time_calls([lambda w=w, d=d: launch(d["x"], *w, d["y"], c) for w in d["copies"]],
                                           reps=3)
                            rec.update(status="ok", us=t * 1e6, gb_s=d["nbytes"] / t / 1e9)
                            line.append(f"{sname} {t * 1e6:5.1f}us {rec['gb_s']:4.0f}")
                            if sname not in cand or t < cand[sname][0]:
                                cand[sname] = (t, c)
                    except Exception as e:  # out of resources, compile error
                        rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
                        line.append(f"{sname} {type(e).__name__}")
                        print(f"   {sname} {cfg_str(c)}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        if isinstance(e, RuntimeError) and ("CUDA error" in str(e) or "illegal" in str(e)):
                            broken = True
                            print("   CUDA context unusable: stopping here", flush=True)
                            records.append(rec)
                            break
                    records.append(rec)
                print(f"   [{ci + 1:3d}] {cfg_str(c):44s} " + " | ".join(line), flush=True)
            best[vname] = {}
            for sname, (t, c) in ({} if broken else cand).items():  # re-time each shape's best, 10 replays
                d = data[sname]
                t = time_calls([lambda w=w, d=d: launch(d["x"], *w, d["y"], c) for w in d["copies"]], reps=10)
                best[vname][sname] = dict(cfg=c, us=t * 1e6, gb_s=d["nbytes"] / t / 1e9,
                                          pct=100 * d["nbytes"] / t / 1e9 / ceiling)
        except Exception as e:
            print(f"   variant {vname} crashed: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        print(f"   ({time.time() - t_var:.0f} s)", flush=True)
        save()

    print(f"\nSummary (best config per shape, 10 replays; GB/s on int8 bytes N*K + 2N; "
          f"copy ceiling {ceiling:.0f} GB/s)", flush=True)
    for sname, d in data.items():
        print(f"\n{sname} {d['N']}x{d['K']}", flush=True)
        for vname in names:
            b = best.get(vname, {}).get(sname)
            if b is None:
                print(f"  {vname:12s} (no result)", flush=True)
            else:
                base = best.get("base", {}).get(sname)
                vs = f"x{base['us'] / b['us']:.2f} vs base" if base else ""
                print(f"  {vname:12s} {b['us']:7.1f} us {b['gb_s']:6.0f} GB/s {b['pct']:5.1f}%  {vs:14s} "
                      f"{cfg_str(b['cfg'])}", flush=True)
    print("\nPer layer (sum of best us over wqkv, wo, w13, w2; cuda_kernels.py's int8 ~67 us):", flush=True)
    for vname in names:
        b = best.get(vname, {})
        if all(s in b for s in LAYER):
            tot = sum(b[s]["us"] for s in LAYER)
            nb = sum(data[s]["nbytes"] for s in LAYER)
            print(f"  {vname:12s} {tot:7.1f} us  {nb / tot / 1e3:6.0f} GB/s", flush=True)
        else:
            print(f"  {vname:12s} incomplete", flush=True)
    mix = {s: min(((b[s]["us"], v) for v, b in best.items() if s in b), default=None) for s in data}
    if all(mix.get(s) for s in LAYER):
        print(f"  {'best-of-all':12s} {sum(mix[s][0] for s in LAYER):7.1f} us  ("
              + ", ".join(f"{s}: {mix[s][1]}" for s in LAYER) + ")", flush=True)
    save()
    print(f"\ntotal {time.time() - t_start:.0f} s" + (f"; JSON in {a.json}" if a.json else ""), flush=True)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 configs per variant (smoke test)")
    p.add_argument("--interpret-check", action="store_true",
                   help="with TRITON_INTERPRET=1: correctness of every non-PTX variant on the CPU")
    p.add_argument("--variants", help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--shapes", help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="wall-clock budget from the start for the grid search (incl. compiles), shared "
                        "out over the variants in order; a variant past its share skips its last configs")
    default_json = Path(os.environ["OUT"]) / "int8_variants.json" if os.environ.get("OUT") else None
    p.add_argument("--json", type=Path, default=default_json)
    a = p.parse_args()
    if a.interpret_check:
        return interpret_check()
    return gpu_run(a)


if __name__ == "__main__":
    sys.exit(main())
