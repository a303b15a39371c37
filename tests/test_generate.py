"""Sampling, stop checks and the command line of generate.py."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate
from generate import Generator, Sampling, sample
from model import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, intermediate_size=128,
                     max_seq_len=512)
    model = Transformer(args).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.3)  # peaky distributions, so greedy is not a coin toss
    return model


def run_gen(model, sampling, prompt=(1, 2, 3), n=40, seed=None, stop=frozenset(), k=8, compiled=False):
    if seed is not None:
        torch.manual_seed(seed)
    gen = Generator(model, sampling, "compile" if compiled else "eager", stop_check_interval=k)
    return [t for chunk in gen.generate([list(prompt)], n, set(stop)) for t in chunk[0]]


def test_greedy_is_deterministic_and_top_k_1_equals_greedy(tiny):
    greedy = run_gen(tiny, Sampling(temperature=0))
    assert len(greedy) == 40
    assert run_gen(tiny, Sampling(temperature=0)) == greedy
    assert run_gen(tiny, Sampling(temperature=1.0, top_k=1), seed=5) == greedy


def test_seeded_sampling_is_reproducible(tiny):
    s = Sampling(temperature=1.0, top_k=None, top_p=0.95)
    a, b = run_gen(tiny, s, seed=123), run_gen(tiny, s, seed=123)
    assert a == b
    assert run_gen(tiny, s, seed=124) != a  # 40 draws from a 64-token vocabulary


def test_top_p_samples_only_inside_the_nucleus():
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.07])
    logits = probs.log().expand(20000, -1).clone()
    torch.manual_seed(0)
    got = sample(logits, Sampling(temperature=1.0, top_k=None, top_p=0.7))
    # cumulative: .35 .60 .75 -> the nucleus for 0.7 is {0, 1, 2}
    assert set(got.tolist()) == {0, 1, 2}
    freq = torch.bincount(got, minlength=6)[:3].float() / len(got)
    expected = probs[:3] / probs[:3].sum()
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)  # > 5 sigma at n=20000


def test_top_k_and_temperature_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(20000, -1).clone()
    torch.manual_seed(1)
    got = sample(logits, Sampling(temperature=1.0, top_k=2))
    assert set(got.tolist()) == {0, 1}
    assert abs((got == 0).float().mean().item() - 0.5 / 0.8) < 0.015
    hot = sample(logits, Sampling(temperature=0.5, top_k=None))  # p^2, renormalised
    assert abs((hot == 0).float().mean().item() - 0.25 / 0.38) < 0.015


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=1.0, top_k=None)],
                         ids=["greedy", "sampled"])
def test_stop_check_interval_does_not_change_output(tiny, sampling):
    full = run_gen(tiny, sampling, n=60, seed=7, k=1)
    stop = full[20]  # a token that occurs: output must end at its first occurrence
    first = full.index(stop)
    outs = {k: run_gen(tiny, sampling, n=60, seed=7, stop={stop}, k=k) for k in (1, 8, 32)}
    for k, out in outs.items():
        assert out == full[: first + 1], f"K={k}"


def test_batch_rows_stop_independently(tiny):
    gen = Generator(tiny, Sampling(temperature=0), "eager", stop_check_interval=4)
    rows = [[1, 2, 3], [4, 5, 6]]
    alone = [[t for c in gen.generate([r], 30) for t in c[0]] for r in rows]
    stop = alone[0][5]
    chunks = list(gen.generate(rows, 30, {stop}))
    got = [[t for c in chunks for t in c[b]] for b in range(2)]
    for b in range(2):
        want = alone[b][: alone[b].index(stop) + 1] if stop in alone[b] else alone[b]
        assert got[b] == want


def test_compiled_decode_equals_eager(tiny):
    assert run_gen(tiny, Sampling(temperature=0), compiled=True) == run_gen(tiny, Sampling(temperature=0))


def test_custom_ops_are_registered_with_inductor_before_it_meets_them(tiny):
    """Compiled decode registers the graphdecode ops as Inductor fallbacks first (register_fallbacks),
    with the layout constraint Inductor itself would give them, so Inductor never takes its
    implicit-fallback path: on torch 2.11 that path formats the str() of every argument, which
    grows ~2x a layer through the residual (a 32-layer int4 model with cuda_kernels.int4_gemv never
    finished compiling). Here the CPU's int4 and int8 ops (cpu_kernels.py) stand for all of them."""
    import logging

    import cpu_kernels
    from quantize import quantize_model
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    assert cpu_kernels.available()  # (else the model has no graphdecode op on the CPU)
    qmodel = quantize_model(tiny, "int4", 32)
    ops = [getattr(torch.ops.graphdecode, n).default for n in ("int4_linear", "int8_linear", "gemv")]
    for op in ops:  # as in a fresh process, whatever other tests compiled before
        lowering.lowerings.pop(op, None)
        lowering._maybe_layout_constraints.pop(op, None)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    graph_log = logging.getLogger("torch._inductor.graph")
    level = graph_log.level
    graph_log.addHandler(handler)
    graph_log.setLevel(logging.INFO)
    try:
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True):
            compiled = run_gen(qmodel, Sampling(temperature=0), n=12, compiled=True)
    finally:
        graph_log.removeHandler(handler)
        graph_log.setLevel(level)
    implicit = [m.splitlines()[1] for m in messages if m.startswith("Creating implicit fallback")]
    assert not [m for m in implicit if "graphdecode" in m], implicit
    for op in ops:
        tag = get_layout_constraint_tag(op, with_default=True)
        assert op in lowering.lowerings
        assert lowering.maybe_layout_constraints(op) is lowering.tag_to_layout_constraint(tag) is not None
    assert compiled == run_gen(qmodel, Sampling(temperature=0), n=12)


