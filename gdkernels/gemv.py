"""Triton GEMVs for decode on CUDA: y = x @ W.T for 1..16 rows of x, W in bf16 or int8 (one scale per
output row), with decode's RMSNorm before, SwiGLU on the two halves and the residual add after fused in.

Decode multiplies one token's activations by every weight matrix, so each matmul is limited by how
fast the weights stream from memory. cuBLAS reaches the copy bandwidth on wide matrices but not on
narrow ones (4096 outputs: too few blocks to fill the GPU), and PyTorch has no fast CUDA kernel for
int8 weights. These kernels give each program a few output rows, dequantize in registers and
accumulate in float32 (but for the one-row int8 GEMVs with the norm fused, which multiply and sum in
float16 pairs first: use_half). Everything they launch has fixed shapes: they replay in CUDA graphs.

Launch plan, per program (one block of outputs, one slice of K):
  1 row of x:        acc[BLOCK_N, BLOCK_K] += W_tile * x   (no reduction inside the loop; int8 with
                     the norm fused: in float16 pairs, 7 instructions for 4 weights)
  2..16 rows, bf16:  acc[BLOCK_N, 16] += W_tile @ x_tile.T   (_rows_kernel: tensor cores, bf16
                     operands, the weights as the large operand, all of K)
  int8, 2+ rows:     acc[BLOCK_M, BLOCK_N] += x_tile @ W_tile.T   (tensor cores; M padded to 16)
(int8's dots take float32 operands in TF32: exact for bf16 activations and int8 weights. Triton's
CPU interpreter, which the CPU tests use, computes bf16 dots wrongly: float32 there.)
A split-K launch writes float32 partial sums [SPLIT, M, N]; their sum (one small reduction that
Inductor fuses into whatever follows) is the result.

Needs Triton, which CUDA builds of PyTorch ship and CPU builds do not (`triton` is then None).
"""
import functools
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 16  # rows of x that _rows_kernel takes (its BLOCK_M: the tensor cores want 16)
# Several rows: split K until about this many programs, 4 per SM of the H200 (132 SMs), where the
# launches were tuned. A constant, not a device query, which torch.compile would have to trace.
TARGET_PROGRAMS = 4 * 132


def usable(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether gemv runs x times weight: on CUDA with Triton, at most max_rows rows, a contiguous
    weight, and offsets that fit the kernel's 32-bit index arithmetic."""
    return (triton is not None and x.is_cuda and x.numel() // x.shape[-1] <= max_rows
            and weight.is_contiguous() and weight.numel() < 2**31)


def emulate() -> bool:
    """Triton's CPU interpreter (the tests without a GPU): it runs no inline PTX and no PDL."""
    return os.environ.get("TRITON_INTERPRET") == "1"


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
        for int-to-float conversions and float32 FMAs. EMULATE: the same numbers through float32,
        rounded to float16."""
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
    def _half_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, k_ok, SWIGLU: tl.constexpr,
                    EMULATE: tl.constexpr):
        """_row_block for int8 weights in float16 pairs (HALF: always with the norm): x is loaded,
        squared and multiplied by g in 1D (masked), then moved into the tile's layout.
        Range: x g (before the norm's rsqrt, which is applied at the end) must fit float16, and the
        products are of w / 128: |x g| up to ~6e4 before overflow, and below ~6e-5 they are
        subnormal and lose relative precision. The default model's activations span 1e-3 (median
        |x g| at layer 0) to 1.3e4 (max, layer 28's gate/up)."""
        xs = tl.load(x_row + rk, mask=k_ok, other=0).to(tl.float32)
        squares += xs * xs
        x = (xs * tl.load(g_ptr + rk, mask=k_ok, other=0).to(tl.float32)).to(tl.float16)[None, :]
        acc = _int8_half_fma(w, x, acc, EMULATE)
        if SWIGLU:
            acc_up = _int8_half_fma(w_up, x, acc_up, EMULATE)
        return acc, acc_up, squares

    @triton.jit
    def _one_row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, k_ok, UNMASKED: tl.constexpr,
                       INT8: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, HALF: tl.constexpr,
                       EMULATE: tl.constexpr):
        """One block of the one-row loop: _half_block (HALF) or _row_block."""
        if HALF:  # (one return for both: Triton wants one return type, and acc's differs between them)
            acc, acc_up, squares = _half_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, k_ok, SWIGLU, EMULATE)
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
        PDL (programmatic dependent launch): the next kernel may start as soon as every program here
        has; one row loads its first weight block before waiting for the previous kernel (which
        writes x), so that load overlaps that kernel's last programs.
        HALF (int8, one row, NORM): products and sums in float16 pairs (_int8_half_fma), each lane of
        the tile summing K / BLOCK_K products before the float32 sum across lanes."""
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
            acc, acc_up, squares = _one_row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk,
                                                  (rk < K) & (rk * 0 + b_start < b_end), False, INT8, NORM,
                                                  SWIGLU, HALF, EMULATE)
            # The blocks wholly inside K with no masks (rows past N read row N - 1 and are not
            # stored), then the block K ends in, if it ends in one: a mask on every block would cost
            # its loads their vector width
            full_end = tl.minimum(b_end, K // BLOCK_K)
            w_rows = w_ptr + tl.minimum(rn, N - 1)[:, None] * K
            for b in range(b_start + 1, full_end):
                rk = b * BLOCK_K + tl.arange(0, BLOCK_K)
                w = tl.load(w_rows + rk[None, :])
                w_up = tl.load(w_rows + N * K + rk[None, :]) if SWIGLU else w
                acc, acc_up, squares = _one_row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk, rk < K,
                                                      True, INT8, NORM, SWIGLU, HALF, EMULATE)
            if not EVEN:  # (EVEN: K is a multiple of BLOCK_K)
                if (b_end > full_end) & (full_end > b_start):
                    rk = full_end * BLOCK_K + tl.arange(0, BLOCK_K)
                    w_ok = (rk < K)[None, :]
                    w = tl.load(w_rows + rk[None, :], mask=w_ok, other=0)
                    w_up = tl.load(w_rows + N * K + rk[None, :], mask=w_ok, other=0) if SWIGLU else w
                    acc, acc_up, squares = _one_row_block(acc, acc_up, squares, w, w_up, x_row, g_ptr, rk,
                                                          rk < K, False, INT8, NORM, SWIGLU, HALF, EMULATE)
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
        the loads (never stored). No PDL: it made batch-8 decode slower (these programs hold most
        of an SM's shared memory)."""
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


