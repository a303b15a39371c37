"""A Llama-family transformer in plain PyTorch, with a static KV cache, written to be compiled and
CUDA-graphed (generate.py). Nothing here knows about custom kernels: gdkernels/ swaps in faster
modules after loading, and this file is what they must agree with.

Read top to bottom: ModelArgs (the config), Transformer (embedding, layers, head, caches,
checkpoint loading), TransformerBlock, Attention, KVCache, FeedForward, MoEFeedForward, RMSNorm, RoPE.

Shapes: B batch, S new tokens this call, L cache length (max_seq_length), H query heads,
Hkv key/value heads, D head_dim. Q and K weight rows use the Hugging Face "rotate-half" layout,
so Hugging Face checkpoints need no permutation (GGUF files do: see convert_gguf.py).
"""
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    # Llama-3.1: {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    max_seq_len: int = 4096  # the model's context length
    tie_embeddings: bool = False  # output head shares the token embedding (SmolLM2, Llama 3.2 1B/3B)
    attention_bias: bool = False  # bias on q, k, v (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (Qwen3)
    # Mixture of experts (Mixtral, Qwen3-MoE) where n_experts > 0: each token's n_active_experts likeliest
    # experts by the router, each a SwiGLU expert_size wide; norm_topk: their router weights renormalised to sum 1.
    n_experts: int = 0
    n_active_experts: int = 0
    expert_size: int = 0
    norm_topk: bool = True

    def __post_init__(self):
        # Derived fields are filled only when the checkpoint left them unset.
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) is not a multiple of n_kv_heads ({self.n_kv_heads})")
        keys = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        if self.rope_scaling is not None and (missing := keys - set(self.rope_scaling)):
            raise ValueError(f"rope_scaling lacks {sorted(missing)}")
        if self.n_experts and not (1 <= self.n_active_experts <= self.n_experts and self.expert_size >= 1):
            raise ValueError(f"need 1 <= n_active_experts ({self.n_active_experts}) <= n_experts and expert_size >= 1")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        if unknown := set(d) - {f.name for f in fields(cls)}:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)


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


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        embedding = torch.empty(args.vocab_size, args.dim)
        if not embedding.is_meta:  # N(0, 1), but not on from_checkpoint's meta device: loading replaces the values
            nn.init.normal_(embedding)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=embedding)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = -1
        self.max_seq_length = -1
        self._register_load_state_dict_pre_hook(self._load_hook)

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        """Allocate the KV cache, RoPE table and key positions once (a call for no more keeps them)."""
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

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, S] token ids at positions input_pos [S] (or per row, [B, S]) -> logits [B, S, vocab]. Writes the
        new keys and values into the cache at input_pos; each query sees positions <= its own. Packed (prompts without
        padding): idx [1, N], the tokens at the flat places keep [N] of input_pos [B, S] -> [1, N, vocab]."""
        if self.max_seq_length < 0:
            raise RuntimeError("call setup_caches() before forward()")
        x = self.tok_embeddings(idx)
        mask = self.kv_pos <= input_pos.unsqueeze(-1)  # [S, L] or [B, S, L]: True where a query may look
        for layer in self.layers:
            x = layer(x, input_pos, self.rope_cos, self.rope_sin, mask, keep)
        return self.output(self.norm(x))

    @classmethod
    def from_checkpoint(cls, path, device="cpu", dtype=torch.bfloat16, quantized=None, split=None) -> "Transformer":
        """Load a checkpoint directory (convert_hf_checkpoint.py's): built on the meta device (no memory, no
        init), each weight read from the memory-mapped file, cast and moved once, and assigned in place of the
        meta one. quantized(model, quantization) puts in the quantized layers first: quantize.load passes
        quantize.quantized_layers. split (tp.py's): (args -> a share's args, (name, safetensors slice) -> its part)."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        config, weights = read_config(path), path / "model.safetensors"
        share, part = split or ((lambda args: args), (lambda name, tensor_slice: tensor_slice[:]))
        if not weights.is_file():
            raise FileNotFoundError(f"{path}: no model.safetensors")
        with torch.device("meta"):
            model = cls(share(config["args"]))
            if config.get("quantization"):
                if quantized is None:
                    raise ValueError(f"{path} is a quantized checkpoint: load it with quantize.load")
                quantized(model, config["quantization"])
        try:
            with safe_open(weights, framework="pt") as f:
                state = {k: (v := part(k, f.get_slice(k))).to(device, dtype if v.is_floating_point() else v.dtype)
                         for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise ValueError(f"{weights}: weights do not match config.json: {str(e).splitlines()[1:3]}") from None
        if model.args.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared one
        return model.eval().requires_grad_(False)

    def _load_hook(self, state, prefix, *args):
        """Checkpoints hold q, k, v and gate, up apart: fuse each set (weights, biases, a quantized layer's
        per-row scales and zeros) into one matrix, so decode launches fewer, larger matmuls."""
        if self.args.tie_embeddings:
            state.pop(prefix + "output.weight", None)
            state[prefix + "output.weight"] = state[prefix + "tok_embeddings.weight"]
        for i in range(self.args.n_layers):
            p = f"{prefix}layers.{i}."
            for fused, parts in (("attention.wqkv", ("wq", "wk", "wv")), ("feed_forward.w13", ("w1", "w3"))):
                base = p + fused.split(".")[0]
                for suffix in ("weight", "bias", "scales", "zeros"):
                    names = [f"{base}.{w}.{suffix}" for w in parts]
                    if all(n in state for n in names):
                        state[f"{p}{fused}.{suffix}"] = torch.cat([state.pop(n) for n in names])


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoEFeedForward(args) if args.n_experts else FeedForward(args)

    def forward(self, x, input_pos, rope_cos, rope_sin, mask, keep=None):
        h = x + self.attention(self.attention_norm(x), input_pos, rope_cos, rope_sin, mask, keep)
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_size, kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.wqkv = nn.Linear(args.dim, q_size + 2 * kv_size, bias=args.attention_bias)
        self.wo = nn.Linear(q_size, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.kv_cache: KVCache | None = None

    def forward(self, x, input_pos, rope_cos, rope_sin, mask, keep=None):
        """x [B, S, dim] -> [B, S, dim]. rope_cos, rope_sin: the RoPE tables [L, D]."""
        return self.wo(self.attend(self.wqkv(x), input_pos, rope_cos, rope_sin, mask, keep))

    def attend(self, qkv, input_pos, rope_cos, rope_sin, mask, keep=None):
        """qkv [B, S, (H + 2 Hkv) D], the new tokens' q, k, v -> [B, S, H D]: RoPE, the cache
        write, and attention over the cache (gdkernels/ replaces this step for decode)."""
        if keep is not None:  # packed [1, N, ...]: into input_pos's grid (zeros between), attended, gathered back
            grid = qkv.new_zeros(input_pos.numel(), qkv.shape[-1]).index_copy(0, keep, qkv[0])
            y = self.attend(grid.view(*input_pos.shape, -1), input_pos, rope_cos, rope_sin, mask)  # [B, S, H D]
            return y.flatten(0, 1)[keep][None]
        B, S, _ = qkv.shape
        q, k, v = self.rope_and_cache(qkv, input_pos, rope_cos, rope_sin)
        mask = mask.unsqueeze(-3)  # [1 or B, 1, S, L]
        # grouped-query attention without repeating K and V (enable_gqa)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return y.transpose(1, 2).reshape(B, S, -1)

    def rope_and_cache(self, qkv, input_pos, rope_cos, rope_sin):
        """qkv -> q [B, H, S, D] with RoPE, and the cache's k, v [B, Hkv, L, D] with the new tokens written in."""
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.split(self.split, dim=-1))  # [B, S, H, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos[input_pos], rope_sin[input_pos]  # [S, D] or [B, S, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H or Hkv, S, D]
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, Hkv, L, D]: the whole cache
        return q, k, v


