"""How fast the one-row int4 GEMV's loads alone stream, and its arithmetic without x's work, against the kernel
itself (session 10's open question:
cuda_kernels.int4_gemv reads its weights at ~2.75 TB/s once running, where the int8 and bf16 GEMVs reach the copy
ceiling; BENCHMARKS.md). A probe kernel loads exactly what _int4_gemv_kernel loads, at its launch (rows a
program, groups a step, warps, PDL; not its PREFETCH), and folds the words together with one xor each instead of
multiplying (gate/up: 2 BLOCK_N contiguous rows a program, where the kernel reads BLOCK_N rows of each half):

  words      the int4 words [BLOCK_N, BLOCK_G, G/8] only
  words+sz   and the scale-and-zero words [BLOCK_N, BLOCK_G], the kernel's second stream
  flat       words+sz with the words as a 2D tile [BLOCK_N, BLOCK_G G/8] (int8's tile rank)
  one        words+sz from one stream: a layout (not the kernel's) holding each 4 groups' 16 words and
             then their 4 scale-and-zero words, 80 contiguous bytes (group 32 only)
  math       the words times constant x bytes in the kernel's integer arithmetic (cuda_kernels._dp4a, each group's
             float32 sum) with s = z = 1: the arithmetic without the scale-and-zero stream or any work on x
  math+sz    and the scale-and-zero words loaded and applied, as the kernel does: the kernel less x's work
  math+szT   the same with the scale-and-zero words stored group-major ([K/G, N]: a group's rows side by side)
  +xq        the same with x already in int8 (its words and each group's numbers loaded in the word tile's
             layout, as int4_gemv(xq=...) of commit 28d8611 did, but no 1D loads)
             Offline (sm_90 SASS, Triton 3.6) the loop has no barrier in math, math+szT and math+szT+xq, and
             2-4 in math+sz, whose per-group sums move to the scale-and-zero tile's layout through shared
             memory; the kernel has 10-14 (x's quantization too)
  kernel     cuda_kernels.int4_gemv itself (integers; the residual form, gate/up with SwiGLU; x times ones)

Read in order (words, words+sz, math, math+sz, kernel), each step adds one part of the kernel's work: the
first that falls well below the copy ceiling names what holds the kernel back. Run 43 (session 11): the
first, words in the 3D tile, at 1.4-2.7 TB/s against flat's 2.7-4.1: the 3D load put a warp's threads on
32 rows. cuda_kernels._int4_load has loaded the 2D tile since, so the math forms and the kernel, which call it,
do too (BENCHMARKS.md, session 11). GB/s counts the bytes each variant reads. Timed as CUDA graph replays over
>= 1 GiB of weight copies (benchmarks/gemv.py's time_calls); the probe's result is checked against torch.

    python benchmarks/int4_stream.py --model llama-2-7b [--warps 4,8] [--json PATH]
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuda_kernels  # noqa: E402
from bench import PRESETS, copy_bandwidth  # noqa: E402
from benchmarks.gemv import L2_MULTIPLE_BYTES, shapes, time_calls  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _probe_block(acc, acc_sz, w_ptr, sz_ptr, rows, b, n_groups, G: tl.constexpr, BLOCK_G: tl.constexpr,
                 SZ: tl.constexpr, FLAT: tl.constexpr, MASKED: tl.constexpr):
    """Block b's words (and scale-and-zero words) xor-ed into acc (acc_sz), addressed as _int4_load does."""
    W: tl.constexpr = G // 8
    groups = b * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = groups < n_groups
    if FLAT:
        cols = b * (BLOCK_G * W) + tl.arange(0, BLOCK_G * W)
        at = w_ptr + rows[:, None] * (n_groups * W) + cols[None, :]
        w = tl.load(at, mask=(cols < n_groups * W)[None, :], other=0) if MASKED else tl.load(at)
    else:
        at = w_ptr + rows[:, None, None] * (n_groups * W) + (groups * W)[None, :, None] + tl.arange(0, W)[None, None, :]
        w = tl.load(at, mask=ok[None, :, None], other=0) if MASKED else tl.load(at)
    acc ^= w
    if SZ:
        at = sz_ptr + rows[:, None] * n_groups + groups[None, :]
        acc_sz ^= tl.load(at, mask=ok[None, :], other=0) if MASKED else tl.load(at)
    return acc, acc_sz


