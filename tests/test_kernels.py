"""The kernels package against float64 references written here: gemv.py's bf16 and int8 GEMVs (one
row and several, with the fusions), int4.py's one-row GEMV and its layout, attention.py's decode
attention, cpu.py's AVX2 matmuls. Without a GPU the Triton kernels run in Triton's CPU interpreter
(conftest.py sets TRITON_INTERPRET); on a GPU, `benchmarks/h200.sh tests` also runs them there, with the tuned
launches (`-m cuda` alone runs only the few marked cuda)."""
import math

import pytest
import torch
import torch.nn.functional as F

import gdkernels
from gdkernels import attention, cpu, gemv, int4

# Triton's CPU interpreter runs the kernels in numpy, which warns where the GPU computes silently: padded
# query heads divide 0 by 0 (never stored), and SiLU's exp overflows to inf for large negative inputs (-> 0).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUNDING = 2**-8 if DEVICE == "cuda" else 2**-7  # bf16's rounding (the interpreter truncates)


def on_device(kwargs):
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in kwargs.items()}


def weights(kind, N, K):
    torch.manual_seed(N * K)
    if kind == "bf16":
        w = torch.randn(N, K).bfloat16()
        return w.to(DEVICE), None, w.double()
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    scales = (torch.rand(N) / 64).bfloat16()
    return q.to(DEVICE), scales.to(DEVICE), q.double() * scales.double()[:, None]


def fused_case(fused, x, W, eps=1e-5, dtype=torch.bfloat16):
    """(keyword arguments, float64 reference, size) for x @ W.T with the fusions named in `fused`
    ("norm", "swiglu", "residual", joined by +; g and the residual in `dtype`). size is what an error
    of e times the largest product moves the output by, over e: the largest output, or for SwiGLU,
    silu(a) b with |silu'| < 1.1, 2.1 max|a| max|b| (its largest output can be far smaller)."""
    torch.manual_seed(x.shape[-1])
    xd, kwargs = x.double(), {}
    if "norm" in fused:
        g = (0.5 + torch.rand(x.shape[-1])).to(dtype)
        kwargs.update(norm_weight=g, eps=eps)
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    y = xd @ W.T
    size = y.abs().max().item()
    if "swiglu" in fused:
        a, b = y.chunk(2, dim=-1)
        kwargs["swiglu"] = True
        y, size = a * torch.sigmoid(a) * b, 2.1 * a.abs().max().item() * b.abs().max().item()
    if "residual" in fused:
        r = torch.randn(y.shape).to(dtype)
        kwargs["residual"] = r
        y = y + r.double()
        size = max(size, y.abs().max().item())
    return kwargs, y, size


# -- gemv.py -----------------------------------------------------------------------------------------

# (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages): one that fits (64, 256) exactly, one that leaves
# partial blocks of (40, 320), one that splits K into unequal parts.
FITS, PARTIAL, SPLIT = (16, 64, 1, 4, 2), (32, 128, 1, 4, 2), (16, 64, 3, 4, 2)


def check_gemv(kind, M, N, K, launch, fused="", eps=1e-5, x_scale=1.0):
    w, scales, W = weights(kind, N, K)
    x = (x_scale * torch.randn(M, K)).bfloat16()
    kwargs, reference, size = fused_case(fused, x, W, eps)
    kwargs = on_device(kwargs)
    # float32 activations with bf16 values: every product is exact, so only the float32 sums err
    # (an indexing mistake would be off by the size of the result, not by 1e-4 of it)
    y = gemv.gemv(x.float().to(DEVICE), w, scales, launch=launch, **kwargs)
    assert y.dtype == torch.float32 and y.shape == reference.shape
    assert (y.double().cpu() - reference).abs().max().item() <= 1e-4 * size, fused
    # bf16 in, bf16 out: the result rounded once; float16 pairs (int8, one row, the norm: use_half)
    # carry 11 bits a product and sum K / BLOCK_K of them a lane in float16 (measured ~5e-4)
    y = gemv.gemv(x.view(1, M, K).to(DEVICE), w, scales, launch=launch, **kwargs)
    assert y.dtype == torch.bfloat16 and y.shape == (1, *reference.shape)
    half = gemv.use_half(x, scales, M, kwargs.get("norm_weight"))
    assert half == (kind == "int8" and M == 1 and "norm" in fused)
    slack = 2e-3 if half else 1e-5
    assert ((y[0].double().cpu() - reference).abs() <= ROUNDING * reference.abs() + slack * size).all(), fused


@pytest.mark.parametrize("M, N, K, launch", [(1, 64, 256, FITS), (1, 40, 320, PARTIAL), (1, 40, 320, SPLIT),
                                             (3, 64, 256, FITS), (3, 40, 320, SPLIT), (20, 40, 320, PARTIAL)])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_gemv_matches_float64(kind, M, N, K, launch):
    """One row; several (bf16 without a split: _rows_kernel; else the tensor-core path, 20 rows at 64
    a program)."""
    check_gemv(kind, M, N, K, launch)