def test_uses_int4_ring_finds_a_layer_the_ring_runs(tiny, monkeypatch):
    """generate.uses_int4_ring (which decides whether graphs mode primes: generate.prime_capture, run on CUDA by
    tests/test_cuda.py) is true once some layer runs int4_ring.py's kernel (gemv_ring), never on the CPU."""
    from model import Int4Linear
    from quantize import quantize_model

    qmodel = quantize_model(tiny, "int4", 32)
    assert not generate.uses_int4_ring(tiny) and not generate.uses_int4_ring(qmodel)
    layer = next(m for m in qmodel.modules() if isinstance(m, Int4Linear))
    monkeypatch.setattr(layer, "gemv_ring", True, raising=False)
    assert generate.uses_int4_ring(qmodel)


def test_register_fallbacks_warns_where_inductor_lacks_what_it_uses(monkeypatch):
    """Without the private Inductor functions register_fallbacks uses, it registers nothing and
    raises nothing. On torch before 2.13, where Inductor may format the str() it avoids, it warns,
    so that a compile that never ends has a cause on screen. On later torch it stays quiet."""
    import warnings

    from torch._inductor import lowering
    from torch.torch_version import TorchVersion

    from generate import register_fallbacks

    monkeypatch.delattr(lowering, "make_fallback")
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0+cu130"))
    with pytest.warns(UserWarning, match="could not register its custom ops with Inductor"):
        register_fallbacks()
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.13.0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register_fallbacks()


def test_ahead_of_time_step_equals_eager_and_is_reused(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(generate, "AOT_CACHE", tmp_path)

    def fresh(seed):  # (not `tiny` itself: other tests grow its cache, and the cache's shape is in the key)
        torch.manual_seed(seed)
        model = Transformer(tiny.args).eval().requires_grad_(False)
        for p in model.parameters():
            p.normal_(0, 0.3)
        return model

    def aot(model, sampling, mode="aot", seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        gen = Generator(model, sampling, mode)
        out = [t for chunk in gen.generate([[1, 2, 3]], 40) for t in chunk[0]]
        return out, gen

    one, other = fresh(0), fresh(1)
    greedy, sampled = Sampling(temperature=0), Sampling(temperature=1.0, top_k=20)
    # A missing package with aot-cached (generate.py's CPU default): eager decode, and a hint.
    out, gen = aot(one, greedy, "aot-cached")
    assert out == run_gen(one, greedy) and gen.step.runner is generate.decode_one_token
    assert "run once with --compile" in capsys.readouterr().err and not list(tmp_path.iterdir())
    out, gen = aot(one, greedy)  # builds the package
    assert out == run_gen(one, greedy) and gen.step.runner is not generate.decode_one_token
    assert aot(one, sampled, seed=7)[0] == run_gen(one, sampled, seed=7)  # --seed holds (PyTorch's generator)
    assert len(list(tmp_path.glob("*.pt2"))) == 2  # one per sampling setting
    # Another model of the same shapes loads the package (it holds no weights) and follows its own.
    out, gen = aot(other, greedy, "aot-cached")
    assert out == run_gen(other, greedy) != run_gen(one, greedy)
    assert gen.step.runner is not generate.decode_one_token and len(list(tmp_path.glob("*.pt2"))) == 2


def test_ahead_of_time_key_follows_the_sources_the_cpu_step_runs(tiny, tmp_path, monkeypatch):
    """The compiled CPU step's package key changes with the sources it runs (cpu_kernels.py's ops,
    model.py, ...) and not with cuda_kernels.py, which model.py calls for CUDA tensors only."""
    import shutil

    here = Path(generate.__file__).resolve().parent
    for f in (*generate.AOT_SOURCES, "cuda_kernels.py"):
        shutil.copy(here / f, tmp_path / f)
    monkeypatch.setattr(generate, "__file__", str(tmp_path / "generate.py"))
    token, tokens = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 64, dtype=torch.long)

    def key():
        return generate.AotStep.key(tiny, token, tokens, Sampling(temperature=0))

    before = key()
    (tmp_path / "cuda_kernels.py").write_text("# a CUDA kernel edit\n" + (tmp_path / "cuda_kernels.py").read_text())
    assert key() == before
    (tmp_path / "cpu_kernels.py").write_text("# an edit of the CPU ops\n" + (tmp_path / "cpu_kernels.py").read_text())
    assert key() != before


# -- the command line -------------------------------------------------------------------------

def cli(*args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def assert_one_line_error(r, needle):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.stderr


def test_cli_generates_greedy_text(default_ckpt):
    r = cli("--checkpoint", default_ckpt, "--prompt", "The capital of France is", "--temperature", "0",
            "--max-new-tokens", "16", "--ignore-eos", "--no-compile")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "16 tokens" in r.stderr and "tok/s" in r.stderr and "time to first token" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--prompt", ""], "prompt is empty"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--top-k", "0"], "--top-k"),
    (["--prompt", "hello " * 9000], "exceeds the model's context of 8192"),
    (["--max-new-tokens", "9000"], "exceeds the model's context"),
    (["--check-graphs", "--device", "cpu"], "--check-graphs needs graphed decode"),
])
def test_cli_bad_input(default_ckpt, args, needle):
    assert_one_line_error(cli("--checkpoint", default_ckpt, *args), needle)


