"""The two layers: model.py and quantize.py are the plain PyTorch model, gdkernels/ swaps faster modules
into it after loading (gdkernels.apply). The plain layer imports nothing of the kernels; the kernels
change no result beyond their own rounding; --no-kernels and GRAPHDECODE_KERNELS=0 run the plain
model; the import graph has no cycle and only bench.py and the tests import generate.py."""
import ast
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate
import gdkernels
from common import Sampling
from generate import Generator
from gdkernels import cpu
from model import Attention, ModelArgs, Transformer
from quantize import Int4Linear, Int8Linear, load, quantize_checkpoint, quantize_model

ROOT = Path(__file__).resolve().parent.parent
GREEDY = Sampling(temperature=0)
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, intermediate_size=128,
                 max_seq_len=256)
needs_cpu_kernel = pytest.mark.skipif(cpu.unsupported() is not None,
                                      reason=f"gdkernels/cpu.cpp does not run here: {cpu.unsupported()}")
# gdkernels/cpu.cpp carries x to ~1/32000 of each block of 32's largest value: at most 2.5e-4 of a
# layer's output (measured ~5e-5: tests/test_quantize.py's test_quantized_linear_is_close_to_float),
# on each quantized layer a token passes: 4 a block, and the head.
CPU_KERNEL_REL = 2.5e-4 * (4 * ARGS.n_layers + 1)


def make_model(seed=0, args=ARGS):
    torch.manual_seed(seed)
    model = Transformer(args).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.3)  # peaky distributions, so greedy is not a coin toss
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def greedy(model, prompt, n):
    gen = Generator(model, GREEDY, "eager", stop_check_interval=4)
    return [t for chunk in gen.generate([list(prompt)], n) for t in chunk[0]]


# -- the plain layer knows nothing of the kernels -----------------------------------------------------

