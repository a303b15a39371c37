"""Exploration: a several-row bf16 GEMV for batched decode, y[m, n] = sum_k x[m, k] W[n, k], x [M, K]
bf16 (M <= 16, mainly 8), W [N, K] bf16, float32 accumulation, y bf16, with decode's per-row fusions
in the same kernel (constexpr flags): NORM (row m of x times g * rsqrt(mean_k x[m]^2 + eps): the sum
of squares is taken on the way and scales the row's sums at the end), SWIGLU (W holds 2N rows, gate
above up: y = silu(gate) * up) and RESIDUAL (y += r). Its kernels are its own (not cuda_kernels.py's).

Variants (BM = rows of a program, BN outputs, BK columns of K per step):
  swap_ab   acc[BN, 16] += W_tile[BN, BK] @ x_tile.T[BK, 16], bf16: the weights as the big operand,
            so Triton can use wgmma on sm_90 (BN >= 64, 4 or 8 warps) and pipeline the weight tiles
            through shared memory (cp.async, num_stages)
  swap_tma  swap_ab with the weight tiles loaded by TMA (host tensor descriptor; zero fill past the
            edges, so no clamped rows and no separate K tail)
  dot_bf16  acc[16, BN] += x_tile[16, BK] @ W_tile.T, bf16 (mma.sync: 16 rows), rows >= M masked to 0
  dot_tma   dot_bf16 with TMA weight tiles
  fma       CUDA cores, BM = M rounded up to a power of 2: acc[BM, BN, BK] += float(W) * float(x)
            reduced once at the end (acc3=1), or acc[BM, BN] += the tile's sum over K each step (acc3=0)
  current   cuda_kernels.py's several-row path, copied: float32 tiles, TF32 dot, split-K writing float32
            partials that one torch.sum adds up afterwards (counted in its time); unfused shapes only
All but `current`: rows past N clamped for the loads (not stored), an unmasked main loop and one
masked K-tail step (w2's K = 11008), and split-K with the reduction inside the kernel: each of the
SPLIT programs of an output block writes float32 partials (and, for NORM, its slice's sums of
squares), takes a ticket from an atomic counter, and the last one adds them up and applies the
fusions, so split-K works with every fusion and needs no second kernel. The split is a runtime
argument (one compile for all splits; each shape is timed at splits 1, 2, 4, 8, 16 while the programs
number fewer than 4 per SM of the H200's 132).

Each launch is checked against a float32 PyTorch reference (relative error > 1e-2: FAIL, not timed),
then timed as CUDA graph replays over weight copies of >= 1 GiB (no L2 hits), like benchmarks/gemv.py,
on the Llama-2-7B shapes with decode's fusions (wqkv+norm, wo+res, w13+norm+swiglu, w2+res,
head+norm) and without. Baselines timed the same way: cuBLAS (F.linear) alone, and cuBLAS with the
fusions as separate kernels (RMSNorm and SiLU*mul as one small Triton kernel each, as Inductor would
fuse them; torch.add). Compiles run ahead in worker processes (warmup, no launches) while the main
process times what is ready, in round-robin order over the variants' grids (most promising first),
so that the time budget cuts every variant's least likely configs.

    python benchmarks/multirow.py [--rows 8] [--variants a,b] [--shapes a,b] [--fusions fused,plain]
                                  [--budget-s 300] [--json PATH] [--quick] [--jobs N]
    TRITON_INTERPRET=1 python benchmarks/multirow.py --interpret-check   # CPU, correctness only

The interpreter check runs every variant on tiny shapes (tails in N and K, 1/3/8 rows, every fusion,
splits 1, 4, 16) with float32 dot operands (DOT_F32: the interpreter computes bf16 dots wrongly and
rounds float32 -> bf16 toward zero), so it checks the indexing, masks, fusions and the split-K
reduction, not the bf16 rounding; on the GPU the operands are bf16 (x * g rounded to bf16 under NORM,
as a separate norm kernel's output would be: ~2e-3 relative error).
"""
import time

T_START = time.time()  # before the imports: --budget-s counts them

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import time_calls  # noqa: E402  (benchmarks/gemv.py; it puts the repository on sys.path)
from bench import copy_bandwidth  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter computes bf16 dots wrongly
L2_MULTIPLE_BYTES = 1 << 30
EPS = 1e-5
SHAPES = {"wqkv": (12288, 4096, "norm"), "wo": (4096, 4096, "res"), "w13": (22016, 4096, "norm+swiglu"),
          "w2": (4096, 11008, "res"), "head": (32000, 4096, "norm")}  # W rows, K, decode's fusion
FUSIONS = {"plain": (0, 0, 0), "norm": (1, 0, 0), "res": (0, 0, 1), "norm+swiglu": (1, 1, 0),
           "swiglu": (0, 1, 0), "norm+swiglu+res": (1, 1, 1)}  # (NORM, SWIGLU, RESIDUAL)
