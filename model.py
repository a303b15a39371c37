"""A Llama-family transformer with a static KV cache, written to be compiled and CUDA-graphed.

Read top to bottom: ModelArgs (the config), Transformer (embedding, layers, head, caches,
checkpoint loading), TransformerBlock, Attention (one-token decode on CUDA: one kernel of
cuda_kernels.py), KVCache, FeedForward, RMSNorm, Linear (a matmul that also applies the norm before it,
SwiGLU, and the residual add after it), RoPE helpers, then the quantized layers.

Shapes: B batch, S new tokens this call, L cache length (max_seq_length), H query heads,
Hkv key/value heads, D head_dim. Q and K weight rows use the Hugging Face "rotate-half" layout,
so Hugging Face checkpoints need no permutation (GGUF files do: see convert_gguf.py).
"""
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_kernels
import cuda_kernels

try:  # Gluon (Triton 3.6 or newer): the int4 GEMV of decode's int8 flow on Hopper (TransformerBlock.forward_int8)
    import int4_ring
except (ImportError, AttributeError):
    int4_ring = None


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    intermediate_size: int
    n_kv_heads: int | None = None  # None: multi-head attention (= n_heads)
    head_dim: int | None = None  # None: dim // n_heads (Qwen3 and some Mistrals set it apart)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3.1 style: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict | None = None
    max_seq_len: int = 4096  # the model's context length
    tie_embeddings: bool = False  # output head shares the token embedding (SmolLM2, Llama 3.2 1B/3B)
    attention_bias: bool = False  # bias on q, k, v (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (Qwen3)

    def __post_init__(self):
        # Derived fields are filled only when the checkpoint left them unset.
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) is not a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.rope_scaling is not None:
            missing = {"factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"} - set(self.rope_scaling)
            if missing:
                raise ValueError(f"rope_scaling lacks {sorted(missing)}")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # Embedding's own init, N(0, 1), but not on the meta device of from_checkpoint, where
        # normal_ would import PyTorch's reference ops first: 2 s of every CPU start.
        embedding = torch.empty(args.vocab_size, args.dim)
        if not embedding.is_meta:
            nn.init.normal_(embedding)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=embedding)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1
        self._register_load_state_dict_pre_hook(self._load_hook)

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        """Allocate the KV cache, RoPE table and key positions once; a call with a smaller or
        equal size keeps (and reuses) what is there."""
        if max_batch_size <= self.max_batch_size and max_seq_length <= self.max_seq_length:
            return
        if max_seq_length > self.args.max_seq_len:
            raise ValueError(f"max_seq_length {max_seq_length} exceeds the model's context "
                             f"of {self.args.max_seq_len} tokens")
        max_batch_size = max(max_batch_size, self.max_batch_size)
        max_seq_length = max(max_seq_length, self.max_seq_length)
        weight = self.tok_embeddings.weight
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, self.args.n_kv_heads, max_seq_length,
                                               self.args.head_dim, weight.dtype, weight.device)
        cos, sin = rope_table(self.args, max_seq_length, weight.device)
        self.register_buffer("rope_cos", cos.to(weight.dtype), persistent=False)  # [L, D]
        self.register_buffer("rope_sin", sin.to(weight.dtype), persistent=False)
        self.register_buffer("kv_pos", torch.arange(max_seq_length, device=weight.device), persistent=False)
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """idx [B, S] token ids at positions input_pos [S] -> logits [B, S, vocab].

        Writes the new keys and values into the cache at input_pos and attends to every cached
        position <= the query's. (input_pos of shape [B, S], per-sequence positions, flows through
        the same indexing; the cache update is the one place that needs a scatter for it.)"""
        if self.max_seq_length < 0:
            raise RuntimeError("call setup_caches() before forward()")
        x = self.tok_embeddings(idx)
        mask = self.kv_pos <= input_pos.unsqueeze(-1)  # [S, L]: True where a query may look
        xq = None  # int4 decode on Hopper: x in int8 too, from each layer to the next (TransformerBlock.forward_int8)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].attention_norm if i + 1 < len(self.layers) else None
            x, xq = layer(x, input_pos, self.rope_cos, self.rope_sin, mask, xq, next_norm)
        return self.output(x, norm=self.norm)  # = output(norm(x)): see Linear

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, path, device="cpu", dtype=torch.bfloat16) -> "Transformer":
        """Load a checkpoint directory written by convert_hf_checkpoint.py (or quantize.py).

        The model is built on the meta device (no memory, no random init), the weights are
        memory-mapped and each is cast and moved once, then assigned in place of the meta ones."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        config = read_config(path)
        if config.get("quantization"):  # int8/int4 layers in place of nn.Linear: see the end of this file
            cls = quantized_constructor(config["quantization"])
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{path}: no model.safetensors")
        with torch.device("meta"):
            model = cls(config["args"])
        try:
            state = load_file(weights)  # memory-mapped: nothing is read until used
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
        state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                 for k, v in state.items()}
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise ValueError(f"{weights}: weights do not match config.json: {str(e).splitlines()[1:3]}") from None
        if model.args.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared one
        return model.eval().requires_grad_(False)

    def _load_hook(self, state, prefix, *args):
        """Checkpoints hold q, k, v and gate, up separately (as every source does); fuse them
        here into one matrix each, so decode launches fewer, larger matmuls."""
        if self.args.tie_embeddings:
            state.pop(prefix + "output.weight", None)
            state[prefix + "output.weight"] = state[prefix + "tok_embeddings.weight"]
        for i in range(self.args.n_layers):
            p = f"{prefix}layers.{i}."
            for suffix in ("weight", "bias"):
                names = [f"{p}attention.{w}.{suffix}" for w in ("wq", "wk", "wv")]
                if all(n in state for n in names):
                    state[f"{p}attention.wqkv.{suffix}"] = torch.cat([state.pop(n) for n in names])
            names = [f"{p}feed_forward.{w}.weight" for w in ("w1", "w3")]
            if all(n in state for n in names):
                state[f"{p}feed_forward.w13.weight"] = torch.cat([state.pop(n) for n in names])


def read_config(path: Path) -> dict:
    """config.json of a checkpoint directory, with "args" parsed into ModelArgs."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json)")
    try:
        config = json.loads(file.read_text())
        config["args"] = ModelArgs.from_dict(config["model"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{file}: invalid checkpoint config ({e})") from None
    return config


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x, input_pos, rope_cos, rope_sin, mask, xq=None, next_norm=None):
        """-> (out, out in int8 for the next layer or None). h = x + attention(attention_norm(x)); out = h +
        feed_forward(ffn_norm(h)). The norm and the residual are handed to the first and the last matmul
        of each sublayer, so that decode on CUDA (up to 16 rows) does them inside its GEMVs (Linear).
        xq, next_norm: forward_int8's."""
        if self.int8_flow(x, input_pos):
            return self.forward_int8(x, xq, input_pos, rope_cos, rope_sin, next_norm)
        h = self.attention(x, input_pos, rope_cos, rope_sin, mask, norm=self.attention_norm, residual=x)
        return self.feed_forward(h, norm=self.ffn_norm, residual=h), None

    def int8_flow(self, x, input_pos) -> bool:
        """Whether this step runs forward_int8: one token on CUDA, every GEMV of the layer an Int4Linear
        that int4_ring.py runs (gemv_ring: group 32 with codes, sm_90), no bias, and the attention kernel
        writing wo's x in int8 groups of 16 (wo_x_group), with SwiGLU fused."""
        a, f = self.attention, self.feed_forward
        return (all(getattr(m, "gemv_ring", False) and m.bias is None for m in (a.wqkv, a.wo, f.w13, f.w2))
                and x.numel() == x.shape[-1] and FUSE_SWIGLU and cuda_kernels.attention_usable(x, input_pos)
                and a.wo_x_group(x) == int4_ring.XG)  # (gemv_ring first: False unless the ring is on)

    def forward_int8(self, x, xq, input_pos, rope_cos, rope_sin, next_norm):
        """forward for one token of int4 decode on Hopper, x handed from GEMV to GEMV in int8 as well as in
        bf16: each GEMV reads its x in int8 and writes its output in int8 too (int4_ring.py), times the next
        RMSNorm's weight (cuda_kernels.int4_quantize_x's layout, groups of 16); the attention kernel writes wo's
        x so, at 32 cache positions a loop step (int4_ring.ATTENTION_BLOCK_L: 8 warps at 146 registers a thread
        instead of 254 leave room on an SM for the ring's programs). The 7B int4 g32 step: 688.6-689.2 tok/s
        against 676.1-678.0 at the kernel's default 64 positions and 675.3-675.5 with cuda_kernels.int4_gemv
        throughout (BENCHMARKS.md, session 21). With one query head a KV head (Llama-2-7B) the attention is
        cuda_kernels._attention_one_kernel, which has its own launch (block_l is the grouped kernel's): 709.3-710.1
        tok/s (session 23).
        xq: x in int8 from the layer before (times attention_norm's weight), or None (the first layer: wqkv
        reads bf16 x, cuda_kernels.int4_gemv). next_norm: the next layer's attention_norm (None: the last layer,
        whose output the head reads in bf16)."""
        a, f = self.attention, self.feed_forward
        if xq is None:
            qkv = a.wqkv(x, norm=self.attention_norm)
        else:
            qkv, _ = a.wqkv.ring(x, xq, norm=self.attention_norm)
        y, yq = a.fused_attention(qkv, input_pos, rope_cos, rope_sin, out_group=int4_ring.XG,
                                  block_l=int4_ring.ATTENTION_BLOCK_L)
        h, hq = a.wo.ring(y, yq, residual=x, out_q=True, out_norm=self.ffn_norm)
        z, zq = f.w13.ring(h, hq, norm=self.ffn_norm, swiglu=True, out_q=True)
        return f.w2.ring(z, zq, residual=h, out_q=next_norm is not None, out_norm=next_norm)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_size, kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.wqkv = Linear(args.dim, q_size + 2 * kv_size, bias=args.attention_bias)
        self.wo = Linear(q_size, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.kv_cache: KVCache | None = None

    def forward(self, x, input_pos, rope_cos, rope_sin, mask, norm, residual):
        """residual + attention over norm(x). rope_cos, rope_sin: the RoPE tables [L, D]."""
        B, S, _ = x.shape
        qkv = self.wqkv(x, norm=norm)
        if S == 1 and FUSE_ATTENTION and cuda_kernels.attention_usable(qkv, input_pos) and not hasattr(self, "q_norm"):
            # Decode on CUDA: RoPE, the cache write and the attention below in one Triton kernel
            group = self.wo_x_group(qkv)
            if group:  # an int4 wo: the kernel also writes its output in int8, which wo reads
                y, yq = self.fused_attention(qkv, input_pos, rope_cos, rope_sin, out_group=group)
                return self.wo(y, residual=residual, xq=yq)
            return self.wo(self.fused_attention(qkv, input_pos, rope_cos, rope_sin), residual=residual)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        v = v.view(B, S, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos[input_pos], rope_sin[input_pos]  # [S, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H or Hkv, S, D]
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, Hkv, L, D]: the whole cache
        k, v, mask = k[:B], v[:B], mask.unsqueeze(-3)  # mask [1 or B, S, L]
        if S == 1:
            y = decode_attention(q, k, v, mask)
        else:  # prefill: grouped-query attention without repeating K and V (enable_gqa)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1), residual=residual)

    def fused_attention(self, qkv, input_pos, rope_cos, rope_sin, out_group=0, block_l=0):
        """cuda_kernels.attention over this layer's cache: y, or (y, y in int8 in groups of out_group); block_l:
        cache positions a loop step (0: the kernel's rule)."""
        cache = self.kv_cache
        return cuda_kernels.attention(qkv, input_pos, rope_cos, rope_sin, cache.k_cache, cache.v_cache, cache.counts,
                                 self.n_heads, self.n_kv_heads, out_group=out_group, block_l=block_l)

    def wo_x_group(self, x) -> int:
        """The group of the attention kernel's output in int8 for wo, for one token x of a batch of one
        (cuda_kernels.INT4_XQ: an int4 wo in integers without a bias, Int4Linear.x_group; the attention
        kernel, head_dim a power of two and a multiple of it), or 0: its output in bf16 only."""
        group = self.wo.x_group(x) if isinstance(self.wo, Int4Linear) and self.wo.bias is None else 0
        D = self.head_dim
        return (group if group and FUSE_ATTENTION and not hasattr(self, "q_norm")  # (x_group: one row)
                and D & (D - 1) == 0 and D % group == 0 else 0)


def decode_attention(q, k, v, mask):
    """Attention of one new token per sequence, q [B, H, 1, D], over the cache k, v [B, Hkv, L, D].

    The PyTorch twin of cuda_kernels.decode_attention, for where that kernel does not run (the CPU,
    per-sequence positions, bench.py --unfused-attention). Written as broadcast products and sums
    rather than SDPA: a fused attention kernel has only B*H rows of work for a single query, while
    Inductor turns these two reductions into kernels spread over the whole cache length, and
    groups of query heads share their K/V head without copying it."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    q = q.view(B, Hkv, H // Hkv, 1, D)  # query heads grouped under their KV head
    # float32 products and sums, as a fused attention kernel accumulates (Inductor fuses the casts)
    scores = (q.float() * k.unsqueeze(2).float()).sum(-1) / math.sqrt(D)  # [B, Hkv, G, L]
    keep = mask.reshape(-1, 1, 1, k.shape[2])  # mask [1, 1, L] or [B, 1, 1, L] -> [1 or B, 1, 1, L]
    scores = scores.masked_fill(~keep, -float("inf"))
    p = torch.softmax(scores, dim=-1)
    y = (p.unsqueeze(-1) * v.unsqueeze(2).float()).sum(-2)  # [B, Hkv, G, D]
    return y.to(q.dtype).view(B, H, 1, D)


class KVCache(nn.Module):
    """Static cache [max_batch, Hkv, max_seq, D], allocated once and written in place."""

    def __init__(self, max_batch_size, n_kv_heads, max_seq_length, head_dim, dtype, device):
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # cuda_kernels.decode_attention's count of finished cache slices per sequence and KV head
        self.register_buffer("counts", torch.zeros(max_batch_size * n_kv_heads, dtype=torch.int32, device=device),
                             persistent=False)

    def update(self, input_pos, k, v):
        # input_pos [S] (or [B, S] per sequence), k and v [B, Hkv, S, D]: rows B.. of a larger
        # cache are left alone.
        B = k.shape[0]
        if input_pos.dim() == 2:
            at = input_pos[:, None, :, None].expand_as(k)
            self.k_cache[:B].scatter_(2, at, k)
            self.v_cache[:B].scatter_(2, at, v)
        else:
            self.k_cache[:B].index_copy_(2, input_pos, k)
            self.v_cache[:B].index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class FeedForward(nn.Module):
    """SwiGLU, residual + w2(silu(x w1) * x w3) of x = norm(input), with w1 (gate) and w3 (up)
    fused into one matrix."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x, norm, residual):
        return self.w2(self.w13(x, norm=norm, swiglu=True), residual=residual)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 (as the reference does), scale in the model's dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


class Linear(nn.Linear):
    """nn.Linear that also does the steps around it in decode: forward(x, norm, residual, swiglu)
    is residual + linear(norm(x)) (either may be left out), with swiglu the SwiGLU of the product's
    two halves in between. Up to cuda_kernels.MAX_ROWS rows in bf16 on CUDA (decode, batched decode)
    run all of it as one Triton kernel of cuda_kernels.py, which also reads decode's narrow matrices
    10-25% faster than cuBLAS (BENCHMARKS.md); anything else runs PyTorch's ops."""

    def forward(self, x, norm=None, residual=None, swiglu=False):
        if x.dtype == torch.bfloat16 and cuda_kernels.usable(x, self.weight, max_rows=cuda_kernels.MAX_ROWS) and (
                self.bias is None or (residual is None and not swiglu)):
            y = decode_gemv(x, self.weight, None, norm, residual, swiglu)
            return y if self.bias is None else y + self.bias
        return unfused(lambda x: F.linear(x, self.weight, self.bias), x, norm, residual, swiglu)


def unfused(linear, x, norm=None, residual=None, swiglu=False):
    """residual + [swiglu of] linear(norm(x)), one PyTorch op at a time."""
    y = linear(x if norm is None else norm(x))
    if swiglu:
        y = silu_and_mul(y)
    return y if residual is None else residual + y


def silu_and_mul(y):
    """SwiGLU's gate: silu(gate) * up, of the gate and up halves of y's last dimension."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


FUSE_NORM_AND_RESIDUAL = True  # False (bench.py --unfused) keeps them apart, to measure what fusing buys
FUSE_SWIGLU = True  # False (bench.py --unfused-swiglu): SwiGLU after the GEMV, not in it
FUSE_ATTENTION = True  # False (bench.py --unfused-attention): decode attention as PyTorch ops on CUDA too


def decode_gemv(x, weight, scales, norm, residual, swiglu=False):
    """cuda_kernels.matmul with the norm, SwiGLU and the residual add inside the kernel, or around it."""
    return fused_matmul(lambda x, **fused: cuda_kernels.matmul(x, weight, scales, **fused), x, norm, residual, swiglu)


def decode_int4_gemv(x, layer, norm, residual, swiglu=False, xq=None):
    """decode_gemv for an Int4Linear's one-row layout: cuda_kernels.int4_matmul (xq: x in int8 too)."""
    return fused_matmul(lambda x, **fused: cuda_kernels.int4_matmul(x, layer.gemv_weight, layer.gemv_sz, layer.gemv_unscale,
                                                              layer.gemv_group, layer.gemv_units, **fused,
                                                              ones=layer.gemv_ones, dp4a=layer.gemv_dp4a, xq=xq),
                        x, norm, residual, swiglu)


def fused_matmul(matmul, x, norm, residual, swiglu):
    """matmul(x, norm_weight=, eps=, residual=, swiglu=) with what FUSE_* allow fused, the rest around it."""
    if not FUSE_NORM_AND_RESIDUAL:
        return unfused(matmul, x, norm, residual, swiglu)
    normed = dict(norm_weight=None if norm is None else norm.weight, eps=0.0 if norm is None else norm.eps)
    if swiglu and not FUSE_SWIGLU:
        y = silu_and_mul(matmul(x, **normed))
        return y if residual is None else residual + y
    return matmul(x, **normed, residual=residual, swiglu=swiglu)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [D/2], with Llama-3.1 scaling when the config has it: long
    wavelengths are divided by `factor`, short ones kept, and the band between interpolated."""
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)
    if args.rope_scaling is None:
        return inv_freq.float()
    s = args.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    # smooth = 0 beyond old_len / low (scaled by 1/factor), 1 below old_len / high (unchanged).
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return scaled.float()


def rope_table(args: ModelArgs, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, D] for rotate-half RoPE: each frequency appears in both halves."""
    inv_freq = rope_frequencies(args).to(device)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, S, heads, D]; cos, sin [S, D]. Rotates the pairs (x[i], x[i + D/2]).
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


# -- weight-only quantization ----------------------------------------------------------------------
#
# quantize.py writes quantized checkpoints; this section runs them. To load one, from_checkpoint builds
# the model through quantized_constructor(config["quantization"]), which swaps nn.Linear layers for
# the modules below before loading, so nothing above knows. The formats, for a layer whose float
# weight W is [N, K] (every tensor is per output row, N first):
#
#   int8           Int8Linear: `weight` int8 [N, K] and `scales` [N]; W = weight * scales[:, None]
#                  (symmetric, per output channel). Every linear layer.
#   int4, group G  Int4Linear: `weight` uint8 [N, K/2], two 4-bit values q per byte (column 2j in
#                  the low nibble), `scales` and `zeros` [N, ceil(K/G)]; W = (q - 8) * scale + zero
#                  for each group of G columns (asymmetric: `zero` is the middle level's value). The
#                  blocks' linear layers; the output head is int8 (4-bit there costs ~5% perplexity).
#   embedding      stays float: a lookup reads one row per token, so quantizing it would save
#                  memory, not time (and setup_caches takes the cache dtype from it).
#
# Scales and zeros are bf16 in the file, the kernels' dtype. A tied embedding becomes two tensors
# (the float table and the int8 head), so quantized configs say tie_embeddings=false. The file
# keeps q/k/v and gate/up apart like a float checkpoint; fusing them is a concatenation along dim 0
# (Transformer._load_hook does `weight`, _fuse_quantized the rest). Int4Linear repacks its weight
# into the kernel's layout after loading, on the device it runs on.
#
# Kernels. On the CPU, decode (<= 32 rows): on x86 with AVX2, cpu_kernels.cpp's integer kernels
# (x quantized per block of 32 in two int8 parts: closer than bf16; 2-3.6x PyTorch's ops);
# elsewhere PyTorch's weight-only ops, which take bf16 activations (their fp32 paths are 5-20x
# slower), so x is cast to bf16 around the matmul and back. CPU prefill dequantizes and calls
# F.linear (2x faster there). On CUDA, int8 decode (<= 16 rows) is cuda_kernels.py's Triton GEMV, which
# dequantizes in registers (2.5-5x the speed of gpt-fast's F.linear(x, w.to(x.dtype)) * scales
# fused by Inductor, used for prefill; aten's CUDA _weight_int8pack_mm is slower still; one row of
# bf16 x with the norm fused runs in float16 pairs, cuda_kernels.use_half), and int4
# is tinygemm (_weight_int4pack_mm), or for one row cuda_kernels.int4_gemv where INT4_GEMV (below). No op
# here syncs with the host: all of it can be captured in a CUDA graph.

INT4_GROUPSIZES = (32, 64, 128, 256)  # what the int4 kernels accept
# One row of int4 x on CUDA runs cuda_kernels.int4_gemv (its layout built at load time, beside tinygemm's,
# which prefill and batches use; in integers unless cuda_kernels.int4_dp4a says float16 pairs) instead of
# tinygemm: the 7B step 1.86x faster at group 32 (runs 34 and 53, BENCHMARKS.md), for a second copy of the
# int4 weights on the GPU. GRAPHDECODE_INT4_GEMV=0 (or bench.py --int4-tinygemm) keeps tinygemm
# alone, set before the model loads.
INT4_GEMV = os.environ.get("GRAPHDECODE_INT4_GEMV", "1") == "1"
# Where a layer's scales and zeros lie on quantize.py's grid (int4_grid_units), cuda_kernels.int4_gemv can
# read them as one byte each instead of two (int4_layout's codes): at group 32, 4.5 bits a weight
# instead of 5. GRAPHDECODE_INT4_CODES: auto (int4_codes' rule), 0 never, 1 wherever the grid holds.
INT4_CODES = os.environ.get("GRAPHDECODE_INT4_CODES", "auto")


def int4_codes(groupsize: int) -> bool:
    """Whether an int4 layer of kernel group size `groupsize` (Int4Linear.kernel_groupsize: the file's
    group size or, where that does not divide K, gcd(group size, K)) reads its scales and zeros as codes
    (INT4_CODES): "auto" takes them up to group 64, where the 7B step runs 647 tok/s against 625 at
    group 32 (run 50) and 639.6 against 624.2 at 64 (run 56); at group 128 they save 3% of the bytes
    and the gate/up GEMV ran slower (15.6 µs at its best launch against 14.0, run 51)."""
    if INT4_CODES not in ("auto", "0", "1"):
        raise ValueError(f"GRAPHDECODE_INT4_CODES must be auto, 0 or 1 (got {INT4_CODES!r})")
    return INT4_CODES == "1" or (INT4_CODES == "auto" and groupsize <= 64)


CPU_KERNEL_MAX_ROWS = 32  # up to this many tokens the CPU int8 kernel beats dequantize + F.linear


def check_quantization(quantization) -> tuple[str, int | None]:
    """(mode, groupsize) of a config's "quantization" entry; ValueError on anything else."""
    mode = quantization.get("mode") if isinstance(quantization, dict) else None
    if mode not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {quantization!r} (mode must be int8 or int4)")
    keys = {"mode", "groupsize"} if mode == "int4" else {"mode"}
    if set(quantization) != keys:
        raise ValueError(f"quantization {quantization}: {mode} takes exactly the keys {sorted(keys)}")
    if mode == "int4" and quantization["groupsize"] not in INT4_GROUPSIZES:
        raise ValueError(f"quantization {quantization}: groupsize must be one of {INT4_GROUPSIZES}")
    return mode, quantization.get("groupsize")


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (weight * scales[:, None]).T -> [..., N]."""
    rows = x.numel() // x.shape[-1]
    if x.is_cpu and rows <= CPU_KERNEL_MAX_ROWS:  # Int8Linear chose the kernel when loading:
        if scales.dtype == torch.float32:  # cpu_kernels.cpp
            y = cpu_kernels.int8_linear(x.reshape(rows, -1).float().contiguous(), weight, scales)
        else:  # PyTorch's, with bf16 scales and activations
            y = torch._weight_int8pack_mm(x.reshape(rows, -1).to(torch.bfloat16), weight, scales)
        return y.view(*x.shape[:-1], -1).to(x.dtype)
    # Decode on CUDA: dequantized in registers, 2.5-5x Inductor's. (Several float32 rows would go
    # through a TF32 dot: those take the exact path below.)
    if cuda_kernels.usable(x, weight, max_rows=1 if x.dtype == torch.float32 else 16):
        return cuda_kernels.matmul(x, weight, scales)
    return F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)


def int4_linear(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor,
                groupsize: int) -> torch.Tensor:
    """x [..., K] @ W.T with W packed by pack_int4 -> [..., N]."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if x.is_cpu:
        y = torch._weight_int4pack_mm_for_cpu(x2, weight, groupsize, scales_and_zeros)
    else:
        y = torch._weight_int4pack_mm(x2, weight, groupsize, scales_and_zeros)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def int4_linear_cpu(x: torch.Tensor, weight: torch.Tensor, block_scales: torch.Tensor,
                    block_zeros: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W.T on the CPU, W in the file's layout with a scale and zero per block of 32
    columns (cpu_kernels.block_params): decode rows through cpu_kernels.cpp (activations rounded
    to int8 per block), more rows (prefill) through the dequantized weight and F.linear."""
    rows = x.numel() // x.shape[-1]
    if rows <= CPU_KERNEL_MAX_ROWS:
        y = cpu_kernels.int4_linear(x.reshape(rows, -1).float().contiguous(), weight, block_scales, block_zeros)
        return y.view(*x.shape[:-1], -1).to(x.dtype)
    blocks = weight.shape[1] // 16
    w = dequantize_int4(weight, block_scales[:, :blocks].float(), block_zeros[:, :blocks].float(), 32)
    return F.linear(x, w.to(x.dtype))


def unpack_int4(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] (column 2j in the low nibble) -> int32 [N, K] in 0..15."""
    return torch.stack([weight & 15, weight >> 4], dim=-1).view(weight.shape[0], -1).int()


def dequantize_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return weight.to(scales.dtype) * scales[:, None]


def dequantize_int4(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groupsize: int) -> torch.Tensor:
    q = unpack_int4(weight).to(scales.dtype)
    group = torch.arange(q.shape[1], device=q.device) // groupsize  # column -> its group
    return (q - 8) * scales[:, group] + zeros[:, group]


def int4_grid_unit(v: torch.Tensor, levels: int) -> torch.Tensor:
    """v [N, G] -> [N, 1] float32: per row, the smallest power of two u with max |v| <= levels u
    (1 for a row of zeros)."""
    m, e = torch.frexp(v.float().abs().amax(1, keepdim=True) / levels)
    return torch.where(m > 0, torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e)), 1.0)


