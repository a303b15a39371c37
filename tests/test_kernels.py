"""cuda_kernels.py's Triton GEMVs against float64 references: bf16 and int8 weights, one row and
several, shapes that do and do not fill the blocks, with and without a split of K. Without a GPU
they run in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET); `pytest -m cuda` also
runs them on the GPU with the tuned launches."""
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cuda_kernels
from model import int4_gemv_layout

# (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages): one that fits the shapes below exactly, one
# that leaves partial blocks, one that splits K into unequal parts.
LAUNCHES = [(16, 64, 1, 4, 2), (32, 128, 1, 4, 2), (16, 64, 3, 4, 2)]
SHAPES = [(64, 256), (40, 320)]  # (N, K)


def weights(kind, N, K):
    torch.manual_seed(N * K)
    if kind == "bf16":
        w = torch.randn(N, K).bfloat16()
        return w, None, w.double()
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    scales = (torch.rand(N) / 64).bfloat16()
    return q, scales, q.double() * scales.double()[:, None]


def half_slack(kind, M, norm=False) -> float:
    """What float16-pair arithmetic adds to bf16's rounding of the result, relative to the largest
    output, where it runs (cuda_kernels.use_half: int8 weights, one row of bf16 x, the norm fused): its
    products carry 11 bits and each lane sums K / BLOCK_K of them in float16 (measured ~5e-4; an
    indexing error is ~1)."""
    half = kind == "int8" and M == 1 and cuda_kernels.INT8_HALF and (norm or cuda_kernels.HALF_EVERYWHERE)
    return 2e-3 if half else 1e-5


def check(device, kind, M, N, K, launch):
    w, scales, reference_w = weights(kind, N, K)
    w, scales = w.to(device), scales if scales is None else scales.to(device)
    x = torch.randn(M, K).bfloat16().to(device)
    reference = x.double().cpu() @ reference_w.T
    size = reference.abs().max().item()
    # float32 activations with bf16 values: every product is exact, so only the float32 sums err
    # (an indexing mistake would be off by the size of the result, not by 1e-4 of it)
    y = cuda_kernels.gemv(x.float(), w, scales, launch=launch)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert (y.double().cpu() - reference).abs().max().item() <= 1e-4 * size
    # bf16 in, bf16 out: the result rounded once, to nearest (the interpreter truncates instead)
    y = cuda_kernels.gemv(x.view(1, M, K), w, scales, launch=launch)
    assert y.dtype == torch.bfloat16 and y.shape == (1, M, N)
    rounding = 2**-8 if device == "cuda" else 2**-7
    assert ((y[0].double().cpu() - reference).abs() <= rounding * reference.abs() + half_slack(kind, M) * size).all()


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_gemv_matches_float64(kind, M, N, K, launch):
    check("cuda" if torch.cuda.is_available() else "cpu", kind, M, N, K, launch)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 5, 8])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_gemv_tuned_launches_on_decode_shapes(kind, M):
    """The launches `config` picks, on 7B-like shapes (narrow, wide, K not a multiple of 1024)."""
    for N, K in [(4096, 4096), (12288, 4096), (4096, 11008), (32000, 4096)]:
        check("cuda", kind, M, N, K, None)


def test_usable_only_on_cuda_with_a_contiguous_weight():
    w = torch.zeros(4, 8)
    assert not cuda_kernels.usable(torch.zeros(1, 8), w, max_rows=16)
    if torch.cuda.is_available():
        x, w = torch.zeros(2, 3, 8, device="cuda"), w.cuda()
        assert cuda_kernels.usable(x, w, max_rows=6) and not cuda_kernels.usable(x, w, max_rows=5)
        assert not cuda_kernels.usable(x, w.t().contiguous().t(), max_rows=6)


def test_opaque_op_matches_and_compiles(monkeypatch):
    """cuda_kernels.matmul through the custom op (the default; bench.py --traced-gemv: not): same numbers as gemv, and
    torch.compile(fullgraph=True) accepts it (its fake tells the compiler the output's shape)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, scales, _ = weights("int8", 64, 256)
    w, scales = w.to(device), scales.to(device)
    x = torch.randn(1, 3, 256).bfloat16().to(device)
    monkeypatch.setattr(cuda_kernels, "OPAQUE", True)
    expected = cuda_kernels.gemv(x, w, scales)
    assert cuda_kernels.matmul(x, w, scales).equal(expected)
    compiled = torch.compile(lambda x: cuda_kernels.matmul(x, w, scales) * 2, fullgraph=True)
    assert compiled(x).equal(expected * 2)


@pytest.mark.parametrize("launch", [LAUNCHES[0], LAUNCHES[1], None])
@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_fused_norm_and_residual_match_float64(kind, N, K, launch):
    """One row: rmsnorm(x) @ W.T, residual + x @ W.T and both, against float64. A split in the
    launch is overridden (the norm needs all of K in one program)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if launch is None and device == "cpu":
        launch = (16, 64, 3, 4, 2)
    w, scales, reference_w = weights(kind, N, K)
    w, scales = w.to(device), scales if scales is None else scales.to(device)
    x = (4 * torch.randn(1, K)).bfloat16()
    g = (1 + torch.rand(K)).bfloat16()
    r = torch.randn(1, N).bfloat16()
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()
    cases = [  # (kwargs, reference)
        (dict(norm_weight=g.to(device), eps=1e-5), normed @ reference_w.T),
        (dict(residual=r.to(device)), r.double() + xd @ reference_w.T),
        (dict(norm_weight=g.to(device), eps=1e-5, residual=r.to(device)), r.double() + normed @ reference_w.T),
        # an eps that matters (mean(x^2) is about 16): a dropped or misplaced eps fails
        (dict(norm_weight=g.to(device), eps=4.0),
         xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 4.0) * g.double() @ reference_w.T),
    ]
    for kwargs, reference in cases:
        size = reference.abs().max().item()
        # float32 in and out: only float32 arithmetic errs
        y = cuda_kernels.gemv(x.float().to(device), w, scales, launch=launch,
                         **{k: v.float() if k == "residual" else v for k, v in kwargs.items()})
        assert (y.double().cpu() - reference).abs().max().item() <= 1e-4 * size, kwargs
        y = cuda_kernels.gemv(x.to(device), w, scales, launch=launch, **kwargs)
        assert y.dtype == torch.bfloat16
        rounding = 2**-8 if device == "cuda" else 2**-7
        assert ((y.double().cpu() - reference).abs() <= rounding * reference.abs()
                + half_slack(kind, 1, "norm_weight" in kwargs) * size).all(), kwargs


@pytest.mark.parametrize("launch", [(8, 64, 1, 4, 2), (16, 128, 1, 4, 2), None])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_fused_swiglu_matches_float64(kind, launch):
    """One row, swiglu: silu(a) * b of the product's halves a (rows < N/2) and b, alone and with
    the norm before and the residual after, against float64. Also with halves that leave a partial
    block (N/2 = 40)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if launch is None and device == "cpu":
        launch = (16, 64, 1, 4, 2)
    for N, K in [(128, 256), (80, 320)]:
        w, scales, reference_w = weights(kind, N, K)
        w, scales = w.to(device), scales if scales is None else scales.to(device)
        x = (4 * torch.randn(1, K)).bfloat16()
        g = (1 + torch.rand(K)).bfloat16()
        r = torch.randn(1, N // 2).bfloat16()
        xd = x.double()
        normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()

        def swiglu(y):
            a, b = y.chunk(2, dim=-1)
            return a * torch.sigmoid(a) * b

        cases = [
            (dict(), swiglu(xd @ reference_w.T)),
            (dict(norm_weight=g.to(device), eps=1e-5, residual=r.to(device)), r.double() + swiglu(normed @ reference_w.T)),
        ]
        for kwargs, reference in cases:
            size = reference.abs().max().item()
            y = cuda_kernels.gemv(x.float().to(device), w, scales, swiglu=True, launch=launch,
                             **{k: v.float() if k == "residual" else v for k, v in kwargs.items()})
            assert y.shape == (1, N // 2)
            assert (y.double().cpu() - reference).abs().max().item() <= 1e-4 * size, (N, kwargs)
            y = cuda_kernels.gemv(x.to(device), w, scales, swiglu=True, launch=launch, **kwargs)  # bf16 (int8: HALF)
            rounding = 2**-8 if device == "cuda" else 2**-7
            assert ((y.double().cpu() - reference).abs() <= rounding * reference.abs()
                    + half_slack(kind, 1, "norm_weight" in kwargs) * size).all(), (N, kwargs)


@pytest.mark.parametrize("fused", ["none", "norm", "swiglu", "residual"])
@pytest.mark.parametrize("N, K, launch", [(64, 256, (16, 64, 1, 4, 2)), (44, 2080, (8, 1024, 1, 4, 2)),
                                          (48, 4096, (8, 1024, 1, 4, 4)), (40, 320, (16, 64, 3, 4, 2))])
def test_int8_half_pairs_match_float64_in_float16(N, K, launch, fused, monkeypatch):
    """cuda_kernels.INT8_HALF (one row of int8 weights in float16 pairs, here on every GEMV) against
    float64, with fp16 x and output, so that the arithmetic's own error shows (bf16's rounding would
    hide it): within 2e-3 of the largest output, the float32 path within 1e-3 (fp16's rounding of the
    output), also with a K tail (2080 = 2 x 1024 + 32: clamped x loads there), a partial block of
    rows (44 at 8 a block) and, without fusions, a split of K (3 splits of 5 blocks)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, scales, reference_w = weights("int8", N, K)
    w, scales = w.to(device), scales.to(device)
    x = torch.randn(1, K).half()  # (outputs of a few hundred: the products of swiglu stay in float16's range)
    g = (1 + torch.rand(K)).half()
    xd = x.double()
    kwargs, reference = {}, xd @ reference_w.T
    if fused == "norm":
        kwargs = dict(norm_weight=g.to(device), eps=1e-5)
        reference = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()) @ reference_w.T
    elif fused == "swiglu":
        kwargs = dict(swiglu=True)
        a, b = reference.chunk(2, dim=-1)
        reference = a * torch.sigmoid(a) * b
    elif fused == "residual":
        r = torch.randn(1, N).half()
        kwargs, reference = dict(residual=r.to(device)), reference + r.double()
    size = reference.abs().max().item()
    errors = {}
    monkeypatch.setattr(cuda_kernels, "HALF_EVERYWHERE", True)  # (by default only with the norm: cuda_kernels.use_half)
    for half in (True, False):
        monkeypatch.setattr(cuda_kernels, "INT8_HALF", half)
        y = cuda_kernels.gemv(x.to(device), w, scales, launch=launch, **kwargs)
        assert y.dtype == torch.float16
        errors[half] = (y.double().cpu() - reference).abs().max().item() / size
    assert errors[True] <= 2e-3 and errors[False] <= 1e-3, errors


