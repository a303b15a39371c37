"""Triton kernels for decode on CUDA: GEMVs, y = x @ W.T for a few rows of x, with W in bf16 or int8
(one scale per output row), and decode attention (RoPE, cache write and attention of one new token
per sequence in one kernel: the second half of this file).

Decode multiplies one token's activations by every weight matrix, so each matmul is a matrix-vector
product limited by how fast the weights stream from memory. cuBLAS reaches the copy bandwidth on
wide matrices but not on narrow ones (4096 outputs: too few blocks to fill the GPU), and PyTorch
has no fast CUDA kernel for int8 weights at all. These kernels give each program a few output
rows (many programs, no split, for one row of x; a split of the input dimension for several),
dequantize in registers, and accumulate in float32 (but for the one-row int8 GEMVs with the norm
fused, which multiply and sum in float16 pairs first: use_half). Everything they launch has fixed shapes:
they replay inside CUDA graphs. int4 (one row, int4_gemv, further down) multiplies in integers
(dp4a, x in int8 per group; float16 pairs with GRAPHDECODE_INT4_DP4A=0, int4_dp4a), its scales and
zeros in 8-bit codes where quantize.py's grid allows (int4_layout's units); decode's int4
step at group 32 is 1.86x as fast as through PyTorch's tinygemm on the Llama-2-7B shape
(BENCHMARKS.md, runs 34 and 53).

Launch plan, per program (one block of outputs, one slice of K):
  1 row of x:        acc[BLOCK_N, BLOCK_K] += W_tile * x   (no reduction inside the loop; int8 with
                     the norm fused: in float16 pairs, 7 instructions for 4 weights: use_half)
  2..16 rows, bf16:  acc[BLOCK_N, 16] += W_tile @ x_tile.T   (_rows_kernel: tensor cores, bf16
                     operands, the weights as the large operand, all of K; 5-20% faster than cuBLAS
                     at 8 rows with the norm, SwiGLU and residual fused in: BENCHMARKS.md)
  int8, 2..16+ rows: acc[BLOCK_M, BLOCK_N] += x_tile @ W_tile.T   (tensor cores; M padded to 16)
(int8's dots take float32 operands in TF32: exact for bf16 activations and int8 weights. Triton's
CPU interpreter, which the CPU tests use, computes bf16 dots wrongly: float32 there.)
A split-K launch writes float32 partial sums [SPLIT, M, N]; their sum (one small reduction that
Inductor fuses into whatever follows) is the result.

For one row (and up to 16 of bf16 weights) the GEMV can also apply the RMSNorm before it, SwiGLU
on its two halves, and the residual add after it (decode's steps around its matmuls), so that they
cost no kernel of their own.

This file needs Triton, which CUDA builds of PyTorch ship and CPU builds do not; model.py calls
it only for CUDA tensors (`usable`, `attention_usable`).
"""
import functools
import math
import os
import sys
from typing import Optional

import torch

