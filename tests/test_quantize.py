"""Weight-only quantization (quantize.py) and perplexity (eval.py): error bounds of the quantizers,
the quantized layers (plain PyTorch, and gdkernels/cpu.py's after gdkernels.apply) against float ones,
the CPU kernels against float64, quantized checkpoints against quantizing in memory, the command
line's errors, and quality on the default model."""
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gdkernels
from common import Sampling
from convert_hf_checkpoint import write_safetensors
from eval import perplexity
from generate import Generator
from gdkernels import cpu
from model import ModelArgs, Transformer
from quantize import (Int4Linear, Int8Linear, dequantize_int4, gptq_int4, int4_units, load,
                      quantize_checkpoint, quantize_int4, quantize_int8, quantize_model, split_fused, unpack_int4)
from quantize import main as quantize_main
from tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "eval_text.txt"
CALIBRATION = ROOT / "tests" / "data" / "calibration_text.txt"  # other chapters of the same book
GROUPSIZES = (32, 64, 128, 256)


def on_grid(scales, zeros) -> bool:
    """Whether int4 scales and zeros [N, G] lie on quantize.py's grid (what gdkernels/int4.py reads as
    8-bit codes): each a whole number of its row's unit (int4_units), scales 1..255, zeros -127..127."""
    units = int4_units(scales, zeros)
    s, z = scales.float() / units[:, :1], zeros.float() / units[:, 1:]
    return bool((s == s.round()).all() and (z == z.round()).all() and s.min() >= 1 and s.max() <= 255
                and z.abs().max() <= 127)


