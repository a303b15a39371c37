"""Weight-only int8 / int4 quantization: a float checkpoint directory -> a new, quantized one.

The formats, for a layer whose float weight W is [N, K] (every tensor per output row; scales and zeros bf16):
  int8           Int8Linear: `weight` int8 [N, K], `scales` [N]; W = weight * scales[:, None]. Every linear layer.
  int4, group G  Int4Linear: `weight` uint8 [N, K/2], two 4-bit values q a byte (column 2j in the low nibble),
                 `scales` and `zeros` [N, ceil(K/G)]; W = (q - 8) * scale + zero per group of G columns (`zero`:
                 the middle level's value). The blocks' linear layers; the head stays int8 (4-bit there costs ~5%
                 perplexity). With --calibration, GPTQ (Frantar et al. 2022) rounds each layer's columns in turn,
                 compensating every rounding error on the columns not yet rounded as the layer's inputs on that
                 text correlate (the default model at group size 128: perplexity 1.39x float -> 1.14x).
  experts        Int8Experts (mixtures of experts, in both modes): stacked `w1`, `w3`, `w2` int8 [E, N, K], with
                 `w1_scales`, `w3_scales`, `w2_scales` [E, N]; the router stays float.
  embedding      stays float: a lookup reads one row per token, so quantizing it saves memory, not time.
A tied embedding becomes two tensors (the float table, the int8 head): configs say tie_embeddings=false. The output
(default: DIR-int8 or DIR-int4-gG beside DIR) gets DIR's tokenizer files; config.json's "quantization" is the format.
quantize.load reads it (generate.py with no extra flag); gdkernels/ swaps in GEMVs that read the packed weights.
"""
import argparse
import functools
import itertools
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from common import ConversionError, UsageError, one_line_errors
from convert_hf_checkpoint import prepare_default_model, staged, write_safetensors
from model import ModelArgs, MoEFeedForward, Transformer, read_config

SCALE_DTYPE = torch.bfloat16  # the kernels' dtype: scales are fitted to the values they will have
BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
INT4_GROUPSIZES = (32, 64, 128, 256)
INT4_DIMS = "int4 needs an input dim that is a multiple of 32 and an output dim that is a multiple of 16"
CALIBRATION_WINDOW = 256  # tokens per calibration sequence


# -- the quantized layers (the formats above): what quantize_checkpoint writes, in plain PyTorch ---------------

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