class KVCache(nn.Module):
    """Static cache [max_batch, Hkv, max_seq, D], allocated once and written in place."""

    def __init__(self, max_batch_size, n_kv_heads, max_seq_length, head_dim, dtype, device):
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("rows", torch.arange(max_batch_size, device=device)[:, None], persistent=False)
        self.first = 0  # a batch's row i is cache row first + i (serve.py prefills into the rows after the decoding ones)

    def update(self, input_pos, k, v):
        """input_pos [S] (or [B, S], each row its own), k and v [B, Hkv, S, D] -> the cache's B rows from `first`."""
        rows = slice(self.first, self.first + k.shape[0])
        if input_pos.dim() == 2:  # indexing the whole cache: compiled, a write into the slice k_cache[rows]
            at = (self.rows[rows], slice(None), input_pos)  # copies the slice (the serving engine's B < rows)
            self.k_cache[at] = k.transpose(1, 2)  # [B, S, Hkv, D]: advanced indices' dims come first
            self.v_cache[at] = v.transpose(1, 2)
        else:
            self.k_cache[rows].index_copy_(2, input_pos, k)
            self.v_cache[rows].index_copy_(2, input_pos, v)
        return self.k_cache[rows], self.v_cache[rows]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(x w1) * x w3), with w1 (gate) and w3 (up) fused into one matrix."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class MoEFeedForward(nn.Module):
    """Mixture of experts: the router's softmax picks each token's top-k experts, whose SwiGLU outputs are summed
    with those weights. Experts are stacked: w1 (gate) and w3 (up) [E, expert_size, dim], w2 [E, dim, expert_size]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.k, self.norm_topk = args.n_active_experts, args.norm_topk
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.w1, self.w3 = (nn.Parameter(torch.empty(args.n_experts, args.expert_size, args.dim)) for _ in "13")
        self.w2 = nn.Parameter(torch.empty(args.n_experts, args.dim, args.expert_size))

    def experts(self, name: str, index: torch.Tensor | None) -> torch.Tensor:  # (int8: quantize.Int8Experts)
        return getattr(self, name)[index]  # w1, w3 or w2 of the experts index [T, k]: [T, k, ...]; None: [1, E, ...]

    def forward(self, x):
        shape, x = x.shape, x.flatten(0, -2)  # [T, dim]
        weight, chosen = F.softmax(self.gate(x).float(), dim=-1).topk(self.k, dim=-1)  # [T, k]
        weight = weight / weight.sum(-1, keepdim=True) if self.norm_topk else weight
        index = chosen if len(x) * self.k < len(self.w2) else None  # few tokens (decode): the chosen experts only;
        if index is None:  # many: every expert on every token, weighted 0 where not chosen (fixed shapes either way)
            weight = torch.zeros(len(x), len(self.w2), device=x.device).scatter(-1, chosen, weight)
        # a [T, k or 1, in] -> [T, k or E, out]. Few: products summed, which compiled are one reduction reading the
        # weights where they lie (a batched matmul copies them out first; BENCHMARKS.md); many: a batched matmul.
        mm = (lambda a, w: (a.unsqueeze(-2) * self.experts(w, index)).sum(-1)) if index is not None else (
            lambda a, w: torch.einsum("tki,tkoi->tko", a, self.experts(w, index)))
        gate, up = (mm(x[:, None], w) for w in ("w1", "w3"))
        y = mm(F.silu(gate) * up, "w2")
        return (weight.to(x.dtype).unsqueeze(-1) * y).sum(1).view(shape)


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
    # x [B, S, heads, D]; cos, sin [S, D] or [B, S, D]. Rotates the pairs (x[i], x[i + D/2]).
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