def weights(n, k, seed=0):
    """Gaussian rows of different scales, with a few outliers: what trained weights look like."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1) * 0.05
    w[torch.rand(n, k, generator=g) < 0.002] *= 8
    return w


# -- the quantizers --------------------------------------------------------------------------------

def test_int8_error_is_at_most_half_a_step():
    w = weights(96, 160)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (96,) and scales.dtype == torch.bfloat16
    err = (q * scales.float()[:, None] - w).abs()  # (dequantized)
    # Round to nearest on a grid that reaches max|w| (the bf16 scale is at most 2^-9 smaller, so
    # nothing is clipped): error <= half a step, and the biggest value is hit within half a step.
    assert (err <= scales.float()[:, None] / 2 * (1 + 1e-6)).all()
    assert (q.abs().amax(dim=1) >= 126).all()
    assert err.max() > 0.3 * scales.float().min()  # a real rounding, not a copy


@pytest.mark.parametrize("groupsize", GROUPSIZES)
def test_int4_error_per_group_beats_min_max_rounding(groupsize):
    n, k = 64, 576  # 576 is not a multiple of 128 or 256: a shorter last group
    w = weights(n, k, seed=groupsize)
    packed, scales, zeros = quantize_int4(w, groupsize)
    groups = -(-k // groupsize)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert scales.shape == zeros.shape == (n, groups)
    q = unpack_int4(packed)
    assert q.min() >= 0 and q.max() <= 15
    err = dequantize_int4(packed, scales.float(), zeros.float(), groupsize) - w
    # The fit keeps, per group, the least squared error of several candidates, plain min/max
    # rounding among them, whose rms error is at most half its step (max - min) / 15 (1% slack
    # for the bf16 scale and zero). Over the matrix it does clearly better than min/max rounding.
    col = torch.arange(k) // groupsize
    fit_sq = minmax_sq = 0.0
    for gi in range(groups):
        wg, eg = w[:, col == gi], err[:, col == gi]
        lo, hi = wg.amin(dim=1, keepdim=True), wg.amax(dim=1, keepdim=True)
        step = (hi - lo) / 15
        assert (eg.pow(2).mean(dim=1).sqrt() <= step.squeeze(1) / 2 * 1.01 + 1e-7).all(), gi
        fit_sq += eg.pow(2).sum()
        minmax_sq += (((wg - lo) / step).round() * step + lo - wg).pow(2).sum()
    assert fit_sq < 0.95 * minmax_sq
    assert on_grid(scales, zeros)  # the GPU kernel's codes


@pytest.mark.parametrize("groupsize", [32, 128])
def test_int4_grid_costs_little(groupsize, monkeypatch):
    """Scales and zeros on the grid (quantize._grid_fit: 8 bits a row, the best of the grid points
    around the fit) leave the weights' squared error within 3% of the fit's in bf16 (measured here:
    0.5% smaller at group 32, 0.3% at 128: the search among grid points more than pays for the
    grid)."""
    import quantize

    w = weights(64, 576, seed=groupsize)
    packed, scales, zeros = quantize_int4(w, groupsize)
    assert on_grid(scales, zeros)
    # the levels are the weights rounded against the scales and zeros as stored (bf16)
    col = torch.arange(576) // groupsize
    levels = ((w - zeros.float()[:, col]) / scales.float()[:, col]).round().clamp(-8, 7) + 8
    assert torch.equal(unpack_int4(packed), levels.int())
    err = (dequantize_int4(packed, scales.float(), zeros.float(), groupsize) - w).pow(2).sum()
    monkeypatch.setattr(quantize, "_grid_fit",  # (the fit as it is: its levels against its bf16 scale and zero)
                        lambda w, s, z, units: ((w - z.float()[..., None]).div(s.float()[..., None]).round()
                                                .clamp(-8, 7) + 8, s, z))
    p, s, z = quantize_int4(w, groupsize)
    assert not on_grid(s, z)
    err_off = (dequantize_int4(p, s.float(), z.float(), groupsize) - w).pow(2).sum()
    assert err <= 1.03 * err_off, (err / err_off).item()


@pytest.mark.parametrize("groupsize", [32, 64, 256])
def test_gptq_beats_rounding_on_the_layer_output(groupsize):
    """GPTQ writes quantize_int4's format and, on inputs whose columns correlate (as activations'
    do), gives a clearly smaller error of x @ W.T than rounding each weight well on its own; on
    other inputs from the same distribution too, not just the calibration rows."""
    n, k = 48, 320  # 320: a shorter last group for 64 and 256
    w = weights(n, k, seed=groupsize)
    g = torch.Generator().manual_seed(1)
    basis = torch.randn(64, k, generator=g)  # inputs near a 64-dimensional subspace
    x, x_new = (torch.randn(m, 64, generator=g) @ basis + 0.1 * torch.randn(m, k, generator=g) for m in (512, 256))
    packed, scales, zeros = gptq_int4(w, x.double().T @ x.double(), groupsize)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert scales.shape == zeros.shape == (n, -(-k // groupsize)) and scales.dtype == torch.bfloat16
    assert on_grid(scales, zeros)
    w_gptq = dequantize_int4(packed, scales.float(), zeros.float(), groupsize)
    p, s, z = quantize_int4(w, groupsize)
    w_rtn = dequantize_int4(p, s.float(), z.float(), groupsize)
    for inputs in (x, x_new):
        err_gptq = (inputs @ (w_gptq - w).T).norm()
        err_rtn = (inputs @ (w_rtn - w).T).norm()
        assert err_gptq < 0.6 * err_rtn, (err_gptq, err_rtn)  # measured 0.32-0.35


# -- the quantized layers --------------------------------------------------------------------------

def quantized_linear(w, mode, groupsize=None, bias=None, kernel=False):
    """An Int8Linear / Int4Linear loaded from w the way a checkpoint loads, and the float weight it
    stands for (its dequantized weight). kernel: then swapped for gdkernels/cpu.py's layer, as
    gdkernels.apply does on the CPU."""
    n, k = w.shape
    if mode == "int8":
        q, scales = quantize_int8(w)
        layer, state = Int8Linear(k, n, bias is not None), {"weight": q, "scales": scales.float()}
        deq = q * scales.float()[:, None]
    else:
        q, scales, zeros = quantize_int4(w, groupsize)
        layer = Int4Linear(k, n, groupsize, bias is not None)
        state = {"weight": q, "scales": scales.float(), "zeros": zeros.float()}
        deq = dequantize_int4(q, scales.float(), zeros.float(), groupsize)
    if bias is not None:
        state["bias"] = bias
    layer.load_state_dict(state, assign=True)
    if kernel:
        cpu_layer(layer)
    return layer, deq


def cpu_layer(layer):
    """What gdkernels.apply does to one quantized linear layer on the CPU: the same parameters, the
    class of gdkernels/cpu.py's forward (and its convert, where the class has one)."""
    layer.__class__ = gdkernels.Int8Cpu if isinstance(layer, Int8Linear) else gdkernels.Int4Cpu
    if hasattr(layer, "convert"):
        layer.convert(torch.device("cpu"))
    return layer


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