def test_int8_half_pairs_can_be_turned_off_from_the_environment():
    """GRAPHDECODE_INT8_HALF=0: every int8 GEMV in float32 (the way out for a model whose norm inputs
    leave float16's range)."""
    import subprocess
    import sys

    code = "import cuda_kernels; print(cuda_kernels.INT8_HALF)"
    for value, expected in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "GRAPHDECODE_INT8_HALF": value}, cwd=Path(cuda_kernels.__file__).parent)
        assert out.stdout.strip() == expected


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_int8_half_pairs_over_the_range_of_real_activations(scale, monkeypatch):
    """Float16 pairs apply the norm's rsqrt at the end, so x g itself must fit float16: checked with
    the norm fused over the range the default model's norm inputs span (BENCHMARKS.md: median |x g|
    1e-3 at layer 0 to a largest |x g| of 1.3e4 at layer 28), against float64 and within 2e-3 of the
    largest output. (Far smaller inputs lose precision to subnormals, far larger overflow: the
    cuda_kernels.py docstring of _half_block.)"""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, scales, reference_w = weights("int8", 64, 1024)
    x = torch.randn(1, 1024) * scale
    x[0, 7] = 40 * scale  # one outlier, as the residual stream has
    x = x.bfloat16()
    g = (0.2 + torch.rand(1024)).bfloat16()
    xd = x.double()
    reference = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()) @ reference_w.T
    monkeypatch.setattr(cuda_kernels, "INT8_HALF", True)
    y = cuda_kernels.gemv(x.to(device).half(), w.to(device), scales.to(device), norm_weight=g.to(device).half(), eps=1e-5,
                     launch=(16, 256, 1, 4, 2))
    size = reference.abs().max().item()
    assert (y.double().cpu() - reference).abs().max().item() <= 2e-3 * size


