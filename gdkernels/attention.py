"""Decode attention on CUDA: RoPE, the cache write and the attention of one new token per sequence
in one Triton kernel.

Done with PyTorch ops this is ~7 small kernels a layer (RoPE of q and k, the two cache writes, the
scores, the softmax, the weighted sum of V), each 1-4 µs of mostly launch latency on the H200. Here
each program takes one KV head of one sequence, with its group of query heads (padded to 16 rows for
the tensor cores, which do the products), and a slice of the cache ("flash decoding"). The number of
slices is fixed per launch (so it replays in a graph); their length is set from `pos` on the device,
so every slice shares the work however long the cache (one that starts beyond `pos` reads nothing).
Each program:
  - loads its first block of cached K and V at once, then RoPE's q and the new k (rotate-half, in
    float32, rounded to the cache dtype like the PyTorch path);
  - attends to the positions < pos of its slice, BLOCK_L at a time, with an online softmax (base 2),
    and in slice 0 to the new token from registers; then slice 0 writes the new k and v into the
    cache at pos (after the reads: no program reads a row written in this launch);
  - one slice: writes the normalised output. Several: writes its max, sum and unnormalised output;
    the last slice of a sequence and KV head to finish (an atomic count) merges them.
"""
import math

import torch

from .gemv import pdl, triton

if triton is not None:
    import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 16  # the merge holds [heads of a group, slices, head_dim] partial results in registers
SLICED_PROGRAMS = 4096  # splits_for's aim
BLOCK_L, WARPS = 32, 4  # cache positions a loop step, and warps: the best or within 6% of it at every size measured

if triton is not None:

    @triton.jit
    def _attend(q, k, v, ok, m, l, acc, qk_scale):
        """Online softmax over one block of positions, on tensor cores: scores of q [G, D] (G >= 16,
        padded) against k [L, D] (base 2), where ok; (m, l, acc) the running max, sum of weights and
        weighted sum of v (the weights rounded to the cache dtype for it, as in flash attention; a float32
        cache's products in TF32, Triton's default)."""
        scores = tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * qk_scale, -float("inf"))  # [G, L]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing seen yet: weights stay 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)

    @triton.jit
    def _attention_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, y_ptr, m_ptr, l_ptr, acc_ptr,
                          count_ptr, pos_stride, qkv_stride, cache_stride_b, cache_stride_h, L, qk_scale,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_S: tl.constexpr, PDL: tl.constexpr):
        b, hkv, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PDL:  # as in gemv.py: the next kernel may start once all programs here have
            tl.extra.cuda.gdc_launch_dependents()
        G: tl.constexpr = H // HKV
        HALF: tl.constexpr = D // 2
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < D
        cache = b * cache_stride_b + hkv * cache_stride_h
        pos = tl.load(pos_ptr + b * pos_stride).to(tl.int32)  # (stride 0: one position for the batch)
        inside = (rd * 0 + pos) < L  # callers keep pos < L; if not, nothing is read or written past the cache
        # Slices sized from pos, so that the work is spread over all of them however long the cache
        chunk = tl.cdiv(tl.cdiv(pos + 1, SPLITS), BLOCK_L) * BLOCK_L
        start = s * chunk
        end = tl.minimum(tl.minimum(start + chunk, pos), L)  # cached positions < pos of this slice
        # The slice's first block of K and V, loaded before anything waits on the RoPE tables
        rl = start + tl.arange(0, BLOCK_L)
        l_ok = rl < end
        kv_at = cache + rl[:, None] * D + rd[None, :]
        k0 = tl.load(kc_ptr + kv_at, mask=l_ok[:, None] & d_ok[None, :], other=0)
        v0 = tl.load(vc_ptr + kv_at, mask=l_ok[:, None] & d_ok[None, :], other=0)
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
        q = q.to(kc_ptr.dtype.element_ty)
        k_at = row + H * D + hkv * D
        k_new = tl.load(k_at + rd, mask=d_ok, other=0).to(tl.float32) * cos \
            + tl.load(k_at + rd_rot, mask=d_ok, other=0).to(tl.float32) * sin
        k_new = k_new.to(kc_ptr.dtype.element_ty)
        v_new = tl.load(row + (H + HKV) * D + hkv * D + rd, mask=d_ok, other=0)
        # Attention over the slice's cached positions, then (slice 0) the new token's own
        m = tl.zeros((BLOCK_G,), tl.float32) - float("inf")
        l = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        m, l, acc = _attend(q, k0, v0, l_ok, m, l, acc, qk_scale)
        for off in range(start + BLOCK_L, end, BLOCK_L):
            rl = off + tl.arange(0, BLOCK_L)
            l_ok = rl < end
            kv_at = cache + rl[:, None] * D + rd[None, :]
            k = tl.load(kc_ptr + kv_at, mask=l_ok[:, None] & d_ok[None, :], other=0)
            v = tl.load(vc_ptr + kv_at, mask=l_ok[:, None] & d_ok[None, :], other=0)
            m, l, acc = _attend(q, k, v, l_ok, m, l, acc, qk_scale)
        # The new token, in slice 0 only: one score a query head. (As a block of one position, through
        # _attend, this goes wrong on an H100 with 16 query rows: Triton 3.6.)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
        s_new = tl.where(rg * 0 + s == 0, s_new, -float("inf"))
        m_new = tl.maximum(m, s_new)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha, p_new = tl.exp2(m - m_safe), tl.exp2(s_new - m_safe)
        m, l = m_new, l * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        # Written after the reads above: no program reads position pos from the cache.
        write = d_ok & (rd * 0 + s == 0) & inside
        tl.store(kc_ptr + cache + pos * D + rd, k_new, mask=write)
        tl.store(vc_ptr + cache + pos * D + rd, v_new, mask=write)
        y_at = y_ptr + (b * H + heads[:, None]) * D + rd[None, :]
        if SPLITS == 1:
            tl.store(y_at, (acc / l[:, None]).to(y_ptr.dtype.element_ty), mask=qd_ok)
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
                tl.atomic_xchg(count_ptr + b * HKV + hkv, 0)