def unpack_int4(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] (column 2j in the low nibble) -> int32 [N, K] in 0..15."""
    return torch.stack([weight & 15, weight >> 4], dim=-1).view(weight.shape[0], -1).int()


def dequantize_int4(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groupsize: int) -> torch.Tensor:
    q = unpack_int4(weight).to(scales.dtype)
    group = torch.arange(q.shape[1], device=q.device) // groupsize  # column -> its group
    return (q - 8) * scales[:, group] + zeros[:, group]


def _parameter(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = _parameter(out_features, in_features, dtype=torch.int8)
        self.scales = _parameter(out_features, dtype=torch.get_default_dtype())
        self.bias = _parameter(out_features, dtype=torch.get_default_dtype()) if bias else None

    def forward(self, x):
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False):
        super().__init__()
        if in_features % 32 or out_features % 16:
            raise ValueError(f"{INT4_DIMS} (got {in_features} -> {out_features})")
        self.groupsize = groupsize
        groups = -(-in_features // groupsize)
        self.weight = _parameter(out_features, in_features // 2, dtype=torch.uint8)
        self.scales = _parameter(out_features, groups, dtype=torch.get_default_dtype())
        self.zeros = _parameter(out_features, groups, dtype=torch.get_default_dtype())
        self.bias = _parameter(out_features, dtype=torch.get_default_dtype()) if bias else None

    def forward(self, x):
        w = dequantize_int4(self.weight, self.scales, self.zeros, self.groupsize)
        return F.linear(x, w.to(x.dtype), self.bias)


class Int8Experts(MoEFeedForward):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for name in ("w1", "w3", "w2"):
            shape = getattr(self, name).shape
            setattr(self, name, _parameter(*shape, dtype=torch.int8))
            setattr(self, f"{name}_scales", _parameter(*shape[:2], dtype=torch.get_default_dtype()))

    def experts(self, name, index):  # dequantized: the experts' weights [T, k, N, K] (None: all, [1, E, N, K])
        scales = getattr(self, f"{name}_scales")[index]
        return getattr(self, name)[index].to(scales.dtype) * scales.unsqueeze(-1)


def quantized_layers(model: Transformer, quantization: dict) -> None:
    """Replace the blocks' nn.Linear layers by quantized ones of `quantization`'s mode (the head by Int8Linear, a
    mixture's experts by Int8Experts), empty, ready to load a quantized state dict: from_checkpoint's `quantized`."""
    mode, groupsize = check_quantization(quantization)
    if model.args.tie_embeddings:
        raise ValueError("a quantized checkpoint keeps the head apart from the embedding: its config "
                         "must say tie_embeddings=false")

    def quantized(linear: nn.Linear, mode: str) -> nn.Module:
        dims, bias = (linear.in_features, linear.out_features), linear.bias is not None
        return Int8Linear(*dims, bias) if mode == "int8" else Int4Linear(*dims, groupsize, bias)

    for layer in model.layers:
        moe, ffn = isinstance(layer.feed_forward, MoEFeedForward), layer.feed_forward
        if moe:
            layer.feed_forward = Int8Experts(model.args)
        linears = [(layer.attention, "wqkv"), (layer.attention, "wo")] + [(ffn, "w13"), (ffn, "w2")] * (not moe)
        for parent, name in linears:
            setattr(parent, name, quantized(getattr(parent, name), mode))
    model.output = quantized(model.output, "int8")


def load(path, device="cpu", dtype=torch.bfloat16, split=None) -> Transformer:
    """Any checkpoint directory, float or quantized (Transformer.from_checkpoint with quantized_layers)."""
    return Transformer.from_checkpoint(path, device=device, dtype=dtype, quantized=quantized_layers, split=split)


def int4_units(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The grid's units for int4 scales and zeros [N, G]: [N, 2] float32, per row the smallest power of two u with
    max |scales| <= 255 u, then the one with max |zeros| <= 127 u (1 where all are 0)."""
    m, e = torch.frexp(torch.stack([scales.float().abs().amax(1) / 255, zeros.float().abs().amax(1) / 127], dim=1))
    return torch.where(m > 0, torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e)), 1.0)