def int4_weights(N, K, G, scale=1.0, grid=False):
    """Random int4 weights in model.py's file layout and their float64 values; grid: the scales and
    zeros on quantize.py's grid (as it writes them)."""
    from model import dequantize_int4, int4_units
    from quantize import on_grid

    torch.manual_seed(N * K + G)
    q = torch.randint(0, 16, (N, K))
    packed = (q[:, ::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    groups = -(-K // G)
    scales = ((torch.rand(N, groups) / 50 + 1e-3) * scale).bfloat16()
    zeros = (torch.randn(N, groups) / 100 * scale).bfloat16()
    if grid:
        scales, zeros = on_grid(scales, zeros, int4_units(scales, zeros))
    return packed, scales, zeros, dequantize_int4(packed, scales.double(), zeros.double(), G)


def int4_case(fused, x, N, W):
    """(int4_gemv's keyword arguments, float64 reference, size) for one of the fusions. size is what
    an error of e times the largest product moves the output by, over e: the largest output, or for
    SwiGLU, silu(a) b with |silu'| < 1.1, 2.1 max|a| max|b| (its largest output can be far smaller)."""
    xd = x.double()
    if fused in ("norm", "swiglu"):
        g = (0.5 + torch.rand(x.shape[-1])).bfloat16()
        kwargs = dict(norm_weight=g, eps=1e-5)
        reference = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()) @ W.T
        if fused == "swiglu":
            kwargs["swiglu"] = True
            a, b = reference.chunk(2, dim=-1)
            return kwargs, a * torch.sigmoid(a) * b, 2.1 * a.abs().max().item() * b.abs().max().item()
        return kwargs, reference, reference.abs().max().item()
    if fused == "residual":
        r = torch.randn(1, N).to(x.dtype)
        reference = xd @ W.T + r.double()
        return dict(residual=r), reference, reference.abs().max().item()
    return {}, xd @ W.T, (xd @ W.T).abs().max().item()


# How far int4_gemv may be from the float64 product, as a share of int4_case's size: float16 pairs
# round sums to float16; dp4a takes x to int8 per int4 group (~0.5% noise on each x; its own exact
# check is test_int4_gemv_dp4a_is_its_definition). An indexing, nibble-order or scale error is ~1.
INT4_TOLERANCE = {False: 2e-3, True: 2.5e-2}


@pytest.mark.parametrize("dp4a, codes", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("fused", ["none", "norm", "swiglu", "residual"])
@pytest.mark.parametrize("N, K, G, launch", [(64, 256, 32, (16, 4, 4, 2, True)), (40, 576, 128, (16, 2, 4, 2, True)),
                                             (48, 1024, 32, None), (32, 512, 128, (8, 1, 4, 1, False)),
                                             (40, 576, 128, (16, 2, 4, 2, False)), (40, 576, 128, (16, 2, 4, 2, 2)),
                                             (64, 576, 32, (16, 16, 4, 2, 2)), (32, 256, 32, (8, 8, 4, 2, 2)),
                                             (40, 320, 32, (16, 4, 4, 2, 2)), (32, 256, 32, (16, 4, 4, 2, 2))])
def test_int4_gemv_matches_float64(N, K, G, launch, fused, dp4a, codes):
    """cuda_kernels.int4_gemv (one row, float16 pairs or dp4a, file layout repacked by int4_gemv_layout;
    codes: scales and zeros on quantize.py's grid, read as int16 codes) against the float64 product
    of the dequantized weights: float32 x within INT4_TOLERANCE of the largest output, bf16 x also
    within bf16's rounding. Covers blocks that fit, a group size that does not divide K (576 = 4 x
    128 + 64: groups of 64 then), a partial block of rows (40 at 16) and a last block K ends inside
    (9 groups at 2 a block). Launches with prefetch 2 load two blocks before the wait (EARLY): with
    blocks after them and a partial last one; with the partial block second (18 groups at 16); with
    one block only (8 groups at 8); with two whole blocks then a partial one (10 at 4); with two
    blocks only (8 at 4)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed, scales, zeros, W = int4_weights(N, K, G, grid=codes)
    layout = int4_gemv_layout(packed.to(device), scales.to(device), zeros.to(device), G, dp4a, codes)
    assert layout[3] == math.gcd(G, K)
    assert (layout[4] is not None) == codes and layout[1].dtype == (torch.int16 if codes else torch.int32)
    for dtype, rounding in ((torch.float32, 0.0), (torch.bfloat16, 2**-8 if device == "cuda" else 2**-7)):
        x = torch.randn(1, K).bfloat16().to(dtype)
        kwargs, reference, size = int4_case(fused, x, N, W)
        kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        y = cuda_kernels.int4_gemv(x.to(device), *layout, launch=launch, dp4a=dp4a, **kwargs)
        assert y.dtype == dtype and y.shape == reference.shape
        assert ((y.double().cpu() - reference).abs() <= rounding * reference.abs()
                + INT4_TOLERANCE[dp4a] * size).all(), (dtype, fused)


@pytest.mark.parametrize("codes", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("fused", ["norm", "swiglu", "residual"])
def test_int4_gemv_dp4a_is_its_definition(fused, prefetch, codes):
    """dp4a's result is its definition: x (times g) to int8 per group of G, q = floor(x 127 / max|x| +
    0.5), and per group s max|x| / 127 sum((q_w - 8) q) + z sum(x), s and z as float16 times the
    layout's power of two (codes: each code times its row's unit); over 5 blocks of 8 groups and a
    last one of 1. In the interpreter (exact float32, as torch's here) to float32 rounding; on the
    GPU, whose division is approximate, a q at a tie may round the other way: within 2e-3 of the
    output's scale (a 1% error of scale is 1e-2)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    N, K, G = 48, 1312, 32
    packed, scales, zeros, _ = int4_weights(N, K, G, grid=codes)
    layout = int4_gemv_layout(packed.to(device), scales.to(device), zeros.to(device), G, True, codes)
    sz, w_unscale, units = layout[1].cpu(), layout[2], layout[4]
    x = torch.randn(1, K)
    kwargs, _, _ = int4_case(fused, x, N, torch.zeros(N, K, dtype=torch.float64))  # (its fused arguments)
    xg = x.float() * (kwargs["norm_weight"].float() if "norm_weight" in kwargs else 1.0)
    xg = xg.view(-1, G)
    amax = xg.abs().amax(1, keepdim=True)
    q = torch.floor(xg * (127 / amax) + 0.5).double()
    if codes:  # the scale's code in the low byte, the zero's (signed) in the high byte
        units = units.cpu().double()
        s, z = (sz.int() & 255).double() * units[:, :1], (sz.int() >> 8).double() * units[:, 1:]
    else:
        halves = torch.stack([sz & 0xFFFF, (sz >> 16) & 0xFFFF]).to(torch.int16).view(torch.float16).double()
        s, z = halves[0] * w_unscale, halves[1] * w_unscale  # [rows, groups]
    q_w = torch.stack([packed & 15, packed >> 4], -1).view(N, K).double().view(N, -1, G)
    y_def = (((q_w - 8) * q[None]).sum(-1) * s * (amax.double().T / 127) + z * xg.double().sum(1)[None]).sum(1)[None]
    if "norm_weight" in kwargs:
        y_def = y_def * torch.rsqrt(x.double().pow(2).mean() + 1e-5)
    scale = y_def.abs().max().item()
    if kwargs.get("swiglu"):
        gate, up = y_def.chunk(2, dim=-1)
        y_def = gate * torch.sigmoid(gate) * up
        scale = 2.1 * gate.abs().max().item() * up.abs().max().item()
    if "residual" in kwargs:
        y_def = y_def + kwargs["residual"].double()
        scale = y_def.abs().max().item()
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    y = cuda_kernels.int4_gemv(x.to(device), *layout, launch=(16, 8, 4, 2, prefetch), dp4a=True, **kwargs)
    atol = (1e-5 if device == "cpu" else 2e-3) * scale
    assert torch.allclose(y.double().cpu(), y_def, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("x_scale, w_scale", [(1e-4, 1.0), (1e8, 1.0), (1.0, 1e-4), (1.0, 1e4)])
@pytest.mark.parametrize("fused", ["norm", "residual"])
@pytest.mark.parametrize("dp4a", [False, True])
def test_int4_gemv_over_wide_ranges_of_x_and_weights(x_scale, w_scale, fused, dp4a):
    """x enters float16 scaled by its first block's 1 / rms (dp4a: int8 scaled per group) and the
    weights by a power of two (cuda_kernels.int4_layout), so neither's size matters: bf16 x from 1e-4 to 1e8 with an outlier 40 times the
    rest, scales and zeros from ~1e-7 to ~1e2, within INT4_TOLERANCE of the largest output."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed, scales, zeros, W = int4_weights(32, 512, 32, w_scale)
    x = torch.randn(1, 512) * x_scale
    x[0, 300] = 40 * x_scale
    x = x.bfloat16()
    kwargs, reference, size = int4_case(fused, x, 32, W)
    if fused == "residual":  # (a residual of the output's own size)
        kwargs["residual"] = (torch.randn(1, 32) * reference.abs().max().item()).bfloat16()
        reference = x.double() @ W.T + kwargs["residual"].double()
        size = reference.abs().max().item()
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    layout = int4_gemv_layout(packed.to(device), scales.to(device), zeros.to(device), 32, dp4a)
    y = cuda_kernels.int4_gemv(x.to(device), *layout, launch=(16, 4, 4, 2, True), dp4a=dp4a, **kwargs)
    assert torch.isfinite(y).all()
    assert ((y.double().cpu() - reference).abs() <= 2**-7 * reference.abs() + INT4_TOLERANCE[dp4a] * size).all()


def test_int4_arithmetic_and_its_setting(monkeypatch):
    """cuda_kernels.int4_dp4a: integers on every shape (auto), or by GRAPHDECODE_INT4_DP4A 0 / 1 everywhere;
    anything else is an error, not a silent choice."""
    assert cuda_kernels.int4_dp4a()
    monkeypatch.setattr(cuda_kernels, "INT4_DP4A", "0")
    assert not cuda_kernels.int4_dp4a()
    monkeypatch.setattr(cuda_kernels, "INT4_DP4A", "1")
    assert cuda_kernels.int4_dp4a()
    monkeypatch.setattr(cuda_kernels, "INT4_DP4A", "2")
    with pytest.raises(ValueError, match="GRAPHDECODE_INT4_DP4A must be auto, 0 or 1"):
        cuda_kernels.int4_dp4a()


def test_int4_codes_only_on_the_grid():
    """int4_gemv_layout reads the scales and zeros as codes only where every one lies on the grid
    (quantize.py's), exactly; a file from elsewhere (these random bf16 scales, as a GGUF's) keeps
    float16 pairs, and so does float16 arithmetic. The codes are the grid's numbers: code times
    unit gives the file's scale and zero back."""
    from model import int4_grid_units

    packed, scales, zeros, _ = int4_weights(32, 256, 32)
    assert int4_grid_units(scales, zeros) is None
    assert int4_gemv_layout(packed, scales, zeros, 32, True, True)[4] is None
    packed, scales, zeros, _ = int4_weights(32, 256, 32, grid=True)
    assert int4_gemv_layout(packed, scales, zeros, 32, False, True)[4] is None  # (float16 pairs)
    _, sz, w_unscale, _, units = int4_gemv_layout(packed, scales, zeros, 32, True, True)
    assert sz.dtype == torch.int16 and w_unscale == 1.0 and units.shape == (32, 2)
    assert torch.equal((sz.int() & 255).float() * units[:, :1], scales.float())
    assert torch.equal((sz.int() >> 8).float() * units[:, 1:], zeros.float())
    off = scales.clone()
    off[3, 5] = 1.5 * units[3, 0]  # (half a unit past one: bf16 holds it exactly)
    assert int4_grid_units(off, zeros) is None
    with pytest.raises(ValueError, match="not whole codes"):
        cuda_kernels.int4_layout(torch.zeros(32, 256, dtype=torch.int64), off, zeros, True, units)
    with pytest.raises(ValueError, match="integer kernel"):
        cuda_kernels.int4_layout(torch.zeros(32, 256, dtype=torch.int64), scales, zeros, False, units)
    layout = int4_gemv_layout(packed, scales, zeros, 32, True, True)
    with pytest.raises(ValueError, match="go with their units"):
        cuda_kernels.int4_gemv(torch.zeros(1, 256), *layout[:4], dp4a=True)
    with pytest.raises(ValueError, match=r"units must be float32 \[32, 2\]"):
        cuda_kernels.int4_gemv(torch.zeros(1, 256), *layout[:4], layout[4].double(), dp4a=True)


def test_int4_codes_setting_and_launch(monkeypatch):
    """model.int4_codes: codes up to group 64 (auto), or by GRAPHDECODE_INT4_CODES 0 / 1 everywhere, else
    an error; with codes the down projection at group 32 takes its own launch (16 rows, not 8)."""
    import model as model_module

    monkeypatch.setattr(model_module, "INT4_CODES", "auto")
    assert model_module.int4_codes(32) and model_module.int4_codes(64) and not model_module.int4_codes(128)
    monkeypatch.setattr(model_module, "INT4_CODES", "0")
    assert not model_module.int4_codes(32)
    monkeypatch.setattr(model_module, "INT4_CODES", "1")
    assert model_module.int4_codes(128)
    monkeypatch.setattr(model_module, "INT4_CODES", "yes")
    with pytest.raises(ValueError, match="GRAPHDECODE_INT4_CODES must be auto, 0 or 1"):
        model_module.int4_codes(32)
    assert cuda_kernels.int4_config(4096, 11008, 32, dp4a=True)[0] == 8
    assert cuda_kernels.int4_config(4096, 11008, 32, dp4a=True, codes=True)[0] == 16


def test_bench_refuses_bad_int4_settings(monkeypatch, capsys):
    """bench.py checks GRAPHDECODE_INT4_CODES, _DP4A and _XQ before any model loads: a bad
    value is a one-line error and exit status 1."""
    import model as model_module
    from bench import main

    for module, name in ((model_module, "INT4_CODES"), (cuda_kernels, "INT4_DP4A"), (cuda_kernels, "INT4_XQ")):
        with monkeypatch.context() as m:
            m.setattr(module, name, "yes")
            assert main(["--device", "cpu", "--model", "smollm2-135m"]) == 1
            assert capsys.readouterr().err.startswith(f"error: GRAPHDECODE_{name} must be auto, 0")


def unpack_x_int8(xq, K, group):
    """cuda_kernels.int4_quantize_x's layout -> (codes q [K], its numbers [4, K / group]: sx, sx sum(q),
    sum(u), sum(x^2))."""
    words = xq[:K // 4].cpu().long() & 0xFFFFFFFF
    q = (words[:, None] >> (8 * torch.arange(4))) & 255
    return torch.where(q >= 128, q - 256, q).flatten(), xq[K // 4:].cpu().view(torch.float32).view(4, -1)


def assert_x_int8(xq, x, g, group):
    """xq is int4_quantize_x(x, g, group), written by a kernel: the same codes but at a rounding tie
    (neither the GPU's division nor the interpreter's is correctly rounded: 127 / max|u| may differ
    from torch's in its last bit, and a bf16 value at half its group's max lands on .5), which moves
    a code by one and sx sum(q) by sx; the same numbers to float32 rounding (sums in another order)."""
    K = x.shape[-1]
    q, stats = unpack_x_int8(xq, K, group)
    q_ref, ref = unpack_x_int8(cuda_kernels.int4_quantize_x(x.cpu(), None if g is None else g.cpu(), group), K, group)
    off = 1
    assert (q - q_ref).abs().max().item() <= off and xq.numel() == K // 4 + 4 * K // group
    assert (q != q_ref).float().mean().item() < 0.01  # (ties only)
    sx = ref[0]
    assert torch.allclose(stats[0], sx, rtol=1e-6, atol=0)
    assert ((stats[1] - ref[1]).abs() <= 1e-5 * ref[1].abs() + off * 4 * sx).all()
    scale = ref[2:].abs().max(1, keepdim=True).values
    assert ((stats[2:] - ref[2:]).abs() <= 1e-5 * scale).all()


@pytest.mark.parametrize("group", [8, 16, 32])
def test_int4_quantize_x_is_its_definition(group):
    """cuda_kernels.int4_quantize_x: codes q = round(u / sx) of u = x g with sx = max|u| / 127 per group,
    in -127..127, four to a word; then sx, sx sum(q), sum(u), sum(x^2) per group; a group of zeros
    codes to zeros."""
    torch.manual_seed(group)
    x = torch.randn(1, 1, 256).bfloat16()
    x[..., :group] = 0
    g = (0.5 + torch.rand(256)).bfloat16()
    q, stats = unpack_x_int8(cuda_kernels.int4_quantize_x(x, g, group), 256, group)
    u = (x.double() * g.double()).view(-1, group)
    sx = u.abs().amax(1) / 127
    assert torch.allclose(stats[0].double(), sx, rtol=1e-6)
    assert q.abs().max() <= 127 and q[:group].eq(0).all() and stats[:, 0].eq(0).all()
    assert ((q.view(-1, group).double() * sx[:, None] - u).abs() <= sx[:, None] * (0.5 + 1e-5)).all()
    assert torch.allclose(stats[1].double(), q.view(-1, group).sum(1).double() * sx, rtol=1e-5)
    assert torch.allclose(stats[2].double(), u.sum(1), rtol=1e-5, atol=1e-6)
    assert torch.allclose(stats[3].double(), x.double().view(-1, group).pow(2).sum(1), rtol=1e-5)


@pytest.mark.parametrize("codes", [True, False])
@pytest.mark.parametrize("fused", ["none", "norm", "swiglu", "residual"])
@pytest.mark.parametrize("G, K, group, launch", [(32, 544, 16, (16, 4, 4, 2, False)), (32, 544, 32, (16, 4, 4, 2, True)),
                                                 (32, 544, 8, (8, 8, 4, 2, False)), (128, 640, 16, (16, 2, 4, 2, False)),
                                                 (32, 544, 16, (16, 4, 4, 2, 2))])
def test_int4_gemv_reads_x_in_int8(G, K, group, launch, fused, codes):
    """int4_gemv(xq=) takes x in int8 from int4_quantize_x (x times the norm's g) and gives its
    definition: per group of G, s (sum over its x groups of sx sum(q_w q) - 8 sx sum(q)) + z sum(u), times
    the norm's 1 / rms (from the sums of squares), then SwiGLU or the residual; within INT4_TOLERANCE
    of the float64 product; with the scales and zeros as codes or as float16 pairs. K ends in a
    partial block (544 at 32: 17 groups, 4 a block; 640 at 128: 5 groups, 2 a block)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    N = 64
    packed, scales, zeros, W = int4_weights(N, K, G, grid=codes)
    layout = int4_gemv_layout(packed.to(device), scales.to(device), zeros.to(device), G, True, codes)
    _, sz, w_unscale, kernel_g, units = layout
    assert kernel_g == G and (units is not None) == codes
    x = torch.randn(1, K)  # (float32: y unrounded, for the definition)
    kwargs, reference, size = int4_case(fused, x, N, W)
    xq = cuda_kernels.int4_quantize_x(x, kwargs.get("norm_weight"), group)
    q, (sx, qs, x_sum, squares) = unpack_x_int8(xq, K, group)
    per = kernel_g // group  # x groups in an int4 group
    q_w = torch.stack([packed & 15, packed >> 4], -1).view(N, K).double()
    dots = (q_w * q.double()).view(N, -1, per, group).sum(-1)
    if codes:
        s, z = (sz.cpu().int() & 255).double() * units.cpu().double()[:, :1], (sz.cpu().int() >> 8).double() * units.cpu().double()[:, 1:]
    else:
        sz = sz.cpu()
        halves = torch.stack([sz & 0xFFFF, (sz >> 16) & 0xFFFF]).to(torch.int16).view(torch.float16).double()
        s, z = halves[0] * w_unscale, halves[1] * w_unscale
    y_def = ((dots * sx.double().view(-1, per)).sum(-1) * s + z * x_sum.double().view(-1, per).sum(-1)).sum(1)[None]
    y_def = y_def - 8 * (s * qs.double().view(-1, per).sum(-1)).sum(1)[None]
    if "norm_weight" in kwargs:
        y_def = y_def * torch.rsqrt(squares.double().sum() / K + 1e-5)
    scale = y_def.abs().max().item()
    if kwargs.get("swiglu"):
        gate, up = y_def.chunk(2, dim=-1)
        y_def, scale = gate * torch.sigmoid(gate) * up, 2.1 * gate.abs().max().item() * up.abs().max().item()
    if "residual" in kwargs:
        y_def = y_def + kwargs["residual"].double()
        scale = y_def.abs().max().item()
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    y = cuda_kernels.int4_gemv(x.to(device), *layout, launch=launch, dp4a=True, xq=xq.to(device), **kwargs)
    atol = (1e-5 if device == "cpu" else 2e-3) * scale
    assert torch.allclose(y.double().cpu(), y_def, rtol=1e-5 if device == "cpu" else 1e-2, atol=atol)
    assert ((y.double().cpu() - reference).abs() <= INT4_TOLERANCE[True] * size).all()


def ring_or_skip(monkeypatch):
    """int4_ring.py's module, turned on (ENABLED), where its kernel can run (sm_90, Gluon), else a skip: it runs
    on the H200 only."""
    try:
        import int4_ring
    except (ImportError, AttributeError) as e:
        pytest.skip(f"int4_ring.py does not import here: {e}")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("int4_ring.py's kernel is for sm_90")
    monkeypatch.setattr(int4_ring, "ENABLED", True)
    return int4_ring


@pytest.mark.cuda
@pytest.mark.parametrize("fused", ["none", "norm", "swiglu", "residual"])
@pytest.mark.parametrize("N, K, per_sm", [(128, 512, 3), (1056, 2816, 1), (4096, 4096, 1)])
@pytest.mark.parametrize("one_sum", [False, True])
def test_int4_ring_matches_int4_gemv_reading_x_in_int8(N, K, per_sm, fused, one_sum, monkeypatch):
    """int4_ring.gemv (decode's int8 flow) gives cuda_kernels.int4_gemv's product with x in int8 (groups of 16, codes)
    to float32 rounding of the sums, and so stays within INT4_TOLERANCE of the float64 product. K = 2816 ends
    in a partial box (2.75 boxes of 1024 columns); per_sm 1 makes programs take several tiles (4096 rows: 256
    tiles over the H200's 132 programs; 1056: 66 tiles, fewer programs than SMs). Either way of summing a tile's
    rows (int4_ring.ONE_SUM)."""
    int4_ring = ring_or_skip(monkeypatch)
    monkeypatch.setattr(int4_ring, "ONE_SUM", one_sum)
    packed, scales, zeros, W = int4_weights(2 * N if fused == "swiglu" else N, K, 32, grid=True)
    layout = int4_gemv_layout(packed.cuda(), scales.cuda(), zeros.cuda(), 32, True, True)
    words, codes, w_unscale, _, units = layout
    assert int4_ring.usable(words, codes, 32) and not int4_ring.usable(words, codes, 64)
    x = torch.randn(1, K).bfloat16()
    kwargs, reference, size = int4_case(fused, x, N, W)
    kwargs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    xq = cuda_kernels.int4_quantize_x(x.cuda(), kwargs.get("norm_weight"), 16)
    expect = cuda_kernels.int4_gemv(x.cuda(), *layout, dp4a=True, xq=xq, **kwargs).double()
    y, yq = int4_ring.gemv(x.cuda(), xq, words, codes, units, w_unscale, norm="norm_weight" in kwargs,
                           eps=kwargs.get("eps", 0.0), residual=kwargs.get("residual"),
                           swiglu=kwargs.get("swiglu", False), per_sm=per_sm)
    assert yq is None and y.shape == (1, N) and y.dtype == torch.bfloat16
    scale = size if fused == "swiglu" else expect.abs().max().item()
    assert ((y.double() - expect).abs() <= 1e-2 * expect.abs() + 1e-3 * scale).all()  # (both rounded to bf16)
    assert ((y.double().cpu() - reference).abs() <= INT4_TOLERANCE[True] * size).all()


@pytest.mark.cuda
@pytest.mark.parametrize("fused, norm_out", [("residual", True), ("swiglu", False), ("none", True)])
@pytest.mark.parametrize("one_sum", [False, True])
def test_int4_ring_writes_its_output_in_int8(fused, norm_out, one_sum, monkeypatch):
    """out_q: int4_ring.gemv also writes y in int8, cuda_kernels.int4_quantize_x(y, g) of the y it returns (groups of
    16, each a tile of 16 rows: assert_x_int8's codes and numbers), times the next norm's weight g if given; and
    the next GEMV reading it gives what it gives reading int4_quantize_x's. Over several tiles a program; either
    way of summing a tile's rows (int4_ring.ONE_SUM)."""
    int4_ring = ring_or_skip(monkeypatch)
    monkeypatch.setattr(int4_ring, "ONE_SUM", one_sum)
    N, K = 8192, 1024  # (512 tiles: ~4 a program at one program an SM of the H200's 132)
    packed, scales, zeros, _ = int4_weights(2 * N if fused == "swiglu" else N, K, 32, grid=True)
    words, codes, w_unscale, _, units = int4_gemv_layout(packed.cuda(), scales.cuda(), zeros.cuda(), 32, True, True)
    x = torch.randn(1, K, device="cuda").bfloat16()
    xq = cuda_kernels.int4_quantize_x(x, None, 16)
    g = (0.5 + torch.rand(N, device="cuda")).bfloat16() if norm_out else None
    residual = torch.randn(1, N, device="cuda").bfloat16() if fused == "residual" else None
    y, yq = int4_ring.gemv(x, xq, words, codes, units, w_unscale, residual=residual, swiglu=fused == "swiglu",
                           out_q=True, out_norm_weight=g, per_sm=1)
    assert_x_int8(yq, y, g, 16)
    packed2, scales2, zeros2, _ = int4_weights(512, N, 32, grid=True)
    words2, codes2, unscale2, _, units2 = int4_gemv_layout(packed2.cuda(), scales2.cuda(), zeros2.cuda(), 32, True,
                                                           True)
    nxt = [int4_ring.gemv(y, q, words2, codes2, units2, unscale2, norm=True, eps=1e-5)[0].float()
           for q in (yq, cuda_kernels.int4_quantize_x(y, g, 16))]
    assert ((nxt[0] - nxt[1]).abs() <= 2e-2 * nxt[1].abs().max()).all()  # (codes may differ by 1 at ties)


@pytest.mark.cuda
@pytest.mark.parametrize("swiglu", [False, True])
def test_int4_ring_launches_give_the_same_numbers(swiglu, monkeypatch):
    """Programs an SM and boxes in flight only split rows among programs and pace the copies: every such launch
    (by argument and by LAUNCHES) gives the default's y and y in int8 bit for bit. Rows a tile and warps change
    the order of the float32 sums, so y within bf16 rounding."""
    int4_ring = ring_or_skip(monkeypatch)
    monkeypatch.setattr(int4_ring, "LAUNCH", "")  # (whatever GRAPHDECODE_INT4_RING_LAUNCH says)
    N, K = 4096, 2816  # (256 tiles; a partial box at the end of each row)
    packed, scales, zeros, _ = int4_weights(2 * N if swiglu else N, K, 32, grid=True)
    words, codes, w_unscale, _, units = int4_gemv_layout(packed.cuda(), scales.cuda(), zeros.cuda(), 32, True, True)
    x = torch.randn(1, K, device="cuda").bfloat16()
    xq = cuda_kernels.int4_quantize_x(x, None, 16)

    def run(**launch):
        return int4_ring.gemv(x, xq, words, codes, units, w_unscale, swiglu=swiglu, out_q=True, **launch)

    y, yq = run()
    for launch in ({"per_sm": 1, "stages": 2}, {"per_sm": 4, "stages": 5}, {"per_sm": 2, "stages": 9}):
        y2, yq2 = run(**launch)
        assert torch.equal(y2, y) and torch.equal(yq2, yq), launch
    shape = cuda_kernels.int4_shape(N, K, swiglu)
    monkeypatch.setattr(int4_ring, "LAUNCHES", {shape: (1, 3, 32, int4_ring.WARPS)})
    assert int4_ring.launch(N, K, swiglu) == (1, 3, 32, int4_ring.WARPS)
    y2, yq2 = run()  # (y in int8 keeps 16 rows a tile)
    assert torch.equal(y2, y) and torch.equal(yq2, yq)
    monkeypatch.setattr(int4_ring, "LAUNCHES", {})
    for rows, warps in ((8, 2), (32, 8), (16, 8)):  # without y in int8, any rows
        y3 = int4_ring.gemv(x, xq, words, codes, units, w_unscale, swiglu=swiglu, rows=rows, warps=warps)[0]
        assert ((y3.float() - y.float()).abs() <= 1e-2 * y.float().abs() + 1e-3 * y.float().abs().max()).all()
    # LAUNCHES' rows and warps reach the kernel where it writes no y in int8: the same numbers as asked by argument
    asked = int4_ring.gemv(x, xq, words, codes, units, w_unscale, swiglu=swiglu, rows=32, warps=8)[0]
    monkeypatch.setattr(int4_ring, "LAUNCHES", {shape: (2, 4, 32, 8)})
    assert torch.equal(int4_ring.gemv(x, xq, words, codes, units, w_unscale, swiglu=swiglu)[0], asked)


@pytest.mark.cuda
@pytest.mark.parametrize("fused", ["none", "norm", "swiglu", "residual"])
@pytest.mark.parametrize("one_sum", [False, True])
def test_int4_ring_reads_scale_codes_alone_where_zeros_are_zero(fused, one_sum, monkeypatch):
    """For a layer whose zeros are all 0 (symmetric int4), int4_ring.code_bytes keeps the scales' codes alone, one
    byte a group (rows padded to 16 bytes where K / 32 is not a multiple of 16: K = 2816, 88 codes a row), and the
    kernel reading them gives the int16 codes' y and y in int8 bit for bit. Codes with a zero are refused. With the
    norm (and SwiGLU, which takes it here) they gave wrong numbers in session 28, before _x_stage's fix (checked on
    the H200 in session 29: each call 25 times). Either way of summing a tile's rows (int4_ring.ONE_SUM)."""
    int4_ring = ring_or_skip(monkeypatch)
    monkeypatch.setattr(int4_ring, "ONE_SUM", one_sum)
    N, K = 1056, 2816
    packed, scales, zeros, W = int4_weights(2 * N if fused == "swiglu" else N, K, 32, grid=True)
    words, codes, w_unscale, _, units = int4_gemv_layout(packed.cuda(), scales.cuda(), torch.zeros_like(zeros).cuda(),
                                                         32, True, True)
    with pytest.raises(ValueError, match="every zero's code 0"):
        int4_ring.code_bytes(int4_gemv_layout(packed.cuda(), scales.cuda(), zeros.cuda(), 32, True, True)[1])
    one = int4_ring.code_bytes(codes)
    assert one.dtype == torch.int8 and one.shape == codes.shape and one.stride() == (96, 1)
    assert torch.equal(one.view(torch.uint8).int(), codes.int())  # (zeros' codes 0: the int16 code is the scale's)
    x = torch.randn(1, K, device="cuda").bfloat16()
    kwargs = int4_case(fused, x.cpu(), N, W)[0]
    kwargs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    xq = cuda_kernels.int4_quantize_x(x, kwargs.get("norm_weight"), 16)
    norm = "norm_weight" in kwargs
    for per_sm in (1, 3):  # (several tiles a program; the default)
        two = int4_ring.gemv(x, xq, words, codes, units, w_unscale, norm=norm, eps=kwargs.get("eps", 0.0),
                             residual=kwargs.get("residual"), swiglu=kwargs.get("swiglu", False), out_q=True,
                             per_sm=per_sm)
        assert two[0].float().abs().max() > 0
        for _ in range(25):  # (the bug of session 28 was a race: wrong in some calls only)
            one_byte = int4_ring.gemv(x, xq, words, one, units, w_unscale, norm=norm, eps=kwargs.get("eps", 0.0),
                                      residual=kwargs.get("residual"), swiglu=kwargs.get("swiglu", False),
                                      out_q=True, per_sm=per_sm)
            assert torch.equal(two[0], one_byte[0]) and torch.equal(two[1], one_byte[1])  # (y, and y in int8)
    with pytest.raises(ValueError, match="rows 16 bytes apart"):
        int4_ring.gemv(x, xq, words, one.contiguous(), units, w_unscale)


@pytest.mark.cuda
@pytest.mark.parametrize("fused", ["none", "norm", "swiglu", "residual"])
def test_int4_ring_masked_dots_give_the_same_numbers(fused, monkeypatch):
    """int4_ring.MASKED (_dot_masked: the high nibbles masked in place and each x group's two words chained in dp4a)
    computes the same integer dots as the default products, so y and y in int8 equal bit for bit, with int16 codes
    and with one-byte scale codes. K = 2816 ends in a partial box; per_sm 1: several tiles a program."""
    int4_ring = ring_or_skip(monkeypatch)
    N, K = 1056, 2816
    packed, scales, zeros, W = int4_weights(2 * N if fused == "swiglu" else N, K, 32, grid=True)
    x = torch.randn(1, K).bfloat16()
    kwargs = int4_case(fused, x, N, W)[0]
    kwargs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    xq = cuda_kernels.int4_quantize_x(x.cuda(), kwargs.get("norm_weight"), 16)
    for zeros_of in (zeros, torch.zeros_like(zeros)):
        words, codes, w_unscale, _, units = int4_gemv_layout(packed.cuda(), scales.cuda(), zeros_of.cuda(), 32, True,
                                                             True)
        for c in (codes,) if zeros_of is zeros else (int4_ring.code_bytes(codes),):
            out = {}
            for masked in (False, True):
                monkeypatch.setattr(int4_ring, "MASKED", masked)
                out[masked] = int4_ring.gemv(x.cuda(), xq, words, c, units, w_unscale, norm="norm_weight" in kwargs,
                                             eps=kwargs.get("eps", 0.0), residual=kwargs.get("residual"),
                                             swiglu=kwargs.get("swiglu", False), out_q=True, per_sm=1)
            assert out[False][0].float().abs().max() > 0
            assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1]), c.dtype


def test_int4_ring_launch_override(monkeypatch):
    """GRAPHDECODE_INT4_RING_LAUNCH's form: SHAPE=PROGRAMS_AN_SM,BOXES by cuda_kernels.int4_shape's names, in place of
    int4_ring.LAUNCHES; anything else is a one-line error naming the form."""
    try:
        import int4_ring
    except (ImportError, AttributeError):
        pytest.skip("int4_ring.py needs Triton's Gluon (3.6 or newer), which this machine lacks")
    defaults = (int4_ring.ROWS, int4_ring.WARPS)
    assert int4_ring.launch_override("gate/up=4,6;wide=3,5,32,8") == {"gate/up": (4, 6, *defaults),
                                                                        "wide": (3, 5, 32, 8)}
    assert int4_ring.launch_override("") == {}
    for bad in ("gate=4,6", "square=4", "square=0,6", "long=2,1", "wide=a,b", "wide=3,5,12,4", "wide=3,5,16",
                "wide=3,5,16,3"):
        with pytest.raises(ValueError, match="SHAPE=PROGRAMS_AN_SM,BOXES"):
            int4_ring.launch_override(bad)
    monkeypatch.setattr(int4_ring, "LAUNCHES", {"long": (2, 8, 16, 4)})
    monkeypatch.setattr(int4_ring, "LAUNCH", "gate/up=4,5")
    default = (int4_ring.PER_SM, int4_ring.STAGES, *defaults)
    assert [int4_ring.launch(4096, 11008, False), int4_ring.launch(11008, 4096, True),
            int4_ring.launch(12288, 4096, False), int4_ring.launch(4096, 4096, False)] == \
        [(2, 8, 16, 4), (4, 5, *defaults), default, default]
    assert [cuda_kernels.int4_shape(*s) for s in ((12288, 4096), (4096, 4096), (4096, 11008))] == ["wide", "square", "long"]


def test_int4_ring_refuses_what_it_cannot_run(monkeypatch):
    """int4_ring.usable is False unless turned on (ENABLED: on by default, GRAPHDECODE_INT4_RING=0 off), off
    sm_90 and for CPU tensors, other groups or float16 scales; gemv's errors name the shapes it takes."""
    try:
        import int4_ring
    except (ImportError, AttributeError):
        pytest.skip("int4_ring.py needs Triton's Gluon (3.6 or newer), which this machine lacks")
    assert int4_ring.ENABLED == (os.environ.get("GRAPHDECODE_INT4_RING", "1") == "1")
    words, codes = torch.zeros(64, 64, dtype=torch.int32), torch.zeros(64, 16, dtype=torch.int16)
    if torch.cuda.is_available():
        monkeypatch.setattr(int4_ring, "ENABLED", False)
        assert not int4_ring.usable(words.cuda(), codes.cuda(), 32)
    monkeypatch.setattr(int4_ring, "ENABLED", True)
    assert not int4_ring.usable(words, codes, 32)  # (CPU)
    if torch.cuda.is_available():
        assert not int4_ring.usable(words.cuda(), None, 32) and not int4_ring.usable(words.cuda(), codes.cuda(), 64)
        assert int4_ring.usable(words.cuda(), codes.cuda(), 32) == (torch.cuda.get_device_capability()[0] == 9)
    units = torch.ones(64, 2)
    with pytest.raises(ValueError, match="one row of x and its int8 form"):
        int4_ring.gemv(torch.zeros(2, 512), torch.zeros(256, dtype=torch.int32), words, codes, units, 1.0)
    with pytest.raises(ValueError, match="K a multiple of 256"):
        int4_ring.gemv(torch.zeros(1, 128), torch.zeros(64, dtype=torch.int32), torch.zeros(64, 16, dtype=torch.int32),
                       torch.zeros(64, 4, dtype=torch.int16), units, 1.0)
    with pytest.raises(ValueError, match="do not fit K=512"):
        int4_ring.gemv(torch.zeros(1, 512), torch.zeros(256, dtype=torch.int32), words, codes[:, :8], units, 1.0)


def test_int4_launch_prefetch_values():
    """A launch's prefetch 2 (two blocks before the PDL wait) gives the product of prefetch 0; a prefetch
    other than 0, 1 or 2 is an error."""
    packed, scales, zeros, _ = int4_weights(32, 576, 32, grid=True)
    layout = int4_gemv_layout(packed, scales, zeros, 32, True, True)
    x = torch.randn(1, 576)
    y = cuda_kernels.int4_gemv(x, *layout, dp4a=True, launch=(16, 4, 4, 2, 2))
    assert torch.allclose(y, cuda_kernels.int4_gemv(x, *layout, dp4a=True, launch=(16, 4, 4, 2, False)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prefetch is 0, 1 or 2"):
        cuda_kernels.int4_gemv(x, *layout, dp4a=True, launch=(16, 4, 4, 2, 3))


def test_int4_x_in_int8_errors_and_setting(monkeypatch):
    """x in int8 goes with integers at int4 groups it divides, in int4_quantize_x's length;
    GRAPHDECODE_INT4_XQ picks the group (auto: 16 at int4 groups of 32, none at 128; or 0: none),
    anything else is an error; a group that does not divide the int4 groups gives none."""
    packed, scales, zeros, _ = int4_weights(16, 64, 32, grid=True)
    layout = int4_gemv_layout(packed, scales, zeros, 32, True, True)
    x = torch.zeros(1, 64)
    xq = cuda_kernels.int4_quantize_x(x, group=16)
    with pytest.raises(ValueError, match="not 64 columns of int4_quantize_x"):
        cuda_kernels.int4_gemv(x, *layout, dp4a=True, xq=xq[:-1])
    with pytest.raises(ValueError, match="for integers"):
        cuda_kernels.int4_gemv(x, *int4_gemv_layout(packed, scales, zeros, 32), xq=xq)
    with pytest.raises(ValueError, match="one row of whole groups"):
        cuda_kernels.int4_quantize_x(torch.zeros(2, 64))
    monkeypatch.setattr(cuda_kernels, "INT4_XQ", "auto")
    assert cuda_kernels.int4_x_group(32) == 16 and cuda_kernels.int4_x_group(8) == cuda_kernels.int4_x_group(128) == 0
    monkeypatch.setattr(cuda_kernels, "INT4_XQ", "0")
    assert cuda_kernels.int4_x_group(32) == 0
    monkeypatch.setattr(cuda_kernels, "INT4_XQ", "32")
    assert cuda_kernels.int4_x_group(128) == 32 and cuda_kernels.int4_x_group(64) == 32
    monkeypatch.setattr(cuda_kernels, "INT4_XQ", "64")
    with pytest.raises(ValueError, match="GRAPHDECODE_INT4_XQ must be auto, 0, 8, 16 or 32"):
        cuda_kernels.int4_x_group(32)


def test_int4_launch_setting(monkeypatch):
    """GRAPHDECODE_INT4_LAUNCH replaces a shape's launch for the integer kernel on x in bf16 (columns
    capped at K's groups, rounded up to a power of two), leaves the other shapes and x in int8 alone,
    and anything but SHAPE=ROWS,COLUMNS,WARPS in powers of two is an error."""
    default_w2 = cuda_kernels.int4_config(4096, 11008, 32, dp4a=True, codes=True)
    default_wo = cuda_kernels.int4_config(4096, 4096, 32, dp4a=True, codes=True, xq=True)
    monkeypatch.setattr(cuda_kernels, "INT4_LAUNCH", "gate/up=8,2048,4;square=4,65536,8")
    assert cuda_kernels.int4_config(11008, 4096, 32, swiglu=True, dp4a=True, codes=True) == (8, 64, 4, 3, False)
    assert cuda_kernels.int4_config(4096, 4096, 32, dp4a=True) == (4, 128, 8, 3, False)
    assert cuda_kernels.int4_config(4096, 11008, 32, dp4a=True, codes=True) == default_w2
    assert cuda_kernels.int4_config(4096, 4096, 32, dp4a=True, codes=True, xq=True) == default_wo
    packed, scales, zeros, _ = int4_weights(8, 64, 32, grid=True)
    layout = int4_gemv_layout(packed, scales, zeros, 32, True, True)
    x = torch.randn(1, 64)
    expect = cuda_kernels.int4_gemv(x, *layout, dp4a=True, launch=(16, 2, 4, 3, False))
    assert torch.allclose(cuda_kernels.int4_gemv(x, *layout, dp4a=True), expect, rtol=1e-5, atol=1e-5)
    for bad in ("gate/up=8,2048", "up=8,2048,4", "long=8,2048,3", "wide=0,1024,4", "square=a,b,c"):
        monkeypatch.setattr(cuda_kernels, "INT4_LAUNCH", bad)
        with pytest.raises(ValueError, match="GRAPHDECODE_INT4_LAUNCH: .* is not SHAPE=ROWS,COLUMNS,WARPS"):
            cuda_kernels.int4_config(4096, 4096, 32, dp4a=True)


def test_int4_gemv_takes_one_row():
    packed, scales, zeros, _ = int4_weights(16, 64, 32)
    layout = int4_gemv_layout(packed, scales, zeros, 32)
    with pytest.raises(ValueError, match="one row"):
        cuda_kernels.int4_gemv(torch.zeros(2, 64), *layout)
    with pytest.raises(ValueError, match="do not fit"):
        cuda_kernels.int4_gemv(torch.zeros(1, 128), *layout)


def test_fused_steps_take_one_row_or_a_few_of_bf16_weights():
    with pytest.raises(ValueError, match="one row"):
        cuda_kernels.gemv(torch.zeros(17, 16).bfloat16(), torch.zeros(8, 16).bfloat16(),
                     residual=torch.zeros(17, 8).bfloat16())
    with pytest.raises(ValueError, match="one row"):
        cuda_kernels.gemv(torch.zeros(2, 16).bfloat16(), torch.zeros(8, 16, dtype=torch.int8),
                     torch.ones(8).bfloat16(), residual=torch.zeros(2, 8).bfloat16())


def test_more_rows_than_the_several_row_kernel_takes_go_elsewhere(monkeypatch):
    """_rows_kernel computes 16 rows a program: 20 rows go to the other kernel, whatever MAX_ROWS says."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(cuda_kernels, "MAX_ROWS", 32)
    w, _, reference_w = weights("bf16", 64, 256)
    x = torch.randn(20, 256).bfloat16()
    y = cuda_kernels.gemv(x.to(device), w.to(device), launch=(16, 64, 1, 4, 2))
    reference = x.double() @ reference_w.T
    assert (y.double().cpu() - reference).abs().max().item() <= 2e-2 * reference.abs().max().item()


@pytest.mark.parametrize("launch", [(16, 64, 1, 4, 2), (32, 128, 1, 4, 3), None])
@pytest.mark.parametrize("M", [2, 8, 16])
def test_several_rows_with_the_fusions_match_float64(M, launch):
    """Batched decode (2-16 rows, bf16 weights: cuda_kernels._rows_kernel): each row's RMSNorm, SwiGLU
    and residual against float64, on shapes with a K tail (320) and partial blocks of outputs; each
    row differs in scale, so a norm taken over the wrong row fails."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if launch is None and device == "cpu":
        launch = (16, 128, 1, 4, 2)
    for N, K in [(160, 256), (80, 320)]:
        w, _, reference_w = weights("bf16", N, K)
        w = w.to(device)
        x = (torch.randn(M, K) * torch.linspace(0.5, 8, M)[:, None]).bfloat16()
        g = (1 + torch.rand(K)).bfloat16()
        xd = x.double()
        normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()

        def swiglu(y):
            a, b = y.chunk(2, dim=-1)
            return a * torch.sigmoid(a) * b

        r, r_half = torch.randn(M, N).bfloat16(), torch.randn(M, N // 2).bfloat16()
        cases = [  # (kwargs, reference)
            (dict(), xd @ reference_w.T),
            (dict(norm_weight=g, eps=1e-5), normed @ reference_w.T),
            (dict(residual=r), r.double() + xd @ reference_w.T),
            (dict(swiglu=True), swiglu(xd @ reference_w.T)),
            (dict(norm_weight=g, eps=1e-5, residual=r_half, swiglu=True), r_half.double() + swiglu(normed @ reference_w.T)),
        ]
        for kwargs, reference in cases:
            kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
            y = cuda_kernels.gemv(x.to(device), w, launch=launch, **kwargs)
            assert y.dtype == torch.bfloat16 and y.shape == reference.shape
            err = (y.double().cpu() - reference).abs()
            # bf16: the output rounded once; with the norm, x * g also goes to the tensor cores in bf16
            assert err.max().item() <= 2e-2 * reference.abs().max().item(), (N, K, kwargs.keys())
            assert (err.norm() / reference.norm()).item() <= 8e-3, (N, K, kwargs.keys())


# -- decode attention ------------------------------------------------------------------------------

def reference_attention(qkv, pos, cos, sin, k_cache, v_cache, H, Hkv):
    """model.py's PyTorch path for one token: RoPE, cache write, attention over positions <= pos."""
    import model

    B, D = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.float().split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = model.apply_rope(q.view(B, 1, H, D), cos.float(), sin.float()).to(qkv.dtype)
    k = model.apply_rope(k.view(B, 1, Hkv, D), cos.float(), sin.float()).to(qkv.dtype)
    v = v.view(B, 1, Hkv, D).to(qkv.dtype)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k_cache[:B].index_copy_(2, pos, k)
    v_cache[:B].index_copy_(2, pos, v)
    mask = (torch.arange(k_cache.shape[2], device=pos.device) <= pos.unsqueeze(-1)).unsqueeze(-3)
    y = model.decode_attention(q, k_cache[:B], v_cache[:B], mask)
    return y.transpose(1, 2).reshape(B, 1, H * D)


# (batch, cache rows, query heads, kv heads, head dim, cache length, position, slices (None: auto))
ATTENTION_CASES = [
    (1, 1, 4, 4, 64, 100, 0, None),  # first position: only the new token
    (1, 1, 4, 4, 64, 100, 37, 1),  # one slice: no combine step
    (1, 1, 4, 4, 64, 600, 300, 2),  # one head a group at 8 warps (128 positions a step): a slice of two steps
    (2, 3, 8, 2, 64, 130, 129, None),  # grouped heads, last position, cache with a spare row
    (2, 3, 6, 2, 48, 130, 70, 3),  # 3 heads a group, head dim not a power of two
    (1, 1, 6, 2, 64, 130, 70, 3),  # 3 heads a group (padded to 4), one sequence: its int8 output masked
    (1, 1, 4, 1, 32, 300, 200, 5),  # slices past the position do nothing
    (1, 2, 8, 2, 32, 1024, 100, 16),  # a long cache, an early position: slices sized from it
]


@pytest.mark.parametrize("B, rows, H, Hkv, D, L, pos, splits", ATTENTION_CASES)
def test_decode_attention_matches_pytorch(B, rows, H, Hkv, D, L, pos, splits, monkeypatch):
    """cuda_kernels.decode_attention against the PyTorch ops it replaces: the output within bf16
    rounding, the new k (RoPE'd) and v written at pos, every other cache entry untouched."""
    monkeypatch.setattr(cuda_kernels, "ATTENTION_ONE", False)
    check_decode_attention(B, rows, H, Hkv, D, L, pos, splits)


@pytest.mark.parametrize("B, rows, H, Hkv, D, L, pos, splits",
                         [c for c in ATTENTION_CASES if c[2] == c[3]]
                         + [(1, 1, 2, 2, 128, 224, 150, 4), (2, 2, 2, 2, 64, 300, 20, 5), (1, 1, 2, 2, 64, 300, 299, 5)])
def test_one_head_attention_kernel_matches_pytorch(B, rows, H, Hkv, D, L, pos, splits, monkeypatch):
    """cuda_kernels._attention_one_kernel (cuda_kernels.ATTENTION_ONE: one query head a KV head) as above; and
    Llama-2-7B's head dim and bench.py's cache (224 positions, 4 slices); a position that leaves one slice of
    five with cached positions (no merge) and one that needs all five."""
    monkeypatch.setattr(cuda_kernels, "ATTENTION_ONE", True)
    calls = []
    one = cuda_kernels._attention_one_kernel
    monkeypatch.setattr(cuda_kernels, "_attention_one_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: calls.append(grid) or one[grid]})())
    check_decode_attention(B, rows, H, Hkv, D, L, pos, splits, monkeypatch, launches=[(16, 4), (32, 8), (128, 8)])
    assert calls  # (it ran)


def check_decode_attention(B, rows, H, Hkv, D, L, pos, splits, monkeypatch=None, launches=()):
    """(launches: also each of these cuda_kernels.ATTENTION_ONE_LAUNCH, the sums' order only)"""
    import model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(L + pos)
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D).bfloat16().to(device)
    k_cache = torch.randn(rows, Hkv, L, D).bfloat16().to(device)
    v_cache = torch.randn(rows, Hkv, L, D).bfloat16().to(device)
    args = model.ModelArgs(dim=H * D, n_layers=1, n_heads=H, n_kv_heads=Hkv, head_dim=D, vocab_size=8,
                           intermediate_size=8, max_seq_len=L)
    cos, sin = (t.bfloat16() for t in model.rope_table(args, L, device))
    p = torch.tensor([pos], device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = reference_attention(qkv, p, cos[p], sin[p], k_ref, v_ref, H, Hkv).float()
    counts = torch.zeros(rows * Hkv, dtype=torch.int32, device=device)
    before = (k_cache.clone(), v_cache.clone())
    y = cuda_kernels.decode_attention(qkv, p, cos, sin, k_cache, v_cache, counts, H, Hkv, splits)
    assert not counts.any()  # left at zero for the next call
    for group in (8, 16, 32) if B == 1 and D & (D - 1) == 0 else ():  # y also in int8 for an int4 wo
        caches = tuple(t.clone() for t in before)
        y_again, yq = cuda_kernels.decode_attention(qkv, p, cos, sin, *caches, counts, H, Hkv, splits, out_group=group)
        assert torch.equal(y_again, y) and not counts.any()
        assert_x_int8(yq, y, None, group)
    assert y.shape == (B, 1, H * D) and y.dtype == torch.bfloat16
    assert (y.float() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
    for block_l in (16, 32):  # cache positions a loop step (the int8 flow asks for 32): the sums' order only
        y_l = cuda_kernels.decode_attention(qkv, p, cos, sin, *(t.clone() for t in before), counts, H, Hkv, splits,
                                       block_l=block_l)
        assert (y_l.float() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item(), block_l
    for launch in launches:
        monkeypatch.setattr(cuda_kernels, "ATTENTION_ONE_LAUNCH", launch)
        y_l = cuda_kernels.decode_attention(qkv, p, cos, sin, *(t.clone() for t in before), counts, H, Hkv, splits)
        assert (y_l.float() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item(), launch
        assert not counts.any()
    rounding = 2**-8 if device == "cuda" else 2**-7  # the interpreter truncates to bf16
    new_k, ref_k = k_cache[:B, :, pos].float(), k_ref[:B, :, pos].float()
    assert ((new_k - ref_k).abs() <= rounding * ref_k.abs() + 1e-6).all()  # RoPE'd k within one rounding
    k_cache[:B, :, pos] = k_ref[:B, :, pos]
    assert k_cache.equal(k_ref) and v_cache.equal(v_ref)  # v written exactly, nothing else touched


def test_attention_launch_rule():
    """cuda_kernels.attention_launch: one query head a KV head at batch 1 of Llama-2-7B (32 KV heads, 4 slices,
    D = 128) runs 8 warps at 64 positions a step; at batch 8 (1024 programs) 4 warps at 32; grouped heads
    (Llama-3.1-8B: 4 a KV head) 8192 products a step; the settings override the rule."""
    assert cuda_kernels.attention_launch(1, 32, 4, 1, 128) == (64, 8)
    assert cuda_kernels.attention_launch(1, 4, 2, 1, 64) == (128, 8)  # (the attention test case above)
    assert cuda_kernels.attention_launch(8, 32, 4, 1, 128) == (32, 4)
    assert cuda_kernels.attention_launch(1, 8, 4, 4, 128) == (16, 4)


def test_decode_attention_at_a_position_past_the_cache_touches_nothing():
    """pos >= L (which callers prevent) writes nothing: the caches stay as they were and the output is
    finite (on the CPU in Triton's interpreter, on a GPU itself)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    H, D, L = 2, 32, 64
    torch.manual_seed(0)
    qkv = torch.randn(1, 1, 3 * H * D).bfloat16().to(device)
    k_cache, v_cache = (torch.randn(2, H, L, D).bfloat16().to(device) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    table = torch.randn(L, D).bfloat16().to(device)
    counts = torch.zeros(2 * H, dtype=torch.int32, device=device)
    for splits in (1, 3):
        y = cuda_kernels.decode_attention(qkv, torch.tensor([L], device=device), table, table, k_cache, v_cache, counts,
                                     H, H, splits)
        assert y.float().isfinite().all() and not counts.any()
        assert k_cache.equal(k_ref) and v_cache.equal(v_ref)


def test_decode_attention_rejects_what_it_cannot_run():
    qkv = torch.zeros(1, 2, 3 * 4 * 16).bfloat16()
    cache = torch.zeros(1, 4, 8, 16).bfloat16()
    with pytest.raises(ValueError, match="not one token"):
        cuda_kernels.decode_attention(qkv, torch.tensor([0]), torch.zeros(8, 16), torch.zeros(8, 16), cache, cache,
                                 torch.zeros(4, dtype=torch.int32), 4, 4)
    qkv, cache = torch.zeros(2, 1, 3 * 4 * 16).bfloat16(), torch.zeros(2, 4, 8, 16).bfloat16()
    with pytest.raises(ValueError, match="y in int8 takes one sequence"):
        cuda_kernels.decode_attention(qkv, torch.tensor([0]), torch.zeros(8, 16), torch.zeros(8, 16), cache, cache,
                                 torch.zeros(8, dtype=torch.int32), 4, 4, out_group=16)
    with pytest.raises(ValueError, match="power of two"):
        cuda_kernels.decode_attention(qkv[:1], torch.tensor([0]), torch.zeros(8, 16), torch.zeros(8, 16), cache[:1],
                                 cache[:1], torch.zeros(4, dtype=torch.int32), 4, 4, block_l=24)


def test_decode_attention_op_updates_the_cache_in_place_when_compiled():
    """Through the custom op under torch.compile, the caches are written in place (the compiler
    hands the op the cache buffers themselves, not copies)."""
    from torch._inductor.utils import run_and_get_code

    device = "cuda" if torch.cuda.is_available() else "cpu"
    H, D, L = 4, 32, 16
    qkv = torch.randn(1, 1, 3 * H * D).bfloat16().to(device)
    k_cache, v_cache = (torch.zeros(1, H, L, D).bfloat16().to(device) for _ in range(2))
    cos, sin = torch.ones(L, D).bfloat16().to(device), torch.zeros(L, D).bfloat16().to(device)
    pos = torch.tensor([0], device=device)
    counts = torch.zeros(H, dtype=torch.int32, device=device)
    f = torch.compile(lambda qkv: cuda_kernels.decode_attention_op(qkv, pos, cos, sin, k_cache, v_cache, counts, H, H, 0)[0] * 1,
                      fullgraph=True)
    seen = []
    attention = cuda_kernels.decode_attention
    cuda_kernels.decode_attention = lambda *a, **k: seen.append((a[4].data_ptr(), a[5].data_ptr())) or attention(*a, **k)
    try:
        y, code = run_and_get_code(f, qkv)
    finally:
        cuda_kernels.decode_attention = attention
    assert seen == [(k_cache.data_ptr(), v_cache.data_ptr())]  # the kernel got the buffers themselves
    assert k_cache[0, :, 0].equal(qkv[0, 0, H * D:2 * H * D].view(H, D))  # RoPE by angle 0
    assert v_cache[0, :, 0].equal(qkv[0, 0, 2 * H * D:].view(H, D))
    assert y.view(H, D).equal(qkv[0, 0, 2 * H * D:].view(H, D))  # one position: its v
    assert k_cache[0, :, 1:].eq(0).all()
    assert "copy_" not in "".join(code)  # no copy of the caches back after a functional op


def test_no_custom_op_gives_a_mutated_argument_a_default():
    """torch 2.11 (the H200's) drops the trailing arguments of an op call that equal their defaults before it bumps
    the versions of the mutated arguments by position: a mutated argument with a default, left at it, made every
    trace of the op fail there with an IndexError (session 24: int4_ring's flag=None, since removed). So no
    graphdecode op gives a mutated argument a default, and the one that mutates runs on fake tensors (as
    torch.compile traces it) with its trailing arguments at their defaults."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    importlib.import_module("int4_ring")  # (registers its op)

    schemas = {s.name: s for s in torch._C._jit_get_all_schemas() if s.name.startswith("graphdecode::")}
    assert {"graphdecode::gemv", "graphdecode::int4_gemv", "graphdecode::decode_attention",
            "graphdecode::int4_ring_gemv"} <= set(schemas)
    mutated = {name: [(a.name, a.has_default_value()) for a in s.arguments if a.alias_info and a.alias_info.is_write]
               for name, s in schemas.items()}
    assert mutated["graphdecode::decode_attention"] == [("k_cache", False), ("v_cache", False), ("counts", False)]
    assert not [(name, arg) for name, args in mutated.items() for arg, default in args if default]
    H, D, L = 4, 32, 16
    with FakeTensorMode():
        k_cache, v_cache = (torch.empty(1, H, L, D, dtype=torch.bfloat16) for _ in range(2))
        table = torch.empty(L, D, dtype=torch.bfloat16)
        y, yq = cuda_kernels.decode_attention_op(torch.empty(1, 1, 3 * H * D, dtype=torch.bfloat16),
                                            torch.empty(1, dtype=torch.long), table, table, k_cache, v_cache,
                                            torch.empty(H, dtype=torch.int32), H, H, 16)
        assert y.shape == (1, 1, H * D) and yq.shape == (H * D // 4 + 4 * H * D // 16,)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_model_decode_with_the_attention_kernel_equals_pytorch(mode, monkeypatch):
    """A small model (grouped heads) generates the same greedy tokens, and near-identical logits, with
    decode's attention in cuda_kernels.decode_attention as with the PyTorch ops; compiled, through the
    custom op. (On the CPU the kernel runs in Triton's interpreter: forced on here.)"""
    import model as model_module
    from bench import make_generator, random_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = model_module.ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                                  intermediate_size=256, max_seq_len=256)
    torch.manual_seed(0)
    m = random_model(args, device, torch.float32)
    m.setup_caches(1, 200)  # 4 cache slices, merged by the kernel
    assert cuda_kernels.attention_splits(1, args.n_kv_heads, m.max_seq_length) == 4
    calls = []
    attention = cuda_kernels.decode_attention
    monkeypatch.setattr(cuda_kernels, "decode_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    monkeypatch.setattr(cuda_kernels, "attention_usable", lambda qkv, pos: pos.numel() == 1)

    def run(fused):
        monkeypatch.setattr(model_module, "FUSE_ATTENTION", fused)
        gen = make_generator(m, mode)
        tokens = [t for chunk in gen.generate([[5, 17, 200, 42, 7]], 40) for t in chunk[0]]
        pos = torch.tensor([45], device=device)
        with torch.no_grad():
            return tokens, m(torch.tensor([[tokens[-1]]], device=device), pos).float()

    tokens, logits = run(True)
    assert len(calls) >= 39 * args.n_layers
    calls.clear()
    plain_tokens, plain_logits = run(False)
    assert not calls
    assert tokens == plain_tokens and len(set(tokens)) > 5
    assert ((logits - plain_logits).norm() / plain_logits.norm()).item() < 1e-4


def test_int4_ring_scratch_never_overlaps_its_buffers():
    """benchmarks/ring_smem.py, compiled here for sm_90 without a GPU: no scratch of the ring kernel (the norm's sum, a
    layout change) shares shared memory with one of its buffers, with int16 or one-byte codes and the norm, with and
    without SwiGLU, MASKED and ONE_SUM each on and off. Before
    session 28's fix (_x_stage copied x's sums, which nothing read without zeros) the norm's sum lay over them while
    the copy landed, and the GEMV gave wrong numbers on the H200; the tool reported that overlap (exit 1)."""
    try:
        for module in ("int4_ring", "triton.experimental.gluon._runtime"):
            importlib.import_module(module)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"no Gluon to compile int4_ring.py's kernel with here: {e}")
    run = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" / "ring_smem.py"),
                          "--variants", "int16,int8", "--norm", "1", "--swiglu", "0,1", "--masked", "0,1",
                          "--one-sum", "0,1", "--k", "2816", "--stages", "5"],
                         capture_output=True, text=True, timeout=900)
    if run.returncode == 2:  # (this Triton cannot compile it offline: a renamed API, no ptxas)
        pytest.skip(f"ring_smem.py could not compile the kernel here: {run.stderr.strip().splitlines()[-1:]}")
    assert run.returncode == 0, run.stdout + run.stderr  # (1: an overlap; 3: no offsets found in the IR)
    assert run.stdout.count("scratch of tt.reduce") == 16 and "no scratch overlaps a buffer" in run.stdout
