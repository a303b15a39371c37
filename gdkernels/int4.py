"""The one-row int4 GEMV for decode on CUDA, in integers (dp4a), with gemv.py's fusions (RMSNorm
before, SwiGLU, residual after): decode's int4 step at group 32 runs 1.86x as fast as through
PyTorch's tinygemm on the Llama-2-7B shape (BENCHMARKS.md).

x (times the norm weight g) goes to int8 per group of G columns, x ~ sx q with sx = max |x| / 127,
and each int32 word of 8 weights takes two dp4a with x's bytes. Per group, in float32:
    sum_k x_k W_k ~ s sx (sum(q_w q) - 8 sum(q)) + z sum(x)        (W = (q_w - 8) s + z)
(x in int8 per group costs the default model 0.2% perplexity at group 32, 0.5% at 128.)

layout() re-lays the file's int4 weights for the kernel once; dequantize() gives them back in float
for prefill and batches (F.linear).
"""
import math
from typing import NamedTuple, Optional

import torch

from quantize import int4_units

from .gemv import emulate, pdl, triton

if triton is not None:
    import triton.language as tl


class Layout(NamedTuple):
    """The kernel's int4 weights [N, K]: words int32 [N, K/8] (column 8j + i at bits 8i of word j,
    8j + 4 + i at bits 8i + 4, for i < 4: each word's nibbles masked with 0x0F0F0F0F are 4 bytes for
    dp4a); sz [N, K/g], each group's scale and zero: int16 codes (the scale's 0..255 in the low byte,
    the zero's -127..127 in the high byte) times units float32 [N, 2] (each row's scale unit and zero
    unit), or else (units None) int32 holding two float16 (scale, zero) times 1 / w_unscale."""
    words: torch.Tensor
    sz: torch.Tensor
    units: Optional[torch.Tensor]
    w_unscale: float
    group: int