try:  # CPU-only installs of torch come without Triton: model.py then never calls in here
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def usable(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether gemv runs x times weight: on CUDA with Triton, at most max_rows rows (callers pass
    the row count up to which the kernel beats PyTorch's for their weights: BENCHMARKS.md), a
    contiguous weight, and offsets that fit the kernel's 32-bit index arithmetic."""
    return (triton is not None and x.is_cuda and x.numel() // x.shape[-1] <= max_rows
            and weight.is_contiguous() and weight.numel() < 2**31)


if triton is not None:

    @triton.jit
    def _to_float(w, INT8: tl.constexpr):
        """bf16 or int8 weights -> float32. int8 goes through the float bit pattern of 2^23 + 128 + w
        (an integer add and a float subtract, both full rate) instead of the slow int-to-float
        conversion, which otherwise caps the kernel below the memory bandwidth."""
        if INT8:
            return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        return w.to(tl.float32)

    @triton.jit
    def _row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, k_ok, UNMASKED: tl.constexpr, INT8: tl.constexpr,
                   NORM: tl.constexpr, SWIGLU: tl.constexpr):
        """One block of columns rk of the one-row GEMV: loads x there (where k_ok, unless UNMASKED) and
        accumulates w (and w_up) times it."""
        if UNMASKED:
            x = tl.load(x_row + rk).to(tl.float32)
        else:
            x = tl.load(x_row + rk, mask=k_ok, other=0).to(tl.float32)
        if NORM:  # sum of squares on the way; the rsqrt scales the sums at the end
            squares += x * x
            x *= tl.load(g_ptr + rk, mask=k_ok, other=0).to(tl.float32)
        acc += _to_float(w, INT8) * x[None, :]
        if SWIGLU:  # the up row N + n beside the gate row n
            acc_up += _to_float(w_up, INT8) * x[None, :]
        return acc, acc_up, squares

    @triton.jit
    def _int8_half_fma(w, x, acc, EMULATE: tl.constexpr):
        """acc + (w / 128) * x for int8 w and float16 x and acc (tensors of one shape), in float16
        pairs: 8 + (w + 128) / 128 is built exactly by placing w's byte, shifted by 128, under
        float16's exponent of 8 (one xor for 4 weights, one prmt for 2), then 9 is subtracted and
        the product added (one sub and one fma for 2): 7 instructions for 4 weights, against ~20
        for int-to-float conversions and float32 FMAs. EMULATE (Triton's CPU interpreter, which runs
        no PTX): the same numbers through float32, rounded to float16."""
        if EMULATE:
            return (w.to(tl.float32) / 128 * x.to(tl.float32) + acc.to(tl.float32)).to(tl.float16)
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 u, a, b, nine;
            mov.b32 nine, 0x48804880;
            xor.b32 u, $2, 0x80808080;
            prmt.b32 a, u, 0x48484848, 0x4140;
            prmt.b32 b, u, 0x48484848, 0x4342;
            sub.f16x2 a, a, nine;
            sub.f16x2 b, b, nine;
            fma.rn.f16x2 $0, a, $3, $5;
            fma.rn.f16x2 $1, b, $4, $6;
            }
            """,
            constraints="=r,=r,r,r,r,r,r", args=[w, x, acc], dtype=tl.float16, is_pure=True, pack=4)

    @triton.jit
    def _half_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, rn, k_ok, K, UNMASKED: tl.constexpr,
                    NORM: tl.constexpr, SWIGLU: tl.constexpr, EMULATE: tl.constexpr):
        """_row_block for int8 weights in float16 pairs (HALF). Without the norm, x is loaded in the
        weight tile's own layout (a [BN, BK] load of row stride 0, which each thread reads once for
        all its rows), so it never moves between threads; that load takes no mask (masked loads are
        not merged across a thread's rows, and the work would be repeated per row): past K it reads
        x at K - 1, where the weights are masked to 0. With the norm, x is loaded, squared and
        multiplied by g in 1D (masked), then moved into the tile's layout.
        Range: x (times g, before the norm's rsqrt, which is applied at the end) must fit float16,
        and the products are of w / 128: |x g| up to ~6e4 before overflow, and below ~6e-5 they are
        subnormal and lose relative precision. The default model's activations span 1e-3 (median
        |x g| at layer 0) to 1.3e4 (max, layer 28's gate/up), measured on the CPU (BENCHMARKS.md)."""
        if NORM:  # (normed in 1D, then moved into the tile's layout: the tile form repeated work per row)
            xs = tl.load(x_row + rk, mask=k_ok, other=0).to(tl.float32)
            squares += xs * xs
            x = (xs * tl.load(g_ptr + rk, mask=k_ok, other=0).to(tl.float32)).to(tl.float16)[None, :]
        else:
            cols = rk if UNMASKED else tl.minimum(rk, K - 1)
            x = tl.load(x_row + cols[None, :] + 0 * rn[:, None]).to(tl.float16)
        acc = _int8_half_fma(w, x, acc, EMULATE)
        if SWIGLU:
            acc_up = _int8_half_fma(w_up, x, acc_up, EMULATE)
        return acc, acc_up, squares

    @triton.jit
    def _one_row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, rn, k_ok, K, UNMASKED: tl.constexpr,
                       INT8: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, HALF: tl.constexpr,
                       EMULATE: tl.constexpr):
        """One block of the one-row loop: _half_block (HALF) or _row_block."""
        if HALF:  # (one return for both: Triton wants one return type, and acc's differs between them)
            acc, acc_up, squares = _half_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, rn, k_ok, K,
                                               UNMASKED, NORM, SWIGLU, EMULATE)
        else:
            acc, acc_up, squares = _row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, k_ok, UNMASKED,
                                              INT8, NORM, SWIGLU)
        return acc, acc_up, squares

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, g_ptr, r_ptr, y_ptr, M, N, K, blocks_per_split, eps,
                     INT8: tl.constexpr, EVEN: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                     SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr, HALF: tl.constexpr, EMULATE: tl.constexpr):
        """y[split, m, n] = sum over this split's columns k of x[m, k] * W[n, k] (* scale[n]).
        One row per program (BLOCK_M 1) may also apply RMSNorm to x first (NORM: x * g * rsqrt(mean(x^2)
        + eps), the mean over all of K, so no split), multiply rows n and N + n of W
        into silu(a) * b (SWIGLU: W holds 2N rows, gate above up), and add a residual (RESIDUAL).
        PDL (programmatic dependent launch, launched with launch_pdl): the next kernel may start as
        soon as every program here has; one row loads its first weight block before waiting for the
        previous kernel (which writes x), so that load overlaps that kernel's last programs.
        HALF (int8, one row): products and sums in float16 pairs (_int8_half_fma), each lane of the
        tile summing K / BLOCK_K products before the float32 sum across lanes; EMULATE: the
        interpreter's stand-in for its PTX."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = rn < N, rm < M
        b_start = pid_k * blocks_per_split
        b_end = tl.minimum(b_start + blocks_per_split, tl.cdiv(K, BLOCK_K))
        if BLOCK_M == 1:  # one row: elementwise products, one reduction at the end
            x_row = x_ptr + pid_m * K
            ACC: tl.constexpr = tl.float16 if HALF else tl.float32
            acc = tl.zeros((BLOCK_N, BLOCK_K), ACC)
            acc_up = tl.zeros((BLOCK_N, BLOCK_K), ACC)  # SWIGLU only
            squares = tl.zeros((BLOCK_K,), tl.float32)
            # The first block's weights (gate and up) before the wait: they do not depend on x
            rk = b_start * BLOCK_K + tl.arange(0, BLOCK_K)
            w_at = w_ptr + rn[:, None] * K + rk[None, :]
            first_ok = (n_ok & (rn * 0 + b_start < b_end))[:, None]  # (an empty split of K: none)
            if not EVEN:
                first_ok = first_ok & (rk < K)[None, :]
            w = tl.load(w_at, mask=first_ok, other=0)
            w_up = tl.load(w_at + N * K, mask=first_ok, other=0) if SWIGLU else w
            if PDL:
                tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, the residual) are visible
            acc, acc_up, squares = _one_row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, rn,
                                                  (rk < K) & (rk * 0 + b_start < b_end), K, False, INT8, NORM,
                                                  SWIGLU, HALF, EMULATE)
            # The blocks wholly inside K with no masks (rows past N read row N - 1 and are not
            # stored), then the block K ends in, if it ends in one: a mask on every block would cost
            # its loads their vector width (down, 4096x11008, int8 at 1024 columns a block: 14.4 µs
            # with a mask on every block, run 25; 14.0 µs so, run 26)
            full_end = tl.minimum(b_end, K // BLOCK_K)
            w_rows = w_ptr + tl.minimum(rn, N - 1)[:, None] * K
            for b in range(b_start + 1, full_end):
                rk = b * BLOCK_K + tl.arange(0, BLOCK_K)
                w = tl.load(w_rows + rk[None, :])
                w_up = tl.load(w_rows + N * K + rk[None, :]) if SWIGLU else w
                acc, acc_up, squares = _one_row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, rn, rk < K,
                                                      K, True, INT8, NORM, SWIGLU, HALF, EMULATE)
            if not EVEN:  # (EVEN: K is a multiple of BLOCK_K)
                if (b_end > full_end) & (full_end > b_start):
                    rk = full_end * BLOCK_K + tl.arange(0, BLOCK_K)
                    w_ok = (rk < K)[None, :]
                    w = tl.load(w_rows + rk[None, :], mask=w_ok, other=0)
                    w_up = tl.load(w_rows + N * K + rk[None, :], mask=w_ok, other=0) if SWIGLU else w
                    acc, acc_up, squares = _one_row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, rn,
                                                          rk < K, K, False, INT8, NORM, SWIGLU, HALF, EMULATE)
            out = tl.sum(acc.to(tl.float32), axis=1)[None, :]  # [1, BLOCK_N]
            up = tl.sum(acc_up.to(tl.float32), axis=1)[None, :]
            if HALF:  # (the products were of w / 128)
                out *= 128.0
                up *= 128.0
            if NORM:
                r = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
                out *= r
                up *= r
        else:  # several rows (launched without PDL): tensor-core dot products, rows padded to BLOCK_M
            out = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for b in range(b_start, b_end):
                rk = b * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = rk < K
                w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
                x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
                out += tl.dot(x.to(tl.float32), tl.trans(_to_float(w, INT8)), input_precision="tf32")
        if INT8:
            out *= tl.load(scale_ptr + rn, mask=n_ok, other=0).to(tl.float32)[None, :]
        if SWIGLU:  # (one row)
            if INT8:
                up *= tl.load(scale_ptr + N + rn, mask=n_ok, other=0).to(tl.float32)[None, :]
            out = out / (1 + tl.exp(-out)) * up
        y_at = rm[:, None] * N + rn[None, :]
        if RESIDUAL:
            out += tl.load(r_ptr + y_at, mask=m_ok[:, None] & n_ok[None, :], other=0).to(tl.float32)
        tl.store(y_ptr + pid_k * M * N + y_at, out, mask=m_ok[:, None] & n_ok[None, :])


if triton is not None:

    @triton.jit
    def _first_block_scale(x_row, rk, k_ok, K, BLOCK_K: tl.constexpr):
        """1 / the root mean square of x over the first block (rk, where k_ok; 1 if that is all zeros),
        the scale x takes on its way into float16 in _int4_block: one more load of a block the loop
        reads anyway, and one sum. (int8's _half_block goes without: it cost int8 12.5%, run 30.)"""
        x0 = tl.load(x_row + rk, mask=k_ok, other=0).to(tl.float32)
        mean_square = tl.sum(x0 * x0, axis=0) / tl.minimum(K, BLOCK_K)
        return tl.where(mean_square > 0, tl.rsqrt(mean_square), 1.0)

    @triton.jit
    def _f16_pair(v):
        """int32 holding two float16 (low, high) -> (low, high) as float32."""
        lo = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _to_f16_pair(lo, hi):
        """Two float32 tensors -> int32 holding them as float16 (low, high)."""
        return ((lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
                | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16))

    @triton.jit
    def _int4_half_fma(w, x0, x1, x2, x3, s2, z2, acc, EMULATE: tl.constexpr):
        """acc + the 8 products of word w (the layout above) with x's pairs x0..x3 (float16 pairs in
        int32: (x[8j], x[8j + 1]) ...), acc a float16 pair in an int32: a nibble q becomes 1024 + q (or
        1024 + 16 q) in float16 by a lop3 under the exponent of 1024, q - 8 exactly by a sub (an fma
        by 1/16), (q - 8) s + z by an fma with the group's s2, z2 (float16 pairs (s, s), (z, z)), and
        an fma with x adds its product: 17 instructions for 8 weights. EMULATE (the interpreter,
        which runs no PTX): the same numbers in float32, rounded to float16 where the PTX rounds."""
        if EMULATE:
            s, _ = _f16_pair(s2)
            z, _ = _f16_pair(z2)
            lo, hi = _f16_pair(acc)
            for i in tl.static_range(4):
                xi = x0 if i == 0 else x1 if i == 1 else x2 if i == 2 else x3
                x_lo, x_hi = _f16_pair(xi)
                w_lo = ((((w >> (4 * i)) & 15).to(tl.float32) - 8) * s + z).to(tl.float16).to(tl.float32)
                w_hi = ((((w >> (16 + 4 * i)) & 15).to(tl.float32) - 8) * s + z).to(tl.float16).to(tl.float32)
                lo = (lo + w_lo * x_lo).to(tl.float16).to(tl.float32)
                hi = (hi + w_hi * x_hi).to(tl.float16).to(tl.float32)
            return _to_f16_pair(lo, hi)
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t, a, b, c, d, k1032, k16th, km72;
            mov.b32 k1032, 0x64086408;
            mov.b32 k16th, 0x2C002C00;
            mov.b32 km72, 0xD480D480;
            shr.u32 t, $1, 8;
            lop3.b32 a, $1, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 b, $1, 0x00F000F0, 0x64006400, 0xEA;
            lop3.b32 c, t, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;
            sub.f16x2 a, a, k1032;
            fma.rn.f16x2 b, b, k16th, km72;
            sub.f16x2 c, c, k1032;
            fma.rn.f16x2 d, d, k16th, km72;
            fma.rn.f16x2 a, a, $6, $7;
            fma.rn.f16x2 b, b, $6, $7;
            fma.rn.f16x2 c, c, $6, $7;
            fma.rn.f16x2 d, d, $6, $7;
            fma.rn.f16x2 $0, a, $2, $8;
            fma.rn.f16x2 $0, b, $3, $0;
            fma.rn.f16x2 $0, c, $4, $0;
            fma.rn.f16x2 $0, d, $5, $0;
            }
            """,
            constraints="=r,r,r,r,r,r,r,r,r", args=[w, x0, x1, x2, x3, s2, z2, acc], dtype=tl.int32,
            is_pure=True, pack=1)

    @triton.jit
    def _half_pair(h, HIGH: tl.constexpr, EMULATE: tl.constexpr):
        """int32 holding two float16 (low, high) -> the pair (low, low) or (high, high)."""
        if EMULATE:
            v = (h >> 16) & 0xFFFF if HIGH else h & 0xFFFF
            return v | (v << 16)
        if HIGH:
            return tl.inline_asm_elementwise(asm="prmt.b32 $0, $1, 0, 0x3232;", constraints="=r,r", args=[h],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise(asm="prmt.b32 $0, $1, 0, 0x1010;", constraints="=r,r", args=[h],
                                         dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _dp4a(w, x, acc, EMULATE: tl.constexpr):
        """acc + the dot product of w's four unsigned bytes with x's four signed bytes (int32 each):
        PTX's dp4a, one instruction. EMULATE (the interpreter, which runs no PTX): byte by byte."""
        if EMULATE:
            for i in tl.static_range(4):
                acc += ((w >> (8 * i)) & 255) * ((x << (24 - 8 * i)) >> 24)
            return acc
        return tl.inline_asm_elementwise(asm="dp4a.u32.s32 $0, $1, $2, $3;", constraints="=r,r,r,r",
                                         args=[w, x, acc], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _int4_dp4a_block(acc, acc_up, w, w_up, sz, sz_up, units, units_up, x, SWIGLU: tl.constexpr, G: tl.constexpr,
                         BLOCK_G: tl.constexpr, CODES: tl.constexpr, EMULATE: tl.constexpr):
        """The products of one block of the one-row int4 GEMV in integers (int4_layout(dp4a=True)): x
        [BLOCK_G * G] (times g) per group of G to int8, x ~ sx q with sx = max |x| / 127, four bytes to
        an int32. Each word's nibbles as bytes (w & 0x0F0F0F0F: columns 8j..8j+3; w >> 4 & 0x0F0F0F0F:
        8j+4..8j+7) take a dp4a each with x's bytes: 5 instructions for 8 weights. Per group, in
        float32: acc += s sx (sum(q_w q) - 8 sum(q)) + z sum(x) (CODES: s and z from their codes and
        the rows' units, _int4_scale_zero)."""
        x = tl.reshape(x, (BLOCK_G, G))
        amax = tl.max(tl.abs(x), axis=1)
        x_sum = tl.sum(x, axis=1)[None, :]
        sx = (amax / 127)[None, :]
        q = tl.floor(x * tl.where(amax > 0, 127 / amax, 0)[:, None] + 0.5).to(tl.int32)
        q_sum = tl.sum(q, axis=1).to(tl.float32)[None, :]
        q = tl.reshape(q & 255, (BLOCK_G, G // 8, 2, 4)) << (8 * tl.arange(0, 4))[None, None, None, :]
        x_lo, x_hi = tl.split(tl.sum(q, axis=3))  # (bytes apart: the sum is their bitwise or)
        x_lo, x_hi = x_lo[None, :, :], x_hi[None, :, :]
        acc = _int4_dp4a_acc(acc, w, sz, units, x_lo, x_hi, q_sum, sx, x_sum, CODES, EMULATE)
        if SWIGLU:
            acc_up = _int4_dp4a_acc(acc_up, w_up, sz_up, units_up, x_lo, x_hi, q_sum, sx, x_sum, CODES, EMULATE)
        return acc, acc_up

    @triton.jit
    def _int4_dp4a_acc(acc, w, sz, units, x_lo, x_hi, q_sum, sx, x_sum, CODES: tl.constexpr, EMULATE: tl.constexpr):
        """acc [BN, BLOCK_G] + each group's products of words w with x's bytes (_int4_dp4a_block)."""
        dot = _dp4a((w >> 4) & 0x0F0F0F0F, x_hi, _dp4a(w & 0x0F0F0F0F, x_lo, tl.zeros_like(w), EMULATE), EMULATE)
        s, z = _int4_scale_zero(sz, units, CODES)
        return acc + (tl.sum(dot, axis=2).to(tl.float32) - 8 * q_sum) * s * sx + z * x_sum

    @triton.jit
    def _int4_scale_zero(sz, units, CODES: tl.constexpr):
        """Each group's (scale, zero) in float32 from its scale-and-zero word: two float16, or
        (CODES) an int16 of two codes, the scale's in the low byte (0..255) and the zero's in the
        high byte (signed), times their row's units (units [BN, 2] float32: int4_layout's, a row each)."""
        if CODES:
            v = sz.to(tl.int32)  # (sign-extended: v >> 8 is the zero's code)
            unit_s, unit_z = tl.split(units)
            s, z = (v & 255).to(tl.float32) * unit_s[:, None], (v >> 8).to(tl.float32) * unit_z[:, None]
        else:
            s, z = _f16_pair(sz)
        return s, z

    @triton.jit
    def _int4_xq_block(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, xw_ptr, xs_ptr, b, n_groups,
                       NORM: tl.constexpr, SWIGLU: tl.constexpr, G: tl.constexpr, XG: tl.constexpr,
                       BLOCK_G: tl.constexpr, CODES: tl.constexpr, EMULATE: tl.constexpr):
        """Block b of the one-row int4 GEMV in integers with x already in int8 per group of XG
        columns (int4_quantize_x's layout, written by the kernel that made x): x's words (four
        bytes each) as the weights' nibbles pair them, and per group of XG its scale sx, sx sum(q),
        sum(x) and (NORM) the sum of squares before g. Per group of G, in float32: acc += s
        (sum over its x groups of sx sum(q_w q) - 8 sx sum(q)) + z sum(x)."""
        XB: tl.constexpr = BLOCK_G * G // XG  # x groups in the block
        n_x = n_groups * (G // XG)
        words = b * (BLOCK_G * G // 4) + tl.arange(0, BLOCK_G * G // 4)
        x_lo, x_hi = tl.split(tl.reshape(tl.load(xw_ptr + words, mask=words < n_groups * (G // 4), other=0),
                                         (BLOCK_G, G // 8, 2)))
        xg = b * XB + tl.arange(0, XB)
        ok = xg < n_x
        sx = tl.reshape(tl.load(xs_ptr + xg, mask=ok, other=0), (BLOCK_G, G // XG))[None, :, :]
        qs = tl.sum(tl.reshape(tl.load(xs_ptr + n_x + xg, mask=ok, other=0), (BLOCK_G, G // XG)), axis=1)[None, :]
        x_sum = tl.sum(tl.reshape(tl.load(xs_ptr + 2 * n_x + xg, mask=ok, other=0), (BLOCK_G, G // XG)), axis=1)[None, :]
        if NORM:
            squares += tl.load(xs_ptr + 3 * n_x + xg, mask=ok, other=0)
        x_lo, x_hi = x_lo[None, :, :], x_hi[None, :, :]
        acc = _int4_xq_acc(acc, w, sz, units, x_lo, x_hi, sx, qs, x_sum, G, XG, CODES, EMULATE)
        if SWIGLU:
            acc_up = _int4_xq_acc(acc_up, w_up, sz_up, units_up, x_lo, x_hi, sx, qs, x_sum, G, XG, CODES, EMULATE)
        return acc, acc_up, squares

    @triton.jit
    def _int4_xq_acc(acc, w, sz, units, x_lo, x_hi, sx, qs, x_sum, G: tl.constexpr, XG: tl.constexpr,
                     CODES: tl.constexpr, EMULATE: tl.constexpr):
        """acc [BN, BLOCK_G] + each group's products of words w with x's bytes (_int4_xq_block)."""
        dot = _dp4a((w >> 4) & 0x0F0F0F0F, x_hi, _dp4a(w & 0x0F0F0F0F, x_lo, tl.zeros_like(w), EMULATE), EMULATE)
        dot = tl.sum(tl.reshape(dot, (w.shape[0], w.shape[1], G // XG, XG // 8)), axis=3)  # per x group
        s, z = _int4_scale_zero(sz, units, CODES)
        return acc + (tl.sum(dot.to(tl.float32) * sx, axis=2) - 8 * qs) * s + z * x_sum

    @triton.jit
    def _int4_quantize_store(v, u, col0, n_valid, yw_ptr, ys_ptr, n_cols, XG: tl.constexpr):
        """Columns col0 + [0, A XG) of a GEMV's x, for the int4 GEMV that takes it (int4_quantize_x's
        layout): v [A, XG / 4, 4] float32 as stored, u = v g (g the GEMV's norm weight, if any); col0
        a multiple of XG, the columns from n_valid on not stored. Per group of XG (one row of v):
        q = floor(u 127 / max|u| + 0.5), four to a word at yw_ptr, and max|u| / 127, that times
        sum(q), sum(u) and sum(v^2) at ys_ptr, n_cols / XG apart."""
        A: tl.constexpr = v.shape[0]
        B: tl.constexpr = v.shape[1]
        amax = tl.max(tl.max(tl.abs(u), axis=2), axis=1)
        q = tl.floor(u * tl.where(amax > 0, 127 / amax, 0)[:, None, None] + 0.5).to(tl.int32)
        words = tl.sum((q & 255) << (8 * tl.arange(0, 4))[None, None, :], axis=2)  # [A, B]
        rw = tl.arange(0, A)[:, None] * B + tl.arange(0, B)[None, :]
        tl.store(yw_ptr + col0 // 4 + rw, words, mask=rw * 4 < n_valid)
        rg = tl.arange(0, A)
        ok = rg * XG < n_valid
        at = ys_ptr + col0 // XG + rg
        n_x = n_cols // XG
        sx = amax / 127
        tl.store(at, sx, mask=ok)
        tl.store(at + n_x, tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32) * sx, mask=ok)
        tl.store(at + 2 * n_x, tl.sum(tl.sum(u, axis=2), axis=1), mask=ok)
        tl.store(at + 3 * n_x, tl.sum(tl.sum(v * v, axis=2), axis=1), mask=ok)

    @triton.jit
    def _int4_step(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, x_row, xs_ptr, g_ptr, x_scale, b,
                   n_groups, NORM: tl.constexpr, SWIGLU: tl.constexpr, G: tl.constexpr, XG: tl.constexpr,
                   BLOCK_G: tl.constexpr, DP4A: tl.constexpr, XQ: tl.constexpr, CODES: tl.constexpr,
                   EMULATE: tl.constexpr):
        """Block b of the one-row int4 GEMV: from x in int8 (XQ: _int4_xq_block), or from x (_int4_block)."""
        if XQ:
            acc, acc_up, squares = _int4_xq_block(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, x_row,
                                                  xs_ptr, b, n_groups, NORM, SWIGLU, G, XG, BLOCK_G, CODES, EMULATE)
        else:
            acc, acc_up, squares = _int4_block(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, x_row,
                                               g_ptr, x_scale, b, n_groups, NORM, SWIGLU, G, BLOCK_G, DP4A, CODES,
                                               EMULATE)
        return acc, acc_up, squares

    @triton.jit
    def _int4_block(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, x_row, g_ptr, x_scale, b, n_groups,
                    NORM: tl.constexpr, SWIGLU: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                    DP4A: tl.constexpr, CODES: tl.constexpr, EMULATE: tl.constexpr):
        """Block b (BLOCK_G groups of G columns) of the one-row int4 GEMV: x there, normed (NORM:
        squares, g); then (DP4A) in integers, _int4_dp4a_block, or scaled by x_scale in float32, as
        float16 pairs in int32 in 1D, moved into the weight tile's layout as the four pairs of each
        word, and the products."""
        cols = b * (BLOCK_G * G) + tl.arange(0, BLOCK_G * G)
        ok = cols < n_groups * G
        x = tl.load(x_row + cols, mask=ok, other=0).to(tl.float32)
        if NORM:
            squares += x * x
        # times g, or ones without the norm: a multiply by a loaded vector keeps x's conversion in 1D
        # (without one Triton 3.6 moved it into the weight tile's layout, where each thread repeats it
        # for its groups: 4.1 instructions a weight against 2.7, sm_90 machine code)
        x *= tl.load(g_ptr + cols, mask=ok, other=0).to(tl.float32)
        if DP4A:
            acc, acc_up = _int4_dp4a_block(acc, acc_up, w, w_up, sz, sz_up, units, units_up, x, SWIGLU, G, BLOCK_G,
                                           CODES, EMULATE)
        else:
            lo, hi = tl.split(tl.reshape(x * x_scale, (BLOCK_G * G // 2, 2)))
            pairs = tl.reshape(_to_f16_pair(lo, hi), (BLOCK_G, G // 8, 2, 2))  # [group, word, i // 2, i % 2]
            x02, x13 = tl.split(pairs)
            x0, x2 = tl.split(x02)
            x1, x3 = tl.split(x13)
            x0, x1, x2, x3 = x0[None, :, :], x1[None, :, :], x2[None, :, :], x3[None, :, :]
            acc = _int4_half_fma(w, x0, x1, x2, x3, _half_pair(sz, False, EMULATE), _half_pair(sz, True, EMULATE),
                                 acc, EMULATE)
            if SWIGLU:
                acc_up = _int4_half_fma(w_up, x0, x1, x2, x3, _half_pair(sz_up, False, EMULATE),
                                        _half_pair(sz_up, True, EMULATE), acc_up, EMULATE)
        return acc, acc_up, squares

    @triton.jit
    def _int4_load(w_ptr, sz_ptr, rows, b, n_groups, G: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr,
                   DP4A: tl.constexpr):
        """Block b of int4 words [BN, BLOCK_G, G/8] and their scale-and-zero words [BN, BLOCK_G, 1]
        (DP4A: [BN, BLOCK_G]) for rows `rows`; MASKED: zero past the last group. The words load as
        the 2D tile they are in memory, [BN, BLOCK_G G/8], then take their 3D shape: loaded in 3D,
        Triton put a warp's threads on 32 rows, 16 bytes each, not along a row's contiguous bytes
        (the 7B step at group 32: 479 against 539 tok/s, runs 41 and 44). The scale-and-zero words
        are loaded in 2D and expanded: loaded in 3D, Triton moved the weights into their layout
        through shared memory."""
        groups = b * BLOCK_G + tl.arange(0, BLOCK_G)
        cols = b * (BLOCK_G * (G // 8)) + tl.arange(0, BLOCK_G * (G // 8))
        w_at = w_ptr + rows[:, None] * (n_groups * (G // 8)) + cols[None, :]
        sz_at = sz_ptr + rows[:, None] * n_groups + groups[None, :]
        if MASKED:
            ok = groups < n_groups
            w = tl.load(w_at, mask=(cols < n_groups * (G // 8))[None, :], other=0)
            sz = tl.load(sz_at, mask=ok[None, :], other=0)
        else:
            w = tl.load(w_at)
            sz = tl.load(sz_at)
        w = tl.reshape(w, (rows.shape[0], BLOCK_G, G // 8))
        if not DP4A:
            sz = sz[:, :, None]
        return w, sz

    @triton.jit
    def _int4_units(u_ptr, rows, CODES: tl.constexpr):
        """Rows `rows`' units [BN, 2] (float32: scale's, zero's) where CODES, else a placeholder."""
        if CODES:
            units = tl.load(u_ptr + rows[:, None] * 2 + tl.arange(0, 2)[None, :])
        else:
            units = tl.zeros((rows.shape[0], 2), tl.float32)
        return units

    @triton.jit
    def _int4_gemv_kernel(x_ptr, xs_ptr, w_ptr, sz_ptr, u_ptr, g_ptr, r_ptr, y_ptr, N, K, n_groups, eps, w_unscale,
                          NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, G: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, PREFETCH: tl.constexpr,
                          PDL: tl.constexpr, DP4A: tl.constexpr, CODES: tl.constexpr, XQ: tl.constexpr,
                          XG: tl.constexpr, EMULATE: tl.constexpr, EARLY: tl.constexpr):
        """y[n] = sum_k x[k] W[n, k] for one row x [K] and int4 W (the layout above, K a multiple of
        G), with _gemv_kernel's fusions (NORM, SWIGLU: W holds 2N rows, gate above up; RESIDUAL) and
        PDL. Each program takes BLOCK_N rows over all of K, BLOCK_G groups a step; each word's float16
        pair of the [BLOCK_N, BLOCK_G, G/8] tile sums its products (the first block of x sets x_scale,
        as for int8: _half_block), then the pairs are summed in float32. PREFETCH: each block's
        weights load one step ahead of its products. DP4A: in integers, each group's sum in float32
        (_int4_dp4a_block; no x_scale). CODES (DP4A only): the scale-and-zero words are int16 codes and
        u_ptr holds each row's two units (int4_layout with units). XQ (DP4A only): x is already in int8
        (x_ptr its words, xs_ptr its groups' numbers: int4_quantize_x, groups of XG), written by the
        kernel before (the attention kernel, for wo). EARLY (1 or 2, without PREFETCH): blocks of
        weights loaded before the PDL wait (an experiment: int4_gemv's launch with prefetch 2)."""
        tl.static_assert(EARLY == 1 or not PREFETCH)
        pid = tl.program_id(0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(rn, N - 1)  # rows past N are computed on row N - 1 and not stored
        if DP4A:
            acc = tl.zeros((BLOCK_N, BLOCK_G), tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_G), tl.float32)  # SWIGLU only
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_G, G // 8), tl.int32)  # float16 pairs (0, 0)
            acc_up = tl.zeros((BLOCK_N, BLOCK_G, G // 8), tl.int32)  # SWIGLU only
        if XQ:
            squares = tl.zeros((BLOCK_G * G // XG,), tl.float32)  # each x group's sum of squares
        else:
            squares = tl.zeros((BLOCK_G * G,), tl.float32)
        w, sz = _int4_load(w_ptr, sz_ptr, rows, 0, n_groups, G, BLOCK_G, True, DP4A)  # before the wait
        w_up, sz_up = w, sz
        if SWIGLU:
            w_up, sz_up = _int4_load(w_ptr, sz_ptr, rows + N, 0, n_groups, G, BLOCK_G, True, DP4A)
        w1, sz1, w1_up, sz1_up = w, sz, w_up, sz_up
        if EARLY == 2:  # block 1 too, masked (it may be K's partial block, or past K)
            w1, sz1 = _int4_load(w_ptr, sz_ptr, rows, 1, n_groups, G, BLOCK_G, True, DP4A)
            w1_up, sz1_up = w1, sz1
            if SWIGLU:
                w1_up, sz1_up = _int4_load(w_ptr, sz_ptr, rows + N, 1, n_groups, G, BLOCK_G, True, DP4A)
        units = _int4_units(u_ptr, rows, CODES)
        units_up = units
        if SWIGLU:
            units_up = _int4_units(u_ptr, rows + N, CODES)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if DP4A:
            x_scale = 1.0
        else:
            x_scale = _first_block_scale(x_ptr, tl.arange(0, BLOCK_G * G), tl.arange(0, BLOCK_G * G) < K, K,
                                         BLOCK_G * G)
        # Blocks wholly inside K load without masks (a mask on every block would cost the loop the
        # zeroing of its registers); then the block K ends in, if any.
        full = n_groups // BLOCK_G
        if PREFETCH:
            for b in range(1, full):
                w_next, sz_next = _int4_load(w_ptr, sz_ptr, rows, b, n_groups, G, BLOCK_G, False, DP4A)
                w_up_next, sz_up_next = w_next, sz_next
                if SWIGLU:
                    w_up_next, sz_up_next = _int4_load(w_ptr, sz_ptr, rows + N, b, n_groups, G, BLOCK_G, False, DP4A)
                acc, acc_up, squares = _int4_step(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up,
                                                   x_ptr, xs_ptr, g_ptr, x_scale, b - 1, n_groups,
                                                   NORM, SWIGLU, G, XG, BLOCK_G, DP4A, XQ, CODES, EMULATE)
                w, w_up, sz, sz_up = w_next, w_up_next, sz_next, sz_up_next
            acc, acc_up, squares = _int4_step(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up,
                                               x_ptr, xs_ptr, g_ptr, x_scale, tl.maximum(full, 1) - 1, n_groups,
                                               NORM, SWIGLU, G, XG, BLOCK_G, DP4A, XQ, CODES, EMULATE)
        else:
            acc, acc_up, squares = _int4_step(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up,
                                               x_ptr, xs_ptr, g_ptr, x_scale, 0, n_groups,
                                               NORM, SWIGLU, G, XG, BLOCK_G, DP4A, XQ, CODES, EMULATE)
            if EARLY == 2:
                if n_groups > BLOCK_G:  # block 1, loaded before the wait
                    acc, acc_up, squares = _int4_step(acc, acc_up, squares, w1, w1_up, sz1, sz1_up, units, units_up,
                                                       x_ptr, xs_ptr, g_ptr, x_scale, 1, n_groups,
                                                       NORM, SWIGLU, G, XG, BLOCK_G, DP4A, XQ, CODES, EMULATE)
            for b in range(EARLY, full):
                w, sz = _int4_load(w_ptr, sz_ptr, rows, b, n_groups, G, BLOCK_G, False, DP4A)
                if SWIGLU:
                    w_up, sz_up = _int4_load(w_ptr, sz_ptr, rows + N, b, n_groups, G, BLOCK_G, False, DP4A)
                acc, acc_up, squares = _int4_step(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up,
                                                   x_ptr, xs_ptr, g_ptr, x_scale, b, n_groups,
                                                   NORM, SWIGLU, G, XG, BLOCK_G, DP4A, XQ, CODES, EMULATE)
        if (full * BLOCK_G < n_groups) & (full > EARLY - 1):  # (EARLY 2: a partial block 1 is done)
            w, sz = _int4_load(w_ptr, sz_ptr, rows, full, n_groups, G, BLOCK_G, True, DP4A)
            if SWIGLU:
                w_up, sz_up = _int4_load(w_ptr, sz_ptr, rows + N, full, n_groups, G, BLOCK_G, True, DP4A)
            acc, acc_up, squares = _int4_step(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up,
                                               x_ptr, xs_ptr, g_ptr, x_scale, full, n_groups,
                                               NORM, SWIGLU, G, XG, BLOCK_G, DP4A, XQ, CODES, EMULATE)
        unscale = w_unscale / x_scale
        if NORM:
            unscale *= tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        if DP4A:
            out = tl.sum(acc, axis=1) * unscale
        else:
            lo, hi = _f16_pair(acc)
            out = tl.sum(tl.sum(lo + hi, axis=2), axis=1) * unscale
        if SWIGLU:
            if DP4A:
                up = tl.sum(acc_up, axis=1) * unscale
            else:
                lo, hi = _f16_pair(acc_up)
                up = tl.sum(tl.sum(lo + hi, axis=2), axis=1) * unscale
            out = out / (1 + tl.exp(-out)) * up
        if RESIDUAL:
            out += tl.load(r_ptr + rn, mask=rn < N, other=0).to(tl.float32)
        tl.store(y_ptr + rn, out, mask=rn < N)

if triton is not None:

    @triton.jit
    def _rows_step(acc, acc_up, squares, w, w_up, x_rows, m_ok, g_ptr, rk, k_ok, UNMASKED: tl.constexpr,
                   NORM: tl.constexpr, SWIGLU: tl.constexpr, DOT_F32: tl.constexpr):
        """One block of columns rk of _rows_kernel: acc[BN, BM] += w [BN, BK] @ x[BM, BK].T."""
        if UNMASKED:
            x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None], other=0)
        else:
            x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        if NORM:  # each row's sum of squares on the way; x * g goes to the tensor cores in bf16
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = xf * tl.load(g_ptr + rk, mask=k_ok, other=0).to(tl.float32)[None, :]
        if DOT_F32:  # Triton's CPU interpreter computes bf16 dots wrongly: float32 there, exact
            xt = tl.trans(x.to(tl.float32))
            acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
            if SWIGLU:
                acc_up = tl.dot(w_up.to(tl.float32), xt, acc_up, input_precision="ieee")
        else:  # (x in the weights' dtype: bf16 operands, float32 sums)
            xt = tl.trans(x.to(w.dtype))
            acc = tl.dot(w, xt, acc)
            if SWIGLU:
                acc_up = tl.dot(w_up, xt, acc_up)
        return acc, acc_up, squares

    @triton.jit
    def _rows_kernel(x_ptr, w_ptr, g_ptr, r_ptr, y_ptr, M, N, K, eps, EVEN_K: tl.constexpr, NORM: tl.constexpr,
                     RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, DOT_F32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[m, n] = sum_k x[m, k] W[n, k] for a few rows of x (M <= BLOCK_M = 16) and bf16 W, with the
        same fusions as _gemv_kernel's one row (NORM per row, SWIGLU, RESIDUAL). Each program takes
        BLOCK_N rows of W over all of K and multiplies them by the rows of x on the tensor cores,
        weights as the large operand ("swap AB": acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile.T), the
        weight tiles pipelined through shared memory (num_stages). Rows of W past N are clamped for
        the loads (never stored). No PDL: with it, batch-8 decode took 4.68 ms a step (run 19),
        without 4.13 (run 20); these programs hold most of an SM's shared memory."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + tl.minimum(rn, N - 1)[:, None] * K
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        x_rows = x_ptr + rm[:, None] * K
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # SWIGLU only
        squares = tl.zeros((BLOCK_M,), tl.float32)  # NORM only
        for b in range(0, tl.cdiv(K, BLOCK_K)):
            rk = b * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            if EVEN_K:
                w = tl.load(w_rows + rk[None, :])
                w_up = tl.load(w_rows + N * K + rk[None, :]) if SWIGLU else w
            else:
                w = tl.load(w_rows + rk[None, :], mask=k_ok[None, :], other=0)
                w_up = tl.load(w_rows + N * K + rk[None, :], mask=k_ok[None, :], other=0) if SWIGLU else w
            acc, acc_up, squares = _rows_step(acc, acc_up, squares, w, w_up, x_rows, m_ok, g_ptr, rk, k_ok,
                                              EVEN_K, NORM, SWIGLU, DOT_F32)
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        if NORM:
            r = tl.rsqrt(squares / K + eps)[:, None]
            out *= r
        if SWIGLU:
            up = tl.trans(acc_up)
            if NORM:
                up *= r
            out = out / (1 + tl.exp(-out)) * up
        y_at = rm[:, None] * N + rn[None, :]
        ok = m_ok[:, None] & (rn < N)[None, :]
        if RESIDUAL:
            out += tl.load(r_ptr + y_at, mask=ok, other=0).to(tl.float32)
        tl.store(y_ptr + y_at, out, mask=ok)


# Programmatic dependent launch (sm_90+) of the one-row GEMVs and the attention kernel: each lets the
# next kernel start as soon as all its programs have, and waits for the previous kernel's writes
# only where it reads them (a GEMV loads its first weight block before, the attention kernel its
# first K/V block). In a graph of decode's ~160 kernels this overlaps each kernel's start with the
# end of the one before (BENCHMARKS.md; bench.py --no-pdl is the A/B). Several-row launches go
# without: with it, batch-8 decode was slower (BENCHMARKS.md).
# Since each of these kernels signals at its start, the part of one before its wait may run while
# any earlier kernel of an unbroken run of them still does: it reads only what none of them writes
# (weights, the RoPE tables, pos, cache rows before pos: decode's step ends in PyTorch's sampling
# kernels, launched normally, which wait for everything before them). Triton's CPU interpreter
# has no such launch.
PDL = True


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device are launched with PDL: not in Triton's interpreter, not while
    torch.compile traces into cuda_kernels.py (bench.py --traced-gemv: its kernel wrapper knows no such
    launch option), and not if Inductor launches its own kernels with PDL (triton.enable_pdl), which
    would break the rule above (its kernels would no longer wait for ours)."""
    inductor = sys.modules.get("torch._inductor.config")  # (only if already imported: it is slow to import)
    if inductor is not None and getattr(inductor.triton, "enable_pdl", False):
        return False
    return (PDL and x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and not torch.compiler.is_compiling()
            and _pdl_capable(x.device.index or 0))


@functools.cache
def _pdl_capable(device: int) -> bool:
    """sm_90 or newer (NVIDIA), and a Triton with the launch option and the wait (3.6 and 3.9 have both)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        triton_has = "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")
    except (ImportError, AttributeError):
        triton_has = False
    return triton_has and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


# int8 weights, one row of bf16 or fp16 x: products and sums in float16 pairs (_int8_half_fma),
# ~2.7 instructions a weight against ~5.2 through float32 (SASS of the loops, sm_90), where it is
# faster (use_half); False (bench.py --int8-float32, or GRAPHDECODE_INT8_HALF=0 for any program, e.g.
# for a model whose norm inputs leave float16's range: _half_block) keeps float32 arithmetic. Float32
# x always takes float32 arithmetic (its products are exact there).
INT8_HALF = os.environ.get("GRAPHDECODE_INT8_HALF", "1") != "0"
HALF_EVERYWHERE = False  # (tests and benchmarks/gemv.py: float16 pairs on every one-row int8 GEMV)

def use_half(x: torch.Tensor, scales: torch.Tensor | None, M: int, norm_weight: torch.Tensor | None) -> bool:
    """Whether a one-row int8 GEMV runs in float16 pairs: where it measured faster, the GEMVs with the
    RMSNorm before them (Llama-2-7B, tuned, run 24: wqkv 15.0 against 16.6 µs, gate/up with SwiGLU 23.5
    against 30.5, the head 34.8 against 38.4); not wo and down, the narrow ones with the residual after
    them (run 24: 6.9 against 6.1, 27.7 against 14.4; run 26, re-tuned after the loop lost its
    masks: 7.0 against 6.2, 15.8 against 14.0)."""
    return (INT8_HALF and scales is not None and M == 1 and x.dtype != torch.float32
            and (norm_weight is not None or HALF_EVERYWHERE))


# The one-row int4 GEMV's arithmetic: "auto" (int4_dp4a's rule), "1" integers (dp4a: sm_61 and
# later, as every GPU Triton supports) everywhere, "0" float16 pairs everywhere. Read when an
# Int4Linear loads: its layout follows.
INT4_DP4A = os.environ.get("GRAPHDECODE_INT4_DP4A", "auto")


def int4_dp4a() -> bool:
    """Whether int4_gemv runs in integers (INT4_DP4A): "auto" takes integers on every shape. Since
    the words load as 2D tiles (_int4_load, run 44) they beat float16 pairs on the down projection
    too (Llama-2-7B, K = 11008, tuned, run 45: 9.4 against 11.0 µs at group 32, 9.2 against 10.8 at
    128), where in run 35, loaded across rows, they lost (19.6 against 13.7; the rule was integers up
    to 8192 columns). x in int8 per int4 group costs the default model 0.2% perplexity at group 32,
    0.5% at 128, with every int4 layer doing it (benchmarks/x_int8_perplexity.py)."""
    if INT4_DP4A not in ("auto", "0", "1"):
        raise ValueError(f"GRAPHDECODE_INT4_DP4A must be auto, 0 or 1 (got {INT4_DP4A!r})")
    return INT4_DP4A in ("auto", "1")


# Rows of x that _rows_kernel takes (bf16 weights; its BLOCK_M): batched decode, short prefills
MAX_ROWS = 16  # (at most 16: the kernel pads the rows to 16 for the tensor cores)

# Several rows: split K until about this many programs: 4 per SM of the H200 (132 SMs), where the
# launches were measured. A constant rather than a device query, which torch.compile would have
# to trace (and whose decorator, torch.compiler.assume_constant_result, cost every import 1.7 s
# of loading torch._dynamo).
TARGET_PROGRAMS = 4 * 132


# A launch: (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages).
def config(kind: str, M: int, N: int, K: int, swiglu: bool = False, half: bool = False) -> tuple[int, int, int, int, int]:
    """The launch for an [M, K] x [N, K] product of `kind` ("bf16" or "int8"), from tuning runs on
    the H200 (benchmarks/gemv.py --tune [--fused]; BENCHMARKS.md). One row: many narrow programs, no
    split, tuned with what decode fuses in (the residual into the narrow wo and w2, RMSNorm into
    wqkv and the head, SwiGLU into w13, where BLOCK_N counts rows of each half). Several rows:
    split K until there are about TARGET_PROGRAMS programs. `half`: int8 in float16 pairs (use_half)."""
    if M == 1:
        if kind == "bf16":  # (N <= 8192 from Llama-3.1-8B's qkv 6144x4096; K > 12288 its down 4096x14336)
            return ((2, 1024, 1, 4, 2) if swiglu else ((4, 2048, 1, 4, 4) if K > 12288 else (4, 1024, 1, 4, 2))
                    if N <= 4096 else (16, 512, 1, 4, 2) if N <= 8192 else (32, 256, 1, 8, 4) if N <= 16384
                    else (8, 1024, 1, 4, 4))
        if half:  # int8 in float16 pairs (runs 24, 27: benchmarks/gemv.py --kinds int8 --rows 1 --fused --tune)
            return (16, 256, 1, 4, 4) if swiglu or N > 16384 else (32, 512, 1, 4, 3)  # (wqkv 14.9 -> 13.8 µs)
        return ((8, 512, 1, 4, 4) if swiglu else (4, 1024, 1, 4, 4) if N <= 8192  # int8
                else (32, 256, 1, 8, 4) if N <= 16384 else (32, 128, 1, 4, 4))
    if kind == "bf16" and M <= 16:  # _rows_kernel (benchmarks/multirow.py's swap_ab, 8 rows, Llama-2-7B)
        if swiglu:
            return 128, 128, 1, 8, 3
        if N <= 4096:
            return (32, 256, 1, 4, 6) if K > 8192 else (64, 128, 1, 4, 6)  # (w2 at 8 rows: 25.6 -> 24.5 us, run 21)
        return (128, 128, 1, 8, 4) if N >= 8192 else (64, 128, 1, 4, 4)
    block_n, block_k = 32, 128
    programs, blocks = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    split = 1
    while programs * split < TARGET_PROGRAMS and blocks // (split * 2) >= 8:
        split *= 2
    return block_n, block_k, split, 4, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, swiglu: bool = False, launch: tuple | None = None) -> torch.Tensor:
    """x [..., K] times weight [N, K] (bf16, or int8 with `scales` [N]) -> [..., N] in x's dtype.
    For one row of x, or up to MAX_ROWS with bf16 weights, it can also do, in the same kernel, what
    decode does around its matmuls: residual + rmsnorm(x, norm_weight, eps) @ W.T (each row normed
    on its own), and with `swiglu` silu(a) * b of the two halves a, b of that product (-> [..., N/2]).
    `launch` overrides `config` (for tuning)."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    fused = norm_weight is not None or residual is not None or swiglu
    half = use_half(x, scales, M, norm_weight)
    block_n, block_k, split, warps, stages = launch or config("int8" if scales is not None else "bf16",
                                                              M, N, K, swiglu, half)
    rows = 1 < M <= min(MAX_ROWS, 16) and scales is None and (split == 1 or fused)  # _rows_kernel (16 rows a program)
    if fused and M != 1 and not rows:
        raise ValueError(f"gemv: the norm, SwiGLU and the residual take one row of x, or up to 16 of bf16 "
                         f"weights (got {M})")
    if swiglu and N % 2:
        raise ValueError(f"gemv: SwiGLU needs an even number of rows (got {N})")
    if fused:
        split = 1  # the norm needs all of K in one program; the residual is added once
    if swiglu:
        N //= 2  # outputs; each program reads BLOCK_N rows of each half
    if rows:
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        _rows_kernel[(triton.cdiv(N, block_n),)](
            x2, weight, weight if norm_weight is None else norm_weight,
            weight if residual is None else residual.reshape(M, N).contiguous(), y, M, N, K, eps,
            EVEN_K=K % block_k == 0, NORM=norm_weight is not None, RESIDUAL=residual is not None, SWIGLU=swiglu,
            DOT_F32=os.environ.get("TRITON_INTERPRET") == "1", BLOCK_M=16, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages)
        return y.view(*x.shape[:-1], N)
    block_m = 1 if M == 1 else 16 if M <= 16 else 64
    y = torch.empty((split, M, N), device=x.device, dtype=x.dtype if split == 1 else torch.float32)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    per_split = triton.cdiv(triton.cdiv(K, block_k), split)
    even = K % block_k == 0  # (no partly filled block of K: the one-row loop needs no tail)
    use_pdl = M == 1 and pdl(x)  # (PDL measured for one row only)
    _gemv_kernel[grid](x2, weight, weight if scales is None else scales,
                       weight if norm_weight is None else norm_weight,
                       weight if residual is None else residual.reshape(M, N).contiguous(), y, M, N, K,
                       per_split, eps, INT8=scales is not None, EVEN=even, NORM=norm_weight is not None,
                       RESIDUAL=residual is not None, SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, PDL=use_pdl, HALF=half, EMULATE=os.environ.get("TRITON_INTERPRET") == "1",
                       num_warps=warps, num_stages=stages,
                       **({"launch_pdl": True} if use_pdl else {}))  # (the interpreter knows no such option)
    y = y[0] if split == 1 else y.sum(0).to(x.dtype)  # split: sum the float32 partials
    return y.view(*x.shape[:-1], N)


# How torch.compile sees the GEMV. Traced (OPAQUE False), it lowers our Triton kernel to Triton IR
# at each call site (129 per decode step of a 7B model) to learn which arguments it writes: cold
# first call 76-86 s on the H200. Through a custom op it treats as a black box (OPAQUE True, the
# default; still captured in the graph) 49 s, at the same speed (BENCHMARKS.md). bench.py
# --traced-gemv measures the other way.
OPAQUE = True


def matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
           norm_weight: torch.Tensor | None = None, eps: float = 0.0,
           residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """gemv with its tuned launch, through the custom op (OPAQUE) or directly."""
    f = gemv_op if OPAQUE else gemv
    return f(x, weight, scales, norm_weight, eps, residual, swiglu)


@torch.library.custom_op("graphdecode::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, scales: Optional[torch.Tensor],
            norm_weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor],
            swiglu: bool) -> torch.Tensor:
    return gemv(x, weight, scales, norm_weight, eps, residual, swiglu)


@gemv_op.register_fake
def _(x, weight, scales, norm_weight, eps, residual, swiglu):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2 if swiglu else weight.shape[0]))



# -- int4, one row: the host side ------------------------------------------------------------------

def int4_layout(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dp4a: bool = False,
                units: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """int4 values q [N, K] in 0..15 with a scale and zero [N, K/g] per group of g columns
    (W = (q - 8) s + z; model.int4_gemv_layout makes them from the file) -> (int32 words [N, K/8],
    scale-and-zero words [N, K/g], w_unscale) for int4_gemv. c = 1 / w_unscale is the power of two
    that brings the largest |(q - 8) s + z| to (1/2, 1] (float16 keeps its 11 bits for the small
    groups; c is exact). Scale-and-zero words (s c, z c) in float16; or, given each row's units
    [N, 2] (dp4a only: quantize.py's grid, model.int4_grid_units), int16 codes (s / u_s in the low
    byte, 0..255; z / u_z in the high byte, -128..127), half the bytes, and w_unscale 1. Weights,
    float16 pairs: column 8j + 2i + h at bits 16 h + 4 i of word j; dp4a: column 8j + i at bits 8 i,
    8j + 4 + i at 8 i + 4."""
    N, K = q.shape
    if K % 32:
        raise ValueError(f"int4_layout: K must be a multiple of 32 (got {K})")
    s, z = scales.float(), zeros.float()
    if units is not None:
        if not dp4a:
            raise ValueError("int4_layout: codes (units) are for the integer kernel (dp4a) only")
        c = 1.0
        codes_s, codes_z = s / units[:, :1], z / units[:, 1:]
        if not all(bool(((k == k.round()) & (k >= lo) & (k <= hi)).all())
                   for k, lo, hi in ((codes_s, 0, 255), (codes_z, -128, 127))):
            raise ValueError("int4_layout: the scales and zeros are not whole codes of the units given")
        sz = (codes_s + 256 * codes_z).to(torch.int16)
    else:
        bound = (8 * s.abs() + z.abs()).max().item()  # |(q - 8) s + z| <= 8 |s| + |z|
        c = 2.0 ** -math.ceil(math.log2(bound)) if bound > 0 else 1.0
        halves = [(t * c).half().view(torch.int16).int() for t in (s, z)]
        sz = (halves[0] & 0xFFFF) | (halves[1] << 16)
    if dp4a:
        shifts = 4 * torch.arange(2, device=q.device)[:, None] + 8 * torch.arange(4, device=q.device)
        words = (q.view(N, K // 8, 2, 4).long() << shifts).sum((2, 3))
    else:
        shifts = 4 * torch.arange(4, device=q.device)[:, None] + 16 * torch.arange(2, device=q.device)
        words = (q.view(N, K // 8, 4, 2).long() << shifts).sum((2, 3))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.contiguous(), sz.contiguous(), 1.0 / c


# A launch of the int4 GEMV: (BLOCK_N, BLOCK_G, num_warps, num_stages, PREFETCH). By layer shape: gate/up
# (SwiGLU), wide (N > 8192: wqkv), long (K > 8192: the down projection), square (wo, and the rest); in
# integers (rows, columns a step, warps) at group 32 and at group 128, or in float16 pairs (and PREFETCH);
# then in integers at group 32 with the scales and zeros as codes (int4_layout with units).
INT4_LAUNCHES = {
    "gate/up": ((16, 1024, 8), (32, 1024, 4), (8, 512, 4, True), (16, 1024, 8)),
    "wide": ((32, 1024, 4), (32, 1024, 8), (16, 512, 4, False), (32, 1024, 4)),
    "long": ((8, 2048, 8), (16, 4096, 8), (8, 1024, 4, True), (16, 2048, 8)),
    "square": ((16, 2048, 8), (16, 4096, 8), (16, 2048, 8, False), (16, 2048, 8)),
}


def int4_shape(N: int, K: int, swiglu: bool = False) -> str:
    """INT4_LAUNCHES' name for a layer's shape (also int4_ring.py's)."""
    return "gate/up" if swiglu else "wide" if N > 8192 else "long" if K > 8192 else "square"


def int4_launch_override(text: str) -> dict[str, tuple[int, int, int]]:
    """GRAPHDECODE_INT4_LAUNCH's launches for the integer kernel on one row of x in bf16, in place of
    INT4_LAUNCHES', by shape: "gate/up=8,2048,8;long=8,4096,8" (rows a program, columns a step,
    warps; powers of two). For timing a launch in the whole step (bench.py), which the tuner's
    GEMVs timed alone do not always predict."""
    launches = {}
    for shape, values in launch_parts(text):
        rows, columns, warps = values if len(values) == 3 else (0, 0, 0)
        if shape not in INT4_LAUNCHES or min(rows, columns, warps) < 1 or any(
                v & (v - 1) for v in (rows, columns, warps)):
            raise ValueError(f"GRAPHDECODE_INT4_LAUNCH: {shape}={','.join(map(str, values))} is not "
                             f"SHAPE=ROWS,COLUMNS,WARPS (shapes {', '.join(INT4_LAUNCHES)}; powers of two)")
        launches[shape] = (rows, columns, warps)
    return launches


def launch_parts(text: str) -> list[tuple[str, list[int]]]:
    """"SHAPE=A,B,...;SHAPE=..." -> [(SHAPE, [A, B, ...]), ...]; a value that is not an integer reads as 0."""
    parts = []
    for part in filter(None, text.split(";")):
        shape, _, values = part.partition("=")
        parts.append((shape, [int(v) if v.strip().lstrip("-").isdigit() else 0 for v in values.split(",")]))
    return parts


INT4_LAUNCH = os.environ.get("GRAPHDECODE_INT4_LAUNCH", "")  # read at each launch (int4_config)


def int4_config(N: int, K: int, groupsize: int, swiglu: bool = False, dp4a: bool = False,
                codes: bool = False, xq: bool = False) -> tuple[int, int, int, int, bool]:
    """The launch for one row of x times int4 weights [N, K] in groups of `groupsize` (INT4_LAUNCHES),
    from benchmarks/gemv_int4.py --tune on the H200 (Llama-2-7B with the fusions; float16 pairs run 30
    at group 32; integers run 35, and runs 44-48 at groups 32 and 128 after the 2D load): rows a
    program, columns a step (BLOCK_G = columns / groupsize), warps, PREFETCH. Groups 64 and 256 take
    group 128's (not tuned). Codes at group 32: the down projection at 16 rows (8.9 µs against 9.8
    at 8, run 51); codes at other groups take the integers' launches. xq (x in int8 already, wo's
    case): the square shape at 16 rows, 4096 columns a step, 4 warps (wo at group 32 with codes,
    3.1 µs against 3.9 at the codes' launch, run 58; other groups not tuned)."""
    shape = int4_shape(N, K, swiglu)
    at_32, at_128, half, codes_at_32 = INT4_LAUNCHES[shape]
    override = int4_launch_override(INT4_LAUNCH).get(shape) if dp4a and not xq else None
    if override:
        (rows, columns, warps), prefetch = override, False
    elif dp4a and xq and shape == "square":
        rows, columns, warps, prefetch = 16, 4096, 4, False
    elif dp4a:
        (rows, columns, warps), prefetch = (codes_at_32 if codes else at_32) if groupsize <= 32 else at_128, False
    else:
        rows, columns, warps, prefetch = half
    block_g = max(1, min(columns // groupsize, triton.next_power_of_2(K // groupsize)))
    return rows, block_g, warps, 3, prefetch


# x in int8 for the integer kernel, written by the kernel that made it: the attention kernel also
# writes its output in int8 per group of X columns (decode_attention's out_group) for an int4 wo
# (model.py's Attention), whose programs then read that instead of each quantizing all of x again
# (Llama-2-7B at group 32, tuned: 4.2 -> 3.1 µs, run 58). The int4 GEMVs do not write theirs: their
# epilogue's group reductions over rows spread across warps cost more than the next GEMV saved
# (run 58: w13 15.2 -> 17.6 µs writing, against 14.2 reading; BENCHMARKS.md, session 13).
# GRAPHDECODE_INT4_XQ: "auto" (groups of 16 at int4 groups of 32: int4_x_group), "0" (off: wo quantizes
# x itself), or 8, 16, 32 (which must divide the int4 groups). Read at each trace (model.Int4Linear.x_group).
INT4_XQ = os.environ.get("GRAPHDECODE_INT4_XQ", "auto")
X_GROUPS = (8, 16, 32)


def int4_x_group(groupsize: int) -> int:
    """The group of x in int8 for an int4 GEMV whose kernel groups are `groupsize` (INT4_XQ); 0: none
    (x in bf16, quantized by each of its programs). auto: 16 at groups of 32, where it won (the 7B
    step 668.9 against 653.5 tok/s, run 59); none above (group 128: 685.6 against 693.6, run 60;
    64 not measured)."""
    if INT4_XQ not in ("auto", "0", *map(str, X_GROUPS)):
        raise ValueError(f"GRAPHDECODE_INT4_XQ must be auto, 0, 8, 16 or 32 (got {INT4_XQ!r})")
    group = (16 if groupsize <= 32 else 0) if INT4_XQ == "auto" else int(INT4_XQ)
    return group if group and groupsize % group == 0 else 0


def int4_quantize_x(x: torch.Tensor, g: torch.Tensor | None = None, group: int = 16) -> torch.Tensor:
    """One row x [..., K] (times g [K], the next GEMV's norm weight) in int8 per group of `group`
    columns: what int4_gemv(xq=) reads and decode_attention(out_group=) writes (_int4_quantize_store).
    int32 [K/4 + 4 K/group]: the codes q = floor(u 127 / max|u| + 0.5) of u = x g, four to a word
    (column 4i + j at bits 8j of word i), then per group, as float32, max|u| / 127, that times sum(q),
    sum(u) and sum(x^2), each K/group long. In PyTorch: the tests' reference, and for an x that no
    kernel of ours wrote."""
    K = x.shape[-1]
    if x.numel() != K or K % group or group not in X_GROUPS:
        raise ValueError(f"int4_quantize_x takes one row of whole groups of 8, 16 or 32 (got {tuple(x.shape)}, {group})")
    v = x.reshape(K).float()
    u = (v if g is None else v * g.float()).view(-1, group)
    amax = u.abs().amax(1, keepdim=True)
    q = torch.floor(u * torch.where(amax > 0, 127 / amax, 0) + 0.5).int()
    sx = amax[:, 0] / 127
    words = ((q.view(-1, 4).long() & 255) << (8 * torch.arange(4, device=x.device))).sum(1)
    words = torch.where(words >= 2**31, words - 2**32, words).int()
    stats = torch.stack([sx, q.sum(1).float() * sx, u.sum(1), v.pow(2).view(-1, group).sum(1)])
    return torch.cat([words, stats.flatten().view(torch.int32)])


def _x_group_of(xq: torch.Tensor, K: int) -> int:
    """The group size of x in int8 (int4_quantize_x's layout) for K columns, from its length."""
    extra = xq.numel() - K // 4
    group = 4 * K // extra if extra > 0 and (4 * K) % extra == 0 else 0
    if xq.dtype != torch.int32 or xq.dim() != 1 or not xq.is_contiguous() or group not in X_GROUPS or K % group:
        raise ValueError(f"int4_gemv: xq ({xq.dtype}, {xq.numel()}) is not {K} columns of int4_quantize_x")
    return group


def int4_gemv(x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor, w_unscale: float, groupsize: int,
              units: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              residual: torch.Tensor | None = None, swiglu: bool = False, ones: torch.Tensor | None = None,
              launch: tuple | None = None, dp4a: bool = False, xq: torch.Tensor | None = None) -> torch.Tensor:
    """One row x [..., K] times int4 weights (int4_layout, of the same dp4a and units) -> [..., N] in x's
    dtype, with gemv's fusions: residual + [swiglu of] rmsnorm(x, norm_weight, eps) @ W.T. Without the
    norm the kernel multiplies x by `ones` [K] (see _int4_block; made here if not given: a kernel of its
    own). dp4a: in integers (_int4_dp4a_block), else in float16 pairs (_int4_half_fma).
    xq (dp4a only): x in int8 already (int4_quantize_x(x, norm_weight), in groups that divide the int4
    groups), read instead of x, which then gives only the shape and dtype (_int4_xq_block).
    launch: (BLOCK_N, BLOCK_G, warps, stages, prefetch), int4_config's by default; prefetch 1 loads each
    block one step ahead, 2 (an experiment, benchmarks/gemv_int4.py --prefetch 2) two blocks before the
    PDL wait (EARLY)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.shape[0] != 1:
        raise ValueError(f"int4_gemv takes one row of x (got {x2.shape[0]})")
    if weight.shape[1] * 8 != K or K % groupsize or sz.shape != (weight.shape[0], K // groupsize):
        raise ValueError(f"int4_gemv: weight {tuple(weight.shape)} and sz {tuple(sz.shape)} do not fit K={K} "
                         f"in groups of {groupsize}")
    if (units is not None) != (sz.dtype == torch.int16) or (units is not None and not dp4a):
        raise ValueError("int4_gemv: int16 codes go with their units, in integers (dp4a)")
    if units is not None and (units.shape != (weight.shape[0], 2) or units.dtype != torch.float32
                              or not units.is_contiguous()):
        raise ValueError(f"int4_gemv: units must be float32 [{weight.shape[0]}, 2], contiguous "
                         f"(got {units.dtype} {tuple(units.shape)})")
    x_group = _x_group_of(xq, K) if xq is not None else 16  # (16: unused)
    if xq is not None and (not dp4a or groupsize % x_group):
        raise ValueError(f"int4_gemv: x in int8 (groups of {x_group}) is for integers (dp4a) at int4 groups "
                         f"it divides (got {groupsize})")
    N = weight.shape[0] // (2 if swiglu else 1)
    block_n, block_g, warps, stages, prefetch = launch or int4_config(N, K, groupsize, swiglu, dp4a, units is not None,
                                                                      xq is not None)
    if prefetch not in (0, 1, 2):
        raise ValueError(f"int4_gemv: a launch's prefetch is 0, 1 or 2 (got {prefetch!r})")
    x2 = x2 if xq is not None else x2.contiguous()
    y = torch.empty((1, N), device=x.device, dtype=x.dtype)
    use_pdl = pdl(x)
    x_words, x_stats = (xq[:K // 4], xq[K // 4:].view(torch.float32)) if xq is not None else (x2, x2)
    _int4_gemv_kernel[(triton.cdiv(N, block_n),)](
        x_words, x_stats, weight, sz, sz if units is None else units,
        norm_weight if norm_weight is not None else ones if ones is not None else x_words if xq is not None
        else x.new_ones(K),  # (x in int8 is already times g: no ones needed)
        weight if residual is None else residual.reshape(1, N).contiguous(), y, N, K, K // groupsize, eps, w_unscale,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, SWIGLU=swiglu, G=groupsize,
        BLOCK_N=block_n, BLOCK_G=block_g, PREFETCH=bool(prefetch) and prefetch != 2, PDL=use_pdl, DP4A=dp4a,
        CODES=units is not None, XQ=xq is not None, XG=x_group, EMULATE=os.environ.get("TRITON_INTERPRET") == "1",
        EARLY=2 if prefetch == 2 else 1,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if use_pdl else {}))
    return y.view(*x.shape[:-1], N)


def int4_matmul(x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor, w_unscale: float, groupsize: int,
                units: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, swiglu: bool = False,
                ones: torch.Tensor | None = None, dp4a: bool = False, xq: torch.Tensor | None = None) -> torch.Tensor:
    """int4_gemv with its tuned launch, through the custom op (OPAQUE) or directly."""
    if OPAQUE:
        return int4_gemv_op(x, weight, sz, w_unscale, groupsize, units, norm_weight, eps, residual, swiglu, ones,
                            dp4a, xq)
    return int4_gemv(x, weight, sz, w_unscale, groupsize, units, norm_weight, eps, residual, swiglu, ones, dp4a=dp4a,
                     xq=xq)


@torch.library.custom_op("graphdecode::int4_gemv", mutates_args=())
def int4_gemv_op(x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor, w_unscale: float, groupsize: int,
                 units: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor], eps: float,
                 residual: Optional[torch.Tensor], swiglu: bool, ones: Optional[torch.Tensor],
                 dp4a: bool, xq: Optional[torch.Tensor]) -> torch.Tensor:
    return int4_gemv(x, weight, sz, w_unscale, groupsize, units, norm_weight, eps, residual, swiglu, ones, dp4a=dp4a,
                     xq=xq)


@int4_gemv_op.register_fake
def _(x, weight, sz, w_unscale, groupsize, units, norm_weight, eps, residual, swiglu, ones, dp4a, xq):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2 if swiglu else weight.shape[0]))

# -- decode attention ------------------------------------------------------------------------------
#
# One new token per sequence attends to its cache. Done with PyTorch ops this is ~7 small kernels a
# layer (RoPE of q and k, the two cache writes, the scores, the softmax, the weighted sum of V), each
# 1-4 µs of mostly launch latency on the H200 (BENCHMARKS.md). Here it is one kernel: each program
# takes one KV head of one sequence, with its group of query heads, and a slice of the cache
# ("flash decoding"). The number of slices is fixed per launch (so it replays in a graph); their
# length is set from `pos` on the device, so every slice shares the work however long the cache
# (one that starts beyond `pos` reads nothing). Each program:
#   - loads its first block of cached K and V at once, then RoPE's q and the new k (rotate-half, in
#     float32, rounded to the cache dtype like the PyTorch path);
#   - attends to the positions < pos of its slice, BLOCK_L at a time, with an online softmax (base 2),
#     and in slice 0 to the new token from registers; then slice 0 writes the new k and v into the
#     cache at pos (after the reads: no program reads a row written in this launch);
#   - one slice: writes the normalised output. Several: writes its max, sum and unnormalised output;
#     the last slice of a sequence and KV head to finish (an atomic count) merges them.
# Two kernels do this: _attention_kernel for any group of query heads a KV head, and _attention_one_kernel
# for one query head a KV head ([positions, D] tiles with no heads axis; only the slices that hold cached
# positions take part, and with one of them it writes y without a merge), which decode_attention picks
# where it applies (ATTENTION_ONE).

LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _attend(q, k, v, ok, m, l, acc):
        """Online softmax over one block of positions: scores of q [G, D] against k [L, D] (base 2),
        where ok; (m, l, acc) the running max, sum of weights and weighted sum of v."""
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, L]
        scores = tl.where(ok[None, :], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing seen yet: weights stay 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)

    @triton.jit
    def _attention_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, y_ptr, m_ptr, l_ptr, acc_ptr,
                          count_ptr, yw_ptr, ys_ptr, qkv_stride, cache_stride_b, cache_stride_h, L, qk_scale,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_S: tl.constexpr, PDL: tl.constexpr, XQ_OUT: tl.constexpr, XG: tl.constexpr):
        b, hkv, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PDL:  # as in _gemv_kernel: the next kernel may start once all programs here have
            tl.extra.cuda.gdc_launch_dependents()
        G: tl.constexpr = H // HKV
        HALF: tl.constexpr = D // 2
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < D
        cache = b * cache_stride_b + hkv * cache_stride_h
        pos = tl.load(pos_ptr).to(tl.int32)
        inside = (rd * 0 + pos) < L  # callers keep pos < L; if not, nothing is read or written past the cache
        # Slices sized from pos, so that the work is spread over all of them however long the cache
        chunk = tl.cdiv(tl.cdiv(pos + 1, SPLITS), BLOCK_L) * BLOCK_L
        start = s * chunk
        end = tl.minimum(tl.minimum(start + chunk, pos), L)  # cached positions < pos of this slice
        # The slice's first block of K and V, loaded before anything waits on the RoPE tables
        rl = start + tl.arange(0, BLOCK_L)
        l_ok = rl < end
        kv_at = cache + rl[:, None] * D + rd[None, :]
        k0 = tl.load(kc_ptr + kv_at, mask=l_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
        v0 = tl.load(vc_ptr + kv_at, mask=l_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
        if PDL:  # pos, the cache and the tables are from earlier steps; qkv is the previous kernel's
            tl.extra.cuda.gdc_wait()
        # RoPE (rotate-half) of the query heads and the new key, rounded to the cache dtype
        rd_rot = tl.where(rd < HALF, rd + HALF, rd - HALF)
        cos = tl.load(cos_ptr + pos * D + rd, mask=d_ok & inside, other=0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + rd, mask=d_ok & inside, other=0).to(tl.float32) * tl.where(rd < HALF, -1.0, 1.0)
        rg = tl.arange(0, BLOCK_G)
        g_ok = rg < G
        heads = hkv * G + rg
        qd_ok = g_ok[:, None] & d_ok[None, :]
        row = qkv_ptr + b * qkv_stride
        q_at = row + heads[:, None] * D
        q = tl.load(q_at + rd[None, :], mask=qd_ok, other=0).to(tl.float32) * cos[None, :] \
            + tl.load(q_at + rd_rot[None, :], mask=qd_ok, other=0).to(tl.float32) * sin[None, :]
        q = q.to(kc_ptr.dtype.element_ty).to(tl.float32) * qk_scale  # 1/sqrt(D), log2(e): base 2
        k_at = row + H * D + hkv * D
        k_new = tl.load(k_at + rd, mask=d_ok, other=0).to(tl.float32) * cos \
            + tl.load(k_at + rd_rot, mask=d_ok, other=0).to(tl.float32) * sin
        k_new = k_new.to(kc_ptr.dtype.element_ty)
        v_new = tl.load(row + (H + HKV) * D + hkv * D + rd, mask=d_ok, other=0)
        # Attention over the slice's cached positions, then (slice 0) the new token's own
        m = tl.zeros((BLOCK_G,), tl.float32) - float("inf")
        l = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        m, l, acc = _attend(q, k0, v0, l_ok, m, l, acc)
        for off in range(start + BLOCK_L, end, BLOCK_L):
            rl = off + tl.arange(0, BLOCK_L)
            l_ok = rl < end
            kv_at = cache + rl[:, None] * D + rd[None, :]
            k = tl.load(kc_ptr + kv_at, mask=l_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
            v = tl.load(vc_ptr + kv_at, mask=l_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
            m, l, acc = _attend(q, k, v, l_ok, m, l, acc)
        first = (tl.arange(0, 1) + s) == 0  # [1]: the new token counts in slice 0 only
        m, l, acc = _attend(q, k_new.to(tl.float32)[None, :], v_new.to(tl.float32)[None, :],
                            first, m, l, acc)
        # Written after the reads above: no program reads position pos from the cache.
        write = d_ok & (rd * 0 + s == 0) & inside
        tl.store(kc_ptr + cache + pos * D + rd, k_new, mask=write)
        tl.store(vc_ptr + cache + pos * D + rd, v_new, mask=write)
        y_at = y_ptr + (b * H + heads[:, None]) * D + rd[None, :]
        if SPLITS == 1:
            y = (acc / l[:, None]).to(y_ptr.dtype.element_ty)
            tl.store(y_at, y, mask=qd_ok)
            if XQ_OUT:  # (one sequence, BLOCK_D = D): also in int8 for the int4 GEMV wo, as it rounded
                v = tl.reshape(y.to(tl.float32), (BLOCK_G * BLOCK_D // XG, XG // 4, 4))
                _int4_quantize_store(v, v, hkv * G * D, G * D, yw_ptr, ys_ptr, H * D, XG)
        else:
            # Each slice leaves its (max, sum, weighted sum); the last slice of this sequence and
            # KV head to finish (an atomic count) merges them and resets the count for the next call.
            part = (b * H + heads) * SPLITS + s
            tl.store(m_ptr + part, m, mask=g_ok)
            tl.store(l_ptr + part, l, mask=g_ok)
            tl.store(acc_ptr + part[:, None] * D + rd[None, :], acc, mask=qd_ok)
            tl.debug_barrier()  # every thread's stores are issued before the count (a release)
            done = tl.atomic_add(count_ptr + b * HKV + hkv, 1)
            if done == SPLITS - 1:
                tl.debug_barrier()  # every thread of this program reads after the count, not before
                rs = tl.arange(0, BLOCK_S)
                parts = (b * H + heads)[:, None] * SPLITS + rs[None, :]  # [G, S]
                gs_ok = g_ok[:, None] & (rs < SPLITS)[None, :]
                ms = tl.load(m_ptr + parts, mask=gs_ok, other=-float("inf"), cache_modifier=".cg")
                ls = tl.load(l_ptr + parts, mask=gs_ok, other=0, cache_modifier=".cg")
                accs = tl.load(acc_ptr + parts[:, :, None] * D + rd[None, None, :],
                               mask=gs_ok[:, :, None] & d_ok[None, None, :], other=0, cache_modifier=".cg")
                top = tl.max(ms, axis=1)  # finite for real heads: slice 0 has the new token
                w = tl.exp2(ms - tl.where(top == -float("inf"), 0.0, top)[:, None])  # (padded heads: 0)
                y = (tl.sum(w[:, :, None] * accs, axis=1) / tl.sum(w * ls, axis=1)[:, None]).to(y_ptr.dtype.element_ty)
                tl.store(y_at, y, mask=qd_ok)
                if XQ_OUT:
                    v = tl.reshape(y.to(tl.float32), (BLOCK_G * BLOCK_D // XG, XG // 4, 4))
                    _int4_quantize_store(v, v, hkv * G * D, G * D, yw_ptr, ys_ptr, H * D, XG)
                tl.atomic_xchg(count_ptr + b * HKV + hkv, 0)


    @triton.jit
    def _attend_one(q, k, v, ok, m, l, acc):
        """_attend for one query head: q [D] against k, v [L, D]; m, l scalars, acc [D]."""
        scores = tl.where(ok, tl.sum(k * q[None, :], axis=1), -float("inf"))  # [L]
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe)
        return m_new, l * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)

    @triton.jit
    def _attention_one_store(y, y_at, yw_ptr, ys_ptr, h, H: tl.constexpr, D: tl.constexpr, XQ_OUT: tl.constexpr,
                             XG: tl.constexpr):
        """Head h's output y [D] (float32) at y_at, and (XQ_OUT) in int8 for the int4 GEMV wo."""
        y = y.to(y_at.dtype.element_ty)
        tl.store(y_at, y)
        if XQ_OUT:
            v = tl.reshape(y.to(tl.float32), (D // XG, XG // 4, 4))
            _int4_quantize_store(v, v, h * D, D, yw_ptr, ys_ptr, H * D, XG)

    @triton.jit
    def _attention_one_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, y_ptr, m_ptr, l_ptr, acc_ptr,
                              count_ptr, yw_ptr, ys_ptr, qkv_stride, cache_stride_b, cache_stride_h, L, qk_scale,
                              H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_L: tl.constexpr,
                              BLOCK_S: tl.constexpr, PDL: tl.constexpr, XQ_OUT: tl.constexpr, XG: tl.constexpr):
        """_attention_kernel for one query head a KV head (H = HKV, D a power of two), on [positions, D]
        tiles: no heads axis, and the RoPE tables read before the PDL wait."""
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        HALF: tl.constexpr = D // 2
        rd = tl.arange(0, D)
        cache = b * cache_stride_b + h * cache_stride_h
        pos = tl.load(pos_ptr).to(tl.int32)
        inside = (rd * 0 + pos) < L
        chunk = tl.cdiv(tl.cdiv(pos + 1, SPLITS), BLOCK_L) * BLOCK_L
        start = s * chunk
        end = tl.minimum(tl.minimum(start + chunk, pos), L)
        rl = start + tl.arange(0, BLOCK_L)
        l_ok = rl < end
        kv_at = cache + rl[:, None] * D + rd[None, :]
        k0 = tl.load(kc_ptr + kv_at, mask=l_ok[:, None], other=0)
        v0 = tl.load(vc_ptr + kv_at, mask=l_ok[:, None], other=0)
        rd_rot = tl.where(rd < HALF, rd + HALF, rd - HALF)
        cos = tl.load(cos_ptr + pos * D + rd, mask=inside, other=0).to(tl.float32)  # (tables: earlier steps')
        sin = tl.load(sin_ptr + pos * D + rd, mask=inside, other=0).to(tl.float32) * tl.where(rd < HALF, -1.0, 1.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        row = qkv_ptr + b * qkv_stride
        q = tl.load(row + h * D + rd).to(tl.float32) * cos + tl.load(row + h * D + rd_rot).to(tl.float32) * sin
        q = q.to(kc_ptr.dtype.element_ty).to(tl.float32) * qk_scale
        k_at = row + H * D + h * D
        k_new = (tl.load(k_at + rd).to(tl.float32) * cos + tl.load(k_at + rd_rot).to(tl.float32) * sin
                 ).to(kc_ptr.dtype.element_ty)
        v_new = tl.load(row + 2 * H * D + h * D + rd)
        # The new token first (slice 0 only), then the slice's cached positions
        first = s == 0
        m = tl.where(first, tl.sum(q * k_new.to(tl.float32), axis=0), -float("inf"))
        l = tl.where(first, 1.0, 0.0)
        acc = tl.where(first, v_new.to(tl.float32), 0.0)
        m, l, acc = _attend_one(q, k0.to(tl.float32), v0.to(tl.float32), l_ok, m, l, acc)
        for off in range(start + BLOCK_L, end, BLOCK_L):
            rl = off + tl.arange(0, BLOCK_L)
            l_ok = rl < end
            kv_at = cache + rl[:, None] * D + rd[None, :]
            k = tl.load(kc_ptr + kv_at, mask=l_ok[:, None], other=0).to(tl.float32)
            v = tl.load(vc_ptr + kv_at, mask=l_ok[:, None], other=0).to(tl.float32)
            m, l, acc = _attend_one(q, k, v, l_ok, m, l, acc)
        write = inside & (rd * 0 + s == 0)
        tl.store(kc_ptr + cache + pos * D + rd, k_new, mask=write)
        tl.store(vc_ptr + cache + pos * D + rd, v_new, mask=write)
        # Slices with cached positions (slice 0 always: the new token). One: slice 0 writes y, no merge.
        active = tl.maximum(tl.cdiv(tl.minimum(pos, L), chunk), 1)
        y_at = y_ptr + (b * H + h) * D + rd
        if active == 1:
            if s == 0:
                _attention_one_store(acc / l, y_at, yw_ptr, ys_ptr, h, H, D, XQ_OUT, XG)
        elif s < active:
            part = (b * H + h) * SPLITS + s
            tl.store(m_ptr + part, m)
            tl.store(l_ptr + part, l)
            tl.store(acc_ptr + part * D + rd, acc)
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + b * H + h, 1)
            if done == active - 1:
                tl.debug_barrier()
                rs = tl.arange(0, BLOCK_S)
                s_ok = rs < active
                parts = (b * H + h) * SPLITS + rs
                ms = tl.load(m_ptr + parts, mask=s_ok, other=-float("inf"), cache_modifier=".cg")
                ls = tl.load(l_ptr + parts, mask=s_ok, other=0, cache_modifier=".cg")
                accs = tl.load(acc_ptr + parts[:, None] * D + rd[None, :], mask=s_ok[:, None], other=0,
                               cache_modifier=".cg")
                w = tl.exp2(ms - tl.max(ms, axis=0))  # (the max is finite: slice 0 has the new token)
                _attention_one_store(tl.sum(w[:, None] * accs, axis=0) / tl.sum(w * ls, axis=0), y_at, yw_ptr,
                                     ys_ptr, h, H, D, XQ_OUT, XG)
                tl.atomic_xchg(count_ptr + b * H + h, 0)


def attention_usable(qkv: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether decode_attention runs this step: on CUDA with Triton, one position shared by the batch."""
    return triton is not None and qkv.is_cuda and pos.numel() == 1


def attention(qkv, pos, cos, sin, k_cache, v_cache, counts, n_heads: int, n_kv_heads: int, out_group: int = 0,
              block_l: int = 0):
    """decode_attention, through the custom op (OPAQUE) or directly."""
    if OPAQUE:
        y, yq = decode_attention_op(qkv, pos, cos, sin, k_cache, v_cache, counts, n_heads, n_kv_heads, out_group,
                                    block_l)
        return (y, yq) if out_group else y
    return decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, n_heads, n_kv_heads, out_group=out_group,
                            block_l=block_l)


ATTENTION_SPLITS = None  # a fixed number of cache slices (bench.py --attention-splits), or the rule below
ATTENTION_BLOCK_L = None  # cache positions per step of the loop (bench.py --attention-block-l), or the rule
ATTENTION_WARPS = None  # warps of the attention kernel (benchmarks/attention.py), or the rule
ATTENTION_MAXNREG = None  # a cap on the attention kernel's registers a thread (bench.py --attention-maxnreg; A/B)
# _attention_one_kernel where a KV head has one query head and head_dim is a power of two (GRAPHDECODE_ATTENTION_ONE=0
# or bench.py --attention-one 0: the grouped kernel there too); its (cache positions a loop step, warps). The 7B int4
# g32 step 710.0-710.1 tok/s against the grouped kernel's 685.7-687.6; at 32 positions 690.3, at 64 and 8 warps 701.8,
# 128 and 8 699.9 (runs 112-113); bf16 279.5 against 281.1, batch 8 2000.6 against 1978.3 (run 113; BENCHMARKS.md)
ATTENTION_ONE = os.environ.get("GRAPHDECODE_ATTENTION_ONE", "1") == "1"
ATTENTION_ONE_LAUNCH = (64, 4)
MAX_SPLITS = 16  # the merge holds [heads of a group, slices, head_dim] partial results in registers


def attention_splits(batch: int, n_kv_heads: int, length: int) -> int:
    """Slices of the cache: enough programs to fill the GPU (TARGET_PROGRAMS), at most MAX_SPLITS,
    and no more than a cache of 64 positions a slice would need."""
    if ATTENTION_SPLITS:
        return ATTENTION_SPLITS
    return max(1, min(triton.cdiv(length, 64), TARGET_PROGRAMS // (batch * n_kv_heads), MAX_SPLITS))


def attention_launch(batch: int, n_kv_heads: int, splits: int, block_g: int, block_d: int) -> tuple[int, int]:
    """(cache positions a loop step, warps) of the attention kernel (ATTENTION_BLOCK_L and _WARPS, or
    the rule), for query heads a KV head and head_dim padded to block_g and block_d. Products
    [block_g, positions, block_d] a step. One query head a KV head (Llama-2-7B): 8 warps while the
    programs fit one per SM, at 8192 products, 64 positions at D = 128 (benchmarks/attention.py, run 63:
    batch 1, positions 50-200, 5.5 µs against 6.4 at 32; the 7B int4 step 674 against 670 tok/s, run 64;
    other head dims not measured), and 4 warps at 4096 products beyond, where smaller programs let
    more of them run at once (run 18: batch 8 13.8 -> 11.1 µs). Grouped heads keep 8192 products (not
    measured otherwise)."""
    warps = ATTENTION_WARPS or (8 if block_g == 1 and batch * n_kv_heads * splits <= 132 else 4)
    products = 4096 if block_g == 1 and warps == 4 else 8192
    return ATTENTION_BLOCK_L or max(16, products // (block_g * block_d)), warps


def decode_attention(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, counts: torch.Tensor, n_heads: int,
                     n_kv_heads: int, splits: int | None = None, out_group: int = 0, block_l: int = 0):
    """Attention of one new token per sequence, with its RoPE and cache write:
    qkv [B, 1, (H + 2 Hkv) D] (q, k, v of the new token, before RoPE), pos [1] its position,
    cos and sin [L, D] the RoPE tables, caches [>= B, Hkv, L, D] (written at pos), counts int32
    [>= B Hkv] of zeros (the slices' finishing count; left at zero)
    -> y [B, 1, H D], the attention output over positions 0..pos, heads side by side.
    pos must be < L; the kernel reads and writes nothing outside the cache if it is not.
    out_group (one sequence, D a power of two and a multiple of it): also return y in int8 per
    group of out_group for the int4 GEMV after: (y, int4_quantize_x(y, group=out_group)).
    block_l: cache positions a loop step instead of attention_launch's rule's (0; ATTENTION_BLOCK_L, an A/B
    setting, overrides both)."""
    B, S, width = qkv.shape
    _, Hkv, L, D = k_cache.shape
    if S != 1 or width != (n_heads + 2 * n_kv_heads) * D or qkv.stride(-1) != 1:
        raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} is not one token of {n_heads}+2x{n_kv_heads} heads of {D}")
    if not all(t.is_contiguous() for t in (k_cache, v_cache, cos, sin)) or cos.shape[-1] != D:
        raise ValueError("decode_attention: the caches and RoPE tables must be contiguous, D wide")
    if counts.dtype != torch.int32 or counts.numel() < B * Hkv:
        raise ValueError(f"decode_attention: counts must be int32 with at least {B * Hkv} entries")
    splits = splits or attention_splits(B, Hkv, L)
    G = n_heads // n_kv_heads
    block_g = triton.next_power_of_2(G)
    block_d = triton.next_power_of_2(D)
    if out_group and (B != 1 or block_d != D or D % out_group or out_group not in X_GROUPS):
        raise ValueError(f"decode_attention: y in int8 takes one sequence and groups of 8, 16 or 32 that divide "
                         f"a power-of-two D (got B={B}, D={D}, group {out_group})")
    rule_block_l, warps = attention_launch(B, Hkv, splits, block_g, block_d)
    block_l = ATTENTION_BLOCK_L or block_l or rule_block_l
    if block_l < 1 or block_l & (block_l - 1):
        raise ValueError(f"decode_attention: cache positions a loop step must be a power of two (got {block_l})")
    y = qkv.new_empty((B, 1, n_heads * D))
    use_pdl = pdl(qkv)
    if splits == 1:
        m = l = acc = y
    else:
        m = torch.empty((B, n_heads, splits), device=qkv.device, dtype=torch.float32)
        l = torch.empty_like(m)
        acc = torch.empty((B, n_heads, splits, D), device=qkv.device, dtype=torch.float32)
    width = n_heads * D
    if out_group:
        yq = torch.empty(width // 4 + 4 * width // out_group, device=qkv.device, dtype=torch.int32)
        y_words, y_stats = yq[:width // 4], yq[width // 4:].view(torch.float32)
    else:
        y_words = y_stats = y  # (placeholders: XQ_OUT off)
    args = (qkv, pos, cos, sin, k_cache, v_cache, y, m, l, acc, counts, y_words, y_stats, qkv.stride(0),
            k_cache.stride(0), k_cache.stride(1), L, LOG2E / math.sqrt(D))
    flags = dict(H=n_heads, D=D, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), PDL=use_pdl,
                 XQ_OUT=bool(out_group), XG=out_group or 16, **({"launch_pdl": True} if use_pdl else {}))
    if ATTENTION_ONE and G == 1 and block_d == D:  # (block_l is the grouped kernel's)
        one_block_l, one_warps = ATTENTION_ONE_LAUNCH
        _attention_one_kernel[(B, Hkv, splits)](*args, BLOCK_L=ATTENTION_BLOCK_L or one_block_l,
                                                num_warps=ATTENTION_WARPS or one_warps, **flags)
    else:
        _attention_kernel[(B, Hkv, splits)](*args, HKV=Hkv, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_L=block_l,
                                            num_warps=warps, **flags,
                                            **({"maxnreg": ATTENTION_MAXNREG} if ATTENTION_MAXNREG else {}))
    return (y, yq) if out_group else y


@torch.library.custom_op("graphdecode::decode_attention", mutates_args=("k_cache", "v_cache", "counts"))
def decode_attention_op(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, counts: torch.Tensor, n_heads: int,
                        n_kv_heads: int, out_group: int, block_l: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    out = decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, n_heads, n_kv_heads, out_group=out_group,
                           block_l=block_l)
    return out if out_group else (out, qkv.new_empty(0, dtype=torch.int32))


@decode_attention_op.register_fake
def _(qkv, pos, cos, sin, k_cache, v_cache, counts, n_heads, n_kv_heads, out_group, block_l=0):
    width = n_heads * k_cache.shape[-1]
    return (qkv.new_empty((qkv.shape[0], 1, width)),
            qkv.new_empty(width // 4 + 4 * width // out_group if out_group else 0, dtype=torch.int32))
