"""The fast paths, plugged into the plain model after loading by swapping its modules' classes
(the way Liger-Kernel's apply_liger_kernel_to_* or torchao's quantize_ do it): model.py stays the
reference, and each class here is a subclass whose forward calls a kernel where it applies and
the reference forward everywhere else.

    model = quantize.load(path, device, dtype)
    gdkernels.apply(model)            # -> what it swapped; GRAPHDECODE_KERNELS=0 or --no-kernels: nothing

On CUDA (BENCHMARKS.md has each one's gain in the whole decode step):
  FusedBlock       hands RMSNorm, SwiGLU and the residual adds to the matmuls around them, so they cost
                   no kernel of their own: h = wo(attend(wqkv(x, norm=attention_norm)), residual=x), ...
  GemvLinear       bf16 weights, 1-16 rows: gemv.py's Triton GEMV (alone it ties cuBLAS in the step;
                   it is what takes the norm, SwiGLU and residual in)
  Int8Gemv         int8 weights: the same GEMV, dequantizing in registers
  Int4Gemv         int4 weights, up to 8 rows: int4.py's one-row GEMV in integers, once a row; the
                   weights are re-laid once for it (the file's layout is dropped: each weight is held
                   once), and more rows (prefill) dequantize that layout for F.linear
  KernelAttention  one new token: RoPE, the cache write and attention in one kernel (attention.py)
On the CPU: Int8Cpu and Int4Cpu, cpu.cpp's AVX2 matmuls for up to CPU_MAX_ROWS rows; CpuAttention, reading
each query's keys up to its position only; and aot.py's decode step compiled ahead of time (generate.py uses it).
Names: a kernel's file has a function named for the kernel, which checks and launches it (gemv.gemv, int4.gemv,
attention.decode_attention), and the custom op the modules call, named for the operation (.matmul, .attention).
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Attention, Transformer, TransformerBlock
from quantize import Int4Linear, Int8Linear, dequantize_int4

from . import attention, cpu, gemv, int4

CPU_MAX_ROWS = 160  # up to this many rows the CPU kernels beat dequantizing + F.linear (BENCHMARKS.md); beyond,
# F.linear's blocked matmul reuses each dequantized weight across the rows
INT4_MAX_ROWS = 8  # up to this many rows of x, the one-row int4 GEMV once a row
ATTENTION_MAX_BATCH = 256  # KernelAttention's counts cover this many rows


def enabled() -> bool:
    """The one off switch besides --no-kernels: GRAPHDECODE_KERNELS=0."""
    return os.environ.get("GRAPHDECODE_KERNELS", "1") != "0"


def apply(model: Transformer, fuse: bool = True, attend: bool = True, compiled: bool | None = None) -> list[str]:
    """Swap the model's modules for the kernels' where this device runs them -> a line per kind of swap.
    fuse=False keeps the blocks' norms and residuals apart (tp.py); attend=False, PyTorch's attention: it exists for
    benchmarks/kernel_gains.py. compiled (None: on CUDA, where decode compiles by default): register the ops with
    Inductor first (register_fallbacks). model.ahead_of_time: each query reads its keys up to its position only
    (CpuAttention), so one step built ahead of time for a fixed cache length (aot.py) serves every length."""
    device = model.tok_embeddings.weight.device
    done = {}

    def swap(module, cls, what):
        module.__class__ = cls  # the same parameters and buffers, the subclass's forward
        if hasattr(cls, "convert"):  # a new layout of the same weights, or new state
            module.convert(device)
        done[what] = done.get(what, 0) + 1

    # (exact types: a module swapped already is left alone, so a second apply changes nothing)
    linears = [m for m in model.modules() if type(m) in (nn.Linear, Int8Linear, Int4Linear)]
    if device.type == "cuda" and gemv.triton is not None:
        for m in linears:
            if isinstance(m, Int4Linear):
                swap(m, Int4Gemv, "int4 linear -> int4.py GEMV (up to 8 rows)")
            elif isinstance(m, Int8Linear):
                swap(m, Int8Gemv, "int8 linear -> gemv.py GEMV")
            else:
                swap(m, GemvLinear, "bf16 linear -> gemv.py GEMV")
        for layer in model.layers:
            if fuse and type(layer) is TransformerBlock and not model.args.n_experts:
                swap(layer, FusedBlock, "block -> norms, SwiGLU, residuals fused into the GEMVs")
            if attend and not model.args.qk_norm and type(layer.attention) is Attention:
                swap(layer.attention, KernelAttention, "decode attention -> attention.py")
    elif device.type == "cpu" and cpu.available():
        for layer in model.layers:
            if type(layer.attention) is Attention and layer.attention.head_dim % 8 == 0:
                swap(layer.attention, CpuAttention, "attention -> cpu.cpp (each query reads up to its position)")
        for m in linears:
            if isinstance(m, Int4Linear) and m.weight.shape[1] % 32 == 0:
                swap(m, Int4Cpu, f"int4 linear -> cpu.cpp (up to {CPU_MAX_ROWS} rows)")
            elif isinstance(m, Int8Linear) and m.weight.shape[1] % 32 == 0:
                swap(m, Int8Cpu, f"int8 linear -> cpu.cpp (up to {CPU_MAX_ROWS} rows)")
    model.ahead_of_time = any(type(m) is CpuAttention for m in model.modules())
    if done and (compiled or compiled is None and device.type == "cuda"):
        register_fallbacks()
    return [f"{n} x {what}" for what, n in done.items()]


# -- CUDA: the blocks and the linear layers --------------------------------------------------------

class FusedBlock(TransformerBlock):
    """TransformerBlock.forward with the norms, SwiGLU and residual adds inside the matmuls."""

    def forward(self, x, input_pos, rope_cos, rope_sin, mask, keep=None):
        a, f = self.attention, self.feed_forward
        h = a.wo(a.attend(a.wqkv(x, norm=self.attention_norm), input_pos, rope_cos, rope_sin, mask, keep), residual=x)
        return f.w2(f.w13(h, norm=self.ffn_norm, swiglu=True), residual=h)


def unfused(linear, x, norm=None, residual=None, swiglu=False):
    """residual + [SwiGLU of] linear(norm(x)), one PyTorch op at a time."""
    y = linear(x if norm is None else norm(x))
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


class Fused:
    """forward(x, norm=None, residual=None, swiglu=False) = residual + [SwiGLU of] linear(norm(x)): in one
    kernel where kernel(x, fused) gives one, else the reference forward (plain) between PyTorch's ops."""

    def forward(self, x, norm=None, residual=None, swiglu=False):
        fused = norm is not None or residual is not None or swiglu
        kernel = self.kernel(x, fused) if self.bias is None or (residual is None and not swiglu) else None
        if kernel is None:
            return unfused(self.plain, x, norm, residual, swiglu)
        y = kernel(x, None if norm is None else norm.weight, 0.0 if norm is None else norm.eps, residual, swiglu)
        return y if self.bias is None else y + self.bias