def test_cli_missing_and_corrupt_checkpoint(default_ckpt, tmp_path):
    assert_one_line_error(cli("--checkpoint", tmp_path / "nope"), "no config.json")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in default_ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[:1000] if f.name == "model.safetensors" else f.read_bytes())
    assert_one_line_error(cli("--checkpoint", broken), "model.safetensors")
    (broken / "config.json").write_text("{not json")
    assert_one_line_error(cli("--checkpoint", broken), "config.json")


def test_cli_refuses_kv_cache_that_does_not_fit(default_ckpt, tmp_path):
    import json

    big = tmp_path / "long-context"
    big.mkdir()
    for f in default_ckpt.iterdir():
        (big / f.name).symlink_to(f)
    config = json.loads((default_ckpt / "config.json").read_text())
    config["model"]["max_seq_len"] = 50_000_000
    (big / "config.json").unlink()
    (big / "config.json").write_text(json.dumps(config))
    # 30 layers x 2 x 3 heads x 64 x 4 bytes = 46 KB per token: 20M tokens need ~860 GiB
    assert_one_line_error(cli("--checkpoint", big, "--max-new-tokens", "20000000"), "do not fit")


def test_cli_interactive_chat_until_eof(default_ckpt):
    r = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--checkpoint", str(default_ckpt),
                        "--interactive", "--temperature", "0", "--max-new-tokens", "12", "--no-compile"],
                       input="What is the capital of France?\nAnd of Italy?\n", capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("tok/s") == 2  # one answer per turn, then EOF ends the chat
    assert "Paris" in r.stdout


def test_recompile_after_warm_up_is_an_error_naming_the_guard(tiny):
    gen = Generator(tiny, Sampling(temperature=0), "compile")
    gen.reserve(1, 64)
    run = lambda n: [t for c in gen.generate([[1, 2, 3]], n) for t in c[0]]  # noqa: E731
    run(10)
    assert gen.warm
    with gen.no_recompiles():
        assert len(run(20)) == 20  # same buffers: no recompile
    gen.reserve(1, 128)  # a resize reallocates the static buffers: the guard on their size fails
    with pytest.raises(RuntimeError, match="decode recompiled after warm-up.*'tokens' size mismatch"):
        with gen.no_recompiles():
            run(30)


def test_batched_positions_shape_supported_by_mask_and_rope(tiny):
    """Per-sequence positions [B, S] flow through RoPE, the mask, the cache update (a scatter) and
    decode attention: two rows at different positions give the logits each gets on its own."""
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    tiny.setup_caches(2, 64)
    with torch.no_grad():
        # on its own: row 0 decodes its 4th token at position 3, row 1 its 3rd at position 2
        tiny(idx[0:1, :3], torch.arange(3))
        alone0 = tiny(idx[0:1, 3:4], torch.tensor([3]))[0]
        tiny(idx[1:2, :2], torch.arange(2))
        alone1 = tiny(idx[1:2, 2:3], torch.tensor([2]))[0]
        # batched: both rows prefilled with 3 tokens (row 1's 3rd is rewritten, with the same token)
        tiny(idx[:, :3], torch.arange(3))
        both = tiny(torch.tensor([[4], [7]]), torch.tensor([[3], [2]]))
    assert torch.allclose(both[0], alone0, atol=1e-5) and torch.allclose(both[1], alone1, atol=1e-5)
    assert not torch.allclose(both[0], both[1], atol=1e-2)


