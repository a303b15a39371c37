"""Exploration: Triton kernels for the one-row int4 weight-only GEMV, y[n] = sum_k x[k] w[n, k], x [1, K]
bf16, y [1, N] bf16, w = (q - 8) * scale + zero, q in 0..15, one bf16 scale and zero per group of G = 32
or 128 consecutive k and output row (tinygemm's convention). Its kernels are its own (not cuda_kernels.py's), like
int8_variants.py: each kernel is checked against a float32 reference of the dequantized weights on every
shape, then timed over a grid of launch configs as CUDA graph replays over >= 1 GiB of weight copies
(benchmarks/gemv.py's time_calls); each variant's best per shape is re-timed with 10 replays.

Layout (ours, built at load time by `pack`): int32 words of the nibbles of 8 consecutive k, the nibble at
bits 4t holding k-offset M_OF_SLOT[t] = 2t (t < 4) or 2(t - 4) + 1, so that one lop3 with 0x000F000F
takes out the pair (k, k + 1) that one f16x2 of x multiplies. Words in blocks of 4 groups, [N, NGP/4,
G/8, 4]: word j of groups 4b..4b+3 side by side, so a [BLOCK_N, BLOCK_G] tile of word j gives each thread
16 bytes (4 groups) at a compile-time offset 16 j from one base, and meets the [BLOCK_N, BLOCK_G] tile of
scales element for element (NGP = groups rounded up to 16, zero padding; the tail is masked in whole
blocks of 4 groups so its loads stay 16-byte). Scales and zeros: one int32 per row and group (the
scale's bf16 bits low, the zero's high), [N, NGP]. All kernels take y = sum over groups of
s * sum (q - 8) x + z * sum x, the group math in float32.

Variants (x in the weight tile's layout through a row-stride-0 load, as int8_variants.py's xload):
  words   float32 FMAs with one integer op per weight: a nibble masked in place (w & 0xF << b, one LOP3;
          one shift per word for the top two) IS the float32 denormal q * 2^(b - 149) (a bit pattern
          below 2^24 is its integer times 2^-149), FFMA keeps denormal inputs (Triton emits no .ftz), and
          x prescaled by 2^(109 - b) makes every product q x 2^-40, exact to float32 rounding (|x| < 2^18);
          per group s * 2^40 and z - 8 s. math=1: the plain formulation, (nib | 0x4B000000) as float
          - (2^23 + 8) = q - 8 (shift, LOP3, FADD, FFMA per weight), for comparison
  prmt    PTX per word: shr + 4 lop3 give 4 f16x2 of 1024 + q or 1024 + 16 q, sub/fma.f16x2 make q - 8
          exactly, 4 fma.f16x2 multiply-add the f16x2 pairs of x / 16 into a half-precision chain of ch
          words (4 products per lane per word), converted to float32 per chain: 13 instructions per 8
          weights. x / 16 keeps the chain finite for |x| < ~8000 / (ch / 4). math=3: the same data flow
          in plain Triton ops and float32 arithmetic (what the interpreter checks)
  mma     tensor cores: each word's 8 weights dequantized to f16 ((q - 8) s + z, PTX as prmt; conv=0
          plain ops), joined into a [BLOCK_N, 8 BLOCK_G] tile per word position j, tl.dot with x in
          column 0 of a [8 BLOCK_G, 16] f16 tile, float32 accumulation (operands go through shared memory)
  xprep=1 (words, prmt): a small kernel first writes what the main loop multiplies (prescaled float32
          or f16x2 pairs per nibble slot, in the weights' block order) and the per-group sums of x; both
          launches are timed. (In decode, the norm or attention kernel before the GEMV could write them.)
          xprep=0 converts x in the loop: cheap only with several rows per thread.
  tinygemm  torch._weight_int4pack_mm on the same q, scales and zeros (built as model.py's pack_int4)
  bf16      F.linear on the dequantized weights in bf16 (cuBLAS): the target is 2.6x its speed
GB/s counts the int4 bytes, N K / 2 + 4 N K / G. Loop cost offline (Triton 3.9 SASS for sm_90, per
weight): words xprep=1 2.8 at 1 row per thread, 2.6 at 2, 2.5 at 4 (floor 2.125); prmt 2.3 / 2.1 / 2.0
(floor 1.625); mma 2.8-3.5 at BLOCK_N = 128; xprep=0 ~6 at 1 row per thread, 3.2 (words) at 4.

    python benchmarks/int4_variants.py [--groupsizes 32,128] [--variants words,prmt] [--shapes wo,w2]
                                       [--quick] [--budget-s 280] [--json PATH]
    TRITON_INTERPRET=1 python benchmarks/int4_variants.py --interpret-check   # CPU, correctness only
"""
import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import time_calls  # noqa: E402  (benchmarks/gemv.py; it puts the repository on sys.path)
from bench import copy_bandwidth  # noqa: E402

L2_MULTIPLE_BYTES = 1 << 30  # each timed graph reads at least this much weight
SHAPES = {"wqkv": (12288, 4096), "wo": (4096, 4096), "w13": (22016, 4096), "w2": (4096, 11008),
          "output": (32000, 4096)}
LAYER = ("wqkv", "wo", "w13", "w2")  # one transformer layer
DEVICE = "cuda"  # (a CPU dry run of the harness sets "cpu")
M_OF_SLOT = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble slot t (bits 4t..4t+3) -> k-offset inside the word

