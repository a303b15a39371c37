"""kernels.py's Triton GEMVs against float64 references: bf16 and int8 weights, one row and
several, shapes that do and do not fill the blocks, with and without a split of K. Without a GPU
they run in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET); `pytest -m cuda` also
runs them on the GPU with the tuned launches."""
import pytest
import torch

import kernels

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


def check(device, kind, M, N, K, launch):
    w, scales, reference_w = weights(kind, N, K)
    w, scales = w.to(device), scales if scales is None else scales.to(device)
    x = torch.randn(M, K).bfloat16().to(device)
    reference = x.double().cpu() @ reference_w.T
    size = reference.abs().max().item()
    # float32 activations with bf16 values: every product is exact, so only the float32 sums err
    # (an indexing mistake would be off by the size of the result, not by 1e-4 of it)
    y = kernels.gemv(x.float(), w, scales, launch=launch)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert (y.double().cpu() - reference).abs().max().item() <= 1e-4 * size
    # bf16 in, bf16 out: the result rounded once, to nearest (the interpreter truncates instead)
    y = kernels.gemv(x.view(1, M, K), w, scales, launch=launch)
    assert y.dtype == torch.bfloat16 and y.shape == (1, M, N)
    rounding = 2**-8 if device == "cuda" else 2**-7
    assert ((y[0].double().cpu() - reference).abs() <= rounding * reference.abs() + 1e-5 * size).all()


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
    assert not kernels.usable(torch.zeros(1, 8), w, max_rows=16)
    if torch.cuda.is_available():
        x, w = torch.zeros(2, 3, 8, device="cuda"), w.cuda()
        assert kernels.usable(x, w, max_rows=6) and not kernels.usable(x, w, max_rows=5)
        assert not kernels.usable(x, w.t().contiguous().t(), max_rows=6)


def test_opaque_op_matches_and_compiles(monkeypatch):
    """kernels.matmul through the custom op (the default; bench.py --traced-gemv: not): same numbers as gemv, and
    torch.compile(fullgraph=True) accepts it (its fake tells the compiler the output's shape)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, scales, _ = weights("int8", 64, 256)
    w, scales = w.to(device), scales.to(device)
    x = torch.randn(1, 3, 256).bfloat16().to(device)
    monkeypatch.setattr(kernels, "OPAQUE", True)
    expected = kernels.gemv(x, w, scales)
    assert kernels.matmul(x, w, scales).equal(expected)
    compiled = torch.compile(lambda x: kernels.matmul(x, w, scales) * 2, fullgraph=True)
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
        y = kernels.gemv(x.float().to(device), w, scales, launch=launch,
                         **{k: v.float() if k == "residual" else v for k, v in kwargs.items()})
        assert (y.double().cpu() - reference).abs().max().item() <= 1e-4 * size, kwargs
        y = kernels.gemv(x.to(device), w, scales, launch=launch, **kwargs)
        assert y.dtype == torch.bfloat16
        rounding = 2**-8 if device == "cuda" else 2**-7
        assert ((y.double().cpu() - reference).abs() <= rounding * reference.abs() + 1e-5 * size).all(), kwargs


def test_fused_steps_take_one_row():
    with pytest.raises(ValueError, match="one row"):
        kernels.gemv(torch.zeros(2, 16).bfloat16(), torch.zeros(8, 16).bfloat16(),
                     residual=torch.zeros(2, 8).bfloat16())