class GemvLinear(Fused, nn.Linear):
    plain = nn.Linear.forward

    def kernel(self, x, fused):
        if x.dtype == torch.bfloat16 and gemv.usable(x, self.weight, gemv.MAX_ROWS):
            return lambda x, *fusion: gemv.matmul(x, self.weight, None, *fusion)


class Int8Gemv(Fused, Int8Linear):
    plain = Int8Linear.forward

    def kernel(self, x, fused):  # (the norm and residual on one row; float32 x: one row, exact products)
        if gemv.usable(x, self.weight, 1 if fused or x.dtype == torch.float32 else gemv.MAX_ROWS):
            return lambda x, *fusion: gemv.matmul(x, self.weight, self.scales, *fusion)


class Int4Gemv(Fused, Int4Linear):
    """A swapped int4 layer (Int4Cpu too) passes isinstance(m, Int4Linear) but holds the kernel's layout: no .weight,
    .scales, .zeros (Int4Cpu: block_scales, block_zeros), so its state_dict() has other names and does not load back."""

    def convert(self, device):
        """The file's layout -> int4.py's (words, scale-and-zero codes), in place of it."""
        lay = int4.layout(self.weight, self.scales, self.zeros, self.groupsize)
        del self.weight, self.scales, self.zeros
        self.w_unscale, self.group = lay.w_unscale, lay.group
        for name in ("words", "sz", "units"):
            self.register_buffer(name, getattr(lay, name))
        # x times ones where no norm is fused (the kernel's multiply by the norm weight stays in place)
        self.register_buffer("ones", torch.ones(lay.words.shape[1] * 8, device=lay.words.device,
                                                dtype=torch.bfloat16), persistent=False)

    def layout(self):
        return int4.Layout(self.words, self.sz, self.units, self.w_unscale, self.group)

    def kernel(self, x, fused):  # a few rows: one launch each (each reads the weights; cheaper than dequantizing)
        if gemv.usable(x, self.words, INT4_MAX_ROWS):
            return self.rows

    def rows(self, x, norm_weight, eps, residual, swiglu):
        xs = x.reshape(-1, 1, x.shape[-1])
        rs = None if residual is None else residual.reshape(xs.shape[0], 1, -1)
        ys = [int4.matmul(xs[i], self.words, self.sz, self.units, self.w_unscale, self.group, self.ones, norm_weight,
                          eps, None if rs is None else rs[i], swiglu) for i in range(xs.shape[0])]
        return torch.cat(ys).view(*x.shape[:-1], -1)

    def plain(self, x):
        return F.linear(x, int4.dequantize(self.layout()).to(x.dtype), self.bias)