def usable(qkv: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether decode_attention runs this step: on CUDA with Triton, one position for the batch or one a row."""
    return triton is not None and qkv.is_cuda and one_or_per_row(pos, qkv.shape[0])


def one_or_per_row(pos: torch.Tensor, B: int) -> bool:
    """pos holds one position, or one a row along its first dimension ([B] or [B, 1])."""
    return pos.numel() == 1 or pos.shape[0] == pos.numel() == B


def splits_for(batch: int, n_kv_heads: int, length: int) -> int:
    """Slices of the cache: up to SLICED_PROGRAMS programs, at most MAX_SPLITS, and no more than a cache of
    128 positions a slice would need (32 for at most 16 sequence x KV-head pairs, which leave most SMs idle
    otherwise). The best of a grid (benchmarks/records/attention-tensor-cores.json), 1,024-position cache, rows at
    16-1,000: Llama-2-7B's heads at batch 64 2 slices (191 µs against 201 at 4), batch 8 8 (37 against 49 at 16),
    batch 1 8; Llama-3.1-8B's at batch 64 8 (69 against 96 at 16), batch 1 16 (H100)."""
    per_slice = 32 if batch * n_kv_heads <= 16 else 128
    return max(1, min(triton.cdiv(length, per_slice), SLICED_PROGRAMS // (batch * n_kv_heads), MAX_SPLITS))


def decode_attention(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, counts: torch.Tensor, n_heads: int,
                     n_kv_heads: int, splits: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence, with its RoPE and cache write:
    qkv [B, 1, (H + 2 Hkv) D] (q, k, v of the new token, before RoPE), pos [1] its position (or [B, 1],
    each row its own: the serving engine's),
    cos and sin [L, D] the RoPE tables, caches [>= B, Hkv, L, D] (written at pos), counts int32
    [>= B Hkv] of zeros (the slices' finishing count; left at zero)
    -> y [B, 1, H D], the attention output over positions 0..pos, heads side by side.
    pos must be < L; the kernel reads and writes nothing outside the cache if it is not.
    splits: slices of the cache (splits_for's by default)."""
    B, S, width = qkv.shape
    _, Hkv, L, D = k_cache.shape
    if S != 1 or width != (n_heads + 2 * n_kv_heads) * D or qkv.stride(-1) != 1:
        raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} is not one token of {n_heads}+2x{n_kv_heads} heads of {D}")
    if not all(t.is_contiguous() for t in (k_cache, v_cache, cos, sin)) or cos.shape[-1] != D:
        raise ValueError("decode_attention: the caches and RoPE tables must be contiguous, D wide")
    if not one_or_per_row(pos, B):
        raise ValueError(f"decode_attention: pos {tuple(pos.shape)} is neither one position nor one a row of {B}")
    if counts.dtype != torch.int32 or counts.numel() < B * Hkv:
        raise ValueError(f"decode_attention: counts must be int32 with at least {B * Hkv} entries")
    splits = splits or splits_for(B, Hkv, L)
    y = qkv.new_empty((B, 1, n_heads * D))
    if splits == 1:
        m = l = acc = y  # (unused)
    else:
        m = torch.empty((B, n_heads, splits), device=qkv.device, dtype=torch.float32)
        l = torch.empty_like(m)
        acc = torch.empty((B, n_heads, splits, D), device=qkv.device, dtype=torch.float32)
    use_pdl = pdl(qkv)
    _attention_kernel[(B, Hkv, splits)](
        qkv, pos, cos, sin, k_cache, v_cache, y, m, l, acc, counts, 0 if pos.numel() == 1 else pos.stride(0),
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), L, LOG2E / math.sqrt(D), H=n_heads, HKV=Hkv, D=D,
        SPLITS=splits, BLOCK_G=max(16, triton.next_power_of_2(n_heads // n_kv_heads)),  # (16: tl.dot's least)
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_L=BLOCK_L, BLOCK_S=triton.next_power_of_2(splits), PDL=use_pdl,
        num_warps=WARPS, **({"launch_pdl": True} if use_pdl else {}))
    return y


# (No mutated argument has a default: torch 2.11 drops the trailing arguments of an op call that
# equal their defaults before it bumps the versions of the mutated arguments by position.)
@torch.library.custom_op("graphdecode::decode_attention", mutates_args=("k_cache", "v_cache", "counts"))
def attention(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, counts: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """decode_attention as the custom op graphdecode::decode_attention (opaque to torch.compile)."""
    return decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, n_heads, n_kv_heads)


@attention.register_fake
def _(qkv, pos, cos, sin, k_cache, v_cache, counts, n_heads, n_kv_heads):
    return qkv.new_empty((qkv.shape[0], 1, n_heads * k_cache.shape[-1]))