@pytest.mark.parametrize("fused", ["norm", "residual", "norm+residual", "swiglu", "norm+swiglu+residual"])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_fused_one_row_matches_float64(kind, fused):
    """One row: rmsnorm(x) @ W.T, SwiGLU of the halves (40 outputs: a partial block), the residual.
    A split in the launch is overridden (the norm needs all of K in one program); SwiGLU at config's."""
    check_gemv(kind, 1, 80 if "swiglu" in fused else 40, 320, None if "swiglu" in fused else SPLIT, fused)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_fused_norm_with_an_eps_that_matters(kind):
    """mean(x^2) is about 16: a dropped or misplaced eps fails."""
    check_gemv(kind, 1, 64, 256, FITS, "norm", eps=4.0, x_scale=4.0)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 5, 8])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_gemv_tuned_launches_on_decode_shapes(kind, M):
    """The launches `config` picks, on 7B-like shapes (narrow, wide, K not a multiple of 1024)."""
    for N, K in [(4096, 4096), (12288, 4096), (4096, 11008), (32000, 4096)]:
        check_gemv(kind, M, N, K, None)
        if M == 1:
            check_gemv(kind, M, N, K, None, "norm")


@pytest.mark.parametrize("fused", ["norm", "norm+swiglu", "norm+residual"])
@pytest.mark.parametrize("N, K, launch", [(64, 256, FITS), (44, 2080, (8, 1024, 1, 4, 2))])
def test_int8_half_pairs_match_float64_in_float16(N, K, launch, fused):
    """One row of int8 weights with the norm, in float16 pairs (use_half), with fp16 x, g and output,
    so that the arithmetic's own error shows (bf16's rounding would hide it): within 2e-3 of the
    largest output; also with a K tail (2080 = 2 x 1024 + 32) and a partial block of rows (44 at 8)."""
    w, scales, W = weights("int8", N * (2 if "swiglu" in fused else 1), K)
    x = torch.randn(1, K).half()
    kwargs, reference, size = fused_case(fused, x, W, dtype=torch.float16)
    y = gemv.gemv(x.to(DEVICE), w, scales, launch=launch, **on_device(kwargs))
    assert y.dtype == torch.float16 and gemv.use_half(x, scales, 1, kwargs["norm_weight"])
    assert (y.double().cpu() - reference).abs().max().item() <= 2e-3 * size


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_int8_half_pairs_over_the_range_of_real_activations(scale):
    """Float16 pairs apply the norm's rsqrt at the end, so x g itself must fit float16: checked over
    the range the default model's norm inputs span (median |x g| 1e-3 at layer 0 to a largest 1.3e4 at
    layer 28), with an outlier, within 2e-3 of the largest output."""
    w, scales, W = weights("int8", 64, 1024)
    x = torch.randn(1, 1024) * scale
    x[0, 7] = 40 * scale  # one outlier, as the residual stream has
    g = (0.2 + torch.rand(1024)).half()
    xd = x.half().double()
    reference = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()) @ W.T
    y = gemv.gemv(x.half().to(DEVICE), w, scales, norm_weight=g.to(DEVICE), eps=1e-5, launch=(16, 256, 1, 4, 2))
    assert (y.double().cpu() - reference).abs().max().item() <= 2e-3 * reference.abs().max().item()


@pytest.mark.parametrize("M, launch", [(2, FITS), (16, (32, 128, 1, 4, 3))])
def test_several_rows_with_the_fusions_match_float64(M, launch):
    """Batched decode (2-16 rows, bf16 weights: _rows_kernel): each row's RMSNorm, SwiGLU and residual
    against float64, on shapes with a K tail (320) and partial blocks of outputs; each row differs in
    scale, so a norm taken over the wrong row fails."""
    for N, K in [(160, 256), (80, 320)]:
        w, _, W = weights("bf16", N, K)
        x = (torch.randn(M, K) * torch.linspace(0.5, 8, M)[:, None]).bfloat16()
        for fused in ("", "norm", "residual", "swiglu", "norm+swiglu+residual"):
            kwargs, reference, _ = fused_case(fused, x, W)
            y = gemv.gemv(x.to(DEVICE), w, launch=launch, **on_device(kwargs))
            assert y.dtype == torch.bfloat16 and y.shape == reference.shape
            err = (y.double().cpu() - reference).abs()
            # bf16: the output rounded once; with the norm, x * g also goes to the tensor cores in bf16
            assert err.max().item() <= 2e-2 * reference.abs().max().item(), (N, K, fused)
            assert (err.norm() / reference.norm()).item() <= 8e-3, (N, K, fused)


def test_gemv_refuses_fusions_it_cannot_run():
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.zeros(17, 16).bfloat16(), torch.zeros(8, 16).bfloat16(), residual=torch.zeros(17, 8).bfloat16())
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.zeros(2, 16).bfloat16(), torch.zeros(8, 16, dtype=torch.int8), torch.ones(8).bfloat16(),
                  residual=torch.zeros(2, 8).bfloat16())


def test_usable_only_on_cuda_with_a_contiguous_weight():
    w = torch.zeros(4, 8)
    assert not gemv.usable(torch.zeros(1, 8), w, max_rows=16)
    if torch.cuda.is_available():
        x, w = torch.zeros(2, 3, 8, device="cuda"), w.cuda()
        assert gemv.usable(x, w, max_rows=6) and not gemv.usable(x, w, max_rows=5)
        assert not gemv.usable(x, w.t().contiguous().t(), max_rows=6)


# -- int4.py -----------------------------------------------------------------------------------------