class KernelAttention(Attention):
    """Attention.attend with one kernel for one new token a row (at one position, or at each row's own)."""

    def convert(self, device):  # the cache slices' finishing counts (the kernel leaves them at zero)
        self.register_buffer("counts", torch.zeros(ATTENTION_MAX_BATCH * self.n_kv_heads, dtype=torch.int32,
                                                   device=device), persistent=False)

    def attend(self, qkv, input_pos, rope_cos, rope_sin, mask, keep=None):
        if keep is not None or qkv.shape[1] != 1 or qkv.shape[0] > ATTENTION_MAX_BATCH or \
                not attention.usable(qkv, input_pos):
            return super().attend(qkv, input_pos, rope_cos, rope_sin, mask, keep)
        c = self.kv_cache
        return attention.attention(qkv, input_pos, rope_cos, rope_sin, c.k_cache, c.v_cache, self.counts,
                                   self.n_heads, self.n_kv_heads)


# -- the CPU -------------------------------------------------------------------------------------

def _rows(x):
    return x.numel() // x.shape[-1]


class CpuAttention(Attention):
    """Attention.attend reading each query's keys up to its position (the reference reads the whole cache,
    masked): the ahead-of-time step, built for one cache length, costs what its position costs."""

    def attend(self, qkv, input_pos, rope_cos, rope_sin, mask, keep=None):
        if keep is not None:  # packed: Attention.attend unpacks, then calls this again
            return super().attend(qkv, input_pos, rope_cos, rope_sin, mask, keep)
        B, S, _ = qkv.shape
        q, k, v = self.rope_and_cache(qkv, input_pos, rope_cos, rope_sin)
        y = cpu.attention(q.float().contiguous(), k, v, input_pos.contiguous())
        return y.to(qkv.dtype).transpose(1, 2).reshape(B, S, -1)


class Int8Cpu(Int8Linear):
    def convert(self, device):  # the kernel's layout (cpu.interleave) and dtype
        self.weight = nn.Parameter(cpu.interleave(self.weight), requires_grad=False)
        self.scales = nn.Parameter(self.scales.float(), requires_grad=False)

    def forward(self, x):
        if _rows(x) > CPU_MAX_ROWS:
            y = F.linear(x, cpu.interleave(self.weight, inverse=True).to(x.dtype)) * self.scales.to(x.dtype)
            return y if self.bias is None else y + self.bias
        y = cpu.int8_linear(x.reshape(_rows(x), -1).float().contiguous(), self.weight, self.scales)
        y = y.view(*x.shape[:-1], -1).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Cpu(Int4Linear):
    def convert(self, device):
        """The weight in the kernel's layout (cpu.interleave); scales and zeros -> one per block of 32 columns
        (cpu.block_params), in place of them."""
        K = 2 * self.weight.shape[1]
        self.weight = nn.Parameter(cpu.interleave(self.weight), requires_grad=False)
        block_scales, block_zeros = cpu.block_params(self.scales, self.zeros, self.groupsize, K)
        del self.scales, self.zeros
        self.block_scales = nn.Parameter(block_scales, requires_grad=False)
        self.block_zeros = nn.Parameter(block_zeros, requires_grad=False)

    def forward(self, x):
        if _rows(x) > CPU_MAX_ROWS:  # prefill: dequantized, then F.linear (CPU_MAX_ROWS says why)
            blocks = self.weight.shape[1] // 16
            w = dequantize_int4(cpu.interleave(self.weight, inverse=True), self.block_scales[:, :blocks].float(),
                                self.block_zeros[:, :blocks].float(), 32)
            return F.linear(x, w.to(x.dtype), self.bias)
        y = cpu.int4_linear(x.reshape(_rows(x), -1).float().contiguous(), self.weight, self.block_scales,
                            self.block_zeros)
        y = y.view(*x.shape[:-1], -1).to(x.dtype)
        return y if self.bias is None else y + self.bias


def register_fallbacks() -> None:
    """Before compiling (apply(compiled=), aot.py; once is enough): tell Inductor that the kernels' custom ops are
    fallbacks (calls of their own implementation, with the layout constraint Inductor gives a custom op by default).
    Inductor does that itself on meeting such an op, but torch 2.11 first formats a log line with the str() of each
    argument, and through the residual that str() grows ~2x a layer: a 32-layer int4 model never finished
    compiling. Registering first skips the line. Private Inductor functions: a torch without them gets Inductor's
    own fallbacks (torch 2.13 formats that line lazily: pytorch/pytorch#185951)."""
    try:
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag

        lowering.make_fallback, lowering.tag_to_layout_constraint, lowering.lowerings  # noqa: B018 (present?)
    except (ImportError, AttributeError):
        return
    for name in ("gemv", "int4_gemv", "decode_attention", "int4_linear", "int8_linear", "attention"):
        try:
            op = getattr(torch.ops.graphdecode, name).default
        except (AttributeError, RuntimeError):  # not defined in this process
            continue
        if op not in lowering.lowerings and op not in getattr(lowering, "decompositions", {}):
            tag = get_layout_constraint_tag(op, with_default=True)
            lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))