def int4_units(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The units of quantize.py's grid for int4 scales and zeros [N, G]: [N, 2] float32, the scales'
    (int4_grid_unit with 255 levels) and the zeros' (127 levels)."""
    return torch.cat([int4_grid_unit(scales, 255), int4_grid_unit(zeros, 127)], dim=1)


def int4_grid_units(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor | None:
    """int4_units, if every scale is a whole number of its row's unit (0..255) and every zero one
    too (-127..127): 8 bits each, exactly, and in bf16 too (a power of two times 8 bits); else None
    (a file from elsewhere, such as a GGUF's)."""
    units = int4_units(scales, zeros)
    codes_s, codes_z = scales.float() / units[:, :1], zeros.float() / units[:, 1:]
    whole = all(bool(((k == k.round()) & (k >= lo) & (k <= hi)).all())
                for k, lo, hi in ((codes_s, 0, 255), (codes_z, -127, 127)))  # (the range: float32's subnormals)
    return units if whole else None


def kernel_groups(scales, zeros, groupsize: int, K: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The file's scales and zeros for the GPU kernels, which want equal groups: a group size that
    does not divide K leaves a shorter last group in the file (576 = 4 x 128 + 64), so the kernels
    run with g = gcd(groupsize, K) and each scale repeated groupsize/g times (the same numbers)
    -> (scales, zeros [N, K/g], g)."""
    g = math.gcd(groupsize, K)
    group = torch.arange(K // g, device=scales.device) * g // groupsize  # kernel group -> file group
    return scales[:, group], zeros[:, group], g


def pack_int4(weight, scales, zeros, groupsize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's int4 layout -> (packed weight, scales_and_zeros [K/g, N, 2] bf16) for
    PyTorch's kernel on weight's device (groups of g: kernel_groups)."""
    K = 2 * weight.shape[1]
    s, z, g = kernel_groups(scales, zeros, groupsize, K)
    scales_and_zeros = torch.stack([s, z], dim=-1)  # [N, K/g, 2]
    scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)
    q = unpack_int4(weight)
    if weight.is_cpu:
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)  # innerKTiles: unused on the CPU
    else:  # tinygemm wants uint8 [N, K/2] with column 2j in the high nibble
        inner_k_tiles = 8 if K % 128 == 0 else 4 if K % 64 == 0 else 2
        packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), inner_k_tiles)
    return packed, scales_and_zeros