# -- the quantizers: float weight [N, K] -> the file's tensors ------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric, per row: (int8 [N, K], scales [N]) with w ~ q * scales[:, None]."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(SCALE_DTYPE)
    q = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, groupsize: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric, per group of `groupsize` columns (the last group shorter when groupsize does not divide K):
    (uint8 [N, K/2] two values a byte, scales [N, G], zeros [N, G]), the scales and zeros on the grid (_grid_fit)."""
    if w.shape[1] % 2:
        raise ConversionError(f"int4 needs an even input dim (got {w.shape[1]})")
    pieces, fits, units = _group_fits(w, groupsize)
    levels, scales, zeros = zip(*(_grid_fit(piece, *fit, units) for piece, fit in zip(pieces, fits)))
    q = torch.cat([lv.flatten(1) for lv in levels], dim=1).to(torch.uint8)  # [N, K] in 0..15
    return q[:, ::2] | q[:, 1::2] << 4, torch.cat(scales, dim=1), torch.cat(zeros, dim=1)


def _group_fits(w: torch.Tensor, groupsize: int) -> tuple[list, list, torch.Tensor]:
    """w [N, K] in float32 as groups ([N, K // groupsize, groupsize], then [N, 1, K % groupsize] if that is not 0),
    their _fit_int4 fits (scale, zero), and the grid's units [N, 2] of each row from those fits."""
    N, K = w.shape
    full = K // groupsize * groupsize
    pieces = [p.view(N, -1, min(groupsize, p.shape[1])) for p in w.float().split([full, K - full], dim=1) if p.shape[1]]
    fits = [_fit_int4(piece) for piece in pieces]
    return pieces, fits, int4_units(*(torch.cat(f, dim=1) for f in zip(*fits)))


# Scales and zeros on a grid: a whole number of a power of two per row, 8 bits (scales 1..255, zeros -127..127),
# exact in bf16, so every kernel computes with the same weights and gdkernels/int4.py reads them as one byte each.

def _grid_fit(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fit of groups w [N, G, g] (scale, zero [N, G]) moved onto the grid of `units` [N, 2]: of the four grid
    points around it, the one whose levels leave the least squared error -> (levels [N, G, g] in 0..15, scale,
    zero in SCALE_DTYPE). (Nearest rounding of scale and zero alone cost the default model 0.7% perplexity at g128.)"""
    unit_s, unit_z = units[:, None, :1], units[:, None, 1:]  # [N, 1, 1]
    codes_s, codes_z = scale.float()[..., None] / unit_s, zero.float()[..., None] / unit_z  # [N, G, 1]
    best = None
    for k_s, k_z in itertools.product((codes_s.floor(), codes_s.ceil()), (codes_z.floor(), codes_z.ceil())):
        s, z = k_s.clamp(1, 255) * unit_s, k_z.clamp(-127, 127) * unit_z
        levels = ((w - z) / s).round().clamp(-8, 7)
        err = ((levels * s + z - w) ** 2).sum(-1, keepdim=True)
        new = (err, levels, s, z)
        best = new if best is None else tuple(torch.where(new[0] < best[0], a, b) for a, b in zip(new, best))
    _, levels, s, z = best
    return levels + 8, s.squeeze(-1).to(SCALE_DTYPE), z.squeeze(-1).to(SCALE_DTYPE)


def _fit_int4(w: torch.Tensor, clips=(0.0, 0.05, 0.1)) -> tuple[torch.Tensor, ...]:
    """w [N, G, g] -> (scales [N, G], zeros [N, G]) minimising the squared error per group:
    for each clipping of the group's [min, max] range from below and above, round, refit scale and zero by least
    squares for those levels, round again; keep the best (it beats plain min/max and symmetric 4-bit: BENCHMARKS.md)."""
    g = w.shape[-1]
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    span = (hi - lo).clamp(min=1e-12)
    best = (torch.full_like(lo, float("inf")), span / 15, lo + 8 * span / 15)
    for a, b in itertools.product(clips, clips):
        scale = span * (1 - a - b) / 15
        zero = lo + a * span + 8 * scale
        for refit in (True, False):
            scale, zero = scale.to(SCALE_DTYPE).float().clamp(min=1e-12), zero.to(SCALE_DTYPE).float()
            q = ((w - zero) / scale).round().clamp(-8, 7)
            if refit:  # least squares for w ~ q * scale + zero, the levels q fixed
                sq, sw = q.sum(-1, keepdim=True), w.sum(-1, keepdim=True)
                den = g * (q * q).sum(-1, keepdim=True) - sq * sq
                ok = den > 0
                fit_scale = (g * (q * w).sum(-1, keepdim=True) - sq * sw) / torch.where(ok, den, 1)
                scale = torch.where(ok & (fit_scale > 0), fit_scale, scale)
                zero = torch.where(ok, (sw - scale * sq) / g, zero)
        err = ((q * scale + zero - w) ** 2).sum(-1, keepdim=True)
        best = tuple(torch.where(err < best[0], new, old) for new, old in zip((err, scale, zero), best))
    _, scale, zero = best
    return scale.squeeze(-1).to(SCALE_DTYPE), zero.squeeze(-1).to(SCALE_DTYPE)


def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, groupsize: int, damp: float = 0.01,
              block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int4's format by GPTQ: w [N, K], hessian [K, K] = sum of x x^T over the layer's inputs x. Columns
    are rounded left to right, each group's scale and zero fitted as it starts (the grid's units from W before any
    update); each rounding error is spread over the columns to its right through the Cholesky factor of the inverse
    Hessian (minimising the error of x @ w.T, not of w), lazily per block of columns."""
    N, K = w.shape
    if block % groupsize and groupsize % block:
        raise ValueError(f"gptq_int4: block {block} and group size {groupsize} must divide one another")
    W, H = w.double().clone(), hessian.double().clone()
    dead = torch.diag(H) == 0  # inputs that are always 0: their weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.diag(H).mean() * torch.eye(K, dtype=H.dtype, device=H.device)  # dampened, as the paper does
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    units = _group_fits(W.float(), groupsize)[2]  # from W as it starts
    q = torch.zeros(N, K, dtype=torch.uint8, device=w.device)
    fits = []  # (scale, zero) [N, 1] of each group
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        Wb, errors = W[:, b0:b1].clone(), torch.zeros(N, b1 - b0, dtype=W.dtype, device=W.device)
        for i in range(b1 - b0):
            j = b0 + i
            if j % groupsize == 0:  # a new group: its scale and zero
                group = torch.cat([Wb[:, i:], W[:, b1:j + groupsize]], dim=1)[:, :groupsize].float().unsqueeze(1)
                fits.append(_grid_fit(group, *_fit_int4(group), units)[1:])
                s, z = (t.double().view(N) for t in fits[-1])
            level = ((Wb[:, i] - z) / s).round().clamp(-8, 7)
            q[:, j] = (level + 8).to(torch.uint8)
            errors[:, i] = (Wb[:, i] - (level * s + z)) / U[j, j]
            Wb[:, i:] -= errors[:, i:i + 1] * U[j, j:b1][None, :]
        W[:, b1:] -= errors @ U[b0:b1, b1:]
    scales, zeros = zip(*fits)
    return q[:, ::2] | q[:, 1::2] << 4, torch.cat(scales, dim=1), torch.cat(zeros, dim=1)


def calibration_window(n_tokens: int, args: ModelArgs) -> int:
    return min(n_tokens, CALIBRATION_WINDOW, args.max_seq_len)


@torch.no_grad()
def calibrate(model: Transformer, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Hessians for gptq_int4 (sum of x x^T of each block linear's input, float32: one K x K matrix per distinct
    input, held all at once), from forwards of the float model over `tokens` in whole windows of calibration_window
    (a shorter tail is left out), keyed by the checkpoint's weight names (q, k, v share one, as do gate and up)."""
    length = calibration_window(len(tokens), model.args)
    hessians, hooks = {}, []

    def accumulate(names, module, args, out):
        x = args[0].reshape(-1, args[0].shape[-1]).float()  # the matmul's input
        h = hessians.get(names[0], 0) + x.T @ x
        hessians.update(dict.fromkeys(names, h))  # fused q/k/v and gate/up: one input

    for i, layer in enumerate(model.layers):
        a, f = layer.attention, layer.feed_forward
        for module, names in ((a.wqkv, ("attention.wq", "attention.wk", "attention.wv")), (a.wo, ("attention.wo",)),
                              (getattr(f, "w13", None), ("feed_forward.w1", "feed_forward.w3")),
                              (f.w2, ("feed_forward.w2",))):
            keys = [f"layers.{i}.{n}.weight" for n in names]
            if isinstance(module, nn.Module):  # (not a mixture's stacked experts: int8 in every mode)
                hooks.append(module.register_forward_hook(functools.partial(accumulate, keys)))
    device = model.tok_embeddings.weight.device
    try:
        model.setup_caches(1, length)
        for k in range(len(tokens) // length):
            window = torch.tensor([tokens[k * length:(k + 1) * length]], device=device)
            model(window, torch.arange(window.shape[1], device=device))
    finally:
        for h in hooks:
            h.remove()
    return hessians


def quantize_tensors(tensors: Iterator[tuple[str, torch.Tensor]], mode: str, groupsize: int | None,
                     tied: bool, hessians: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A float checkpoint's (name, tensor) stream -> the quantized one's (int4 by GPTQ where `hessians` is given)."""
    for name, t in tensors:
        if tied and name == "output.weight":
            continue  # the embedding's, made below
        if name == "tok_embeddings.weight":
            yield name, t  # a lookup reads one row per token: kept float
            if not tied:
                continue
            name = "output.weight"  # the tied head, stored apart from now on: int8 below
        if t.dim() == 3:  # a layer's stacked experts: int8 in every mode, a scale per expert and row
            q, scales = quantize_int8(t.flatten(0, 1))
            yield from ((name, q.view(t.shape)), (f"{name}_scales", scales.view(t.shape[:2])))
            continue
        module, _, kind = name.rpartition(".")
        names = (name, module + ".scales", module + ".zeros")  # the quantizers' tensors, in order
        if kind != "weight" or not (module == "output" or module.endswith(BLOCK_LINEARS)):
            yield name, t  # norms, biases: as they are
        elif module == "output" or mode == "int8":
            yield from zip(names, quantize_int8(t))
        else:
            N, K = t.shape
            if K % 32 or N % 16:
                raise ConversionError(f"{name}: {INT4_DIMS} (got {N} x {K})")
            if hessians is not None and name not in hessians:
                raise ConversionError(f"{name}: no calibration statistics for it (GPTQ)")
            yield from zip(names, quantize_int4(t, groupsize) if hessians is None
                           else gptq_int4(t, hessians[name], groupsize))


def quantized_config(config: dict, mode: str, groupsize: int | None) -> dict:
    quantization = {"mode": mode} | ({"groupsize": groupsize} if mode == "int4" else {})
    return {k: v for k, v in config.items() if k != "args"} | {
        "model": dict(config["model"], tie_embeddings=False), "quantization": quantization}


def quantize_model(model: Transformer, mode: str, groupsize: int | None = None,
                   calibration: list[int] | None = None) -> Transformer:
    """The quantized twin of a float model: quantize_checkpoint's tensors, made in memory (int4 by GPTQ on the
    token ids `calibration`, if given), loaded through the same modules and hooks."""
    args = model.args
    state = split_fused(model.state_dict(), args)  # (a tied output.weight: quantize_tensors skips it)
    config = quantized_config({"model": asdict(args)}, mode, groupsize)
    with torch.device("meta"):
        qmodel = Transformer(ModelArgs.from_dict(config["model"]))
        quantized_layers(qmodel, config["quantization"])
    emb = model.tok_embeddings.weight
    hessians = calibrate(model, calibration) if calibration and mode == "int4" else None
    qstate = {k: v.to(emb.device, emb.dtype if v.is_floating_point() else v.dtype)
              for k, v in quantize_tensors(iter(state.items()), mode, groupsize, args.tie_embeddings, hessians)}
    qmodel.load_state_dict(qstate, strict=True, assign=True)
    return qmodel.eval().requires_grad_(False)


def split_fused(state: dict, args: ModelArgs) -> dict:
    """A loaded model's wqkv and w13 back into the checkpoint's wq, wk, wv and w1, w3."""
    out = {}
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    for name, t in state.items():
        if ".attention.wqkv." in name:
            out.update((name.replace("wqkv", p), x) for p, x in zip(("wq", "wk", "wv"), t.split([q, kv, kv])))
        elif ".feed_forward.w13." in name:
            out.update((name.replace("w13", p), x) for p, x in zip(("w1", "w3"), t.chunk(2)))
        else:
            out[name] = t
    return out


# -- the checkpoint directory ---------------------------------------------------------------------

def default_out(checkpoint: Path, mode: str, groupsize: int | None) -> Path:
    suffix = "int8" if mode == "int8" else f"int4-g{groupsize}"
    return checkpoint.parent / f"{checkpoint.resolve().name}-{suffix}"


def prepare_default(device: torch.device) -> Path:
    """The default model, prepared on first use (convert_hf_checkpoint.py); on the CPU its int4 form: 2.5x the
    float model's speed there (README). A failure is a UsageError, one line."""
    try:
        checkpoint = prepare_default_model()
        return prepare_default_int4(checkpoint) if device.type == "cpu" else checkpoint
    except ConversionError as e:
        raise UsageError(f"could not prepare the default model: {e}") from None


def prepare_default_int4(checkpoint: Path) -> Path:
    """The default model's int4 form (groups of 32), next to its float checkpoint, made once: what generate.py
    runs on the CPU (README: the GGUF it comes from is Q4_1, so g32 costs nothing)."""
    out = default_out(checkpoint, "int4", 32)
    return out if (out / "config.json").is_file() else quantize_checkpoint(checkpoint, "int4", 32, out)


def quantize_checkpoint(checkpoint: Path, mode: str, groupsize: int | None = None, out: Path | None = None,
                        calibration: Path | None = None, force: bool = False) -> Path:
    """Write the quantized checkpoint (int4 by GPTQ on the text file `calibration`, if given)."""
    checkpoint = Path(checkpoint)
    if calibration is not None and mode != "int4":
        raise ConversionError("--calibration applies to --mode int4 (GPTQ); int8 rounds per channel")
    groupsize = 32 if mode == "int4" and groupsize is None else groupsize
    try:
        config = read_config(checkpoint)
        new_config = quantized_config(config, mode, groupsize)
        check_quantization(new_config["quantization"])  # (ValueError for an unknown mode or group size)
    except (FileNotFoundError, ValueError) as e:
        raise ConversionError(str(e)) from None
    if config.get("quantization"):
        raise ConversionError(f"{checkpoint} is already quantized ({config['quantization']}); "
                            f"quantize its float checkpoint instead")
    weights = checkpoint / "model.safetensors"
    if not weights.is_file():
        raise ConversionError(f"{checkpoint}: no model.safetensors")
    out = Path(out) if out else default_out(checkpoint, mode, groupsize)
    if out.exists() and not force:
        raise ConversionError(f"{out} already exists (use --force to replace it)")
    start = time.time()
    hessians = calibration_hessians(checkpoint, Path(calibration)) if calibration is not None else None
    label = mode if mode == "int8" else f"int4, group size {groupsize}" + (", GPTQ" if hessians else "")
    print(f"quantizing {checkpoint} -> {out} ({label})", file=sys.stderr)
    with staged(out) as tmp:
        with safe_open(weights, framework="pt") as f:
            tensors = ((name, f.get_tensor(name)) for name in f.keys())
            write_safetensors(tmp / "model.safetensors",
                              quantize_tensors(tensors, mode, groupsize, config["args"].tie_embeddings, hessians),
                              {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
        for f in checkpoint.iterdir():  # tokenizer files, generation_config.json, ...
            if f.is_file() and f.name not in ("model.safetensors", "config.json"):
                shutil.copy2(f, tmp / f.name)
        try:  # loads as the runtime will, or is not kept
            load(tmp, device="meta", dtype=torch.float32)
        except (ValueError, RuntimeError) as e:
            raise ConversionError(f"the quantized checkpoint does not load: {e}") from None
    size = (out / "model.safetensors").stat().st_size / 2**20
    print(f"wrote {out} ({size:.0f} MiB, {time.time() - start:.1f} s)", file=sys.stderr)
    return out


def calibration_hessians(checkpoint: Path, text_file: Path) -> dict[str, torch.Tensor]:
    """calibrate() on the float model of `checkpoint` (whole, float32, on the CPU) reading `text_file`, tokenized."""
    from tokenizer import load_tokenizer

    try:
        text = text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"--calibration {text_file}: cannot read it as text ({e})") from None
    try:
        tokens = load_tokenizer(checkpoint).encode(text)
    except Exception as e:  # a missing or unusable tokenizer file
        raise ConversionError(f"--calibration needs the checkpoint's tokenizer: {e}") from None
    if len(tokens) < 2:
        raise ConversionError(f"--calibration {text_file}: no text to calibrate on")
    start = time.time()
    try:
        model = Transformer.from_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
        window = calibration_window(len(tokens), model.args)
        used = len(tokens) // window * window  # whole windows only
        widest = max(model.args.dim, model.args.intermediate_size, model.args.n_heads * model.args.head_dim)
        print(f"calibrating on {used} tokens of {text_file}", file=sys.stderr)
        if used < 2 * widest:
            print(f"warning: {used} calibration tokens are few for inputs {widest} wide (GPTQ can then do "
                  f"worse than rounding: give {2 * widest} or more)", file=sys.stderr)
        hessians = calibrate(model, tokens)
    except ValueError as e:  # an unreadable or mismatched checkpoint
        raise ConversionError(str(e)) from None
    print(f"calibrated in {time.time() - start:.1f} s", file=sys.stderr)
    return hessians


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="float checkpoint directory")
    p.add_argument("--mode", choices=["int8", "int4"], required=True)
    p.add_argument("--groupsize", type=int, choices=INT4_GROUPSIZES, default=None,
                   help="int4 only: input columns per scale and zero (default 32)")
    p.add_argument("--out", type=Path, help="output directory (default: DIR-int8 or DIR-int4-gG)")
    p.add_argument("--calibration", type=Path, metavar="TEXTFILE", help="int4 only: quantize by GPTQ, calibrated "
                   "on this text (e.g. tests/data/calibration_text.txt); loads the float model in float32")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    if args.mode == "int8" and args.groupsize is not None:
        p.error("--groupsize applies to --mode int4 only (int8 has one scale per output channel)")
    return one_line_errors(lambda: print(quantize_checkpoint(args.checkpoint, args.mode, args.groupsize, args.out,
                                                             args.calibration, args.force)))


if __name__ == "__main__":
    sys.exit(main())