needs_cpu_kernel = pytest.mark.skipif(cpu.unsupported() is not None,
                                      reason=f"gdkernels/cpu.cpp does not run here: {cpu.unsupported()}")
# Each quantized layer with its plain forward (quantize.py) and gdkernels/cpu.py's
KINDS = ["plain", pytest.param("cpu", marks=needs_cpu_kernel)]


@pytest.mark.parametrize("mode,groupsize", [("int8", None)] + [("int4", g) for g in GROUPSIZES])
@pytest.mark.parametrize("rows", [1, 7, 64, 200])
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_linear_is_close_to_float(mode, groupsize, rows, kind):
    torch.manual_seed(rows)  # (x and b: one row's error is itself random, so not the order the tests ran in)
    w, b = weights(256, 576, seed=3), torch.randn(256) * 0.1
    layer, deq = quantized_linear(w, mode, groupsize, b, kernel=kind == "cpu")
    x = torch.randn(rows, 576)
    y = layer(x.view(1, rows, 576)).view(rows, 256)
    assert y.dtype == torch.float32
    # Against its own dequantized weight: the plain layers dequantize and multiply in float32 (so do
    # the CPU layers beyond gdkernels.CPU_MAX_ROWS rows): float rounding alone. Decode through
    # gdkernels/cpu.cpp carries x to ~1/32000 of each block's largest value (measured ~5e-5).
    exact = F.linear(x, deq, b)
    assert rel(y, exact) < (2.5e-4 if kind == "cpu" and rows <= gdkernels.CPU_MAX_ROWS else 1e-5)
    # The weight's relative error is that of rounding to nearest on the grid: step^2 / 12 per weight
    # (measured: int8 1.00x that, int4 0.9x, its fit beating min/max). For inputs in random
    # directions the output's relative error is the weight's.
    weight_err = rel(deq, w)
    assert weight_err < 1.05 * rounding_noise(w, mode, groupsize)
    assert rel(y, F.linear(x, w, b)) < 1.3 * weight_err + 1e-3


# -- the CPU kernels' layers (gdkernels/cpu.py; the kernels themselves: tests/test_kernels.py) ------------

@needs_cpu_kernel
def test_cpu_kernel_builds_and_its_layers_interleave_the_file_layout():
    assert cpu.available()  # a failed build would otherwise pass unseen, through PyTorch's op
    w = weights(32, 608)  # 19 blocks: two chunks of 8 and one of 3
    layer, _ = quantized_linear(w, "int4", 32, kernel=False)
    packed = layer.weight.clone()
    cpu_layer(layer)
    assert isinstance(layer, gdkernels.Int4Cpu) and layer.weight.shape == (32, 304)
    # 32 bytes: 4 of each block; the last 3 blocks: 12 bytes (byte j of block b, 16 bytes in the file: 4 * (j // 4)
    # of each, then block b's 4 bytes)
    assert torch.equal(layer.weight[:, 4:8], packed[:, 16:20]) and torch.equal(layer.weight[:, 272:276], packed[:, 276:280])
    assert torch.equal(cpu.interleave(layer.weight, inverse=True), packed)
    assert layer.block_scales.dtype == torch.bfloat16 and not hasattr(layer, "scales")  # (one per block of 32)
    layer, _ = quantized_linear(w, "int8", kernel=False)
    q = layer.weight.clone()
    cpu_layer(layer)
    assert isinstance(layer, gdkernels.Int8Cpu) and layer.scales.dtype == torch.float32  # (the kernel's dtype)
    assert torch.equal(layer.weight[:, 32:36], q[:, 4:8]) and torch.equal(cpu.interleave(layer.weight, inverse=True), q)


def rounding_noise(w, mode, groupsize):
    """Relative rms error of round-to-nearest on the plain grid, step^2 / 12 per weight: int8
    steps max|w| / 127 per row, int4 (max - min) / 15 per group."""
    if mode == "int8":
        step = (w.abs().amax(dim=1, keepdim=True) / 127).expand_as(w)
    else:
        col = torch.arange(w.shape[1]) // groupsize
        step = torch.empty_like(w)
        for gi in col.unique():
            wg = w[:, col == gi]
            step[:, col == gi] = (wg.amax(dim=1, keepdim=True) - wg.amin(dim=1, keepdim=True)) / 15
    return ((step.pow(2).sum() / 12).sqrt() / w.norm()).item()