def _grid_units(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor | None:
    """The units [N, 2] of quantize.py's grid (scales in 255 steps, zeros in 127), if every scale is a
    whole number 0..255 of its row's unit and every zero one too (-127..127): 8 bits each, exactly;
    else None (a file from elsewhere, such as a GGUF's)."""
    units = int4_units(scales, zeros)
    codes_s, codes_z = scales.float() / units[:, :1], zeros.float() / units[:, 1:]
    whole = all(bool(((k == k.round()) & (k >= lo) & (k <= hi)).all())
                for k, lo, hi in ((codes_s, 0, 255), (codes_z, -127, 127)))  # (the range: float32's subnormals)
    return units if whole else None


def layout(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groupsize: int) -> Layout:
    """The file's int4 layout (weight uint8 [N, K/2], column 2j in the low nibble of byte j; scales,
    zeros [N, ceil(K/groupsize)]: W = (q - 8) scale + zero) -> the kernel's, on weight's device.
    The kernel wants equal groups: a group size that does not divide K leaves a shorter last group in
    the file (576 = 4 x 128 + 64), so it runs with g = gcd(groupsize, K), each scale repeated. Codes
    (half the bytes of float16 pairs) where g <= 64 and the scales and zeros lie on quantize.py's grid:
    at group 128 they save 3% of the bytes and the gate/up GEMV ran slower. Float16 pairs: times
    c = 1 / w_unscale, the power of two that brings the largest |(q - 8) s + z| to (1/2, 1] (float16
    keeps its 11 bits for the small groups; c is exact)."""
    N, K = weight.shape[0], 2 * weight.shape[1]
    if K % 32:
        raise ValueError(f"int4.layout: K must be a multiple of 32 (got {K})")
    g = math.gcd(groupsize, K)
    file_group = torch.arange(K // g, device=weight.device) * g // groupsize  # kernel group -> file group
    s, z = scales[:, file_group].float(), zeros[:, file_group].float()
    units = _grid_units(s, z) if g <= 64 else None
    if units is not None:
        sz, c = (s / units[:, :1] + 256 * (z / units[:, 1:])).to(torch.int16), 1.0
    else:
        bound = (8 * s.abs() + z.abs()).max().item()  # |(q - 8) s + z| <= 8 |s| + |z|
        c = 2.0 ** -math.ceil(math.log2(bound)) if bound > 0 else 1.0
        halves = [(t * c).half().view(torch.int16).int() for t in (s, z)]
        sz = (halves[0] & 0xFFFF) | (halves[1] << 16)
    q = torch.stack([weight & 15, weight >> 4], dim=-1).view(N, K // 8, 2, 4).long()
    words = (q << _shifts(weight.device)).sum((2, 3))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return Layout(words.contiguous(), sz.contiguous(), units, 1.0 / c, g)


def _shifts(device) -> torch.Tensor:
    """[2, 4]: the bit of column 8j + 4h + i in word j."""
    return 4 * torch.arange(2, device=device)[:, None] + 8 * torch.arange(4, device=device)


def dequantize(lay: Layout) -> torch.Tensor:
    """The layout's weights W [N, K] in float32: (q - 8) s + z per group, as the kernel reads them."""
    N = lay.words.shape[0]
    q = (lay.words[:, :, None, None] >> _shifts(lay.words.device).int()) & 15  # [N, K/8, 2, 4]
    if lay.units is not None:
        v = lay.sz.int()  # (sign-extended: v >> 8 is the zero's code)
        s, z = (v & 255).float() * lay.units[:, :1], (v >> 8).float() * lay.units[:, 1:]
    else:
        s, z = ((h & 0xFFFF).to(torch.int16).view(torch.float16).float() * lay.w_unscale
                for h in (lay.sz, lay.sz >> 16))
    s, z = (t.repeat_interleave(lay.group, dim=1) for t in (s, z))
    return (q.view(N, -1) - 8).float() * s + z


if triton is not None:

    @triton.jit
    def _f16_pair(v):
        """int32 holding two float16 (low, high) -> (low, high) as float32."""
        lo = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

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
    def _scale_zero(sz, units, CODES: tl.constexpr):
        """Each group's (scale, zero) in float32 from its scale-and-zero word: two float16, or (CODES)
        an int16 of two codes times their row's units (units [BN, 2] float32)."""
        if CODES:
            v = sz.to(tl.int32)  # (sign-extended: v >> 8 is the zero's code)
            unit_s, unit_z = tl.split(units)
            s, z = (v & 255).to(tl.float32) * unit_s[:, None], (v >> 8).to(tl.float32) * unit_z[:, None]
        else:
            s, z = _f16_pair(sz)
        return s, z

    @triton.jit
    def _dp4a_acc(acc, w, sz, units, x_lo, x_hi, q_sum, sx, x_sum, CODES: tl.constexpr, EMULATE: tl.constexpr):
        """acc [BN, BLOCK_G] + each group's products of words w with x's bytes (_int4_block)."""
        dot = _dp4a((w >> 4) & 0x0F0F0F0F, x_hi, _dp4a(w & 0x0F0F0F0F, x_lo, tl.zeros_like(w), EMULATE), EMULATE)
        s, z = _scale_zero(sz, units, CODES)
        return acc + (tl.sum(dot, axis=2).to(tl.float32) - 8 * q_sum) * s * sx + z * x_sum

    @triton.jit
    def _int4_block(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, x_row, g_ptr, b, n_groups,
                    NORM: tl.constexpr, SWIGLU: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                    CODES: tl.constexpr, EMULATE: tl.constexpr):
        """Block b (BLOCK_G groups of G columns) of the one-row int4 GEMV: x there (NORM: its squares
        summed), times g, to int8 per group, four bytes to an int32. Each word's nibbles as bytes
        (w & 0x0F0F0F0F: columns 8j..8j+3; w >> 4 & 0x0F0F0F0F: 8j+4..8j+7) take a dp4a each with
        x's bytes: 5 instructions for 8 weights."""
        cols = b * (BLOCK_G * G) + tl.arange(0, BLOCK_G * G)
        ok = cols < n_groups * G
        x = tl.load(x_row + cols, mask=ok, other=0).to(tl.float32)
        if NORM:
            squares += x * x
        # times g, or ones without the norm: a multiply by a loaded vector keeps x's conversion in 1D
        # (without one Triton moved it into the weight tile's layout, where each thread repeats it
        # for its groups: 4.1 instructions a weight against 2.7, sm_90 machine code)
        x *= tl.load(g_ptr + cols, mask=ok, other=0).to(tl.float32)
        x = tl.reshape(x, (BLOCK_G, G))
        amax = tl.max(tl.abs(x), axis=1)
        x_sum = tl.sum(x, axis=1)[None, :]
        sx = (amax / 127)[None, :]
        q = tl.floor(x * tl.where(amax > 0, 127 / amax, 0)[:, None] + 0.5).to(tl.int32)
        q_sum = tl.sum(q, axis=1).to(tl.float32)[None, :]
        q = tl.reshape(q & 255, (BLOCK_G, G // 8, 2, 4)) << (8 * tl.arange(0, 4))[None, None, None, :]
        x_lo, x_hi = tl.split(tl.sum(q, axis=3))  # (bytes apart: the sum is their bitwise or)
        x_lo, x_hi = x_lo[None, :, :], x_hi[None, :, :]
        acc = _dp4a_acc(acc, w, sz, units, x_lo, x_hi, q_sum, sx, x_sum, CODES, EMULATE)
        if SWIGLU:
            acc_up = _dp4a_acc(acc_up, w_up, sz_up, units_up, x_lo, x_hi, q_sum, sx, x_sum, CODES, EMULATE)
        return acc, acc_up, squares

    @triton.jit
    def _int4_load(w_ptr, sz_ptr, rows, b, n_groups, G: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr):
        """Block b of int4 words [BN, BLOCK_G, G/8] and their scale-and-zero words [BN, BLOCK_G] for rows
        `rows`; MASKED: zero past the last group. The words load as the 2D tile they are in memory,
        [BN, BLOCK_G G/8], then take their 3D shape: loaded in 3D, Triton put a warp's threads on 32
        rows, 16 bytes each, not along a row's contiguous bytes (the 7B step at group 32: 479 against
        539 tok/s)."""
        groups = b * BLOCK_G + tl.arange(0, BLOCK_G)
        cols = b * (BLOCK_G * (G // 8)) + tl.arange(0, BLOCK_G * (G // 8))
        w_at = w_ptr + rows[:, None] * (n_groups * (G // 8)) + cols[None, :]
        sz_at = sz_ptr + rows[:, None] * n_groups + groups[None, :]
        if MASKED:
            w = tl.load(w_at, mask=(cols < n_groups * (G // 8))[None, :], other=0)
            sz = tl.load(sz_at, mask=(groups < n_groups)[None, :], other=0)
        else:
            w = tl.load(w_at)
            sz = tl.load(sz_at)
        return tl.reshape(w, (rows.shape[0], BLOCK_G, G // 8)), sz

    @triton.jit
    def _int4_units(u_ptr, rows, CODES: tl.constexpr):
        """Rows `rows`' units [BN, 2] (float32: scale's, zero's) where CODES, else a placeholder."""
        if CODES:
            units = tl.load(u_ptr + rows[:, None] * 2 + tl.arange(0, 2)[None, :])
        else:
            units = tl.zeros((rows.shape[0], 2), tl.float32)
        return units

    @triton.jit
    def _int4_gemv_kernel(x_ptr, w_ptr, sz_ptr, u_ptr, g_ptr, r_ptr, y_ptr, N, K, n_groups, eps, w_unscale,
                          NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, G: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr, CODES: tl.constexpr,
                          EMULATE: tl.constexpr):
        """y[n] = sum_k x[k] W[n, k] for one row x [K] and int4 W (Layout, K a multiple of G), with
        gemv.py's fusions (NORM, SWIGLU: W holds 2N rows, gate above up; RESIDUAL) and PDL. Each program
        takes BLOCK_N rows over all of K, BLOCK_G groups a step, each group's sum in float32. CODES:
        the scale-and-zero words are int16 codes and u_ptr holds each row's two units."""
        pid = tl.program_id(0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(rn, N - 1)  # rows past N are computed on row N - 1 and not stored
        acc = tl.zeros((BLOCK_N, BLOCK_G), tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_G), tl.float32)  # SWIGLU only
        squares = tl.zeros((BLOCK_G * G,), tl.float32)
        w, sz = _int4_load(w_ptr, sz_ptr, rows, 0, n_groups, G, BLOCK_G, True)  # before the wait
        w_up, sz_up = w, sz
        if SWIGLU:
            w_up, sz_up = _int4_load(w_ptr, sz_ptr, rows + N, 0, n_groups, G, BLOCK_G, True)
        units = _int4_units(u_ptr, rows, CODES)
        units_up = units
        if SWIGLU:
            units_up = _int4_units(u_ptr, rows + N, CODES)
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc, acc_up, squares = _int4_block(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, x_ptr, g_ptr,
                                           0, n_groups, NORM, SWIGLU, G, BLOCK_G, CODES, EMULATE)
        # Blocks wholly inside K load without masks (a mask on every block would cost the loop the
        # zeroing of its registers); then the block K ends in, if any.
        full = n_groups // BLOCK_G
        for b in range(1, full):
            w, sz = _int4_load(w_ptr, sz_ptr, rows, b, n_groups, G, BLOCK_G, False)
            if SWIGLU:
                w_up, sz_up = _int4_load(w_ptr, sz_ptr, rows + N, b, n_groups, G, BLOCK_G, False)
            acc, acc_up, squares = _int4_block(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, x_ptr,
                                               g_ptr, b, n_groups, NORM, SWIGLU, G, BLOCK_G, CODES, EMULATE)
        if (full * BLOCK_G < n_groups) & (full > 0):  # (full 0: block 0 was the partial one)
            w, sz = _int4_load(w_ptr, sz_ptr, rows, full, n_groups, G, BLOCK_G, True)
            if SWIGLU:
                w_up, sz_up = _int4_load(w_ptr, sz_ptr, rows + N, full, n_groups, G, BLOCK_G, True)
            acc, acc_up, squares = _int4_block(acc, acc_up, squares, w, w_up, sz, sz_up, units, units_up, x_ptr,
                                               g_ptr, full, n_groups, NORM, SWIGLU, G, BLOCK_G, CODES, EMULATE)
        unscale = w_unscale
        if NORM:
            unscale *= tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        out = tl.sum(acc, axis=1) * unscale
        if SWIGLU:
            up = tl.sum(acc_up, axis=1) * unscale
            out = out / (1 + tl.exp(-out)) * up
        if RESIDUAL:
            out += tl.load(r_ptr + rn, mask=rn < N, other=0).to(tl.float32)
        tl.store(y_ptr + rn, out, mask=rn < N)


# Launches (rows a program, columns a step, warps) by layer shape: gate/up (SwiGLU), wide (N > 8192:
# wqkv), long (K > 8192: the down projection), square (wo, and the rest); at group 32, at group 128
# (64 and 256 take it: not tuned), and at group 32 with codes. Tuned on the H200, Llama-2-7B with the
# fusions.
LAUNCHES = {
    "gate/up": ((16, 1024, 8), (32, 1024, 4), (16, 1024, 8)),
    "wide": ((32, 1024, 4), (32, 1024, 8), (32, 1024, 4)),
    "long": ((8, 2048, 8), (16, 4096, 8), (16, 2048, 8)),
    "square": ((16, 2048, 8), (16, 4096, 8), (16, 2048, 8)),
}


def config(N: int, K: int, group: int, swiglu: bool = False, codes: bool = False) -> tuple[int, int, int, int]:
    """The launch (BLOCK_N, BLOCK_G, num_warps, num_stages) for one row of x times int4 weights [N, K]
    in groups of `group` (LAUNCHES)."""
    shape = "gate/up" if swiglu else "wide" if N > 8192 else "long" if K > 8192 else "square"
    at_32, at_128, codes_at_32 = LAUNCHES[shape]
    rows, columns, warps = (codes_at_32 if codes else at_32) if group <= 32 else at_128
    return rows, max(1, min(columns // group, triton.next_power_of_2(K // group))), warps, 3


def gemv(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, units: torch.Tensor | None, w_unscale: float,
         group: int, ones: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, swiglu: bool = False, launch: tuple | None = None) -> torch.Tensor:
    """One row x [..., K] times int4 weights (a Layout's fields) -> [..., N] in x's dtype, with
    gemv.py's fusions: residual + [swiglu of] rmsnorm(x, norm_weight, eps) @ W.T. Without the norm
    the kernel multiplies x by `ones` [K] (see _int4_block; made here if not given: a kernel of its
    own). launch: (BLOCK_N, BLOCK_G, warps, stages), config's by default."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.shape[0] != 1:
        raise ValueError(f"int4.gemv takes one row of x (got {x2.shape[0]})")
    if words.shape[1] * 8 != K or K % group or sz.shape != (words.shape[0], K // group):
        raise ValueError(f"int4.gemv: words {tuple(words.shape)} and sz {tuple(sz.shape)} do not fit K={K} "
                         f"in groups of {group}")
    if (units is not None) != (sz.dtype == torch.int16):
        raise ValueError("int4.gemv: int16 codes go with their units, float16 pairs without")
    if units is not None and (units.shape != (words.shape[0], 2) or units.dtype != torch.float32
                              or not units.is_contiguous()):
        raise ValueError(f"int4.gemv: units must be float32 [{words.shape[0]}, 2], contiguous "
                         f"(got {units.dtype} {tuple(units.shape)})")
    N = words.shape[0] // (2 if swiglu else 1)
    block_n, block_g, warps, stages = launch or config(N, K, group, swiglu, units is not None)
    y = torch.empty((1, N), device=x.device, dtype=x.dtype)
    use_pdl = pdl(x)
    g = norm_weight if norm_weight is not None else ones if ones is not None else x.new_ones(K)
    _int4_gemv_kernel[(triton.cdiv(N, block_n),)](
        x2.contiguous(), words, sz, sz if units is None else units, g,
        words if residual is None else residual.reshape(1, N).contiguous(), y, N, K, K // group, eps, w_unscale,
        NORM=norm_weight is not None, RESIDUAL=residual is not None, SWIGLU=swiglu, G=group, BLOCK_N=block_n,
        BLOCK_G=block_g, PDL=use_pdl, CODES=units is not None, EMULATE=emulate(), num_warps=warps,
        num_stages=stages, **({"launch_pdl": True} if use_pdl else {}))
    return y.view(*x.shape[:-1], N)


@torch.library.custom_op("graphdecode::int4_gemv", mutates_args=())
def matmul(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, units: Optional[torch.Tensor], w_unscale: float,
           group: int, ones: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor] = None, eps: float = 0.0,
           residual: Optional[torch.Tensor] = None, swiglu: bool = False) -> torch.Tensor:
    """gemv with its tuned launch, as the custom op graphdecode::int4_gemv (opaque to torch.compile)."""
    return gemv(x, words, sz, units, w_unscale, group, ones, norm_weight, eps, residual, swiglu)


@matmul.register_fake
def _(x, words, sz, units, w_unscale, group, ones, norm_weight=None, eps=0.0, residual=None, swiglu=False):
    return x.new_empty((*x.shape[:-1], words.shape[0] // 2 if swiglu else words.shape[0]))
