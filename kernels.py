"""Triton GEMV kernels for decode on CUDA: y = x @ W.T for a few rows of x, with W in bf16 or int8
(one scale per output row).

Decode multiplies one token's activations by every weight matrix, so each matmul is a matrix-vector
product limited by how fast the weights stream from memory. cuBLAS reaches the copy bandwidth on
wide matrices but not on narrow ones (4096 outputs: too few blocks to fill the GPU), and PyTorch
has no fast CUDA kernel for int8 weights at all. These kernels give each program a few output
rows (many programs, no split, for one row of x; a split of the input dimension for several),
dequantize in registers, and accumulate in float32. Everything they launch has fixed shapes:
they replay inside CUDA graphs. (An int4 kernel written the same way lost to PyTorch's tinygemm
by 1.3-2x on every shape: BENCHMARKS.md. int4 stays on tinygemm.)

Launch plan, per program (one block of outputs, one slice of K):
  1 row of x:     acc[BLOCK_N, BLOCK_K] += W_tile * x   (no reduction inside the loop)
  2..16+ rows:    acc[BLOCK_M, BLOCK_N] += x_tile @ W_tile.T   (tensor cores; M padded to 16)
(The dots take float32 operands in TF32: exact for bf16 activations and for bf16 and int8
weights, and Triton's CPU interpreter, which the CPU tests use, computes bf16 dots wrongly.)
A split-K launch writes float32 partial sums [SPLIT, M, N]; their sum (one small reduction that
Inductor fuses into whatever follows) is the result.

This file needs Triton, which CUDA builds of PyTorch ship and CPU builds do not; model.py calls
it only for CUDA tensors (`usable`).
"""
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
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, g_ptr, r_ptr, y_ptr, M, N, K, blocks_per_split, eps,
                     INT8: tl.constexpr, EVEN: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[split, m, n] = sum over this split's columns k of x[m, k] * W[n, k] (* scale[n]).
        One row per program (BLOCK_M 1) may also apply RMSNorm to x first (NORM: x * g * rsqrt(mean(x^2)
        + eps), in float32, the mean over all of K, so no split) and add a residual (RESIDUAL)."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = rn < N, rm < M
        b_start = pid_k * blocks_per_split
        b_end = tl.minimum(b_start + blocks_per_split, tl.cdiv(K, BLOCK_K))
        if BLOCK_M == 1:  # one row: elementwise products, one reduction at the end
            x_row = x_ptr + pid_m * K
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            squares = tl.zeros((BLOCK_K,), tl.float32)
            for b in range(b_start, b_end):
                rk = b * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = rk < K
                if EVEN:
                    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
                    x = tl.load(x_row + rk).to(tl.float32)
                else:
                    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
                    x = tl.load(x_row + rk, mask=k_ok, other=0).to(tl.float32)
                if NORM:  # sum of squares on the way; the rsqrt scales the sums at the end
                    squares += x * x
                    x *= tl.load(g_ptr + rk, mask=k_ok, other=0).to(tl.float32)
                acc += _to_float(w, INT8) * x[None, :]
            out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
            if NORM:
                out *= tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        else:  # several rows: tensor-core dot products, rows padded to BLOCK_M
            out = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for b in range(b_start, b_end):
                rk = b * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = rk < K
                w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
                x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
                out += tl.dot(x.to(tl.float32), tl.trans(_to_float(w, INT8)), input_precision="tf32")
        if INT8:
            out *= tl.load(scale_ptr + rn, mask=n_ok, other=0).to(tl.float32)[None, :]
        y_at = rm[:, None] * N + rn[None, :]
        if RESIDUAL:
            out += tl.load(r_ptr + y_at, mask=m_ok[:, None] & n_ok[None, :], other=0).to(tl.float32)
        tl.store(y_ptr + pid_k * M * N + y_at, out, mask=m_ok[:, None] & n_ok[None, :])


# Several rows: split K until about this many programs: 4 per SM of the H200 (132 SMs), where the
# launches were measured. A constant rather than a device query, which torch.compile would have
# to trace (and whose decorator, torch.compiler.assume_constant_result, cost every import 1.7 s
# of loading torch._dynamo).
TARGET_PROGRAMS = 4 * 132


# A launch: (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages).
def config(kind: str, M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """The launch for an [M, K] x [N, K] product of `kind` ("bf16" or "int8"), from a
    tuning run on the H200 (benchmarks/gemv.py --tune; BENCHMARKS.md). One row: many narrow
    programs, no split. Several rows: split K until there are about TARGET_PROGRAMS programs."""
    if M == 1:
        if kind == "bf16":
            return (4, 1024, 1, 4, 2) if N <= 8192 else (16, 512, 1, 4, 2)
        return (4, 1024, 1, 4, 4) if N <= 16384 else (8, 512, 1, 4, 2)  # int8
    block_n, block_k = 32, 128
    programs, blocks = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    split = 1
    while programs * split < TARGET_PROGRAMS and blocks // (split * 2) >= 8:
        split *= 2
    return block_n, block_k, split, 4, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, launch: tuple | None = None) -> torch.Tensor:
    """x [..., K] times weight [N, K] (bf16, or int8 with `scales` [N]) -> [..., N] in x's dtype.
    For one row of x it can also do, in the same kernel, what decode does around its matmuls:
    residual + rmsnorm(x, norm_weight, eps) @ W.T. `launch` overrides `config` (for tuning)."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    fused = norm_weight is not None or residual is not None
    if fused and M != 1:
        raise ValueError(f"gemv: the norm and the residual take one row of x (got {M})")
    block_n, block_k, split, warps, stages = launch or config("int8" if scales is not None else "bf16", M, N, K)
    if fused:
        split = 1  # the norm needs all of K in one program; the residual is added once
    block_m = 1 if M == 1 else 16 if M <= 16 else 64
    y = torch.empty((split, M, N), device=x.device, dtype=x.dtype if split == 1 else torch.float32)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    per_split = triton.cdiv(triton.cdiv(K, block_k), split)
    even = K % block_k == 0 and N % block_n == 0
    _gemv_kernel[grid](x2, weight, weight if scales is None else scales,
                       weight if norm_weight is None else norm_weight,
                       weight if residual is None else residual.reshape(M, N).contiguous(), y, M, N, K,
                       per_split, eps, INT8=scales is not None, EVEN=even, NORM=norm_weight is not None,
                       RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, num_warps=warps, num_stages=stages)
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
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """gemv with its tuned launch, through the custom op (OPAQUE) or directly."""
    f = gemv_op if OPAQUE else gemv
    return f(x, weight, scales, norm_weight, eps, residual)


@torch.library.custom_op("graphdecode::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, scales: Optional[torch.Tensor],
            norm_weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor]) -> torch.Tensor:
    return gemv(x, weight, scales, norm_weight, eps, residual)


@gemv_op.register_fake
def _(x, weight, scales, norm_weight, eps, residual):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