# words: the nibble at bits b (b = 4t for slots t < 6, b = 4t - 8 for t = 6, 7 after w >> 8) is the float
# q * 2^(b - 149); x times 2^(109 - b) makes every product q x 2^-40 (|x| < 2^18 stays finite).
_S109, _S105, _S101 = tl.constexpr(2.0 ** 109), tl.constexpr(2.0 ** 105), tl.constexpr(2.0 ** 101)
_S97, _S93, _S89 = tl.constexpr(2.0 ** 97), tl.constexpr(2.0 ** 93), tl.constexpr(2.0 ** 89)
_U40 = tl.constexpr(2.0 ** 40)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _ld(p, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(p, mask=mask, other=0)
    return tl.load(p)


@triton.jit
def _xscale(v, t: tl.constexpr, MATH: tl.constexpr):
    """x for nibble slot t: MATH 0 (words) times 2^(109 - b); MATH 1 unscaled; f16 paths x / 16."""
    if MATH == 0:
        if t == 0:
            v = v * _S109
        elif t == 1:
            v = v * _S105
        elif t == 2:
            v = v * _S101
        elif t == 3:
            v = v * _S97
        elif t == 4:
            v = v * _S93
        elif t == 6:
            v = v * _S93
        else:
            v = v * _S89
    elif MATH >= 2:
        v = v * 0.0625
    return v


@triton.jit
def _nib(w, w8, t: tl.constexpr, MATH: tl.constexpr):
    """Nibble slot t of the words w as float32: MATH 0 the masked bits themselves (a denormal, see
    _xscale; w8 = w >> 8 for t = 6, 7); otherwise q - 8 through the bit pattern of 2^23 + q."""
    if MATH == 0:
        if t < 6:
            f = (w & (15 << (4 * t))).to(tl.float32, bitcast=True)
        else:
            f = (w8 & (15 << (4 * t - 8))).to(tl.float32, bitcast=True)
    else:
        f = (((w.to(tl.uint32, bitcast=True) >> (4 * t)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return f


@triton.jit
def _f16x2(lo, hi, MATH: tl.constexpr):
    """Two float32 tensors -> int32 holding f16x2 (lo in the low half): PTX cvt (MATH 2) or plain ops."""
    if MATH == 2:
        r = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,r,r", [hi, lo], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        r = ((hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)
             | (lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF))
    return r


@triton.jit
def _halves(u, F16: tl.constexpr):
    """int32 holding two bf16 (F16 0) or f16 (F16 1), low half first -> two float32 tensors."""
    if F16:
        return (u.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (u >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))
    return (u << 16).to(tl.float32, bitcast=True), (u & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _q8(w, t: tl.constexpr):
    """Nibble slot t of w minus 8, as int32 (plain ops)."""
    return ((w >> (4 * t)) & 15) - 8


@triton.jit
def _pair(w, xpair, i: tl.constexpr):
    """Plain ops: slots i and 4 + i of w times the f16x2 pair of x (k-offsets 2i, 2i + 1), float32."""
    lo, hi = _halves(xpair, True)
    return _q8(w, i).to(tl.float32) * lo + _q8(w, 4 + i).to(tl.float32) * hi


@triton.jit
def _word_f16(h, w, x0, x1, x2, x3, MATH: tl.constexpr):
    """h += the word's 8 products (q - 8) x, x0..x3 the f16x2 pairs of x. MATH 2: h is an f16x2
    accumulator (int32 bits), PTX below. MATH 3: plain ops, h float32 (both halves summed)."""
    if MATH == 2:
        h = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 a, b, c, d, t, m0, m1, k1032, k16, k72;
            mov.b32 m0, 0x000F000F;
            mov.b32 m1, 0x00F000F0;
            mov.b32 k1032, 0x64086408;
            mov.b32 k16, 0x2C002C00;
            mov.b32 k72, 0xD480D480;
            shr.u32 t, $1, 8;
            lop3.b32 a, $1, m0, 0x64006400, 0xEA;
            lop3.b32 b, $1, m1, 0x64006400, 0xEA;
            lop3.b32 c, t, m0, 0x64006400, 0xEA;
            lop3.b32 d, t, m1, 0x64006400, 0xEA;
            sub.f16x2 a, a, k1032;
            fma.rn.f16x2 b, b, k16, k72;
            sub.f16x2 c, c, k1032;
            fma.rn.f16x2 d, d, k16, k72;
            fma.rn.f16x2 $0, a, $2, $6;
            fma.rn.f16x2 $0, b, $3, $0;
            fma.rn.f16x2 $0, c, $4, $0;
            fma.rn.f16x2 $0, d, $5, $0;
            }
            """,
            constraints="=r,r,r,r,r,r,r", args=[w, x0, x1, x2, x3, h], dtype=tl.int32, is_pure=True, pack=1)
    else:
        h += _pair(w, x0, 0) + _pair(w, x1, 1) + _pair(w, x2, 2) + _pair(w, x3, 3)
    return h


@triton.jit
def _h_to_f32(h, MATH: tl.constexpr):
    if MATH == 2:
        h = tl.inline_asm_elementwise(
            asm="{ .reg .f16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; cvt.f32.f16 b, h; "
                "add.f32 $0, a, b; }",
            constraints="=r,r", args=[h], dtype=tl.float32, is_pure=True, pack=1)
    return h


@triton.jit
def _tile(acc, x_ptr, xp_ptr, xs_ptr, w_at, sz_at, g0, rz, NG, NGP, G: tl.constexpr, BLOCK_G: tl.constexpr,
          MATH: tl.constexpr, CH: tl.constexpr, XPREP: tl.constexpr, MASKED: tl.constexpr):
    """acc[BN, BG] += for the groups g0 + [0, BG): s * sum (q - 8) x + z * sum x (in MATH's scaling)."""
    GW: tl.constexpr = G // 8
    gs = g0 + tl.arange(0, BLOCK_G)
    m2 = (gs // 4 < (NG + 3) // 4)[None, :]  # whole 4-group blocks (zero padding): loads stay 16-byte
    blk = (gs // 4)[None, :] + rz[:, None]  # 4-group block; row stride 0: x gets the weight tile's layout
    g4 = (gs % 4)[None, :]
    wo = blk * (4 * GW) + g4  # + 4 j: word j of each group, at a compile-time offset from one base
    sz = _ld(sz_at + gs[None, :], m2, MASKED)
    s = (sz << 16).to(tl.float32, bitcast=True)
    z = (sz & -65536).to(tl.float32, bitcast=True)
    p = tl.zeros(acc.shape, tl.float32)
    if XPREP:
        xsum = _ld(xs_ptr + blk * 4 + g4, m2, MASKED)
    else:
        xsum = tl.zeros(acc.shape, tl.float32)
    for c0 in tl.static_range(0, GW, CH):
        if MATH == 2:
            h = tl.zeros(acc.shape, tl.int32)
        else:
            h = tl.zeros(acc.shape, tl.float32)
        for j in tl.static_range(c0, c0 + CH):
            w = _ld(w_at + wo + 4 * j, m2, MASKED)
            if XPREP:
                if MATH <= 1:  # 8 prescaled floats per word, slot order
                    xq = xp_ptr + blk * (32 * GW) + g4 + 32 * j
                    for t in tl.static_range(8):
                        p += _nib(w, w >> 8, t, MATH) * _ld(xq + 4 * t, m2, MASKED)
                else:  # 4 f16x2 pairs per word
                    xq = xp_ptr + blk * (16 * GW) + g4 + 16 * j
                    h = _word_f16(h, w, _ld(xq, m2, MASKED), _ld(xq + 4, m2, MASKED), _ld(xq + 8, m2, MASKED),
                                  _ld(xq + 12, m2, MASKED), MATH)
            else:  # the word's 8 bf16 of x as two int64 (4 bf16 each, k ascending from the low bits)
                xq = x_ptr + (blk * 4 + g4) * (G // 4) + 2 * j
                xw0 = _ld(xq, (gs < NG)[None, :], MASKED)
                xw1 = _ld(xq + 1, (gs < NG)[None, :], MASKED)
                l0, h0 = _halves(xw0.to(tl.int32), False)  # x pair i: k-offsets 2i (l), 2i + 1 (h)
                l1, h1 = _halves((xw0 >> 32).to(tl.int32), False)
                l2, h2 = _halves(xw1.to(tl.int32), False)
                l3, h3 = _halves((xw1 >> 32).to(tl.int32), False)
                xsum += ((l0 + h0) + (l1 + h1)) + ((l2 + h2) + (l3 + h3))
                if MATH <= 1:
                    w8 = w >> 8
                    p += _nib(w, w8, 0, MATH) * _xscale(l0, 0, MATH)
                    p += _nib(w, w8, 4, MATH) * _xscale(h0, 4, MATH)
                    p += _nib(w, w8, 1, MATH) * _xscale(l1, 1, MATH)
                    p += _nib(w, w8, 5, MATH) * _xscale(h1, 5, MATH)
                    p += _nib(w, w8, 2, MATH) * _xscale(l2, 2, MATH)
                    p += _nib(w, w8, 6, MATH) * _xscale(h2, 6, MATH)
                    p += _nib(w, w8, 3, MATH) * _xscale(l3, 3, MATH)
                    p += _nib(w, w8, 7, MATH) * _xscale(h3, 7, MATH)
                else:
                    h = _word_f16(h, w, _f16x2(l0 * 0.0625, h0 * 0.0625, MATH), _f16x2(l1 * 0.0625, h1 * 0.0625, MATH),
                                  _f16x2(l2 * 0.0625, h2 * 0.0625, MATH), _f16x2(l3 * 0.0625, h3 * 0.0625, MATH), MATH)
        if MATH >= 2:
            p += _h_to_f32(h, MATH)
    if MATH == 0:  # p = sum q x 2^-40
        acc += (s * _U40) * p + (z - 8.0 * s) * xsum
    elif MATH == 1:  # p = sum (q - 8) x
        acc += s * p + z * xsum
    else:  # p = sum (q - 8) x / 16
        acc += (s * 16.0) * p + z * xsum
    return acc


@triton.jit(do_not_specialize=["NG"])
def gemv_int4(x_ptr, xp_ptr, xs_ptr, w_ptr, sz_ptr, y_ptr, N, NG, NGP, G: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_G: tl.constexpr, MATH: tl.constexpr, CH: tl.constexpr, XPREP: tl.constexpr):
    """One row: program pid_n takes rows [pid_n BN, +BN) (clamped to N - 1 for the loads, not stored),
    BLOCK_G groups per iteration, an unmasked loop and a masked tail. x_ptr: x as int64 (4 bf16 each);
    xp_ptr, xs_ptr: prep_x's output (XPREP); w_ptr: int32 [N, NGP/4, G/8, 4]; sz_ptr: int32 [N, NGP]."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1)
    rz = 0 * rn
    w_at = w_ptr + rows[:, None] * ((G // 8) * NGP)
    sz_at = sz_ptr + rows[:, None] * NGP
    acc = tl.zeros((BLOCK_N, BLOCK_G), tl.float32)
    ng_full = (NG // BLOCK_G) * BLOCK_G
    for g0 in range(0, ng_full, BLOCK_G):
        acc = _tile(acc, x_ptr, xp_ptr, xs_ptr, w_at, sz_at, g0, rz, NG, NGP, G, BLOCK_G, MATH, CH, XPREP, False)
    if ng_full < NG:
        acc = _tile(acc, x_ptr, xp_ptr, xs_ptr, w_at, sz_at, ng_full, rz, NG, NGP, G, BLOCK_G, MATH, CH, XPREP, True)
    tl.store(y_ptr + rn, tl.sum(acc, axis=1), mask=rn < N)


@triton.jit(do_not_specialize=["NG"])
def prep_x(x_ptr, xp_ptr, xs_ptr, NG, NGP, G: tl.constexpr, MATH: tl.constexpr, BLOCK_G: tl.constexpr):
    """x (bf16) -> per-group sums xs [NGP] and, per word j and slot, what the main loop multiplies, in
    blocks of 4 groups: MATH <= 1 float32 [NGP/4, G/8, 8, 4] (slot t: x[8j + M_OF_SLOT[t]], _xscale'd);
    MATH >= 2 f16x2 pairs [NGP/4, G/8, 4, 4] (pair i: x[8j + 2i], x[8j + 2i + 1], divided by 16)."""
    gs = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = gs < NG
    blk, g4 = gs // 4, gs % 4
    ok_p = gs < NGP  # zeros in the padding, which the main loop reads in whole 4-group blocks
    xsum = tl.zeros((BLOCK_G,), tl.float32)
    for j in tl.static_range(G // 8):
        for i in tl.static_range(4):
            lo = tl.load(x_ptr + gs * G + 8 * j + 2 * i, mask=ok, other=0).to(tl.float32)
            hi = tl.load(x_ptr + gs * G + 8 * j + 2 * i + 1, mask=ok, other=0).to(tl.float32)
            xsum += lo + hi
            if MATH <= 1:
                tl.store(xp_ptr + blk * (4 * G) + (j * 8 + i) * 4 + g4, _xscale(lo, i, MATH), mask=ok_p)
                tl.store(xp_ptr + blk * (4 * G) + (j * 8 + 4 + i) * 4 + g4, _xscale(hi, 4 + i, MATH), mask=ok_p)
            else:
                tl.store(xp_ptr + blk * (2 * G) + (j * 4 + i) * 4 + g4, _f16x2(lo * 0.0625, hi * 0.0625, 3), mask=ok_p)
    tl.store(xs_ptr + gs, xsum, mask=ok_p)


@triton.jit
def _deq8(w, s2, z2, CONV: tl.constexpr):
    """The word's 8 weights, k-offsets 0..7, as float16 (q - 8) s + z. CONV 1: PTX (prmt's lop3 + sub/fma,
    then one fma.f16x2 with s2, z2 = f16x2 (s, s), (z, z)); CONV 0: plain ops (s2, z2 float16)."""
    if CONV == 1:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 a, b, c, d, t, m0, m1, k1032, k16, k72;
            mov.b32 m0, 0x000F000F;
            mov.b32 m1, 0x00F000F0;
            mov.b32 k1032, 0x64086408;
            mov.b32 k16, 0x2C002C00;
            mov.b32 k72, 0xD480D480;
            shr.u32 t, $8, 8;
            lop3.b32 a, $8, m0, 0x64006400, 0xEA;
            lop3.b32 b, $8, m1, 0x64006400, 0xEA;
            lop3.b32 c, t, m0, 0x64006400, 0xEA;
            lop3.b32 d, t, m1, 0x64006400, 0xEA;
            sub.f16x2 a, a, k1032;
            fma.rn.f16x2 b, b, k16, k72;
            sub.f16x2 c, c, k1032;
            fma.rn.f16x2 d, d, k16, k72;
            fma.rn.f16x2 a, a, $9, $10;
            fma.rn.f16x2 b, b, $9, $10;
            fma.rn.f16x2 c, c, $9, $10;
            fma.rn.f16x2 d, d, $9, $10;
            mov.b32 {$0, $1}, a;
            mov.b32 {$2, $3}, b;
            mov.b32 {$4, $5}, c;
            mov.b32 {$6, $7}, d;
            }
            """,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", args=[w, s2, z2], dtype=(tl.float16,) * 8,
            is_pure=True, pack=1)
    else:  # k-offset m sits in slot M_OF_SLOT.index(m) = 0, 4, 1, 5, 2, 6, 3, 7
        return (_q8(w, 0).to(tl.float16) * s2 + z2, _q8(w, 4).to(tl.float16) * s2 + z2,
                _q8(w, 1).to(tl.float16) * s2 + z2, _q8(w, 5).to(tl.float16) * s2 + z2,
                _q8(w, 2).to(tl.float16) * s2 + z2, _q8(w, 6).to(tl.float16) * s2 + z2,
                _q8(w, 3).to(tl.float16) * s2 + z2, _q8(w, 7).to(tl.float16) * s2 + z2)


@triton.jit
def _mma_tile(acc, x_ptr, w_at, sz_at, g0, NG, NGP, G: tl.constexpr, BLOCK_G: tl.constexpr,
              CONV: tl.constexpr, MASKED: tl.constexpr):
    gs = g0 + tl.arange(0, BLOCK_G)
    m2 = (gs // 4 < (NG + 3) // 4)[None, :]  # whole 4-group blocks, as _tile
    sz = _ld(sz_at + gs[None, :], m2, MASKED)
    s = (sz << 16).to(tl.float32, bitcast=True).to(tl.float16)
    z = (sz & -65536).to(tl.float32, bitcast=True).to(tl.float16)
    if CONV == 1:
        s = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        z = z.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        s = s | (s << 16)
        z = z | (z << 16)
    c = tl.arange(0, 8 * BLOCK_G)  # column of the joined tile: group g0 + c // 8, k-offset c % 8
    col0 = (tl.arange(0, 16) == 0)[None, :]
    wo = ((gs // 4) * (G // 2) + gs % 4)[None, :]
    for j in tl.static_range(G // 8):
        w = _ld(w_at + wo + 4 * j, m2, MASKED)
        d0, d1, d2, d3, d4, d5, d6, d7 = _deq8(w, s, z, CONV)
        a = tl.join(tl.join(tl.join(d0, d4), tl.join(d2, d6)), tl.join(tl.join(d1, d5), tl.join(d3, d7)))
        a = tl.reshape(a, (a.shape[0], 8 * BLOCK_G))
        x = _ld(x_ptr + (g0 + c // 8) * G + 8 * j + c % 8, (g0 + c // 8) < NG, MASKED)
        acc = tl.dot(a, tl.where(col0, x.to(tl.float16)[:, None], 0.0).to(tl.float16), acc)
    return acc


@triton.jit(do_not_specialize=["NG"])
def gemv_mma(x_ptr, w_ptr, sz_ptr, y_ptr, N, NG, NGP, G: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_G: tl.constexpr, CONV: tl.constexpr):
    """acc[BN, 16] += W_plane_tile(f16, dequantized) @ [x | 0]; x_ptr bf16 [K]."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1)
    w_at = w_ptr + rows[:, None] * ((G // 8) * NGP)
    sz_at = sz_ptr + rows[:, None] * NGP
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    ng_full = (NG // BLOCK_G) * BLOCK_G
    for g0 in range(0, ng_full, BLOCK_G):
        acc = _mma_tile(acc, x_ptr, w_at, sz_at, g0, NG, NGP, G, BLOCK_G, CONV, False)
    if ng_full < NG:
        acc = _mma_tile(acc, x_ptr, w_at, sz_at, ng_full, NG, NGP, G, BLOCK_G, CONV, True)
    tl.store(y_ptr + rn, tl.sum(acc, axis=1), mask=rn < N)


# ----------------------------------------------------------------------------------------------
# Layout, launchers. A launcher takes a shape's context d (x, y, N, K, G, scratch), one weight copy
# wt and a config dict (bn, bg = groups per iteration, warps, stages, variant extras); returns y.
# ----------------------------------------------------------------------------------------------

def ngp(ng):
    return -(-ng // 16) * 16


def _int32(t):  # int64 holding 32 bits -> int32 with the same bits
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)


def pack(q, s, z, G):
    """q [N, K] in 0..15, s and z [N, K/G] -> words int32 [N, NGP/4, G/8, 4], sz int32 [N, NGP] (see top)."""
    N, K = q.shape
    ng = K // G
    q8 = q.view(N, K // 8, 8).to(torch.int64)
    word = _int32(sum(q8[:, :, m] << (4 * t) for t, m in enumerate(M_OF_SLOT)))
    planes = torch.zeros(N, ngp(ng), G // 8, dtype=torch.int32, device=q.device)
    planes[:, :ng] = word.view(N, ng, G // 8)
    planes = planes.view(N, ngp(ng) // 4, 4, G // 8).transpose(2, 3).contiguous()
    bits = [t.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF for t in (s, z)]
    sz = torch.zeros(N, ngp(ng), dtype=torch.int32, device=q.device)
    sz[:, :ng] = _int32(bits[0] | (bits[1] << 16))
    return planes, sz


def dequantize(q, s, z, G):
    return (q.float() - 8) * s.float().repeat_interleave(G, 1) + z.float().repeat_interleave(G, 1)


def _run(kernel, grid, args, kw, warmup):
    if warmup:
        kernel.warmup(*args, grid=grid, **kw)
    else:
        kernel[grid](*args, **kw)


def launch_int4(d, wt, c, warmup=False):
    N, G = d["N"], d["G"]
    ng = d["K"] // G
    math, xprep = c.get("math", 0), c.get("xprep", 0)
    xp = d["xp"] if math <= 1 else d["xp"].view(torch.int32)
    if xprep:
        _run(prep_x, (triton.cdiv(ngp(ng), 32),), (d["x"], xp, d["xs"], ng, ngp(ng)),
             dict(G=G, MATH=math, BLOCK_G=32, num_warps=4), warmup)
    _run(gemv_int4, (triton.cdiv(N, c["bn"]),), (d["x"].view(torch.int64), xp, d["xs"], *wt, d["y"], N, ng, ngp(ng)),
         dict(G=G, BLOCK_N=c["bn"], BLOCK_G=c["bg"], MATH=math, CH=min(c.get("ch", 4), G // 8),
              XPREP=xprep, num_warps=c["warps"], num_stages=c["stages"]), warmup)
    return d["y"]


def launch_mma(d, wt, c, warmup=False):
    N, G = d["N"], d["G"]
    ng = d["K"] // G
    _run(gemv_mma, (triton.cdiv(N, c["bn"]),), (d["x"], *wt, d["y"], N, ng, ngp(ng)),
         dict(G=G, BLOCK_N=c["bn"], BLOCK_G=c["bg"], CONV=c.get("conv", 1), num_warps=c["warps"],
              num_stages=c["stages"]), warmup)
    return d["y"]


def launch_tinygemm(d, wt, c, warmup=False):
    return torch._weight_int4pack_mm(d["x"], wt[0], d["G"], wt[1])


def launch_bf16(d, wt, c, warmup=False):
    return F.linear(d["x"], wt)


def cfgs(pairs, launches, **extra):
    """Grid: (bn, bg) pairs x (warps, stages) x each combination of the extra lists (the first value of
    each extra outermost), configs with the first pair and launch first. bg: groups per iteration."""
    out = [dict(bn=bn, bg=bg, warps=w, stages=st) for bn, bg in pairs for w, st in launches]
    for key, values in reversed(list(extra.items())):
        out = [dict(c, **{key: v}) for v in values for c in out]
    return out


# Grids per group size, most promising first (--quick takes the first two; the time budget cuts from the
# end). A [bn, bg] tile gives each thread 4 groups (16-byte loads) of bn * bg / (128 * warps / 4) / 4
# rows: more rows share the x loads; more groups per thread or rows put more bytes in flight; narrow
# layers (N = 4096) want >= ~256 programs. Non-dot kernels: num_stages does nothing (kept at 1).
# Offline (Triton 3.9, sm_90 SASS) all of these compile without spills; instructions per weight in the
# loop: words 2.8 / 2.6 / 2.5 at 1 / 2 / 4 rows per thread (floor 2.125), prmt 2.3 / 2.1 / 2.0 (floor
# 1.625; ch=8 1.85), mma 2.8-3.5 at BLOCK_N = 128 and 3.4-4.1 at 64 (wgmma; mma.sync below 64: ~5).
T32 = [(16, 64), (32, 32), (8, 128), (64, 32), (32, 64), (16, 128), (16, 32), (4, 128)]  # rows/thread 2,2,2,4,4,4,1,1
T128 = [(32, 32), (16, 32), (64, 16), (32, 16), (64, 8)]  # 2, 1, 2, 1, 1 (bg 32 = all of K = 4096)
W4, W8 = [(4, 1)], [(8, 1)]


def _grid(tiles, wide8, xprep0, math, extra):
    """tiles (4 warps) first, then 8-warp ones, x converted in the loop (xprep=0), and the extras."""
    return (cfgs(tiles, W4, xprep=[1], math=[math]) + cfgs(wide8, W8, xprep=[1], math=[math])
            + cfgs(xprep0, W4, xprep=[0], math=[math]) + extra)


GRIDS = {
    32: {"words": _grid(T32, [(32, 64), (16, 128)], [(64, 32), (32, 64)], 0, cfgs(T32[:2], W4, xprep=[1], math=[1])),
         "prmt": _grid(T32, [(32, 64), (16, 128)], [(64, 32), (32, 64)], 2,
                       cfgs(T32[:2], W4, xprep=[1], math=[2], ch=[2])),
         "mma": cfgs([(128, 8), (64, 16), (64, 8)], [(4, 2)], conv=[1]) + cfgs([(128, 16)], [(8, 2)], conv=[1])
                + cfgs([(128, 8), (64, 16)], [(4, 3)], conv=[1]) + cfgs([(32, 16)], [(4, 2)], conv=[1])},
    128: {"words": _grid(T128, [(32, 32), (64, 16)], [(64, 16)], 0, cfgs(T128[:1], W4, xprep=[1], math=[1])),
          "prmt": _grid(T128, [(32, 32), (64, 16)], [(64, 16)], 2, cfgs(T128[:2], W4, xprep=[1], math=[2], ch=[8])),
          "mma": cfgs([(128, 8), (64, 8)], [(4, 2)], conv=[1]) + cfgs([(128, 8)], [(8, 2)], conv=[1])
                 + cfgs([(128, 4)], [(4, 2)], conv=[1]) + cfgs([(128, 8)], [(4, 3)], conv=[1])},
}
VARIANTS = {"words": launch_int4, "prmt": launch_int4, "mma": launch_mma, "tinygemm": launch_tinygemm,
            "bf16": launch_bf16}
BASELINES = ("tinygemm", "bf16")


def cfg_str(c):
    return " ".join(f"{k}={v}" for k, v in c.items()) or "-"


# ----------------------------------------------------------------------------------------------
# Data, reference
# ----------------------------------------------------------------------------------------------

def make_context(q, G, gen, out_dtype):
    """Scales, zeros and x for the weights q [N, K] at group size G; the reference y in float32."""
    N, K = q.shape
    dev = q.device
    s = ((0.5 + torch.rand(N, K // G, generator=gen, device=dev)) / (5 * K ** 0.5)).to(torch.bfloat16)
    z = (torch.randn(N, K // G, generator=gen, device=dev) / (20 * K ** 0.5)).to(torch.bfloat16)
    x = torch.randn(1, K, generator=gen, device=dev).to(torch.bfloat16)
    ng = K // G
    d = dict(N=N, K=K, G=G, x=x, y=torch.empty(N, device=dev, dtype=out_dtype), s=s, z=z,
             xp=torch.empty(G * ngp(ng), device=dev, dtype=torch.float32),
             xs=torch.empty(ngp(ng), device=dev, dtype=torch.float32),
             expect=(x.float() @ dequantize(q, s, z, G).T)[0], nbytes=N * K // 2 + 4 * N * ng)
    return d


def rel_err(y, expect):
    return ((y.float().view(-1) - expect).abs().max() / expect.abs().max()).item()


# ----------------------------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------------------------

def interpret_check():
    """words (both formulations, xprep 0 and 1), prmt's plain-op path (math 3) and mma's (conv 0), at G =
    32 and 128, on two small shapes (the second with a tail of groups and a last block of rows not filled),
    on the CPU with a float32 output so that the check (relative error < 1e-3) sees the kernel's own."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run as: TRITON_INTERPRET=1 python benchmarks/int4_variants.py --interpret-check")
    gen = torch.Generator().manual_seed(0)
    small = [("words", dict(bn=16, bg=8, xprep=0, math=0)), ("words", dict(bn=16, bg=4, xprep=1, math=0)),
             ("words", dict(bn=32, bg=4, xprep=1, math=1)), ("prmt", dict(bn=16, bg=8, xprep=1, math=3)),
             ("prmt", dict(bn=32, bg=4, xprep=0, math=3, ch=2)), ("mma", dict(bn=16, bg=4, conv=0))]
    print("The PTX forms (prmt math=2, mma conv=1) run on the GPU only; here prmt runs math=3 (the same data "
          "flow in plain ops) and mma conv=0", flush=True)
    failed = 0
    for N, K in ((64, 1024), (40, 1408)):  # 1408 = 44 x 32 = 11 x 128: a tail of groups for every block
        q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
        for G in (32, 128):
            d = make_context(q, G, gen, torch.float32)
            wt = pack(q, d["s"], d["z"], G)
            for name, c in small:
                c = dict(c, warps=4, stages=1)
                try:
                    d["y"].zero_()
                    err = rel_err(VARIANTS[name](d, wt, c), d["expect"])
                    ok = err < 1e-3
                except Exception as e:
                    err, ok = f"{type(e).__name__}: {e}", False
                    traceback.print_exc()
                failed += not ok
                print(f"{name:6s} N={N:<3d} K={K:<5d} G={G:<3d} {cfg_str(c):50s} {'ok  ' if ok else 'FAIL'} "
                      f"err {err if isinstance(err, str) else f'{err:.1e}'}", flush=True)
    print("all passed" if not failed else f"{failed} FAILED", flush=True)
    return 1 if failed else 0


def _precompile(job):
    """Pool worker: compile one (variant, G, config) into Triton's on-disk cache through
    JITFunction.warmup (no launch), so that the timing process loads it instead of compiling. Every
    shape here has the same specialization (N, NGP multiples of 16, NG not specialized), so the wo
    shape stands for all."""
    vname, G, c = job
    t = time.time()
    try:
        dev = torch.device("cuda")
        N = K = 4096
        ng = K // G
        d = dict(N=N, K=K, G=G, x=torch.empty(1, K, device=dev, dtype=torch.bfloat16),
                 y=torch.empty(N, device=dev, dtype=torch.bfloat16), xp=torch.empty(G * ngp(ng), device=dev),
                 xs=torch.empty(ngp(ng), device=dev))
        wt = (torch.empty(N, ngp(ng) // 4, G // 8, 4, device=dev, dtype=torch.int32),
              torch.empty(N, ngp(ng), device=dev, dtype=torch.int32))
        VARIANTS[vname](d, wt, c, warmup=True)
        return None, time.time() - t
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}", time.time() - t


def start_pool(jobs):
    """Precompile jobs in order on spare cores (spawned processes); {(vname, G, cfg_str): future}."""
    import multiprocessing as mp
    workers = max(1, min(12, (os.cpu_count() or 4) - 3))
    try:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
        return pool, {(v, G, cfg_str(c)): pool.submit(_precompile, (v, G, c)) for v, G, c in jobs}, workers
    except Exception as e:
        print(f"no precompile pool ({type(e).__name__}: {e}): compiling in this process", flush=True)
        return None, {}, 0


def stop_pool(pool):
    if pool is None:
        return
    procs = list(getattr(pool, "_processes", {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:  # compiles still running would hold the exit: end the pool's own processes
        if p.is_alive():
            p.terminate()


def gpu_run(a):
    t_start = time.time()
    deadline = t_start + a.budget_s
    gsizes = [int(g) for g in a.groupsizes.split(",")]
    names = [v for v in (a.variants.split(",") if a.variants else VARIANTS) if v in VARIANTS]
    kern = [v for v in names if v not in BASELINES]
    grids = {(G, v): GRIDS[G][v][:2] if a.quick else GRIDS[G][v] for G in gsizes for v in kern}
    pool, futures, workers = start_pool([(v, G, c) for G in gsizes for v in kern for c in grids[G, v]])
    try:
        return _gpu_run(a, t_start, deadline, gsizes, names, kern, grids, futures, workers)
    finally:
        stop_pool(pool)


def _gpu_run(a, t_start, deadline, gsizes, names, kern, grids, futures, workers):
    dev = torch.device(DEVICE)
    ceiling = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy ceiling "
          f"{ceiling:.0f} GB/s  budget {a.budget_s:.0f} s  precompile workers {workers}", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = {n: nk for n, nk in SHAPES.items() if not a.shapes or n in a.shapes.split(",")}
    qs = {n: torch.randint(0, 16, nk, device=dev, dtype=torch.uint8, generator=gen) for n, nk in shapes.items()}
    records, best = [], {}  # best[G][variant][shape] = dict(cfg, us, gb_s)

    def save():
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(dict(ceiling_gb_s=ceiling, gpu=torch.cuda.get_device_name(),
                                              torch=torch.__version__, triton=triton.__version__,
                                              records=records, best=best), indent=1))

    def measure(G, vname, c, data, cand, reps=3):
        """Check then time c on every shape; cand[shape] keeps the fastest (t, c). False: CUDA broken."""
        line = []
        for sname, d in data.items():
            copies = d["copies"][vname if vname in BASELINES else "ours"]
            rec = dict(variant=vname, G=G, shape=sname, N=d["N"], K=d["K"], cfg=c)
            try:
                err = rel_err(VARIANTS[vname](d, copies[0], c), d["expect"])
                rec["err"] = err
                if not err < 1e-2:
                    rec["status"] = "FAIL"
                    line.append(f"{sname} FAIL({err:.1e})")
                else:
                    t = time_calls([lambda w=w, d=d: VARIANTS[vname](d, w, c) for w in copies], reps=reps)
                    rec.update(status="ok", us=t * 1e6, gb_s=d["nbytes"] / t / 1e9)
                    line.append(f"{sname} {t * 1e6:5.1f}us {rec['gb_s']:4.0f}")
                    if sname not in cand or t < cand[sname][0]:
                        cand[sname] = (t, c, err)
            except Exception as e:  # out of resources, compile error
                rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
                line.append(f"{sname} {type(e).__name__}")
                print(f"   {sname} {cfg_str(c)}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                if "CUDA error" in str(e) or "illegal" in str(e):
                    records.append(rec)
                    print("   CUDA context unusable: stopping here", flush=True)
                    return False, line
            records.append(rec)
        return True, line

    broken = False
    for gi, G in enumerate(gsizes):
        if broken or time.time() > deadline - 5:
            break
        data = {}
        for sname, (N, K) in shapes.items():
            d = make_context(qs[sname], G, gen, torch.bfloat16)
            ours = pack(qs[sname], d["s"], d["z"], G)
            q = qs[sname]
            tiny = (torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8),
                    torch.stack([d["s"], d["z"]], -1).transpose(0, 1).contiguous())
            wbf = dequantize(q, d["s"], d["z"], G).to(torch.bfloat16)
            n = lambda nbytes: max(2, -(-L2_MULTIPLE_BYTES // nbytes))  # noqa: E731
            d["copies"] = {"ours": [ours] + [tuple(t.clone() for t in ours) for _ in range(n(d["nbytes"]) - 1)],
                           "tinygemm": [tiny] + [tuple(t.clone() for t in tiny) for _ in range(n(d["nbytes"]) - 1)],
                           "bf16": [wbf] + [wbf.clone() for _ in range(n(2 * N * K) - 1)]}
            data[sname] = d
        print(f"\n######## G={G}: weights ready ({time.time() - t_start:.0f} s)", flush=True)
        best[G] = {}
        for vname in [v for v in BASELINES if v in names]:
            cand = {}
            ok, line = measure(G, vname, {}, data, cand, reps=10)
            best[G][vname] = {s: dict(cfg={}, us=t * 1e6, gb_s=data[s]["nbytes"] / t / 1e9, err=e)
                              for s, (t, c, e) in cand.items()}
            print(f"   {vname:8s} " + " | ".join(line), flush=True)
        units = [(g, v) for g in gsizes[gi:] for v in kern]
        for vname in kern:
            if broken:
                break
            grid = grids[G, vname]
            t_var = time.time()
            share = (deadline - 5 - t_var) * len(grid) / sum(len(grids[u]) for u in units)
            units = units[1:]
            v_deadline = t_var + max(10.0, share)
            print(f"\n== G={G} {vname}: {len(grid)} configs (time share {max(10.0, share):.0f} s)", flush=True)
            cand = {}
            for ci, c in enumerate(grid):
                if time.time() > min(v_deadline, deadline - 5):
                    print(f"   time budget: skipped the last {len(grid) - ci} configs", flush=True)
                    break
                fut = futures.get((vname, G, cfg_str(c)))
                if fut is not None:  # wait for its precompile (a failure shows again, from here)
                    try:
                        fut.result(timeout=max(1.0, min(v_deadline, deadline - 5) - time.time()))
                    except Exception:
                        pass  # pool broken or slow: compile here
                ok, line = measure(G, vname, c, data, cand)
                print(f"   [{ci + 1:2d}] {cfg_str(c):44s} " + " | ".join(line), flush=True)
                if not ok:
                    broken = True
                    break
            best[G][vname] = {}
            for sname, (t, c, err) in ({} if broken else cand).items():  # re-time each shape's best, 10 replays
                d = data[sname]
                copies = d["copies"]["ours"]
                t = time_calls([lambda w=w, d=d: VARIANTS[vname](d, w, c) for w in copies], reps=10)
                best[G][vname][sname] = dict(cfg=c, us=t * 1e6, gb_s=d["nbytes"] / t / 1e9, err=err)
            print(f"   ({time.time() - t_var:.0f} s)", flush=True)
            save()
        summary(G, data, best[G], names, ceiling)
        del data
        torch.cuda.empty_cache()
    save()
    print(f"\ntotal {time.time() - t_start:.0f} s" + (f"; JSON in {a.json}" if a.json else ""), flush=True)
    return 0


def summary(G, data, best, names, ceiling):
    print(f"\nSummary G={G} (best config per shape, 10 replays; GB/s on int4 bytes N K / 2 + 4 N K / G; "
          f"copy ceiling {ceiling:.0f} GB/s)", flush=True)
    for sname, d in data.items():
        tg, bf = (best.get(v, {}).get(sname) for v in BASELINES)
        print(f"\n{sname} {d['N']}x{d['K']}:  tinygemm {tg['us'] if tg else float('nan'):6.1f} us   "
              f"bf16 {bf['us'] if bf else float('nan'):6.1f} us", flush=True)
        for vname in names:
            b = best.get(vname, {}).get(sname)
            if b is None:
                print(f"  {vname:8s} (no result)", flush=True)
                continue
            vs = ((f"x{tg['us'] / b['us']:.2f} tinygemm " if tg else "")
                  + (f"x{bf['us'] / b['us']:.2f} bf16" if bf else ""))
            print(f"  {vname:8s} {b['us']:7.1f} us {b['gb_s']:6.0f} GB/s  {vs:26s} err {b['err']:.0e}  "
                  f"{cfg_str(b['cfg'])}", flush=True)
    print(f"\nPer layer G={G} (sum of best us over wqkv, wo, w13, w2; target: bf16 / 2.6):", flush=True)
    lay = {v: sum(best[v][s]["us"] for s in LAYER) for v in best if all(s in best[v] for s in LAYER)}
    for vname in names:
        if vname not in lay:
            print(f"  {vname:8s} incomplete", flush=True)
            continue
        nb = sum(data[s]["nbytes"] for s in LAYER)
        vs = (f"x{lay['tinygemm'] / lay[vname]:.2f} tinygemm " if "tinygemm" in lay else "") + \
             (f"x{lay['bf16'] / lay[vname]:.2f} bf16" if "bf16" in lay else "")
        print(f"  {vname:8s} {lay[vname]:7.1f} us {nb / lay[vname] / 1e3:6.0f} GB/s  {vs}", flush=True)
    mix = {s: min(((b[s]["us"], v) for v, b in best.items() if s in b and v != "bf16"), default=None) for s in LAYER}
    if all(mix.values()):
        print(f"  {'best-of':8s} {sum(m[0] for m in mix.values()):7.1f} us  ("
              + ", ".join(f"{s}: {m[1]}" for s, m in mix.items()) + ")", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groupsizes", default="32,128")
    p.add_argument("--variants", help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--shapes", help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--quick", action="store_true", help="2 configs per variant and group size (smoke test)")
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="wall-clock budget from the start for everything (setup, compiles, timing), shared out "
                        "over group sizes and variants in order; a variant past its share skips its last configs")
    p.add_argument("--interpret-check", action="store_true",
                   help="with TRITON_INTERPRET=1: correctness of every variant's plain-op form on the CPU")
    default_json = Path(os.environ["OUT"]) / "int4_variants.json" if os.environ.get("OUT") else None
    p.add_argument("--json", type=Path, default=default_json)
    a = p.parse_args()
    if a.interpret_check:
        return interpret_check()
    return gpu_run(a)


if __name__ == "__main__":
    sys.exit(main())