def test_cli_profile_writes_a_trace(default_ckpt, tmp_path):
    import json

    trace = tmp_path / "trace.json"
    r = cli("--checkpoint", default_ckpt, "--prompt", "Hi", "--max-new-tokens", "3", "--temperature", "0",
            "--no-compile", "--profile", trace)
    assert r.returncode == 0, r.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::mm" in e.get("name", "") or "aten::linear" in e.get("name", "") for e in events)


def test_cli_speculative_greedy_equals_plain_greedy(default_ckpt):
    common = ["--checkpoint", default_ckpt, "--prompt", "The capital of France is", "--temperature", "0",
              "--max-new-tokens", "24", "--ignore-eos", "--no-compile"]
    plain = cli(*common)
    spec = cli(*common, "--draft-checkpoint", default_ckpt, "--speculate-k", "3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    # the draft is the target's own weights: every round accepts all 3 proposals (23 tokens after
    # the prefill's first: 6 rounds of 4, the last cut short)
    line = next(line for line in spec.stderr.splitlines() if line.startswith("speculative:"))
    assert line.endswith("rounds accepting 0..3 proposals: [0, 0, 0, 6]"), line
    assert_one_line_error(cli(*common, "--speculate-k", "3"), "go together")


def test_decode_weight_bytes_counts_the_draft_and_the_target_of_each_round(tiny):
    """generate.py's GB/s of weights: a token of plain decode reads the model once (the first, by the
    prefill); a speculative round reads the target once and the draft K times, after each model's
    prefill, so a small draft is not counted as the target. (Float models read the same bytes at any
    number of rows: the rows each read is given are not checked here.)"""
    from generate import decode_weight_bytes, weight_bytes_per_step
    from speculative import SpeculativeGenerator

    torch.manual_seed(1)
    draft = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, intermediate_size=64,
                                  max_seq_len=512)).eval().requires_grad_(False)
    gen = SpeculativeGenerator(tiny, draft, Sampling(temperature=0), 3)
    assert sum(len(chunk) for chunk in gen.generate([1, 2, 3], 20)) == 20
    target_bytes, draft_bytes = weight_bytes_per_step(tiny), weight_bytes_per_step(draft)
    assert gen.rounds >= 5 and draft_bytes < target_bytes / 4
    assert decode_weight_bytes(gen) == target_bytes + draft_bytes + gen.rounds * (target_bytes + 3 * draft_bytes)
    plain = Generator(tiny, Sampling(temperature=0), stop_check_interval=8)
    tokens = [t for chunk in plain.generate([[1, 2, 3]], 20) for t in chunk[0]]
    assert len(tokens) == 20 and decode_weight_bytes(plain) == 20 * target_bytes
    # with a stop token, the steps up to the next check (after 0, 8, 16 and 19 steps) still ran and read
    first_stop = next(j for j, t in enumerate(tokens) if 1 <= j <= 8 and t not in tokens[:j])
    stopped = [t for chunk in plain.generate([[1, 2, 3]], 20, stop_ids={tokens[first_stop]}) for t in chunk[0]]
    assert stopped == tokens[:first_stop + 1] and plain.decode_steps == 8
    assert decode_weight_bytes(plain) == 9 * target_bytes


def test_bench_kernel_table_profiles_the_cpu_too(tiny):
    """bench.py --kernels on a machine without a GPU: a table of the CPU ops of a few decode steps
    (it asked the profiler for CUDA activity only, and a CPU-only torch raised)."""
    from bench import kernel_table, make_generator

    gen = make_generator(tiny, "eager")
    gen.reserve(1, 16)
    table = kernel_table(gen, steps=2)
    assert "aten::" in table and "Self CPU time total" in table


def test_bench_repeat_times_each_run_from_the_same_position(tiny, capsys):
    """bench_one(repeat=5): five timed runs, each from the prompt's position; bench.py refuses --repeat 0."""
    import bench

    r = bench.bench_one(tiny, "eager", 1, 4, 6, ceiling=1.0, repeat=5)  # (30 steps: past the cache of 26 unless
    assert len(r["tok_s_runs"]) == 5 and all(t > 0 for t in r["tok_s_runs"])  # each run starts again at 4)
    assert bench.main(["--device", "cpu", "--repeat", "0"]) == 1
    assert "error: --repeat must be at least 1" in capsys.readouterr().err