# Programmatic dependent launch (sm_90+) of the one-row GEMVs, int4.py's GEMV and the attention kernel:
# each lets the next kernel start as soon as all its programs have, and waits for the previous
# kernel's writes only where it reads them (a GEMV loads its first weight block before, the attention
# kernel its first K/V block). In a graph of decode's ~160 kernels this overlaps each kernel's start
# with the end of the one before. Several-row launches go without (batch-8 decode was slower).
# Since each of these kernels signals at its start, the part of one before its wait may run while
# any earlier kernel of an unbroken run of them still does: it reads only what none of them writes
# (weights, the RoPE tables, pos, cache rows before pos: decode's step ends in PyTorch's sampling
# kernels, launched normally, which wait for everything before them).
def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device are launched with PDL: not in Triton's interpreter, not while
    torch.compile traces, and where _pdl_capable says so (decided once a device)."""
    return x.is_cuda and not emulate() and not torch.compiler.is_compiling() and _pdl_capable(x.device.index or 0)


@functools.cache
def _pdl_capable(device: int) -> bool:
    """sm_90 or newer (NVIDIA), a Triton with the launch option and the wait (3.6 and 3.9 have both), and not
    Inductor's own kernels with PDL (triton.enable_pdl: they would no longer wait for ours, as the rule above needs)."""
    from torch._inductor import config as inductor

    if getattr(inductor.triton, "enable_pdl", False):  # (a torch without the option: Inductor has no PDL)
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        triton_has = "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")
    except (ImportError, AttributeError):
        triton_has = False
    return triton_has and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def use_half(x: torch.Tensor, scales: torch.Tensor | None, M: int, norm_weight: torch.Tensor | None) -> bool:
    """Whether a one-row int8 GEMV runs in float16 pairs (~2.7 instructions a weight against ~5.2 in
    float32): where it measured faster, the GEMVs with the RMSNorm before them (Llama-2-7B: wqkv 15.0
    against 16.6 µs, gate/up with SwiGLU 23.5 against 30.5, the head 34.8 against 38.4); not wo and
    down, the narrow ones with the residual after them. Float32 x keeps float32 (exact products)."""
    return scales is not None and M == 1 and x.dtype != torch.float32 and norm_weight is not None