def test_model_and_quantize_import_no_kernels():
    for module in ("model", "quantize"):
        r = subprocess.run([sys.executable, "-c", f"import {module}, sys; "
                            "bad = [m for m in sys.modules if m.startswith(('gdkernels', 'triton'))]; "
                            "assert not bad, bad"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, (module, r.stderr)


def test_decoding_does_not_need_gguf():
    """gguf reads .gguf files only: generate.py, bench.py and the kernels import without it."""
    r = subprocess.run([sys.executable, "-c", "import generate, bench, sys; assert 'gguf' not in sys.modules"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr


def repository_modules() -> dict[str, Path]:
    """Every module of the repository (its top-level .py files and packages) by import name."""
    modules = {p.stem: p for p in ROOT.glob("*.py")}
    for init in ROOT.glob("*/__init__.py"):
        package = init.parent.name
        if package in ("tests", "vendor"):
            continue
        modules[package] = init
        modules.update({f"{package}.{p.stem}": p for p in init.parent.glob("*.py") if p.stem != "__init__"})
    return modules


def imports_of(name: str, path: Path, modules: dict) -> set[str]:
    """The repository modules that module `name` imports anywhere in it (functions included): for
    `import a.b` and `from a import b`, a.b where it is a module, and a (imported first) unless it is
    a package of `name` itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def add(module):
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # a.b.c imports a and a.b first (but for the importer's own packages,
            prefix = ".".join(parts[:i])     # which are being imported already)
            if prefix in modules and (i == len(parts) or not name.startswith(prefix + ".")):
                found.add(prefix)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            add(base)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    add(f"{base}.{alias.name}")
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph (a depth-first search: a module met again while still on the path closes
    one), as the list of modules around it, or None."""
    state, path = {}, []

    def visit(name):
        state[name] = "open"
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


def test_import_graph_has_no_cycle_and_only_bench_imports_generate():
    modules = repository_modules()
    assert {"model", "quantize", "common", "generate", "speculative", "bench", "gdkernels", "gdkernels.aot",
            "gdkernels.cpu"} <= set(modules)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert {"gdkernels.attention", "gdkernels.cpu", "gdkernels.gemv", "gdkernels.int4"} <= graph["gdkernels"]  # (it parses)
    assert "gdkernels" in graph["gdkernels.aot"] and "gdkernels.gemv" in graph["gdkernels.int4"]  # (relative imports)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    scripts = {f"benchmarks/{p.name}": imports_of("__main__", p, modules) for p in (ROOT / "benchmarks").glob("*.py")}
    assert {name for name, deps in {**graph, **scripts}.items() if "generate" in deps} == {"bench"}
    assert not {"gdkernels", "gdkernels.aot"} & (graph["model"] | graph["quantize"] | graph["common"] |
                                                 graph["speculative"])
    for name in ("generate", "serve"):  # the decode steps: only the CLI's apply and the CPU's ahead-of-time step
        assert kernel_names(modules[name]) <= {"apply", "enabled", "aot"}, name


def kernel_names(path: Path) -> set[str]:
    """The names a module uses of the kernels package: gdkernels.X, and X of `from gdkernels import X`."""
    tree = ast.parse(path.read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "gdkernels"} | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                                              and n.module == "gdkernels" for a in n.names}


def test_the_import_graph_check_finds_a_cycle_through_a_function(tmp_path):
    """(The checks above would see one: a.py importing b inside a function, b importing a.)"""
    (tmp_path / "a.py").write_text("def f():\n    import b\n")
    (tmp_path / "b.py").write_text("from a import f\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph == {"a": {"b"}, "b": {"a"}}
    assert find_cycle(graph) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


# -- loading: model.py for float checkpoints, quantize.load for any -----------------------------------

def test_from_checkpoint_refuses_a_quantized_checkpoint_that_quantize_load_loads(tmp_path):
    from test_quantize import TINY, write_float_checkpoint

    float_model = write_float_checkpoint(tmp_path / "float", TINY)
    out = quantize_checkpoint(tmp_path / "float", "int8", None, tmp_path / "int8")
    with pytest.raises(ValueError, match="quantized checkpoint: load it with quantize.load"):
        Transformer.from_checkpoint(out, "cpu", torch.float32)
    loaded = load(out, "cpu", torch.float32)
    assert type(loaded.layers[0].attention.wqkv) is Int8Linear and type(loaded.output) is Int8Linear
    # a float checkpoint loads the same either way, and as it was saved
    plain, through_load = (f(tmp_path / "float", "cpu", torch.float32) for f in (Transformer.from_checkpoint, load))
    idx = torch.tensor([[1, 2, 3, 4]])
    for m in (plain, through_load, float_model.eval(), loaded):
        m.setup_caches(1, 8)
    with torch.no_grad():
        ref = float_model(idx, torch.arange(4))
        assert torch.equal(plain(idx, torch.arange(4)), ref) and torch.equal(through_load(idx, torch.arange(4)), ref)
        assert rel(loaded(idx, torch.arange(4)), ref) < 0.03


# -- gdkernels.apply on the CPU ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def float_model():
    return make_model()


@needs_cpu_kernel
@pytest.mark.parametrize("mode, groupsize", [("int8", None), ("int4", 32), ("int4", 128)])
def test_apply_on_the_cpu_swaps_quantized_layers_and_keeps_the_results(float_model, mode, groupsize):
    plain = quantize_model(float_model, mode, groupsize)
    fast = copy.deepcopy(plain)
    swapped = gdkernels.apply(fast)
    assert swapped and all(" x " in line for line in swapped)
    kind = {"int8": (Int8Linear, gdkernels.Int8Cpu), "int4": (Int4Linear, gdkernels.Int4Cpu)}[mode]
    for name, m in plain.named_modules():  # each quantized layer and attention of the plain model, and only those
        want = {Int8Linear: gdkernels.Int8Cpu, Int4Linear: gdkernels.Int4Cpu, Attention: gdkernels.CpuAttention}
        assert type(fast.get_submodule(name)) is want.get(type(m), type(m)), name
    assert type(fast.layers[1].feed_forward.w2) is kind[1] and type(fast.output) is gdkernels.Int8Cpu
    # the file's weights, interleaved for the kernels (int4's scales and zeros one a block)
    assert torch.equal(cpu.interleave(fast.layers[0].attention.wqkv.weight, inverse=True),
                       plain.layers[0].attention.wqkv.weight)

    n = gdkernels.CPU_MAX_ROWS + 8
    prompt = torch.tensor([[(7 * i + 3) % ARGS.vocab_size for i in range(n)]])
    for m in (plain, fast):
        m.setup_caches(1, 256)
    with torch.no_grad():  # a prefill of more than gdkernels.CPU_MAX_ROWS rows: the same weights, F.linear (the
        # attention kernel's float rounding apart: 1e-6, where the quantizing kernels' is ~1e-4)
        assert rel(fast(prompt, torch.arange(n)), plain(prompt, torch.arange(n)).double()) < 1e-6
    # greedy decode: the same tokens
    tokens = greedy(plain, [1, 2, 3], 24)
    assert greedy(fast, [1, 2, 3], 24) == tokens
    # and its steps (one row each: the kernels) along that path: logits within the kernels' rounding,
    # which is below half the gap between the two best tokens at every step (equal tokens are no luck)
    seq = torch.tensor([[1, 2, 3] + tokens])
    with torch.no_grad():
        steps = {name: torch.cat([m(seq[:, i:i + 1], torch.tensor([i])) for i in range(seq.shape[1] - 1)], dim=1)[0]
                 for name, m in (("plain", plain), ("fast", fast))}
    assert rel(steps["fast"], steps["plain"]) < CPU_KERNEL_REL, rel(steps["fast"], steps["plain"])
    top2 = steps["plain"][2:].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 2 * (steps["fast"] - steps["plain"]).abs().max()


@needs_cpu_kernel
def test_cpu_prefill_of_a_chat_sized_prompt_runs_the_kernel_not_a_dequantized_weight(float_model, monkeypatch):
    """Prompts past 32 tokens (a chat template alone makes 38) used to dequantize every int4 weight each
    call, a 0.45 s step in the time to first token; up to CPU_MAX_ROWS rows the kernel runs instead."""
    fast = quantize_model(float_model, "int4", 32)
    gdkernels.apply(fast)
    fast.setup_caches(1, 256)
    calls = []
    real = gdkernels.dequantize_int4
    monkeypatch.setattr(gdkernels, "dequantize_int4", lambda *a: calls.append(a) or real(*a))
    with torch.no_grad():
        for n, dequantized in ((40, False), (gdkernels.CPU_MAX_ROWS, False), (gdkernels.CPU_MAX_ROWS + 1, True)):
            calls.clear()
            fast(torch.ones(1, n, dtype=torch.long), torch.arange(n))
            assert bool(calls) == dequantized, n


@pytest.mark.parametrize("kernels", [False, True])
def test_a_packed_forward_equals_the_padded_one_at_its_tokens(float_model, kernels):
    """Transformer.forward(idx, input_pos, keep), the engine's prefill: 3 rows' chunks of 5, 1 and 7 tokens after
    3, 9 and 0 cached positions, packed without their padding, give the padded grid's logits at those places; with
    gdkernels' attention too (CpuAttention where cpu.cpp runs). The last row's next place rides along (the engine's
    least prefill; what it sees differs: its padding is zeros when packed)."""
    model = copy.deepcopy(float_model)
    if kernels:
        gdkernels.apply(model)
    model.setup_caches(3, 64)
    starts, lengths, S = [3, 9, 0], [5, 1, 7], 8
    pos = torch.tensor([[s + j for j in range(S)] for s in starts])
    idx = (torch.arange(3 * S).view(3, S) * 7 + 1) % ARGS.vocab_size
    keep = torch.tensor([i * S + j for i, n in enumerate(lengths) for j in range(n)] + [3 * S - 1])
    with torch.no_grad():
        model(torch.arange(48).view(3, 16) % 5 + 9, torch.arange(16).repeat(3, 1))  # a history before the chunks
        padded = model(idx, pos).flatten(0, 1)[keep]
        packed = model(idx.flatten()[keep][None], pos, keep)
    assert packed.shape == (1, len(keep), ARGS.vocab_size) and rel(packed[0, :13], padded[:13]) < 1e-6


def test_apply_on_the_cpu_swaps_a_float_models_attention_only_and_a_cpu_without_the_kernel_nothing(float_model,
                                                                                                  monkeypatch):
    model = copy.deepcopy(float_model)
    assert gdkernels.apply(model) == [f"{ARGS.n_layers} x attention -> cpu.cpp (each query reads up to its position)"]
    assert [gdkernels.CpuAttention if type(m) is Attention else type(m) for m in float_model.modules()] == \
        [type(m) for m in model.modules()]
    qmodel = quantize_model(float_model, "int8")
    monkeypatch.setattr(cpu, "available", lambda: False)  # no AVX2 or no compiler: PyTorch's ops
    assert gdkernels.apply(qmodel) == []
    assert type(qmodel.output) is Int8Linear


def test_kernels_enabled_follows_graphdecode_kernels(monkeypatch):
    monkeypatch.delenv("GRAPHDECODE_KERNELS", raising=False)
    assert gdkernels.enabled()
    monkeypatch.setenv("GRAPHDECODE_KERNELS", "0")
    assert not gdkernels.enabled()
    monkeypatch.setenv("GRAPHDECODE_KERNELS", "1")
    assert gdkernels.enabled()


# -- the command line: --no-kernels and GRAPHDECODE_KERNELS=0 -----------------------------------------

@pytest.fixture(scope="module")
def int4_ckpt(tmp_path_factory):
    """A tiny random model with a real (small) tokenizer, in int4 (g32): on the CPU its layers are the
    ones gdkernels.apply swaps."""
    from test_quantize import write_float_checkpoint
    from test_tokenizer import train_bytelevel_bpe

    path = tmp_path_factory.mktemp("cli")
    write_float_checkpoint(path / "float", ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                                                     intermediate_size=128, max_seq_len=256))
    train_bytelevel_bpe(512, ["<|endoftext|>"]).save(str(path / "float" / "tokenizer.json"))
    return quantize_checkpoint(path / "float", "int4", 32, path / "int4")


def test_cli_no_kernels_generates_the_same_greedy_text(int4_ckpt, tmp_path, monkeypatch, capsys):
    import gdkernels.aot

    monkeypatch.setattr(gdkernels.aot, "cache_dir", lambda: tmp_path)  # no compiled step from elsewhere
    argv = ["--checkpoint", str(int4_ckpt), "--prompt", "the quick brown fox", "--temperature", "0",
            "--max-new-tokens", "24", "--ignore-eos"]
    runs = {}
    for name, extra in (("kernels", []), ("no-kernels", ["--no-kernels"])):
        assert generate.main(argv + extra) == 0
        runs[name] = capsys.readouterr()
        assert "24 tokens in all" in runs[name].err, runs[name].err
    err = runs["kernels"].err
    # with kernels: the CPU's int4 and int8 layers, and (by default) the ahead-of-time step if built: not here
    assert "; 8 x int4 linear -> cpu.cpp" in err and "decode aot-cached" in err
    assert "decode: eager (--compile builds a step ahead of time" in err and "kernels on" in err
    assert "kernels: off" in runs["no-kernels"].err and "decode eager" in runs["no-kernels"].err
    assert len(runs["kernels"].out.strip()) > 0
    assert runs["no-kernels"].out == runs["kernels"].out
    # GRAPHDECODE_KERNELS=0 in a process of its own: what --no-kernels does
    r = subprocess.run([sys.executable, str(ROOT / "generate.py"), *argv], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env={**os.environ, "GRAPHDECODE_KERNELS": "0"})
    assert r.returncode == 0, r.stderr
    assert "kernels: off" in r.stderr and "decode eager" in r.stderr
    assert r.stdout == runs["no-kernels"].out