@triton.jit
def _probe_one_block(acc, acc_sz, w_ptr, rows, b, n_groups, BLOCK_G: tl.constexpr, MASKED: tl.constexpr):
    """Block b of the one-stream layout (words [N, n_groups / 4, 20]: 16 words, then 4 scale-and-zero words,
    per 4 groups of 32) xor-ed into acc [BN, BLOCK_G / 4, 16] and acc_sz [BN, BLOCK_G / 4, 4]."""
    quads = b * (BLOCK_G // 4) + tl.arange(0, BLOCK_G // 4)
    at = w_ptr + rows[:, None, None] * (n_groups * 5) + (quads * 20)[None, :, None]
    w_at, sz_at = at + tl.arange(0, 16)[None, None, :], at + 16 + tl.arange(0, 4)[None, None, :]
    if MASKED:
        ok = (quads < n_groups // 4)[None, :, None]
        acc ^= tl.load(w_at, mask=ok, other=0)
        acc_sz ^= tl.load(sz_at, mask=ok, other=0)
    else:
        acc ^= tl.load(w_at)
        acc_sz ^= tl.load(sz_at)
    return acc, acc_sz


@triton.jit
def _probe_one(w_ptr, y_ptr, N, n_groups, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """_probe's words+sz over the one-stream layout (group 32)."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1)
    acc = tl.zeros((BLOCK_N, BLOCK_G // 4, 16), tl.int32)
    acc_sz = tl.zeros((BLOCK_N, BLOCK_G // 4, 4), tl.int32)
    acc, acc_sz = _probe_one_block(acc, acc_sz, w_ptr, rows, 0, n_groups, BLOCK_G, True)
    if PDL:
        tl.extra.cuda.gdc_wait()
    full = n_groups // BLOCK_G
    for b in range(1, full):
        acc, acc_sz = _probe_one_block(acc, acc_sz, w_ptr, rows, b, n_groups, BLOCK_G, False)
    if (full * BLOCK_G < n_groups) & (full > 0):
        acc, acc_sz = _probe_one_block(acc, acc_sz, w_ptr, rows, full, n_groups, BLOCK_G, True)
    folded = tl.xor_sum(tl.xor_sum(acc, axis=2), axis=1) ^ tl.xor_sum(tl.xor_sum(acc_sz, axis=2), axis=1)
    tl.store(y_ptr + rn, folded, mask=rn < N)


X_BYTES = tl.constexpr(0x01010101)  # (math without XQ: every x byte 1, so each word's dot is the sum of its nibbles)


@triton.jit
def _probe_math_block(acc, w_ptr, sz_ptr, xw_ptr, xs_ptr, rows, b, N, n_groups, G: tl.constexpr,
                      BLOCK_G: tl.constexpr, SZ: tl.constexpr, XQ: tl.constexpr, MASKED: tl.constexpr,
                      EMULATE: tl.constexpr):
    """Block b of _probe_math: acc [BN, BLOCK_G] += s (sx dot - bq) + z sum(x) per group of G = 32, in the
    kernel's integer arithmetic. SZ 0: s = z = 1; 1: the scale-and-zero words [N, n_groups] loaded as the kernel
    loads them; 2: stored group-major, [n_groups, N] (a group's rows side by side). XQ: x in int8 already,
    its words [K/4] and each group's (sx, bq, sum(x)) in planes [3, n_groups], loaded in the word tile's layout
    (rows of stride 0); else every x byte 1 (sx 1, bq 8 G, sum(x) G)."""
    w, sz = cuda_kernels._int4_load(w_ptr, sz_ptr, rows, b, n_groups, G, BLOCK_G, MASKED, True)
    groups = b * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = groups < n_groups
    if SZ == 2:
        at = sz_ptr + groups[None, :] * N + rows[:, None]
        sz = tl.load(at, mask=ok[None, :], other=0) if MASKED else tl.load(at)
    if XQ:
        g = tl.minimum(groups, n_groups - 1)  # (past the last group: the weights are masked to 0)
        words = xw_ptr + (g * (G // 4))[None, :, None] + 2 * tl.arange(0, G // 8)[None, None, :] + 0 * rows[:, None, None]
        x_lo, x_hi = tl.load(words), tl.load(words + 1)
        at = xs_ptr + g[None, :] + 0 * rows[:, None]
        sx, bq, x_sum = tl.load(at), tl.load(at + n_groups), tl.load(at + 2 * n_groups)
    else:
        x_lo = tl.zeros_like(w) + X_BYTES
        x_hi = x_lo
        sx, bq, x_sum = 1.0, 8.0 * G, 1.0 * G
    dot = cuda_kernels._dp4a((w >> 4) & 0x0F0F0F0F, x_hi, cuda_kernels._dp4a(w & 0x0F0F0F0F, x_lo, tl.zeros_like(w), EMULATE),
                        EMULATE)
    d = tl.sum(dot, axis=2).to(tl.float32) * sx - bq
    if SZ != 0:
        s, z = cuda_kernels._f16_pair(sz)
        part = d * s + z * x_sum
    else:
        part = d + x_sum
    if MASKED:  # (groups past the last add nothing, as their zeroed scale and zero make the kernel's add nothing)
        part = tl.where(ok[None, :], part, 0.0)
    return acc + part


@triton.jit
def _probe_math(w_ptr, sz_ptr, xw_ptr, xs_ptr, y_ptr, N, n_groups, G: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_G: tl.constexpr, SZ: tl.constexpr, XQ: tl.constexpr, PDL: tl.constexpr, EMULATE: tl.constexpr):
    """Per row, the sum over groups of _probe_math_block's terms, blocks as _int4_gemv_kernel's."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1)
    acc = tl.zeros((BLOCK_N, BLOCK_G), tl.float32)
    acc = _probe_math_block(acc, w_ptr, sz_ptr, xw_ptr, xs_ptr, rows, 0, N, n_groups, G, BLOCK_G, SZ, XQ, True, EMULATE)
    if PDL:
        tl.extra.cuda.gdc_wait()
    full = n_groups // BLOCK_G
    for b in range(1, full):
        acc = _probe_math_block(acc, w_ptr, sz_ptr, xw_ptr, xs_ptr, rows, b, N, n_groups, G, BLOCK_G, SZ, XQ, False,
                                EMULATE)
    if (full * BLOCK_G < n_groups) & (full > 0):
        acc = _probe_math_block(acc, w_ptr, sz_ptr, xw_ptr, xs_ptr, rows, full, N, n_groups, G, BLOCK_G, SZ, XQ, True,
                                EMULATE)
    tl.store(y_ptr + rn, tl.sum(acc, axis=1), mask=rn < N)


def probe_math(w, sz, G, launch, sz_form, xq=None):
    """_probe_math over words w [N, K/8] and scale-and-zero words sz [N, K/G] (sz_form 2: pass them
    group-major, sz.T.contiguous()); xq: (x words [K/4], stats [3, K/G]) or None."""
    N, n_groups = w.shape[0], w.shape[1] * 8 // G
    y = torch.empty(N, device=w.device, dtype=torch.float32)
    use_pdl = cuda_kernels.pdl(w)
    xw, xs = xq if xq is not None else (w, w)
    _probe_math[(triton.cdiv(N, launch[0]),)](w, sz, xw, xs, y, N, n_groups, G=G, BLOCK_N=launch[0],
                                              BLOCK_G=launch[1], SZ=sz_form, XQ=xq is not None, PDL=use_pdl,
                                              EMULATE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=launch[2],
                                              **({"launch_pdl": True} if use_pdl else {}))
    return y


def expected_math(w, sz, G, sz_form, xq=None):
    """What _probe_math computes, by torch in float64 (sz [N, K/G] row-major whatever the form)."""
    N, words = w.shape
    n_groups = words * 8 // G
    w = w.long() & 0xFFFFFFFF
    lo = torch.stack([(w >> (8 * i)) & 15 for i in range(4)], -1)  # [N, words, 4]: columns 8j + i
    hi = torch.stack([(w >> (8 * i + 4)) & 15 for i in range(4)], -1)  # columns 8j + 4 + i
    if xq is None:
        dot = (lo.sum(-1) + hi.sum(-1)).double()
        sx, bq, x_sum = 1.0, 8.0 * G, 1.0 * G
    else:
        xb = xq[0].view(torch.int8).long().view(words, 2, 4)  # word 2j: columns 8j..8j+3, 2j + 1: 8j+4..8j+7
        dot = ((lo * xb[:, 0]).sum(-1) + (hi * xb[:, 1]).sum(-1)).double()
        sx, bq, x_sum = (xq[1][i].double() for i in range(3))
    d = dot.view(N, n_groups, G // 8).sum(-1) * sx - bq
    if sz_form == 0:
        return (d + x_sum).sum(1)
    s = (sz & 0xFFFF).short().view(torch.float16).double()
    z = (sz >> 16).short().view(torch.float16).double()
    return (d * s + z * x_sum).sum(1)


def x_int8(K, G, device):
    """Random x in the XQ form: int32 words of int8 bytes [K/4] and each group's (sx, bq, sum(x)) [3, K/G]."""
    xw = torch.randint(-2**31, 2**31 - 1, (K // 4,), device=device, dtype=torch.int32)
    q = xw.view(torch.int8).float().view(-1, G)
    sx = torch.rand(K // G, device=device) / 100
    return xw, torch.stack([sx, 8 * sx * q.sum(1), q.sum(1) * sx])


def half_pairs(N, n_groups, device):
    """Scale-and-zero words with finite float16 halves in [-1, 1] (random int32 words would hold NaNs)."""
    h = (torch.rand(N, n_groups, 2, device=device) * 2 - 1).half().view(torch.int16).int() & 0xFFFF
    return h[..., 0] | (h[..., 1] << 16)


def one_stream(w, sz):
    """The kernel's words [N, K/8] and scale-and-zero words [N, K/32] -> the one-stream layout [N, K/32/4, 20]."""
    N, n_groups = sz.shape
    return torch.cat([w.view(N, n_groups // 4, 16), sz.view(N, n_groups // 4, 4)], dim=2).contiguous()


def probe_one(wsz, N, n_groups, launch):
    y = torch.empty(N, device=wsz.device, dtype=torch.int32)
    use_pdl = cuda_kernels.pdl(wsz)
    _probe_one[(triton.cdiv(N, launch[0]),)](wsz, y, N, n_groups, BLOCK_N=launch[0], BLOCK_G=launch[1], PDL=use_pdl,
                                             num_warps=launch[2], **({"launch_pdl": True} if use_pdl else {}))
    return y


@triton.jit
def _probe(w_ptr, sz_ptr, y_ptr, N, n_groups, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
           SZ: tl.constexpr, FLAT: tl.constexpr, PDL: tl.constexpr):
    """Per row, the xor of all its int4 words (and SZ: scale-and-zero words), loaded as _int4_gemv_kernel
    loads them: block 0 before the PDL wait, the full blocks unmasked, the last partial block masked."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1)
    if FLAT:
        acc = tl.zeros((BLOCK_N, BLOCK_G * (G // 8)), tl.int32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_G, G // 8), tl.int32)
    acc_sz = tl.zeros((BLOCK_N, BLOCK_G), tl.int32)
    acc, acc_sz = _probe_block(acc, acc_sz, w_ptr, sz_ptr, rows, 0, n_groups, G, BLOCK_G, SZ, FLAT, True)
    if PDL:
        tl.extra.cuda.gdc_wait()
    full = n_groups // BLOCK_G
    for b in range(1, full):
        acc, acc_sz = _probe_block(acc, acc_sz, w_ptr, sz_ptr, rows, b, n_groups, G, BLOCK_G, SZ, FLAT, False)
    if (full * BLOCK_G < n_groups) & (full > 0):
        acc, acc_sz = _probe_block(acc, acc_sz, w_ptr, sz_ptr, rows, full, n_groups, G, BLOCK_G, SZ, FLAT, True)
    if FLAT:
        folded = tl.xor_sum(acc, axis=1)
    else:
        folded = tl.xor_sum(tl.xor_sum(acc, axis=2), axis=1)
    tl.store(y_ptr + rn, folded ^ tl.xor_sum(acc_sz, axis=1), mask=rn < N)


def probe(w, sz, G, launch, sz_stream, flat):
    N, n_groups = sz.shape
    block_n, block_g, warps = launch[0], launch[1], launch[2]
    y = torch.empty(N, device=w.device, dtype=torch.int32)
    use_pdl = cuda_kernels.pdl(w)
    _probe[(triton.cdiv(N, block_n),)](w, sz, y, N, n_groups, G=G, BLOCK_N=block_n, BLOCK_G=block_g, SZ=sz_stream,
                                       FLAT=flat, PDL=use_pdl, num_warps=warps,
                                       **({"launch_pdl": True} if use_pdl else {}))
    return y


def expected(w, sz, sz_stream):
    """What _probe computes, by torch: each row's words (and scale-and-zero words) xor-ed together."""
    out = torch.zeros(w.shape[0], dtype=torch.int64, device=w.device)
    for t in ([w, sz] if sz_stream else [w]):
        v = t.long() & 0xFFFFFFFF
        for i in range(v.shape[1]):
            out ^= v[:, i]
    return torch.where(out >= 2**31, out - 2**32, out).int()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-2-7b")
    p.add_argument("--groupsize", type=int, default=32)
    p.add_argument("--warps", default="", help="also try these warp counts (comma-separated) at each launch")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    dev = torch.device("cuda")
    ceiling = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy ceiling {ceiling:.0f} GB/s", flush=True)
    G, records = a.groupsize, []
    for name, (N, K) in shapes(PRESETS[a.model]).items():
        if name == "output":
            continue
        swiglu = name == "w13"
        torch.manual_seed(0)
        w = torch.randint(-2**31, 2**31 - 1, (N, K // 8), device=dev, dtype=torch.int32)
        sz = torch.randint(-2**31, 2**31 - 1, (N, K // G), device=dev, dtype=torch.int32)
        base = cuda_kernels.int4_config(N // 2 if swiglu else N, K, G, swiglu, True)
        # (gate/up: the kernel's programs read BLOCK_N rows of each half; the probe takes them as 2 BLOCK_N rows)
        launches = [base] + [(base[0], base[1], int(v)) + base[3:] for v in a.warps.split(",") if v and int(v) != base[2]]
        copies = max(2, -(-L2_MULTIPLE_BYTES // (w.numel() * 4 + sz.numel() * 4)))
        ws = [(w, sz)] + [(w.clone(), sz.clone()) for _ in range(copies - 1)]
        sz_half = half_pairs(N, K // G, dev)
        ws_half = [(c[0], c[1], sz_half.clone(), sz_half.T.contiguous()) for c in ws]  # (+ group-major)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        r = torch.randn(1, N // 2 if swiglu else N, device=dev, dtype=torch.bfloat16)
        ones = torch.ones(K, device=dev, dtype=torch.bfloat16)
        for launch in launches:
            plaunch = (2 * launch[0], *launch[1:]) if swiglu else launch
            row = {"layer": name, "N": N, "K": K, "G": G, "launch": list(plaunch), "ceiling_gb_s": ceiling}
            for variant, sz_stream, flat in (("words", False, False), ("words+sz", True, False), ("flat", True, True)):
                got = probe(w, sz, G, plaunch, sz_stream, flat)
                ok = bool(got.equal(expected(w, sz, sz_stream)))
                t = time_calls([lambda c=c: probe(*c, G, plaunch, sz_stream, flat) for c in ws])
                nbytes = w.numel() * 4 + (sz.numel() * 4 if sz_stream else 0)
                row[variant] = {"us": t * 1e6, "gb_s": nbytes / t / 1e9, "matches_torch": ok}
            if G == 32 and (K // G) % 4 == 0 and plaunch[1] % 4 == 0:
                ones_ = [one_stream(*c) for c in ws]
                n_groups = K // G
                ok = bool(probe_one(ones_[0], N, n_groups, plaunch).equal(expected(w, sz, True)))
                t = time_calls([lambda c=c: probe_one(c, N, n_groups, plaunch) for c in ones_])
                row["one"] = {"us": t * 1e6, "gb_s": (w.numel() + sz.numel()) * 4 / t / 1e9, "matches_torch": ok}
                del ones_
            xq = x_int8(K, G, dev)
            for variant, sz_form, with_x in (("math", 0, False), ("math+sz", 1, False), ("math+szT", 2, False),
                                             ("math+sz+xq", 1, True), ("math+szT+xq", 2, True)):
                if G != 32 and (with_x or sz_form == 2):
                    continue
                c_sz = (lambda c: c[3]) if sz_form == 2 else (lambda c: c[2])
                got = probe_math(w, c_sz(ws_half[0]), G, plaunch, sz_form, xq if with_x else None)
                ref = expected_math(w, sz_half, G, sz_form, xq if with_x else None)
                ok = bool(((got.double() - ref).abs() <= 1e-4 * ref.abs().max()).all())
                t = time_calls([lambda c=c: probe_math(c[0], c_sz(c), G, plaunch, sz_form, xq if with_x else None)
                                for c in ws_half])
                nbytes = w.numel() * 4 + (sz.numel() * 4 if sz_form else 0)
                row[variant] = {"us": t * 1e6, "gb_s": nbytes / t / 1e9, "matches_torch": ok}
            # the kernel itself at this launch, in integers: the residual form (gate/up: SwiGLU), x times ones
            fused = dict(swiglu=True) if swiglu else dict(residual=r)
            t = time_calls([lambda c=c: cuda_kernels.int4_gemv(x, c[0], c[2], 1.0, G, **fused, ones=ones, dp4a=True,
                                                          launch=launch) for c in ws_half])
            row["kernel"] = {"us": t * 1e6, "gb_s": (w.numel() + sz.numel()) * 4 / t / 1e9}
            records.append(row)
            print(f"{name:5s} {N:6d}x{K:<6d} launch {plaunch}: " + "  ".join(
                f"{v} {row[v]['us']:6.1f} us {row[v]['gb_s']:5.0f} GB/s" + ("" if row[v].get("matches_torch", True)
                                                                             else " MISMATCH")
                for v in ("words", "words+sz", "flat", "one", "math", "math+sz", "math+szT", "math+sz+xq",
                          "math+szT+xq", "kernel") if v in row), flush=True)
            if a.json:
                a.json.write_text(json.dumps(records, indent=1))
        del ws


if __name__ == "__main__":
    main()