def int4_gemv_layout(weight, scales, zeros, groupsize: int, dp4a: bool = False,
                     codes: bool = False) -> tuple[torch.Tensor, torch.Tensor, float, int, torch.Tensor | None]:
    """The file's int4 layout -> cuda_kernels.int4_gemv's (words, scale-and-zero words, w_unscale, group g,
    units): codes (in integers only), where the scales and zeros are on quantize.py's grid, as int16
    codes of their rows' units; else float16 pairs, and units None."""
    s, z, g = kernel_groups(scales, zeros, groupsize, 2 * weight.shape[1])
    units = int4_grid_units(s, z) if codes and dp4a else None
    return (*cuda_kernels.int4_layout(unpack_int4(weight), s, z, dp4a, units), g, units)


def _int_parameter(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = _int_parameter(out_features, in_features, dtype=torch.int8)
        self.scales = _int_parameter(out_features, dtype=torch.get_default_dtype())
        self.bias = _int_parameter(out_features, dtype=torch.get_default_dtype()) if bias else None
        self.register_load_state_dict_post_hook(Int8Linear._after_load)

    def forward(self, x, norm=None, residual=None, swiglu=False):  # as Linear's
        if cuda_kernels.usable(x, self.weight, max_rows=1) and (self.bias is None or (residual is None and not swiglu)):
            y = decode_gemv(x, self.weight, self.scales, norm, residual, swiglu)
            return y if self.bias is None else y + self.bias
        return unfused(self.linear, x, norm, residual, swiglu)

    def linear(self, x):
        y = int8_linear(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def _after_load(self, incompatible_keys):
        if self.scales.is_cpu:  # cpu_kernels.cpp wants float32 scales, PyTorch's CPU kernel bf16 ones
            ours = self.weight.shape[1] % 32 == 0 and cpu_kernels.available()
            self.scales = nn.Parameter(self.scales.to(torch.float32 if ours else torch.bfloat16), requires_grad=False)


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False):
        super().__init__()
        if in_features % 32 or out_features % 16:
            raise ValueError(f"int4 needs an input dim that is a multiple of 32 and an output dim that is a "
                             f"multiple of 16 (got {in_features} -> {out_features})")
        self.groupsize = groupsize
        self.kernel_groupsize = math.gcd(groupsize, in_features)
        groups = -(-in_features // groupsize)
        self.weight = _int_parameter(out_features, in_features // 2, dtype=torch.uint8)
        self.scales = _int_parameter(out_features, groups, dtype=torch.get_default_dtype())
        self.zeros = _int_parameter(out_features, groups, dtype=torch.get_default_dtype())
        self.bias = _int_parameter(out_features, dtype=torch.get_default_dtype()) if bias else None
        self.register_load_state_dict_post_hook(Int4Linear._after_load)

    def forward(self, x, norm=None, residual=None, swiglu=False, xq=None):
        """As Linear's; xq: x in int8 too, from the kernel that made x (cuda_kernels.int4_quantize_x's layout,
        groups of x_group(x), which the caller checks), which decode's one-row kernel then reads instead of x."""
        if (hasattr(self, "gemv_weight") and cuda_kernels.usable(x, self.gemv_weight, max_rows=1)
                and (self.bias is None or (residual is None and not swiglu))):
            y = decode_int4_gemv(x, self, norm, residual, swiglu, xq)
            return y if self.bias is None else y + self.bias
        return unfused(self.linear, x, norm, residual, swiglu)

    def ring(self, x, xq, norm=None, residual=None, swiglu=False, out_q=False, out_norm=None):
        """forward in decode's int8 flow (TransformerBlock.forward_int8; gemv_ring): (y, y in int8 or None) by
        int4_ring.py's kernel, which reads x in int8 only (xq: cuda_kernels.int4_quantize_x(x, norm's weight), groups
        of 16; x gives the shape); out_q: y also in int8, times out_norm's weight if given."""
        return int4_ring.matmul(x, xq, self.gemv_weight, self.gemv_sz, self.gemv_units, self.gemv_unscale,
                                norm is not None, 0.0 if norm is None else norm.eps, residual, swiglu, out_q,
                                None if out_norm is None else out_norm.weight)

    def x_group(self, x) -> int:
        """The group of x in int8 that the one-row kernel can read for this x (cuda_kernels.int4_x_group), or
        0: x in bf16 only (the kernel not run, float16 pairs, or FUSE_NORM_AND_RESIDUAL off)."""
        if not (getattr(self, "gemv_dp4a", False) and hasattr(self, "gemv_weight") and FUSE_NORM_AND_RESIDUAL
                and cuda_kernels.usable(x, self.gemv_weight, max_rows=1)):
            return 0
        return cuda_kernels.int4_x_group(self.kernel_groupsize)

    def linear(self, x):
        if hasattr(self, "block_scales"):
            y = int4_linear_cpu(x, self.weight, self.block_scales, self.block_zeros)
        else:
            y = int4_linear(x, self.weight, self.scales_and_zeros, self.kernel_groupsize)
        return y if self.bias is None else y + self.bias

    def _after_load(self, incompatible_keys):
        """Repack the loaded file layout for the kernel. On a CPU that runs cpu_kernels.cpp,
        `weight` stays as it is and `scales`, `zeros` become `block_scales`, `block_zeros`;
        elsewhere `weight` becomes PyTorch's packed weight and `scales`, `zeros` `scales_and_zeros`."""
        if not hasattr(self, "scales") or any(t.is_meta for t in (self.weight, self.scales, self.zeros)):
            return  # not (fully) loaded: load_state_dict reports what is missing
        if self.weight.is_cpu and self.weight.shape[1] % 32 == 0 and cpu_kernels.available():  # (K % 64)
            block_scales, block_zeros = cpu_kernels.block_params(self.scales, self.zeros, self.groupsize,
                                                                 2 * self.weight.shape[1])
            del self.scales, self.zeros
            self.block_scales = nn.Parameter(block_scales, requires_grad=False)
            self.block_zeros = nn.Parameter(block_zeros, requires_grad=False)
            return
        if INT4_GEMV and self.weight.is_cuda and torch.version.hip is None and cuda_kernels.triton is not None:  # (PTX)
            self.gemv_dp4a = cuda_kernels.int4_dp4a()
            weight, sz, self.gemv_unscale, self.gemv_group, units = int4_gemv_layout(
                self.weight, self.scales, self.zeros, self.groupsize, self.gemv_dp4a,
                int4_codes(self.kernel_groupsize))
            # (buffers outside the state dict: derived, like the packed weight; a step reads one layout
            # or the other, and generate.weight_bytes_per_step counts this one for one row)
            self.register_buffer("gemv_weight", weight, persistent=False)
            self.register_buffer("gemv_sz", sz, persistent=False)
            self.register_buffer("gemv_units", units, persistent=False)
            self.register_buffer("gemv_ones", torch.ones(weight.shape[1] * 8, device=weight.device, dtype=torch.bfloat16),
                                 persistent=False)  # (bf16: the kernel build benchmarks/gemv_int4.py timed)
            # decode's int8 flow (TransformerBlock.forward_int8) runs this layer by int4_ring.py's kernel
            self.gemv_ring = int4_ring is not None and units is not None and int4_ring.usable(
                weight, sz, self.kernel_groupsize)
        packed, scales_and_zeros = pack_int4(self.weight, self.scales, self.zeros, self.groupsize)
        del self.scales, self.zeros
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.scales_and_zeros = nn.Parameter(scales_and_zeros, requires_grad=False)


def quantized_constructor(quantization: dict):
    """For from_checkpoint: a function ModelArgs -> Transformer whose linear layers are the
    quantized modules above (int4 mode: int8 output head), ready to load a quantized state dict."""
    mode, groupsize = check_quantization(quantization)

    def quantized_linear(linear: nn.Linear, mode: str) -> nn.Module:
        bias = linear.bias is not None
        if mode == "int8":
            return Int8Linear(linear.in_features, linear.out_features, bias)
        return Int4Linear(linear.in_features, linear.out_features, groupsize, bias)

    def build(args: ModelArgs) -> Transformer:
        if args.tie_embeddings:
            raise ValueError("a quantized checkpoint keeps the head apart from the embedding: its config "
                             "must say tie_embeddings=false")
        model = Transformer(args)
        for layer in model.layers:
            for parent, name in ((layer.attention, "wqkv"), (layer.attention, "wo"),
                                 (layer.feed_forward, "w13"), (layer.feed_forward, "w2")):
                setattr(parent, name, quantized_linear(getattr(parent, name), mode))
        model.output = quantized_linear(model.output, "int8")
        model._register_load_state_dict_pre_hook(_fuse_quantized)  # runs after Transformer._load_hook
        return model

    return build


def _fuse_quantized(state, prefix, *args):
    """Load pre-hook: fuse the per-row `scales` and `zeros` of q/k/v and gate/up like
    Transformer._load_hook fuses their weights."""
    for key in [k for k in state if k.startswith(prefix)]:
        head, _, suffix = key.rpartition(".")  # "...layers.3.attention.wq", "scales"
        if suffix not in ("scales", "zeros"):
            continue
        for fused, parts in (("wqkv", ("wq", "wk", "wv")), ("w13", ("w1", "w3"))):
            if head.endswith("." + parts[0]):
                base = head[:-len(parts[0])]
                names = [f"{base}{p}.{suffix}" for p in parts]
                if all(n in state for n in names):
                    state[f"{base}{fused}.{suffix}"] = torch.cat([state.pop(n) for n in names])