def unpack(packed):
    """uint8 [N, K/2] (column 2j in the low nibble) -> [N, K] in 0..15."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


def file_dequantize(packed, scales, zeros, G):
    """The file layout's W = (q - 8) scale + zero per group of G columns, in scales' dtype."""
    q = unpack(packed).to(scales.dtype)
    group = torch.arange(q.shape[1]) // G
    return (q - 8) * scales[:, group] + zeros[:, group]


def grid_units(scales, zeros):
    """quantize.py's grid: per row, the smallest power of two u_s with max|s| <= 255 u_s, and u_z with
    max|z| <= 127 u_z -> [N, 2]."""
    def unit(v, levels):
        top = v.float().abs().amax(1, keepdim=True) / levels
        return torch.where(top > 0, 2.0 ** torch.ceil(torch.log2(top.double())), 1.0).float()
    return torch.cat([unit(scales, 255), unit(zeros, 127)], dim=1)


def int4_weights(N, K, G, scale=1.0, grid=False):
    """Random int4 weights in the file layout and their float64 values; grid: the scales and zeros
    rounded onto quantize.py's grid (as it writes them)."""
    torch.manual_seed(N * K + G)
    q = torch.randint(0, 16, (N, K))
    packed = (q[:, ::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    scales = ((torch.rand(N, -(-K // G)) / 50 + 1e-3) * scale).bfloat16()
    zeros = (torch.randn(N, -(-K // G)) / 100 * scale).bfloat16()
    if grid:
        u = grid_units(scales, zeros)
        scales = ((scales.float() / u[:, :1]).round().clamp(1, 255) * u[:, :1]).bfloat16()
        zeros = ((zeros.float() / u[:, 1:]).round().clamp(-127, 127) * u[:, 1:]).bfloat16()
    return packed, scales, zeros, file_dequantize(packed, scales.double(), zeros.double(), G)


def int4_layout(packed, scales, zeros, G, codes):
    lay = int4.layout(packed.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), G)
    assert lay.group == math.gcd(G, 2 * packed.shape[1])
    assert (lay.units is not None) == codes and lay.sz.dtype == (torch.int16 if codes else torch.int32)
    return lay


# How far the int4 GEMV may be from the float64 product, as a share of fused_case's size: x goes to
# int8 per group (~0.5% noise on each x; its own exact check is test_int4_gemv_is_its_definition).
# An indexing, nibble-order or scale error is ~1.
INT4_TOLERANCE = 2.5e-2


@pytest.mark.parametrize("N, K, G, launch, fused, grid", [
    *[(40, 576, 128, (16, 2, 4, 2), f, grid) for f in ("", "norm", "norm+swiglu", "residual") for grid in (0, 1)],
    (64, 256, 32, (16, 4, 4, 2), "norm", 0), (64, 256, 32, (16, 4, 4, 2), "residual", 1),
    (48, 1024, 32, None, "norm+swiglu", 1), (48, 1024, 32, None, "", 0),
    (40, 320, 32, (16, 4, 4, 2), "norm", 1), (40, 320, 32, (16, 4, 4, 2), "norm+swiglu", 0),
    (32, 512, 128, (8, 1, 4, 1), "", 1), (32, 512, 128, (8, 1, 4, 1), "residual", 0)])
def test_int4_gemv_matches_float64(N, K, G, launch, fused, grid):
    """int4.gemv (one row; the file layout re-laid by int4.layout: codes where the scales and zeros lie
    on the grid, at groups up to 64) against the float64 product: float32 x within INT4_TOLERANCE of
    the largest output, bf16 x also within bf16's rounding. Covers a group size that does not divide
    K (576 = 4 x 128 + 64: groups of 64 then, 9 at 2 a block: K ends inside the last), a partial block
    of rows (40 at 16), two whole blocks and a partial one (10 groups at 4), and group 128 (no codes)."""
    packed, scales, zeros, W = int4_weights(N * (2 if "swiglu" in fused else 1), K, G, grid=bool(grid))
    lay = int4_layout(packed, scales, zeros, G, bool(grid) and math.gcd(G, K) <= 64)
    for dtype, rounding in ((torch.float32, 0.0), (torch.bfloat16, ROUNDING)):
        x = torch.randn(1, K).bfloat16().to(dtype)
        kwargs, reference, size = fused_case(fused, x, W)
        y = int4.gemv(x.to(DEVICE), *lay, launch=launch, **on_device(kwargs))
        assert y.dtype == dtype and y.shape == reference.shape
        assert ((y.double().cpu() - reference).abs() <= rounding * reference.abs() + INT4_TOLERANCE * size).all()


@pytest.mark.parametrize("grid", [False, True])
@pytest.mark.parametrize("fused", ["norm", "norm+swiglu", "residual"])
def test_int4_gemv_is_its_definition(fused, grid):
    """The result is its definition: x (times g) to int8 per group of G, q = floor(x 127 / max|x| +
    0.5), and per group s max|x| / 127 sum((q_w - 8) q) + z sum(x), s and z from the layout's words
    (codes times their row's units, or float16 times w_unscale); over 5 blocks of 8 groups and a last
    one of 1. In the interpreter (exact float32, as torch's here) to float32 rounding; on the GPU,
    whose division is approximate, a q at a tie may round the other way: within 2e-3 of the output's
    scale (a 1% error of scale is 1e-2)."""
    N, K, G = 48, 1312, 32
    packed, scales, zeros, _ = int4_weights(2 * N if "swiglu" in fused else N, K, G, grid=grid)
    lay = int4_layout(packed, scales, zeros, G, grid)
    x = torch.randn(1, K)
    kwargs, _, _ = fused_case(fused, x, torch.zeros(packed.shape[0], K, dtype=torch.float64))
    xg = (x * kwargs.get("norm_weight", torch.ones(K)).float()).view(-1, G)
    amax = xg.abs().amax(1, keepdim=True)
    q = torch.floor(xg * (127 / amax) + 0.5).double()
    sz = lay.sz.cpu()
    if grid:  # the scale's code in the low byte, the zero's (signed) in the high byte
        units = lay.units.cpu().double()
        s, z = (sz.int() & 255).double() * units[:, :1], (sz.int() >> 8).double() * units[:, 1:]
    else:
        halves = torch.stack([sz & 0xFFFF, (sz >> 16) & 0xFFFF]).to(torch.int16).view(torch.float16).double()
        s, z = halves[0] * lay.w_unscale, halves[1] * lay.w_unscale  # [rows, groups]
    q_w = unpack(packed).double().view(packed.shape[0], -1, G)
    y_def = (((q_w - 8) * q[None]).sum(-1) * s * (amax.double().T / 127) + z * xg.double().sum(1)[None]).sum(1)[None]
    if "norm_weight" in kwargs:
        y_def = y_def * torch.rsqrt(x.double().pow(2).mean() + 1e-5)
    scale = y_def.abs().max().item()
    if kwargs.get("swiglu"):
        gate, up = y_def.chunk(2, dim=-1)
        y_def, scale = gate * torch.sigmoid(gate) * up, 2.1 * gate.abs().max().item() * up.abs().max().item()
    if "residual" in kwargs:
        y_def = y_def + kwargs["residual"].double()
        scale = y_def.abs().max().item()
    y = int4.gemv(x.to(DEVICE), *lay, launch=(16, 8, 4, 2), **on_device(kwargs))
    atol = (1e-5 if DEVICE == "cpu" else 2e-3) * scale
    assert torch.allclose(y.double().cpu(), y_def, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("x_scale, w_scale, fused", [(1e-4, 1.0, "norm"), (1e8, 1.0, "residual"),
                                                     (1.0, 1e-4, "residual"), (1.0, 1e4, "norm")])
def test_int4_gemv_over_wide_ranges_of_x_and_weights(x_scale, w_scale, fused):
    """x goes to int8 scaled per group and float16 scale-and-zero words carry a power of two, so
    neither's size matters: bf16 x from 1e-4 to 1e8 with an outlier 40 times the rest, scales and
    zeros from ~1e-7 to ~1e2, within INT4_TOLERANCE of the largest output."""
    packed, scales, zeros, W = int4_weights(32, 512, 32, w_scale)
    x = torch.randn(1, 512) * x_scale
    x[0, 300] = 40 * x_scale
    x = x.bfloat16()
    kwargs, reference, size = fused_case("norm" if fused == "norm" else "", x, W)
    if fused == "residual":  # (a residual of the output's own size)
        kwargs["residual"] = (torch.randn(1, 32) * size).bfloat16()
        reference = reference + kwargs["residual"].double()
        size = reference.abs().max().item()
    lay = int4_layout(packed, scales, zeros, 32, False)
    y = int4.gemv(x.to(DEVICE), *lay, launch=(16, 4, 4, 2), **on_device(kwargs))
    assert torch.isfinite(y).all()
    assert ((y.double().cpu() - reference).abs() <= 2**-7 * reference.abs() + INT4_TOLERANCE * size).all()


@pytest.mark.parametrize("N, K, G, grid", [(32, 256, 32, True), (40, 576, 128, True), (32, 256, 32, False),
                                           (32, 512, 128, True), (16, 256, 64, False)])
def test_int4_dequantize_inverts_the_layout(N, K, G, grid):
    """int4.dequantize(int4.layout(...)) gives the file layout's weights: exactly with codes (each
    code times its unit is the file's scale or zero; also at 576 = 4 x 128 + 64, groups of 64), and
    from float16 words within float16's subnormal step (2^-24, times w_unscale: the only rounding
    where every value is a bf16 scaled by a power of two)."""
    packed, scales, zeros, _ = int4_weights(N, K, G, grid=grid)
    lay = int4_layout(packed, scales, zeros, G, grid and math.gcd(G, K) <= 64)
    W = int4.dequantize(lay).cpu()
    expected = file_dequantize(packed, scales.float(), zeros.float(), G)
    assert W.dtype == torch.float32 and W.shape == (N, K)
    if lay.units is not None:
        assert torch.equal(W, expected)
    else:
        assert (W - expected).abs().max().item() <= 9 * 2**-25 * lay.w_unscale
        if grid:
            assert torch.equal(W, expected)


def test_int4_codes_only_on_the_grid():
    """int4.layout reads the scales and zeros as codes only where every one lies on the grid, exactly,
    at groups up to 64; a file from elsewhere (these random bf16 scales, as a GGUF's) keeps float16
    pairs. The codes are the grid's numbers: code times unit gives the file's scale and zero back.
    The GEMV refuses codes without their units and units of another shape or dtype."""
    packed, scales, zeros, _ = int4_weights(32, 256, 32)
    assert int4.layout(packed, scales, zeros, 32).units is None
    packed, scales, zeros, _ = int4_weights(32, 256, 32, grid=True)
    lay = int4.layout(packed, scales, zeros, 32)
    assert lay.sz.dtype == torch.int16 and lay.w_unscale == 1.0 and lay.units.shape == (32, 2)
    assert torch.equal(lay.units, grid_units(scales, zeros))
    assert torch.equal((lay.sz.int() & 255).float() * lay.units[:, :1], scales.float())
    assert torch.equal((lay.sz.int() >> 8).float() * lay.units[:, 1:], zeros.float())
    off = scales.clone()
    off[3, 5] = 1.5 * lay.units[3, 0]  # (half a unit past one: bf16 holds it exactly)
    assert int4.layout(packed, off, zeros, 32).units is None
    assert int4.layout(packed, scales[:, ::2], zeros[:, ::2], 64).units is not None  # (still on the grid)
    assert int4.layout(packed, scales[:, ::4], zeros[:, ::4], 128).units is None
    with pytest.raises(ValueError, match="go with their units"):
        int4.gemv(torch.zeros(1, 256), lay.words, lay.sz, None, 1.0, 32)
    with pytest.raises(ValueError, match=r"units must be float32 \[32, 2\]"):
        int4.gemv(torch.zeros(1, 256), lay.words, lay.sz, lay.units.double(), 1.0, 32)


def test_int4_gemv_takes_one_row_of_its_layout():
    packed, scales, zeros, _ = int4_weights(16, 64, 32)
    lay = int4.layout(packed, scales, zeros, 32)
    with pytest.raises(ValueError, match="one row"):
        int4.gemv(torch.zeros(2, 64), *lay)
    with pytest.raises(ValueError, match="do not fit"):
        int4.gemv(torch.zeros(1, 128), *lay)
    with pytest.raises(ValueError, match="multiple of 32"):
        int4.layout(packed[:, :8], scales, zeros, 32)


def test_int4_launches():
    """With codes the down projection at group 32 takes its own launch (16 rows, not 8); columns a step
    are capped at K's groups."""
    assert int4.config(4096, 11008, 32)[0] == 8 and int4.config(4096, 11008, 32, codes=True)[0] == 16
    assert int4.config(4096, 4096, 32) == (16, 64, 8, 3) and int4.config(64, 256, 32)[1] == 8


def test_custom_ops_match_and_compile():
    """gemv.matmul and int4.matmul, the custom ops graphdecode::gemv and ::int4_gemv: the direct calls'
    numbers, and torch.compile(fullgraph=True) takes them as opaque ops (their fakes give the shapes)."""
    w, scales, _ = weights("int8", 64, 256)
    packed, s, z, _ = int4_weights(64, 256, 32, grid=True)
    lay = int4.layout(packed.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 32)
    ones = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(1, 3, 256).bfloat16().to(DEVICE)
    x1 = x[:, :1]
    expected = gemv.gemv(x, w, scales), int4.gemv(x1, *lay, ones)
    assert gemv.matmul(x, w, scales).equal(expected[0])
    assert int4.matmul(x1, *lay, ones).equal(expected[1])

    def f(x):
        return gemv.matmul(x, w, scales) * 2, int4.matmul(x[:, :1], *lay, ones) * 2

    compiled = torch.compile(f, fullgraph=True)
    y8, y4 = compiled(x)
    assert y8.equal(expected[0] * 2) and y4.equal(expected[1] * 2)


# -- attention.py ------------------------------------------------------------------------------------

def rope_tables(L, D):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    angles = torch.outer(torch.arange(L).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().bfloat16(), angles.sin().bfloat16()


def reference_attention(qkv, pos, cos, sin, k_cache, v_cache, H, Hkv):
    """RoPE (rotate-half, in float32, rounded to the cache dtype), the cache write and attention over
    positions <= pos, in PyTorch."""
    B, D = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.float().split([H * D, Hkv * D, Hkv * D], dim=-1)

    def rope(t, heads):
        t = t.view(B, heads, D)
        t1, t2 = t.chunk(2, dim=-1)
        return (t * cos[pos].float() + torch.cat([-t2, t1], dim=-1) * sin[pos].float()).to(qkv.dtype)

    k_cache[:B, :, pos] = rope(k, Hkv)
    v_cache[:B, :, pos] = v.view(B, Hkv, D).to(qkv.dtype)
    keys, values = (c[:B, :, :pos + 1].float().repeat_interleave(H // Hkv, dim=1) for c in (k_cache, v_cache))
    scores = torch.einsum("bhd,bhpd->bhp", rope(q, H).float(), keys) / math.sqrt(D)
    return torch.einsum("bhp,bhpd->bhd", scores.softmax(-1), values).reshape(B, 1, H * D)


# (batch, cache rows, query heads, kv heads, head dim, cache length, position, slices (None: auto))
ATTENTION_CASES = [
    (1, 1, 4, 4, 64, 100, 0, None),  # first position: only the new token
    (1, 1, 4, 4, 64, 100, 37, 1),  # one slice: no merge
    (1, 1, 4, 4, 64, 600, 300, 2),  # one head a group, two slices of several loop steps each
    (1, 1, 2, 2, 128, 224, 150, 4),  # Llama-2-7B's head dim, 4 slices
    (2, 3, 8, 2, 64, 130, 129, None),  # grouped heads, last position, cache with a spare row
    (2, 3, 6, 2, 48, 130, 70, 3),  # 3 heads a group (padded to 4), head dim not a power of two
    (1, 1, 4, 1, 32, 300, 200, 5),  # slices past the position do nothing
    (1, 2, 8, 2, 32, 1024, 100, 16),  # a long cache, an early position: slices sized from it
    (2, 2, 32, 2, 64, 200, 150, None),  # 16 query heads a KV head (wrong on an H100 before the new token's
    (1, 1, 16, 2, 128, 96, 64, 2),  # own update), 8 a KV head
    (1, 1, 2, 1, 8, 64, 40, None),  # head dim 8, padded to tl.dot's least 16
]


@pytest.mark.parametrize("B, rows, H, Hkv, D, L, pos, splits", ATTENTION_CASES)
def test_decode_attention_matches_pytorch(B, rows, H, Hkv, D, L, pos, splits):
    """decode_attention against the PyTorch ops it replaces: the output within bf16 rounding, the new k
    (RoPE'd) and v written at pos, every other cache entry untouched, the counts left at zero."""
    torch.manual_seed(L + pos)
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D).bfloat16()
    k_cache, v_cache = torch.randn(rows, Hkv, L, D).bfloat16(), torch.randn(rows, Hkv, L, D).bfloat16()
    cos, sin = rope_tables(L, D)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = reference_attention(qkv, pos, cos, sin, k_ref, v_ref, H, Hkv)
    counts = torch.zeros(rows * Hkv, dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    y = attention.decode_attention(qkv.to(DEVICE), torch.tensor([pos], device=DEVICE), cos.to(DEVICE),
                                   sin.to(DEVICE), k_cache, v_cache, counts, H, Hkv, splits)
    assert not counts.any()  # left at zero for the next call
    assert y.shape == (B, 1, H * D) and y.dtype == torch.bfloat16
    assert (y.float().cpu() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    new_k, ref_k = k_cache[:B, :, pos].float(), k_ref[:B, :, pos].float()
    assert ((new_k - ref_k).abs() <= ROUNDING * ref_k.abs() + 1e-6).all()  # RoPE'd k within one rounding
    k_cache[:B, :, pos] = k_ref[:B, :, pos]
    assert k_cache.equal(k_ref) and v_cache.equal(v_ref)  # v written exactly, nothing else touched


@pytest.mark.parametrize("H, Hkv, D, L, positions, splits", [
    (4, 4, 64, 300, (0, 150, 37, 299), None),  # one head a group, a row at each end of the cache
    (8, 2, 64, 600, (511, 3, 200), 4),  # grouped heads, slices sized per row
])
def test_decode_attention_with_a_position_per_row(H, Hkv, D, L, positions, splits):
    """pos [B, 1], each row at its own position (the serving engine's step): every row's output and cache
    write equal the kernel run on that row alone at its position, and the reference."""
    B = len(positions)
    torch.manual_seed(B)
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D).bfloat16().to(DEVICE)
    caches = [torch.randn(B + 1, Hkv, L, D).bfloat16().to(DEVICE) for _ in range(2)]
    cos, sin = (t.to(DEVICE) for t in rope_tables(L, D))
    counts = torch.zeros((B + 1) * Hkv, dtype=torch.int32, device=DEVICE)
    alone = [c.clone() for c in caches]
    pos = torch.tensor(positions, device=DEVICE)[:, None]
    y = attention.decode_attention(qkv, pos, cos, sin, *caches, counts, H, Hkv, splits)
    for b, p in enumerate(positions):
        row = [c[b:b + 1] for c in alone]
        one = attention.decode_attention(qkv[b:b + 1], torch.tensor([p], device=DEVICE), cos, sin, *row, counts,
                                         H, Hkv, splits)
        assert y[b].equal(one[0]), (b, p)
        row_caches = (c[b:b + 1].cpu().clone() for c in caches)
        ref = reference_attention(qkv[b:b + 1].cpu(), p, cos.cpu(), sin.cpu(), *row_caches, H, Hkv)
        assert (one.float().cpu() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    assert caches[0].equal(alone[0]) and caches[1].equal(alone[1])  # each row written at its own position only
    assert not counts.any()
    strided = torch.tensor(positions, device=DEVICE)[:, None].repeat(1, 3)[:, :1]  # (a view: stride 3 a row)
    assert attention.decode_attention(qkv, strided, cos, sin, *caches, counts, H, Hkv, splits).equal(y)


def test_attention_slices_rule():
    """Slices: up to 4096 programs, at most 16, 128 positions or more (32 for at most 16 sequence x
    KV-head pairs)."""
    assert attention.splits_for(1, 32, 4096) == 16 and attention.splits_for(1, 32, 1024) == 8
    assert attention.splits_for(64, 32, 4096) == 2 and attention.splits_for(64, 8, 1024) == 8
    assert attention.splits_for(1, 2, 200) == 7 and attention.splits_for(256, 32, 4096) == 1
    assert attention.splits_for(2, 8, 200) == 7 and attention.splits_for(3, 8, 200) == 2


def test_decode_attention_at_a_position_past_the_cache_touches_nothing():
    """pos >= L (which callers prevent) writes nothing: the caches stay as they were and the output is
    finite."""
    H, D, L = 2, 32, 64
    torch.manual_seed(0)
    qkv = torch.randn(1, 1, 3 * H * D).bfloat16().to(DEVICE)
    k_cache, v_cache = (torch.randn(2, H, L, D).bfloat16().to(DEVICE) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    table = torch.randn(L, D).bfloat16().to(DEVICE)
    counts = torch.zeros(2 * H, dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        y = attention.decode_attention(qkv, torch.tensor([L], device=DEVICE), table, table, k_cache, v_cache,
                                       counts, H, H, splits)
        assert y.float().isfinite().all() and not counts.any()
        assert k_cache.equal(k_ref) and v_cache.equal(v_ref)


def test_decode_attention_rejects_what_it_cannot_run():
    table, cache = torch.zeros(8, 16), torch.zeros(1, 4, 8, 16).bfloat16()
    with pytest.raises(ValueError, match="not one token"):
        attention.decode_attention(torch.zeros(1, 2, 3 * 4 * 16).bfloat16(), torch.tensor([0]), table, table, cache,
                                   cache, torch.zeros(4, dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match="counts must be int32"):
        attention.decode_attention(torch.zeros(1, 1, 3 * 4 * 16).bfloat16(), torch.tensor([0]), table, table, cache,
                                   cache, torch.zeros(4), 4, 4)
    for pos in (torch.tensor([0, 1, 2]), torch.tensor([[0, 1]])):  # 3 positions for 2 rows; [1, B], not [B, 1]
        with pytest.raises(ValueError, match="neither one position nor one a row"):
            attention.decode_attention(torch.zeros(2, 1, 3 * 4 * 16).bfloat16(), pos, table, table, cache, cache,
                                       torch.zeros(8, dtype=torch.int32), 4, 4)
    assert not attention.usable(torch.zeros(1, 1, 8), torch.tensor([0]))


def test_decode_attention_op_updates_the_cache_in_place_when_compiled(monkeypatch):
    """Through the custom op under torch.compile, the caches are written in place (the compiler hands
    the op the cache buffers themselves, not copies, and copies nothing back)."""
    from torch._inductor.utils import run_and_get_code

    H, D, L = 4, 32, 16
    qkv = torch.randn(1, 1, 3 * H * D).bfloat16().to(DEVICE)
    k_cache, v_cache = (torch.zeros(1, H, L, D).bfloat16().to(DEVICE) for _ in range(2))
    cos, sin = torch.ones(L, D).bfloat16().to(DEVICE), torch.zeros(L, D).bfloat16().to(DEVICE)
    pos = torch.tensor([0], device=DEVICE)
    counts = torch.zeros(H, dtype=torch.int32, device=DEVICE)
    f = torch.compile(lambda qkv: attention.attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, H) * 1,
                      fullgraph=True)
    seen = []
    direct = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention",
                        lambda *a, **k: seen.append((a[4].data_ptr(), a[5].data_ptr())) or direct(*a, **k))
    y, code = run_and_get_code(f, qkv)
    assert seen == [(k_cache.data_ptr(), v_cache.data_ptr())]  # the kernel got the buffers themselves
    assert k_cache[0, :, 0].equal(qkv[0, 0, H * D:2 * H * D].view(H, D))  # RoPE by angle 0
    assert v_cache[0, :, 0].equal(qkv[0, 0, 2 * H * D:].view(H, D))
    assert y.view(H, D).equal(qkv[0, 0, 2 * H * D:].view(H, D))  # one position: its v
    assert k_cache[0, :, 1:].eq(0).all()
    assert "copy_" not in "".join(code)  # no copy of the caches back after a functional op


def test_no_custom_op_gives_a_mutated_argument_a_default():
    """torch 2.11 drops the trailing arguments of an op call that equal their defaults before it bumps
    the versions of the mutated arguments by position: a mutated argument with a default made every
    trace of the op fail with an IndexError. So none has one, and the op that mutates runs on fake
    tensors (as torch.compile traces it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    schemas = {s.name: s for s in torch._C._jit_get_all_schemas() if s.name.startswith("graphdecode::")}
    assert {"graphdecode::gemv", "graphdecode::int4_gemv", "graphdecode::decode_attention"} <= set(schemas)
    mutated = {name: [(a.name, a.has_default_value()) for a in s.arguments if a.alias_info and a.alias_info.is_write]
               for name, s in schemas.items()}
    assert mutated["graphdecode::decode_attention"] == [("k_cache", False), ("v_cache", False), ("counts", False)]
    assert not [(name, arg) for name, args in mutated.items() for arg, default in args if default]
    H, D, L = 4, 32, 16
    with FakeTensorMode():
        k_cache, v_cache = (torch.empty(1, H, L, D, dtype=torch.bfloat16) for _ in range(2))
        table = torch.empty(L, D, dtype=torch.bfloat16)
        y = attention.attention(torch.empty(1, 1, 3 * H * D, dtype=torch.bfloat16), torch.empty(1, dtype=torch.long),
                                table, table, k_cache, v_cache, torch.empty(H, dtype=torch.int32), H, H)
        assert y.shape == (1, 1, H * D)


# -- cpu.py ------------------------------------------------------------------------------------------

needs_cpu_kernels = pytest.mark.skipif(cpu.unsupported() is not None, reason=f"cpu.cpp cannot run here: {cpu.unsupported()}")


def rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@needs_cpu_kernels
@pytest.mark.parametrize("N, K, G", [(48, 64, 32), (256, 576, 128), (96, 1536, 64), (64, 512, 256), (40, 608, 32)])
@pytest.mark.parametrize("rows", [1, 3, 6, 32])
def test_cpu_int4_kernel_matches_float64(N, K, G, rows):
    """cpu.int4_linear carries x to ~1/32000 of its block's largest value: within 4e-4 of the largest
    output with an outlier and a block of zeros, and without outliers 8x closer than x rounded to bf16
    (PyTorch's int4 op's input). (576 at 128: a short last group, which block_params repeats.)"""
    assert cpu.available()  # a failed build would otherwise skip unseen
    packed, scales, zeros, W = int4_weights(N, K, G)
    block_scales, block_zeros = cpu.block_params(scales.float(), zeros.float(), G, K)
    assert block_scales.dtype == torch.bfloat16 and block_scales.shape == (N, -(-K // 256) * 8)
    plain = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    x = plain.clone()
    x[0, 5] = 40.0  # an outlier: the other values of its block keep their precision (the second int8 part)
    x[-1, 32:64] = 0.0  # a block of zeros
    for xs in (plain, x):
        y = cpu.int4_linear(xs, cpu.interleave(packed), block_scales, block_zeros)
        alone = torch.cat([cpu.int4_linear(row[None], cpu.interleave(packed), block_scales, block_zeros) for row in xs])
        assert torch.equal(y, alone)  # each row's arithmetic is its own, whatever the batch (batched = alone)
        ref = xs.double() @ W.T
        assert y.shape == (rows, N) and y.dtype == torch.float32
        assert ((y - ref).abs().max() / ref.abs().max()).item() < 4e-4 and rel(y, ref) < 2.5e-4
    ref = plain.double() @ W.T
    assert rel(cpu.int4_linear(plain, cpu.interleave(packed), block_scales, block_zeros), ref) < rel(plain.bfloat16().double() @ W.T, ref) / 8
    assert torch.equal(cpu.int4_linear(torch.zeros(rows, K), cpu.interleave(packed), block_scales, block_zeros), torch.zeros(rows, N))


@needs_cpu_kernels
@pytest.mark.parametrize("N, K", [(48, 64), (256, 576), (40, 96)])
@pytest.mark.parametrize("rows", [1, 32])
def test_cpu_int8_kernel_matches_float64(N, K, rows):
    q, scales, W = weights("int8", N, K)
    scales = scales.float().cpu()
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ W.T
    y = cpu.int8_linear(x, cpu.interleave(q.cpu()), scales)
    assert y.shape == (rows, N) and y.dtype == torch.float32
    assert rel(y, ref) < min(2.5e-4, rel(x.bfloat16().double() @ W.T, ref) / 8)  # measured 4e-5
    x[0, 5] = 40.0
    assert rel(cpu.int8_linear(x, cpu.interleave(q.cpu()), scales), x.double() @ W.T) < 2.5e-4
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.int8_linear(x[:, :K - 16].contiguous(), q.cpu()[:, :K - 16].contiguous(), scales)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_reads_up_to_each_position_only(dtype):
    """cpu.attention equals masked SDPA over the whole cache, for one position a query ([S]) or a row's own
    ([B, S]), grouped heads, 8 keys at a time and a tail; keys past a query's position are never read:
    NaN there changes nothing. Its module, CpuAttention, equals the reference in a forward."""
    import copy

    from model import ModelArgs, Transformer

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, S, L, D = 3, 8, 2, 5, 48, 16
    q = torch.randn(B, H, S, D, generator=g)
    k, v = (torch.randn(B, Hkv, L, D, generator=g).to(dtype) for _ in range(2))
    for pos in (torch.tensor([0, 7, 8, 20, 30]), torch.tensor([[3, 4, 5, 6, 7], [9, 10, 16, 17, 25], [0, 1, 2, 3, 47]])):
        mask = (torch.arange(L) <= pos[..., None]).unsqueeze(-3)
        ref = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        unread = [t.clone() for t in (k, v)]
        for t in unread:
            t[..., int(pos.max()) + 1:, :] = float("nan")
        for kk, vv in ((k, v), unread):
            assert (cpu.attention(q, kk, vv, pos) - ref).abs().max() < 2e-6
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.attention(q, k, v, torch.tensor([0, 1, 2, 3, L]))
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, intermediate_size=128,
                                  max_seq_len=64)).to(dtype).eval().requires_grad_(False)
    model.setup_caches(2, 64)
    fast = copy.deepcopy(model)
    assert gdkernels.apply(fast) == ["2 x attention -> cpu.cpp (each query reads up to its position)"]
    with torch.no_grad():
        idx = torch.randint(0, 64, (2, 20), generator=g)
        for m in (model, fast):  # (prefill, then a step at each row's own position)
            m(idx, torch.arange(20))
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        token, pos = torch.tensor([[5], [6]]), torch.tensor([[20], [13]])
        assert (model(token, pos) - fast(token, pos)).abs().max() < tol


@needs_cpu_kernels
def test_cpu_int4_kernel_compiles_and_refuses_bad_shapes():
    packed, scales, zeros, _ = int4_weights(64, 128, 32)
    block_scales, block_zeros = cpu.block_params(scales.float(), zeros.float(), 32, 128)
    x = torch.randn(2, 128)
    compiled = torch.compile(cpu.int4_linear, fullgraph=True)  # an opaque op to Inductor
    assert torch.equal(compiled(x, packed, block_scales, block_zeros), cpu.int4_linear(x, packed, block_scales, block_zeros))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.int4_linear(torch.randn(2, 80), packed[:, :40], block_scales, block_zeros)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.int4_linear(x.bfloat16(), packed, block_scales, block_zeros)