# cuda_kernels.py's one-row GEMV on the H200, µs (BENCHMARKS.md, session 4): (with decode's fusion, plain)
ONE_ROW_US = {"wqkv": (25.2, 24.9), "wo": (10.7, 10.6), "w13": (44.7, 43.4), "w2": (23.6, 23.4), "head": (62.4, 61.3)}
LAYER = ("wqkv", "wo", "w13", "w2")
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def _finish(out, up, sq, rm, rn, M, N, K, eps, r_ptr, y_ptr, p_ptr, q_ptr, cnt_ptr, n_splits, pid_n, pid_k,
            NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr):
    """out, up [BM, BN] float32 sums over this program's slice of K, sq [BM] its sums of squares of x.
    Split: partials to p [split, 1 + SWIGLU, M, N] and q [blocks, split, M]; the last program of the
    block (atomic ticket) sums them and resets the counter. Then the fusions and the store."""
    m_ok = rm < M
    ok = m_ok[:, None] & (rn < N)[None, :]
    at = rm[:, None] * N + rn[None, :]
    last = n_splits > 0
    if n_splits > 1:
        part = p_ptr + pid_k * (1 + SWIGLU) * M * N + at
        tl.store(part, out, mask=ok)
        if SWIGLU:
            tl.store(part + M * N, up, mask=ok)
        if NORM:
            tl.store(q_ptr + (pid_n * n_splits + pid_k) * M + rm, sq, mask=m_ok)
        tl.debug_barrier()  # every thread's partials are written before the ticket (a release)
        last = tl.atomic_add(cnt_ptr + pid_n, 1) == n_splits - 1
        if last:
            tl.debug_barrier()
            out = tl.zeros_like(out)
            up = tl.zeros_like(up)
            sq = tl.zeros_like(sq)
            for s in range(0, n_splits):
                ps = p_ptr + s * (1 + SWIGLU) * M * N + at
                out += tl.load(ps, mask=ok, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    up += tl.load(ps + M * N, mask=ok, other=0.0, cache_modifier=".cg")
                if NORM:
                    sq += tl.load(q_ptr + (pid_n * n_splits + s) * M + rm, mask=m_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    if last:
        if NORM:
            inv = tl.rsqrt(sq / K + eps)[:, None]
            out = out * inv
            up = up * inv
        if SWIGLU:
            out = out / (1 + tl.exp(-out)) * up
        if RESIDUAL:
            out += tl.load(r_ptr + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + at, out.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:  # interpreter only: float32 operands, exact
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _dot_step(acc, acc_up, sq, x_rows, m_ok, w_rows, W, g_ptr, n0, k0, N, K, MASKED: tl.constexpr,
              NORM: tl.constexpr, SWIGLU: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
              DOT_F32: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BK step of _dot_kernel (MASKED: columns k >= K read as 0)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K
    if MASKED:
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    else:
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
    if TMA:
        w = W.load([n0, k0])
        wu = w
        if SWIGLU:
            wu = W.load([N + n0, k0])
    else:
        if MASKED:
            w = tl.load(w_rows + k[None, :], mask=k_ok[None, :], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :])
        wu = w
        if SWIGLU:
            if MASKED:
                wu = tl.load(w_rows + N * K + k[None, :], mask=k_ok[None, :], other=0.0)
            else:
                wu = tl.load(w_rows + N * K + k[None, :])
    if NORM:
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)  # reduced each step: a [BM, BK] accumulator costs ~60 registers
        g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        x = xf * g[None, :]
        if not DOT_F32:  # bf16 for the tensor cores (the interpreter would round toward zero: kept float32)
            x = x.to(x_rows.dtype.element_ty)
    if SWAP:
        xt = tl.trans(x)
        acc = _mma(w, xt, acc, DOT_F32)
        if SWIGLU:
            acc_up = _mma(wu, xt, acc_up, DOT_F32)
    else:
        acc = _mma(x, tl.trans(w), acc, DOT_F32)
        if SWIGLU:
            acc_up = _mma(x, tl.trans(wu), acc_up, DOT_F32)
    return acc, acc_up, sq


@triton.jit(do_not_specialize=["M", "blocks_per_split", "n_splits"])
def _dot_kernel(x_ptr, W, g_ptr, r_ptr, y_ptr, p_ptr, q_ptr, cnt_ptr, M, N, K, blocks_per_split, n_splits, eps,
                NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, SWAP: tl.constexpr,
                TMA: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """swap_ab / swap_tma (SWAP) and dot_bf16 / dot_tma. W: the weight pointer, or (TMA) a descriptor
    with block [BLOCK_N, BLOCK_K]. N counts outputs (SWIGLU: W has 2N rows)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    x_rows = x_ptr + rm[:, None] * K
    if TMA:
        w_rows = x_rows  # unused
    else:
        w_rows = W + tl.minimum(rn, N - 1)[:, None] * K
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros_like(acc)  # SWIGLU only
    sq = tl.zeros((BLOCK_M,), tl.float32)  # NORM only
    b0 = pid_k * blocks_per_split
    b1 = tl.minimum(b0 + blocks_per_split, tl.cdiv(K, BLOCK_K))
    if TMA:  # out-of-bounds weights read as 0: one loop
        for b in range(b0, b1):
            acc, acc_up, sq = _dot_step(acc, acc_up, sq, x_rows, m_ok, w_rows, W, g_ptr, n0, b * BLOCK_K, N, K,
                                        True, NORM, SWIGLU, SWAP, TMA, DOT_F32, BLOCK_K)
    else:
        nfull = K // BLOCK_K
        for b in range(b0, tl.minimum(b1, nfull)):
            acc, acc_up, sq = _dot_step(acc, acc_up, sq, x_rows, m_ok, w_rows, W, g_ptr, n0, b * BLOCK_K, N, K,
                                        False, NORM, SWIGLU, SWAP, TMA, DOT_F32, BLOCK_K)
        if (b0 <= nfull) & (nfull < b1):  # this split holds the K tail
            acc, acc_up, sq = _dot_step(acc, acc_up, sq, x_rows, m_ok, w_rows, W, g_ptr, n0, nfull * BLOCK_K, N, K,
                                        True, NORM, SWIGLU, SWAP, TMA, DOT_F32, BLOCK_K)
    if SWAP:
        out, up = tl.trans(acc), tl.trans(acc_up)
    else:
        out, up = acc, acc_up
    _finish(out, up, sq, rm, rn, M, N, K, eps, r_ptr, y_ptr, p_ptr, q_ptr, cnt_ptr, n_splits,
            pid_n, pid_k, NORM, SWIGLU, RESIDUAL)


@triton.jit
def _fma_step(acc, acc_up, sq, x_at, w_at, g_ptr, k0, NK, K, MASKED: tl.constexpr, NORM: tl.constexpr,
              SWIGLU: tl.constexpr, ACC3: tl.constexpr, BLOCK_K: tl.constexpr):
    k = (k0 + tl.arange(0, BLOCK_K))[None, None, :]
    k_ok = k < K
    if MASKED:
        x = tl.load(x_at + k0, mask=k_ok, other=0.0).to(tl.float32)  # [BM, 1, BK]
        w = tl.load(w_at + k0, mask=k_ok, other=0.0).to(tl.float32)  # [1, BN, BK]
    else:
        x = tl.load(x_at + k0).to(tl.float32)
        w = tl.load(w_at + k0).to(tl.float32)
    if NORM:
        sq += x * x
        x = x * tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    if ACC3:
        acc += w * x
    else:
        acc += tl.sum(w * x, axis=2)
    if SWIGLU:
        if MASKED:
            w = tl.load(w_at + NK + k0, mask=k_ok, other=0.0).to(tl.float32)
        else:
            w = tl.load(w_at + NK + k0).to(tl.float32)
        if ACC3:
            acc_up += w * x
        else:
            acc_up += tl.sum(w * x, axis=2)
    return acc, acc_up, sq


@triton.jit(do_not_specialize=["M", "blocks_per_split", "n_splits"])
def _fma_kernel(x_ptr, w_ptr, g_ptr, r_ptr, y_ptr, p_ptr, q_ptr, cnt_ptr, M, N, K, blocks_per_split, n_splits, eps,
                NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ACC3: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """CUDA-core products: x as [BM, 1, BK], W as [1, BN, BK] (rows past M and N clamped, not stored)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_at = x_ptr + tl.minimum(rm, M - 1)[:, None, None] * K + rk[None, None, :]
    w_at = w_ptr + tl.minimum(rn, N - 1)[None, :, None] * K + rk[None, None, :]
    if ACC3:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros_like(acc)
    sq = tl.zeros((BLOCK_M, 1, BLOCK_K), tl.float32)
    b0 = pid_k * blocks_per_split
    b1 = tl.minimum(b0 + blocks_per_split, tl.cdiv(K, BLOCK_K))
    nfull = K // BLOCK_K
    for b in range(b0, tl.minimum(b1, nfull)):
        acc, acc_up, sq = _fma_step(acc, acc_up, sq, x_at, w_at, g_ptr, b * BLOCK_K, N * K, K, False, NORM, SWIGLU,
                                    ACC3, BLOCK_K)
    if (b0 <= nfull) & (nfull < b1):
        acc, acc_up, sq = _fma_step(acc, acc_up, sq, x_at, w_at, g_ptr, nfull * BLOCK_K, N * K, K, True, NORM,
                                    SWIGLU, ACC3, BLOCK_K)
    if ACC3:
        out, up = tl.sum(acc, axis=2), tl.sum(acc_up, axis=2)
    else:
        out, up = acc, acc_up
    _finish(out, up, tl.sum(tl.sum(sq, axis=2), axis=1), rm, rn, M, N, K, eps, r_ptr, y_ptr, p_ptr, q_ptr, cnt_ptr,
            n_splits, pid_n, pid_k, NORM, SWIGLU, RESIDUAL)


@triton.jit
def _current_kernel(x_ptr, w_ptr, y_ptr, M, N, K, blocks_per_split,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """cuda_kernels.py's _gemv_kernel, several-row bf16 path (a copy): y[split, m, n] partial sums."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    b_start = pid_k * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, tl.cdiv(K, BLOCK_K))
    out = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for b in range(b_start, b_end):
        rk = b * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        out += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="tf32")
    y_at = rm[:, None] * N + rn[None, :]
    tl.store(y_ptr + pid_k * M * N + y_at, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _rmsnorm_kernel(x_ptr, g_ptr, y_ptr, K, eps, BLOCK: tl.constexpr):  # baseline: one kernel per norm
    k = tl.arange(0, BLOCK)
    row = tl.program_id(0) * K
    x = tl.load(x_ptr + row + k, mask=k < K, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    tl.store(y_ptr + row + k, x * tl.rsqrt(tl.sum(x * x, axis=0) / K + eps) * g, mask=k < K)


@triton.jit
def _silu_mul_kernel(h_ptr, y_ptr, N, BLOCK: tl.constexpr):  # baseline: h [M, 2N] -> silu(gate) * up
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = tl.program_id(0)
    a = tl.load(h_ptr + m * 2 * N + n, mask=n < N, other=0.0).to(tl.float32)
    b = tl.load(h_ptr + m * 2 * N + N + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * N + n, a / (1 + tl.exp(-a)) * b, mask=n < N)


# ---------------------------------------------------------------------------------------------- launches

def cfgs(pairs, launches, **extra):
    """[(bn, bk)] x [(warps, stages)] x the extra keys' values (the first of each outermost)."""
    out = [dict(bn=bn, bk=bk, warps=w, stages=s) for bn, bk in pairs for w, s in launches]
    for key, values in reversed(list(extra.items())):
        out = [dict(c, **{key: v}) for v in values for c in out]
    return out


# Grids, most promising first (--quick: the first two; the budget cuts from the end, round-robin).
VARIANTS = {
    "swap_ab": dict(kind="dot", swap=1, tma=0, grid=cfgs([(64, 128), (128, 128)], [(4, 4)]) + cfgs(
        [(64, 256)], [(4, 3)]) + cfgs([(128, 64), (64, 128)], [(4, 6)]) + cfgs([(64, 64)], [(4, 8)]) + cfgs(
        [(32, 256)], [(4, 4)]) + cfgs([(256, 64), (128, 128)], [(8, 4)]) + cfgs([(32, 128)], [(4, 6)])),
    "swap_tma": dict(kind="dot", swap=1, tma=1, grid=cfgs([(64, 64), (128, 64)], [(4, 6)]) + cfgs(
        [(64, 128), (128, 128)], [(4, 4)]) + cfgs([(64, 64)], [(4, 10)]) + cfgs([(256, 64)], [(8, 4)]) + cfgs(
        [(32, 128)], [(4, 6)]) + cfgs([(64, 256)], [(4, 3)])),
    "dot_bf16": dict(kind="dot", swap=0, tma=0, grid=cfgs([(64, 128), (32, 256)], [(4, 4)]) + cfgs(
        [(64, 64), (32, 128)], [(4, 6)]) + cfgs([(128, 128)], [(8, 4)]) + cfgs([(16, 256)], [(4, 4)]) + cfgs(
        [(128, 64)], [(4, 6)]) + cfgs([(64, 256)], [(4, 3)])),
    "fma": dict(kind="fma", grid=cfgs([(4, 256), (8, 128)], [(4, 2)], acc3=[1]) + cfgs([(4, 128)], [(4, 2)], acc3=[1])
                + cfgs([(16, 128), (8, 256)], [(8, 2)], acc3=[1]) + cfgs([(32, 64), (16, 64)], [(4, 2)], acc3=[0])),
    "current": dict(kind="current", grid=cfgs([(32, 128), (64, 128), (32, 64), (16, 128), (64, 64)], [(4, 4)])),
    "dot_tma": dict(kind="dot", swap=0, tma=1, grid=cfgs([(64, 64), (128, 64)], [(4, 6)]) + cfgs(
        [(64, 128), (32, 128)], [(4, 4)])),
}


def block_m(variant, M):
    return triton.next_power_of_2(M) if VARIANTS[variant]["kind"] == "fma" else 16


def effective(variant, cfg, flags):
    """cfg with num_stages lowered until the pipelined tiles fit in 216 of the H200's 227 KB of shared
    memory (down to 1: no pipelining)."""
    c = dict(cfg)
    if VARIANTS[variant]["kind"] == "dot":
        per_stage = (c["bn"] * c["bk"] * (2 if flags[1] else 1) + 16 * c["bk"]) * 2
        while c["stages"] > 1 and c["stages"] * per_stage > 216 * 1024:
            c["stages"] -= 1
    return c


def splits_for(variant, case, cfg, limit=(1, 2, 4, 8, 16)):
    """Splits of K worth timing: 1, then doubling while the programs number < 4 per SM (132 SMs)."""
    if VARIANTS[variant]["kind"] == "fma" and cfg["bn"] < 16:
        return [1]
    nb, kb = triton.cdiv(case["N"], cfg["bn"]), triton.cdiv(case["K"], cfg["bk"])
    return [s for s in limit if s == 1 or (kb // s >= 2 and nb * s <= 1100 and nb * (s // 2) < 528)]


def compile_key(variant, cfg, case, split):
    key = (variant, tuple(sorted(effective(variant, cfg, case["flags"]).items())), case["flags"],
           block_m(variant, case["M"]), str(case["y"].dtype))
    return key + (split > 1,) if variant == "current" else key + (False,)


def _run(kernel, grid, args, kw, warmup):
    if warmup:
        kernel.warmup(*args, grid=grid, **kw)
    else:
        kernel[grid](*args, **kw)


def launch(variant, case, w, cfg, split, warmup=False):
    """One product of `case` with weight copy w; returns the output tensor."""
    spec, M, N, K = VARIANTS[variant], case["M"], case["N"], case["K"]
    c = effective(variant, cfg, case["flags"])
    bn, bk = c["bn"], c["bk"]
    assert bn >= 2 and 1 <= split <= 16 and M <= 16, (bn, split, M)  # the buffers' sizes
    per_split = triton.cdiv(triton.cdiv(K, bk), split)
    kw = dict(BLOCK_M=block_m(variant, M), BLOCK_N=bn, BLOCK_K=bk, num_warps=c["warps"], num_stages=c["stages"])
    if spec["kind"] == "current":
        out = case["y"] if split == 1 else case["P"][:split * M * N]
        _run(_current_kernel, (triton.cdiv(N, bn), split, 1), (case["x"], w, out, M, N, K, per_split), kw, warmup)
        if split == 1 or warmup:
            return case["y"]
        return torch.sum(out.view(split, M, N), 0, out=case["yf"])
    norm, swiglu, res = case["flags"]
    kw.update(NORM=norm, SWIGLU=swiglu, RESIDUAL=res)
    if spec["kind"] == "dot":
        kernel = _dot_kernel
        kw.update(SWAP=spec["swap"], TMA=spec["tma"], DOT_F32=INTERPRET)
        if spec["tma"]:
            w = TensorDescriptor.from_tensor(w, [bn, bk])
    else:
        kernel = _fma_kernel
        kw.update(ACC3=c["acc3"])
    args = (case["x"], w, case["g"], case["r"], case["y"], case["P"], case["Q"], case["cnt"], M, N, K,
            per_split, split, EPS)
    _run(kernel, (triton.cdiv(N, bn), split), args, kw, warmup)
    return case["y"]


# ---------------------------------------------------------------------------------------------- data

def make_case(shape, fusion, M, dev, weights, fill=True, ydtype=torch.bfloat16):
    """Inputs, buffers and (fill) the float32 reference of one product. weights: W copies [rows, K]."""
    rows, K = weights[0].shape
    flags = FUSIONS[fusion]
    N = rows // 2 if flags[1] else rows
    new = (lambda *s: torch.randn(*s, device=dev).to(torch.bfloat16)) if fill else \
        (lambda *s: torch.empty(*s, device=dev, dtype=torch.bfloat16))
    case = dict(shape=shape, fusion=fusion, flags=flags, M=M, N=N, K=K, W=weights, nbytes=rows * K * 2,
                x=new(M, K), r=new(M, N), y=torch.empty(M, N, device=dev, dtype=ydtype),
                yf=torch.empty(M, N, device=dev, dtype=torch.float32),
                P=torch.empty(16 * 2 * M * N, device=dev, dtype=torch.float32),  # split <= 16
                Q=torch.empty(triton.cdiv(N, 2) * 16 * M, device=dev, dtype=torch.float32),  # BLOCK_N >= 2
                cnt=torch.zeros(triton.cdiv(N, 2), device=dev, dtype=torch.int32))
    case["g"] = (1 + 0.2 * torch.randn(K, device=dev)).to(torch.bfloat16) if fill else new(K)
    case["name"] = shape + ("" if fusion == "plain" else "+" + fusion)
    if fill:
        h = case["x"].float()
        if flags[0]:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * case["g"].float()
        h = h @ weights[0].float().T
        if flags[1]:
            h = F.silu(h[:, :N]) * h[:, N:]
        case["expect"] = h + case["r"].float() if flags[2] else h
    return case


def rel_err(y, expect):
    e = ((y.float() - expect).abs().max() / expect.abs().max()).item()
    return e if math.isfinite(e) else float("inf")


def baseline(case, w, ops):
    """cuBLAS alone (ops False), or with the fusions as separate kernels."""
    x, M, N, K = case["x"], case["M"], case["N"], case["K"]
    norm, swiglu, res = case["flags"] if ops else (0, 0, 0)
    if norm:
        xn = torch.empty_like(x)
        _rmsnorm_kernel[(M,)](x, case["g"], xn, K, EPS, BLOCK=triton.next_power_of_2(K))
        x = xn
    h = F.linear(x, w)
    if swiglu:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
        _silu_mul_kernel[(M, triton.cdiv(N, 1024))](h, out, N, BLOCK=1024)
        h = out
    return h + case["r"] if res else h


# ---------------------------------------------------------------------------------------------- modes

def interpret_check():
    """Every variant, small configs, M 1/3/8, N 64 and 72 (a partial block), K 256 and 320 (a K tail),
    every fusion, split 1, 4 and 16 (uneven and empty splits), on the CPU; float32 output and float32 dot
    operands (on the GPU: bf16, x * g rounded to bf16 under NORM, ~2e-3), so the error is < 1e-4."""
    if not INTERPRET:
        sys.exit("run as: TRITON_INTERPRET=1 python benchmarks/multirow.py --interpret-check")
    torch.manual_seed(0)
    small = {v: cfgs([(16, 64), (32, 128)], [(4, 2)]) for v in ("swap_ab", "swap_tma", "dot_bf16", "dot_tma", "current")}
    small["fma"] = cfgs([(4, 64)], [(4, 2)], acc3=[1]) + cfgs([(8, 32)], [(4, 2)], acc3=[0])
    failed = total = 0
    worst = [0.0, 0.0]  # largest error without, with the norm
    for (n, K), Ms in (((64, 256), (1, 3, 8)), ((72, 320), (3, 8))):
        for fusion, flags in FUSIONS.items():
            weights = [(torch.randn(n * (2 if flags[1] else 1), K) / math.sqrt(K)).to(torch.bfloat16)]
            for M in Ms:
                case = make_case("tiny", fusion, M, "cpu", weights, ydtype=torch.float32)
                for v, grid in small.items():
                    if v == "current" and fusion != "plain":
                        continue
                    for c in grid:
                        for split in (1, 4, 16) if c is grid[0] and M == 8 else (1, 4):
                            total += 1
                            try:
                                case["y"].fill_(float("nan"))
                                err = rel_err(launch(v, case, weights[0], c, split), case["expect"])
                                if case["cnt"].any():  # the split-K tickets must be back at 0
                                    err = f"counters left at {case['cnt'].nonzero().flatten().tolist()}"
                            except Exception as e:  # noqa: BLE001
                                err = f"{type(e).__name__}: {e}"
                            ok = isinstance(err, float) and err < 1e-4
                            worst[flags[0]] = max(worst[flags[0]], err if isinstance(err, float) else math.inf)
                            failed += not ok
                            if not ok or (M == 8 and split == 4 and c is grid[0]):
                                print(f"{v:9s} {case['name']:28s} N={n} K={K} M={M} split={split} {cfg_short(c):22s} "
                                      f"{'ok  ' if ok else 'FAIL'} err {err}", flush=True)
    print(f"{total - failed}/{total} passed" + (f", {failed} FAILED" if failed else "")
          + f"; largest error {worst[0]:.1e} without the norm, {worst[1]:.1e} with it", flush=True)
    return 1 if failed else 0


def _worker_init():
    torch.set_num_threads(1)


_WORKER_WEIGHTS = {}


def _compile_task(task):
    """Worker: compile one launch (warmup: no launch, so the main process's timings are undisturbed)."""
    variant, cfg, shape, fusion, M, split = task
    t = time.time()
    try:
        if shape not in _WORKER_WEIGHTS:
            rows, K, _ = SHAPES[shape]
            _WORKER_WEIGHTS[shape] = [torch.empty(rows, K, device=DEVICE, dtype=torch.bfloat16)]
        case = make_case(shape, fusion, M, DEVICE, _WORKER_WEIGHTS[shape], fill=False)
        launch(variant, case, case["W"][0], cfg, split, warmup=True)
        return None, time.time() - t
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}", time.time() - t


def gpu_run(a):
    t0 = T_START  # the budget counts from the process start (imports included)
    deadline = t0 + a.budget_s - min(25.0, 0.1 * a.budget_s)  # the rest: re-timing the bests, the summary
    dev = torch.device(DEVICE)
    torch.backends.cuda.matmul.allow_tf32 = False
    names = a.variants.split(",") if a.variants else list(VARIANTS)
    shapes = a.shapes.split(",") if a.shapes else list(SHAPES)
    rows = [int(r) for r in a.rows.split(",")]
    bad = [v for v in names if v not in VARIANTS] + [s for s in shapes if s not in SHAPES]
    if bad:
        sys.exit(f"unknown: {bad}")
    specs = [(s, f) for s in shapes for f in ([SHAPES[s][2]] if "fused" in a.fusions else [])
             + (["plain"] if "plain" in a.fusions else [])]
    grids = {v: VARIANTS[v]["grid"][:2] if a.quick else VARIANTS[v]["grid"] for v in names}
    # The plan: round-robin over the variants' grids, each config over every case
    plan = [(v, grids[v][i], s, f, M) for i in range(max(len(g) for g in grids.values())) for v in names
            if i < len(grids[v]) for M in rows for s, f in specs if not (v == "current" and f != "plain")]
    pool, pending = None, {}
    if a.jobs > 0:  # compile ahead in workers; their first job is to import torch
        try:
            pool = mp.get_context("spawn").Pool(a.jobs, initializer=_worker_init)
        except Exception as e:  # noqa: BLE001
            print(f"no compile workers ({type(e).__name__}: {e}): compiling inline", flush=True)
    ceiling = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy ceiling "
          f"{ceiling:.0f} GB/s  rows {rows}  {len(plan)} (config, case) pairs, {a.jobs} compile workers", flush=True)
    weights, cases = {}, {}
    for s in shapes:
        rows_w, K, _ = SHAPES[s]
        w = (torch.randn(rows_w, K, device=dev) / math.sqrt(K)).to(torch.bfloat16)
        weights[s] = [w] + [w.clone() for _ in range(max(2, -(-L2_MULTIPLE_BYTES // w.nbytes)) - 1)]
    for s, f in specs:
        for M in rows:
            cases[s, f, M] = make_case(s, f, M, dev, weights[s])
    for v, cfg, s, f, M in plan:  # compile tasks, in the order the main process will need them
        for split in splits_for(v, cases[s, f, M], effective(v, cfg, FUSIONS[f]))[:2]:
            key = compile_key(v, cfg, cases[s, f, M], split)
            if pool is not None and key not in pending:
                pending[key] = pool.apply_async(_compile_task, ((v, cfg, s, f, M, split),))
    print(f"weights ready ({sum(len(c) * c[0].nbytes for c in weights.values()) / 2**30:.1f} GiB); "
          f"{len(pending)} compiles queued ({time.time() - t0:.0f} s)", flush=True)

    records, base, best = [], {}, {}
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                ceiling_gb_s=ceiling, rows=rows, args=vars(a) | {"json": str(a.json)})

    def save():
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = a.json.with_suffix(".tmp")
            tmp.write_text(json.dumps(dict(meta, baselines=base, records=records,
                                           best={"|".join(map(str, k)): b for k, b in best.items()}), indent=1))
            tmp.replace(a.json)

    for (s, f, M), case in cases.items():
        line = []
        for kind in ("cublas", "cublas+ops") if f != "plain" else ("cublas",):
            ops = kind == "cublas+ops"
            err = rel_err(baseline(case, case["W"][0], True), case["expect"]) if ops or f == "plain" else None
            t = time_calls([lambda w=w: baseline(case, w, ops) for w in case["W"]])
            base[f"{case['name']}|{M}|{kind}"] = dict(us=t * 1e6, gb_s=case["nbytes"] / t / 1e9, err=err)
            line.append(f"{kind} {t * 1e6:.1f} us" + ("" if err is None else f" (err {err:.1e})"))
        print(f"  baseline {case['name']:16s} M={M}: " + ", ".join(line), flush=True)
    save()

    broken, skipped, group, line = False, 0, None, []
    for item in plan + [None]:
        if item is None or group != item[:2] + item[4:]:  # one line per (variant, config, rows)
            if line:
                print(f"[{time.time() - t0:4.0f} s] {group[0]:8s} {cfg_short(group[1])} M={group[2]}: "
                      + "  ".join(line), flush=True)
                save()
            if item is None:
                break
            group, line = item[:2] + item[4:], []
        v, cfg, s, f, M = item
        case = cases[s, f, M]
        if broken or time.time() > deadline:
            skipped += 1
            continue
        results = []
        for split in splits_for(v, case, effective(v, cfg, case["flags"])):
            rec = dict(variant=v, cfg=effective(v, cfg, case["flags"]), split=split, case=case["name"], M=M)
            res = pending.get(compile_key(v, cfg, case, split))
            if res is not None:  # wait for the worker's compile (then the launch loads it from the cache)
                res.wait(max(0.0, min(deadline - time.time(), 60.0)))
                if time.time() > deadline:
                    break
                if not res.ready():  # a worker died or hangs: compile here from now on
                    print("    compile workers stalled: compiling in the main process from here on", flush=True)
                    pool.terminate()
                    pool, pending = None, {}
                elif res.get()[0]:  # the launch below compiles again and reports its own error
                    rec["worker_error"] = res.get()[0]
            try:
                case["y"].fill_(float("nan"))
                err = rel_err(launch(v, case, case["W"][0], cfg, split), case["expect"])
                rec["err"] = err
                if not err < 1e-2:
                    records.append(dict(rec, status="FAIL"))
                    results.append(f"FAIL(s{split} {err:.0e})")
                    continue
                t = time_calls([lambda w=w: launch(v, case, w, cfg, split) for w in case["W"]], reps=5)
                records.append(dict(rec, status="ok", us=t * 1e6, gb_s=case["nbytes"] / t / 1e9))
                results.append((t * 1e6, split))
                k = (v, case["name"], M)
                if k not in best or t * 1e6 < best[k]["us"]:
                    best[k] = dict(us=t * 1e6, gb_s=case["nbytes"] / t / 1e9, cfg=rec["cfg"], split=split, raw=cfg)
            except Exception as e:  # noqa: BLE001  (out of resources, ...)
                msg = f"{type(e).__name__}: {str(e)[:300]}"
                records.append(dict(rec, status="error", error=msg))
                results.append(type(e).__name__)
                print(f"    {v} {cfg_short(cfg)} {case['name']} split {split}: {msg}", flush=True)
                if "CUDA" in msg or "illegal" in msg:
                    broken = True
                    print("    CUDA context unusable: stopping", flush=True)
                break
        timed = [r for r in results if isinstance(r, tuple)]
        fastest = min(timed) if timed else None
        line.append(f"{case['name']} " + (f"{fastest[0]:.1f}/s{fastest[1]}" if fastest else
                                          ",".join(map(str, results)) or "-"))
    if pool is not None:
        pool.terminate()
        pool.join()
    if skipped:
        print(f"time budget: skipped {skipped} of {len(plan)} (config, case) pairs", flush=True)

    for k, b in ({} if broken else best).items():  # re-time each best with 10 replays
        if time.time() > t0 + a.budget_s - 8:
            break
        v, name, M = k
        case = next(c for c in cases.values() if c["name"] == name and c["M"] == M)
        t = time_calls([lambda w=w: launch(v, case, w, b["raw"], b["split"]) for w in case["W"]], reps=10)
        b.update(us=t * 1e6, gb_s=case["nbytes"] / t / 1e9, retimed=True)
    save()
    summary(cases, base, best, names, rows, ceiling)
    print(f"\ntotal {time.time() - t0:.0f} s" + (f"; JSON in {a.json}" if a.json else ""), flush=True)
    return 1 if broken else 0


def cfg_short(c):
    return (f"{c['bn']}x{c['bk']} w{c['warps']} s{c['stages']}" + (f" acc3={c['acc3']}" if "acc3" in c else ""))


def summary(cases, base, best, names, rows, ceiling):
    print(f"\nSummary: best µs (10 replays; *: 5, not re-timed), GB/s of weight bytes (copy ceiling {ceiling:.0f}), x = time / cuBLAS "
          "(+ the fusions' kernels), 1r = time / cuda_kernels.py's one-row kernel at batch 1 (BENCHMARKS.md)", flush=True)
    for M in rows:
        for case in (c for c in cases.values() if c["M"] == M):
            name = case["name"]
            one = ONE_ROW_US[case["shape"]][case["fusion"] == "plain"]
            bs = {k: base.get(f"{name}|{M}|{k}") for k in ("cublas", "cublas+ops")}
            ref = bs["cublas+ops"] or bs["cublas"]
            print(f"{name} {case['N']}x{case['K']} M={M} {case['nbytes'] / 1e6:.0f}MB  1-row {one} | " + " | ".join(
                f"{k} {b['us']:.1f} ({b['gb_s']:.0f}, 1r x{b['us'] / one:.2f})" for k, b in bs.items() if b), flush=True)
            for v in names:
                b = best.get((v, name, M))
                if b:
                    print(f"  {v:8s} {b['us']:6.1f}{' ' if b.get('retimed') else '*'} {b['gb_s']:4.0f} "
                          f"x{b['us'] / ref['us']:.2f} 1r x{b['us'] / one:.2f}  {cfg_short(b['cfg'])} split {b['split']}",
                          flush=True)
        layer = [c["name"] for c in cases.values() if c["M"] == M and c["shape"] in LAYER and c["fusion"] != "plain"]
        if len(layer) == 4:
            print(f"Per layer M={M} ({' '.join(layer)}); one row {sum(ONE_ROW_US[s][0] for s in LAYER):.1f} us:", flush=True)
            tot = {}
            for v in ["cublas+ops"] + names:
                got = [base.get(f"{n}|{M}|{v}") if v == "cublas+ops" else best.get((v, n, M)) for n in layer]
                if all(got):
                    tot[v] = sum(g["us"] for g in got)
            mix = [min((best[k]["us"], k[0]) for k in best if k[1] == n and k[2] == M) for n in layer
                   if any(k[1] == n and k[2] == M for k in best)]
            print("  " + "  ".join(f"{v} {t:.1f}" for v, t in tot.items()) + (
                f"  best-mix {sum(m[0] for m in mix):.1f} ({','.join(m[1] for m in mix)})" if len(mix) == 4 else ""),
                flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8", help="rows of x, e.g. 1,4,8 (<= 16)")
    p.add_argument("--variants", help="comma-separated subset of " + ",".join(VARIANTS) + " (that order: priority)")
    p.add_argument("--shapes", help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--fusions", default="fused,plain", help="fused (decode's fusion per shape), plain, or both")
    p.add_argument("--budget-s", type=float, default=300.0, help="wall clock for the whole run, compiles included")
    p.add_argument("--quick", action="store_true", help="two configs per variant")
    p.add_argument("--jobs", type=int, default=max(0, min(14, (os.cpu_count() or 2) - 2)),
                   help="compile worker processes (0: compile in the main process)")
    p.add_argument("--interpret-check", action="store_true", help="with TRITON_INTERPRET=1: correctness on the CPU")
    default_json = Path(os.environ["OUT"]) / "multirow.json" if os.environ.get("OUT") else None
    p.add_argument("--json", type=Path, default=default_json)
    a = p.parse_args()
    if a.interpret_check:
        return interpret_check()
    if any(int(r) > 16 for r in a.rows.split(",")):
        sys.exit("--rows: at most 16")
    return gpu_run(a)


if __name__ == "__main__":
    sys.exit(main())