# -- checkpoints -----------------------------------------------------------------------------------

def write_float_checkpoint(path: Path, args: ModelArgs, seed=0) -> Transformer:
    """A random model saved as convert_hf_checkpoint.py saves one (q/k/v and gate/up apart, no
    output head when tied), with a stand-in tokenizer file."""
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    state = split_fused(model.state_dict(), args)
    if args.tie_embeddings:
        del state["output.weight"]
    path.mkdir(parents=True)
    write_safetensors(path / "model.safetensors", iter(state.items()), {"format": "pt"})
    config = {"model": asdict(args), "quantization": None, "source": "random test model"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text('{"stand-in": true}')
    return model


TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, intermediate_size=96,
                 max_seq_len=128, tie_embeddings=True, attention_bias=True)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    write_float_checkpoint(path, TINY)
    return path


def logits(model, idx):
    model.setup_caches(1, 64)
    return model(idx, torch.arange(idx.shape[1]))


@pytest.mark.parametrize("mode,groupsize", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_quantized_checkpoint_loads_like_quantizing_in_memory(tiny_ckpt, tmp_path, mode, groupsize):
    out = quantize_checkpoint(tiny_ckpt, mode, groupsize, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == ({"mode": "int8"} if mode == "int8" else {"mode": "int4", "groupsize": groupsize})
    assert config["source"] == "random test model" and config["model"]["tie_embeddings"] is False
    assert (out / "tokenizer.json").read_bytes() == (tiny_ckpt / "tokenizer.json").read_bytes()

    float_model = Transformer.from_checkpoint(tiny_ckpt, "cpu", torch.float32)
    loaded = load(out, "cpu", torch.float32)  # driven by config.json alone
    in_memory = quantize_model(float_model, mode, groupsize)
    layer = loaded.layers[0].feed_forward.w13
    assert type(layer) is (Int8Linear if mode == "int8" else Int4Linear)
    assert type(loaded.output) is Int8Linear

    idx = torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    ref, got = logits(float_model, idx), logits(loaded, idx)
    assert torch.equal(got, logits(in_memory, idx))
    # quantized, yet the same model: measured 0.0056 (int8) and 0.021-0.023 (int4 g32-g128); 2x that
    assert rel(got, ref) < (0.012 if mode == "int8" else 0.05)
    # Decode (one token at a time) agrees with the prompt's forward: to float rounding with the plain
    # layers; with gdkernels/cpu.py's (gdkernels.apply) within its rounding of x (~2.5e-4 a layer at
    # most, test_quantized_linear_is_close_to_float) on each of the 4 n_layers + 1 quantized layers.
    def decode(model):
        return torch.cat([model(idx[:, i:i + 1], torch.tensor([i])) for i in range(idx.shape[1])], dim=1)

    assert rel(decode(loaded), got) < 1e-5
    if cpu.unsupported() is None:
        swapped = gdkernels.apply(loaded)
        assert swapped and type(layer) is (gdkernels.Int8Cpu if mode == "int8" else gdkernels.Int4Cpu)
        # (int4: w2's 96 input columns are no whole number of the kernel's 64: that layer stays plain)
        assert type(loaded.layers[0].feed_forward.w2) is (gdkernels.Int8Cpu if mode == "int8" else Int4Linear)
        bound = 2.5e-4 * (4 * TINY.n_layers + 1)
        assert rel(logits(loaded, idx), got) < bound  # prefill: 40 rows, through the kernel as well
        assert rel(decode(loaded), got) < bound


# -- perplexity -------------------------------------------------------------------------------------

def test_perplexity_scores_each_token_once_with_its_window(tiny_ckpt):
    model = Transformer.from_checkpoint(tiny_ckpt, "cpu", torch.float32)
    tokens = torch.randint(0, TINY.vocab_size, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    model.setup_caches(1, 64)
    full = F.log_softmax(model(torch.tensor([tokens]), torch.arange(50))[0], dim=-1)
    nll = -full[:-1].gather(1, torch.tensor(tokens[1:])[:, None]).mean()
    assert perplexity(model, tokens, window=64, stride=8) == pytest.approx(nll.exp().item(), rel=1e-5)
    # Windows of 16 ending every 5 tokens: token t is scored once, in the first window that ends
    # after it, seeing the tokens from that window's start. Brute force, one forward per token:
    window, stride, total = 16, 5, 0.0
    for t in range(1, 50):
        end = window if t < window else min(50, window + stride * -(-(t + 1 - window) // stride))
        begin = max(0, end - window)
        out = model(torch.tensor([tokens[begin:t]]), torch.arange(t - begin))[0, -1]
        total -= F.log_softmax(out, dim=-1)[tokens[t]].item()
    assert perplexity(model, tokens, window, stride) == pytest.approx(torch.tensor(total / 49).exp().item(), rel=1e-5)
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, tokens, window=16, stride=16)


# -- the command line ------------------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "quantize.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def assert_clean_error(result, *words):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert all(w in result.stderr for w in words), result.stderr


def test_cli_writes_the_default_name_and_refuses_to_overwrite(tiny_ckpt, capsys):
    result = run_cli("--checkpoint", tiny_ckpt, "--mode", "int4", "--groupsize", "64")
    out = tiny_ckpt.parent / "tiny-int4-g64"
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert load(out, "cpu", torch.float32).layers[1].attention.wqkv.groupsize == 64
    before = sorted(p.name for p in tiny_ckpt.parent.iterdir())
    # A quantized checkpoint cannot be quantized again.
    assert_clean_error(run_cli("--checkpoint", out, "--mode", "int8"), "already quantized")
    # The rest in-process (the same main(), without a Python start each).
    assert quantize_main(["--checkpoint", str(tiny_ckpt), "--mode", "int4", "--groupsize", "64"]) == 1
    assert "already exists" in capsys.readouterr().err
    for argv, words in [(["--mode", "int8", "--groupsize", "32"], "--groupsize applies to"),
                        (["--mode", "int4", "--groupsize", "48"], "invalid choice: 48")]:
        with pytest.raises(SystemExit) as exit:
            quantize_main(["--checkpoint", str(tiny_ckpt), *argv])
        assert exit.value.code == 2 and words in capsys.readouterr().err
    assert sorted(p.name for p in tiny_ckpt.parent.iterdir()) == before  # nothing half-written left
    # --force replaces it (README's example after a first run), with an ordinary directory's permissions
    (out / "stale").write_text("from before")
    assert quantize_main(["--checkpoint", str(tiny_ckpt), "--mode", "int4", "--groupsize", "64", "--force"]) == 0
    assert not (out / "stale").exists() and (out / "config.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == tiny_ckpt.stat().st_mode & 0o777 == 0o777 & ~umask


def test_cli_errors(tmp_path, run_main):
    odd = tmp_path / "odd"  # dim 48: no group of 32 columns divides it
    write_float_checkpoint(odd, ModelArgs(dim=48, n_layers=1, n_heads=4, vocab_size=64, intermediate_size=64))
    assert_clean_error(run_cli("--checkpoint", odd, "--mode", "int4", "--groupsize", "32"),  # (a process of its own)
                       "layers.0.attention.", "input dim that is a multiple of 32", "48 x 48")
    assert_clean_error(run_main(quantize_main, "--checkpoint", odd, "--mode", "int3"), "invalid choice: 'int3'")
    assert_clean_error(run_main(quantize_main, "--checkpoint", tmp_path / "nowhere", "--mode", "int8"),
                       "not a checkpoint directory")
    tiny = tmp_path / "tiny"
    write_float_checkpoint(tiny, TINY)  # its tokenizer file is a stand-in: nothing to calibrate with
    assert_clean_error(run_main(quantize_main, "--checkpoint", tiny, "--mode", "int8", "--calibration", CALIBRATION),
                       "--calibration applies to --mode int4")
    assert_clean_error(run_main(quantize_main, "--checkpoint", tiny, "--mode", "int4", "--calibration", CALIBRATION),
                       "--calibration needs the checkpoint's tokenizer")
    assert_clean_error(run_main(quantize_main, "--checkpoint", tiny, "--mode", "int4", "--calibration",
                                  tmp_path / "none.txt"), "cannot read it as text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd", "tiny"]  # no output, no temporary directory


def test_calibrated_checkpoint_end_to_end(tmp_path):
    """--calibration writes a checkpoint (GPTQ) that loads like any int4 one and stays near the
    float model; its weights differ from plain rounding's."""
    from test_tokenizer import train_bytelevel_bpe

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, intermediate_size=128,
                     max_seq_len=128)
    ckpt = tmp_path / "small"
    write_float_checkpoint(ckpt, args)
    train_bytelevel_bpe(512).save(str(ckpt / "tokenizer.json"))
    gptq = quantize_checkpoint(ckpt, "int4", 32, tmp_path / "gptq", calibration=CALIBRATION)
    rtn = quantize_checkpoint(ckpt, "int4", 32, tmp_path / "rtn")
    float_model, g, r = (load(p, "cpu", torch.float32) for p in (ckpt, gptq, rtn))
    idx = torch.tensor([load_tokenizer(ckpt).encode(TEXT.read_text()[:400])[:64]])
    ref = logits(float_model, idx)
    gptq_err, rtn_err = rel(logits(g, idx), ref), rel(logits(r, idx), ref)
    assert gptq_err < 0.035 and gptq_err < rtn_err  # measured 0.017 against rounding's 0.021
    assert not torch.equal(g.layers[0].feed_forward.w2.weight, r.layers[0].feed_forward.w2.weight)


def test_loading_rejects_a_bad_quantization_entry(tiny_ckpt, tmp_path):
    out = quantize_checkpoint(tiny_ckpt, "int8", None, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    for bad, words in [({"mode": "int2"}, "unknown quantization"),
                       ({"mode": "int4", "groupsize": 48}, "groupsize must be one of"),
                       ({"mode": "int4", "groupsize": 32}, "do not match")]:  # int8 weights, int4 config
        (out / "config.json").write_text(json.dumps(dict(config, quantization=bad)))
        with pytest.raises(ValueError, match=words):
            load(out, "cpu", torch.float32)


# -- quality on the default model ------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at",
]


@pytest.fixture(scope="module")
def default_float(default_ckpt):
    return Transformer.from_checkpoint(default_ckpt, "cpu", torch.float32)


@pytest.fixture(scope="module")
def default_int8(default_float):
    return quantize_model(default_float, "int8")


@pytest.mark.slow
def test_perplexity_on_the_default_model(default_ckpt, default_float, default_int8):
    # The first 1,024 tokens of the shipped text, windows of 256 every 192: short, for speed.
    tokens = load_tokenizer(default_ckpt).encode(TEXT.read_text())[:1024]
    base = perplexity(default_float, tokens, window=256, stride=192)
    assert 5 < base < 60  # a working model on ordinary English
    ratios = {"int8": perplexity(default_int8, tokens, 256, 192) / base}
    for g in (32, 128):
        ratios[f"int4 g{g}"] = perplexity(quantize_model(default_float, "int4", g), tokens, 256, 192) / base
    print(f"\nperplexity {base:.3f} float; ratios " + ", ".join(f"{k} {v:.4f}" for k, v in ratios.items()))
    assert ratios["int8"] <= 1.01  # measured 1.005 (shorter texts: up to 1.010)
    assert ratios["int4 g32"] <= 1.10  # the default model is Q4_1 (blocks of 32) at heart: ~1.00
    # Measured 1.34-1.38: this 135M model, already 4-bit, loses more than the 1.20 aimed for
    # when regrouped by 128 with round-to-nearest (see BENCHMARKS.md); GPTQ reaches it (1.15: the
    # next test checks GPTQ layer by layer, in a tenth of the time the whole model's would take).
    assert ratios["int4 g128"] <= 1.50
    assert ratios["int4 g32"] < ratios["int4 g128"]


@pytest.mark.slow
def test_gptq_beats_rounding_on_the_default_models_layers(default_ckpt, default_float):
    """GPTQ on the default model's own weights and inputs (group 128, where rounding loses most):
    calibrated on 2,048 tokens of the calibration text, the layers' output error on other text (the
    evaluation text's second moments, from calibrate too) is clearly below round-to-nearest's, in a
    first, a middle and the last block. (quantize_model with a calibration runs the same functions on
    every layer; its whole-model perplexity, 1.15x float against 1.36x by rounding, takes ~90 s.)"""
    from quantize import calibrate

    tok = load_tokenizer(default_ckpt)
    hessians = calibrate(default_float, tok.encode(CALIBRATION.read_text())[:2048])
    held_out = calibrate(default_float, tok.encode(TEXT.read_text())[:512])  # sum of x x^T on other text
    state = split_fused(default_float.state_dict(), default_float.args)
    errors = {}
    for name in ("layers.0.feed_forward.w2.weight", "layers.10.attention.wo.weight", "layers.15.attention.wq.weight",
                 "layers.29.feed_forward.w1.weight"):
        w, h = state[name].float(), held_out[name].double()
        gptq, rtn = gptq_int4(w, hessians[name], 128), quantize_int4(w, 128)
        # || X (W_q - W)^T || over the held-out inputs X: sqrt(trace(E H E^T))
        errors[name] = [torch.trace(e @ h @ e.T).sqrt().item() for e in
                        ((dequantize_int4(q, s.float(), z.float(), 128) - w).double() for q, s, z in (gptq, rtn))]
    ratios = {name: g / r for name, (g, r) in errors.items()}
    print("\nGPTQ / rounding, output error on held-out text: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    assert all(r < 1.05 for r in ratios.values()), ratios  # measured 0.44-0.94 (0.94: 1,536 inputs, 2,048 tokens)
    total = sum(g * g for g, _ in errors.values()) ** 0.5 / sum(r * r for _, r in errors.values()) ** 0.5
    assert total < 0.75, total


@pytest.mark.slow
def test_int8_greedy_against_float(default_ckpt, default_float, default_int8):
    tok = load_tokenizer(default_ckpt)

    def greedy(model, ids):
        gen = Generator(model, Sampling(temperature=0), "eager")
        return [t for chunk in gen.generate([ids], 32) for t in chunk[0]]

    agree, flip_gaps = [], []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        a = greedy(default_float, ids)
        assert len(a) == 32
        # Teacher-forced on float's continuation, int8 picks the same next token almost always, and
        # differs only where the float model itself nearly ties (its two best logits close).
        full = torch.tensor([ids + a])
        ref = logits(default_float, full)[0, len(ids) - 1:-1]
        pred = logits(default_int8, full)[0, len(ids) - 1:-1].argmax(-1)
        agree.append((pred == torch.tensor(a)).float().mean().item())
        top2 = ref.topk(2, dim=-1).values
        flip_gaps += (top2[:, 0] - top2[:, 1])[pred != torch.tensor(a)].tolist()
    print(f"teacher-forced next-token agreement {sum(agree) / len(agree):.3f}; float's top-2 gaps where int8 "
          f"differs {flip_gaps}")
    # Measured: 4 flips in 160 positions, at gaps 0.005-0.23 logits (the median gap is 1.3); int8's
    # logits move by up to 2.0, so a wrong scale or rounding flips clear decisions, not only near-ties.
    assert sum(agree) / len(agree) >= 0.95
    assert all(gap < 0.5 for gap in flip_gaps), flip_gaps


def test_eval_cli_prints_the_perplexity_of_one_forward_and_refuses_bad_input(default_ckpt, tmp_path, capsys):
    """eval.py on a text shorter than its window: exp(mean next-token cross-entropy) of one forward,
    computed here from the model's logits; and one `error:` line for each bad input."""
    from eval import main as eval_main

    text = tmp_path / "t.txt"
    text.write_text(TEXT.read_text(encoding="utf-8")[:300], encoding="utf-8")
    assert eval_main(["--checkpoint", str(default_ckpt), "--text", str(text), "--window", "256"]) == 0
    printed = float(capsys.readouterr().out.split()[1])
    ids = torch.tensor([load_tokenizer(default_ckpt).encode(text.read_text(encoding="utf-8"))])
    assert ids.shape[1] <= 256
    model = load(default_ckpt, "cpu", torch.float32)
    model.setup_caches(1, 256)
    with torch.no_grad():
        ce = F.cross_entropy(model(ids, torch.arange(ids.shape[1]))[0, :-1], ids[0, 1:])
    assert printed == pytest.approx(ce.exp().item(), rel=1e-3)
    for argv, words in [(["--window", "64", "--stride", "64"], "need 1 <= --stride < --window"),
                        (["--window", "9000"], "exceeds the model's context of 8192"),
                        (["--text", str(tmp_path / "none.txt")], "cannot read the text")]:
        args = ["--checkpoint", str(default_ckpt), "--text", str(text), *argv]  # (a second --text wins)
        assert eval_main(args) == 1
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and words in err and "Traceback" not in err, err