# A launch: (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages).
def config(kind: str, M: int, N: int, K: int, swiglu: bool = False, half: bool = False) -> tuple[int, int, int, int, int]:
    """The launch for an [M, K] x [N, K] product of `kind` ("bf16" or "int8"), tuned on the H200. One
    row: many narrow programs, no split, tuned with what decode fuses in (the residual into the
    narrow wo and w2, RMSNorm into wqkv and the head, SwiGLU into w13, where BLOCK_N counts rows of
    each half). Several rows: split K until there are about TARGET_PROGRAMS programs. `half`: int8
    in float16 pairs (use_half)."""
    if M == 1:
        if kind == "bf16":  # (N <= 8192 from Llama-3.1-8B's qkv 6144x4096; K > 12288 its down 4096x14336)
            return ((2, 1024, 1, 4, 2) if swiglu else ((4, 2048, 1, 4, 4) if K > 12288 else (4, 1024, 1, 4, 2))
                    if N <= 4096 else (16, 512, 1, 4, 2) if N <= 8192 else (32, 256, 1, 8, 4) if N <= 16384
                    else (8, 1024, 1, 4, 4))
        if half:  # int8 in float16 pairs
            return (16, 256, 1, 4, 4) if swiglu or N > 16384 else (32, 512, 1, 4, 3)
        return ((8, 512, 1, 4, 4) if swiglu else (4, 1024, 1, 4, 4) if N <= 8192  # int8
                else (32, 256, 1, 8, 4) if N <= 16384 else (32, 128, 1, 4, 4))
    if kind == "bf16" and M <= MAX_ROWS:  # _rows_kernel (tuned at 8 rows, Llama-2-7B)
        if swiglu:
            return 128, 128, 1, 8, 3
        if N <= 4096:
            return (32, 256, 1, 4, 6) if K > 8192 else (64, 128, 1, 4, 6)
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
    `launch` overrides `config` (the tests cover partial blocks and splits with it)."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    fused = norm_weight is not None or residual is not None or swiglu
    half = use_half(x, scales, M, norm_weight)
    block_n, block_k, split, warps, stages = launch or config("int8" if scales is not None else "bf16",
                                                              M, N, K, swiglu, half)
    rows = 1 < M <= MAX_ROWS and scales is None and (split == 1 or fused)  # _rows_kernel
    if fused and M != 1 and not rows:
        raise ValueError(f"gemv: the norm, SwiGLU and the residual take one row of x, or up to {MAX_ROWS} of bf16 "
                         f"weights (got {M})")
    if swiglu and N % 2:
        raise ValueError(f"gemv: SwiGLU needs an even number of rows (got {N})")
    if fused:
        split = 1  # the norm needs all of K in one program; the residual is added once
    if swiglu:
        N //= 2  # outputs; each program reads BLOCK_N rows of each half
    g = weight if norm_weight is None else norm_weight  # (placeholders where a pointer is unused)
    r = weight if residual is None else residual.reshape(M, N).contiguous()
    if rows:
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        _rows_kernel[(triton.cdiv(N, block_n),)](
            x2, weight, g, r, y, M, N, K, eps, EVEN_K=K % block_k == 0, NORM=norm_weight is not None,
            RESIDUAL=residual is not None, SWIGLU=swiglu, DOT_F32=emulate(), BLOCK_M=16, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages)
        return y.view(*x.shape[:-1], N)
    block_m = 1 if M == 1 else 16 if M <= 16 else 64
    y = torch.empty((split, M, N), device=x.device, dtype=x.dtype if split == 1 else torch.float32)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    per_split = triton.cdiv(triton.cdiv(K, block_k), split)
    use_pdl = M == 1 and pdl(x)  # (PDL measured for one row only)
    _gemv_kernel[grid](x2, weight, weight if scales is None else scales, g, r, y, M, N, K, per_split, eps,
                       INT8=scales is not None, EVEN=K % block_k == 0, NORM=norm_weight is not None,
                       RESIDUAL=residual is not None, SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, PDL=use_pdl, HALF=half, EMULATE=emulate(), num_warps=warps,
                       num_stages=stages, **({"launch_pdl": True} if use_pdl else {}))
    y = y[0] if split == 1 else y.sum(0).to(x.dtype)  # split: sum the float32 partials
    return y.view(*x.shape[:-1], N)


# Through a custom op, torch.compile treats the GEMV as a black box (still captured in the graph):
# traced instead, it lowers the Triton kernel to Triton IR at each call site to learn which arguments
# it writes (129 per decode step of a 7B model), and the first call compiles for that much longer.
@torch.library.custom_op("graphdecode::gemv", mutates_args=())
def matmul(x: torch.Tensor, weight: torch.Tensor, scales: Optional[torch.Tensor] = None,
           norm_weight: Optional[torch.Tensor] = None, eps: float = 0.0, residual: Optional[torch.Tensor] = None,
           swiglu: bool = False) -> torch.Tensor:
    """gemv with its tuned launch, as the custom op graphdecode::gemv."""
    return gemv(x, weight, scales, norm_weight, eps, residual, swiglu)


@matmul.register_fake
def _(x, weight, scales=None, norm_weight=None, eps=0.0, residual=None, swiglu=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2 if swiglu else weight.shape[0]))
