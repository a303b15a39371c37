"""Sampling, stop checks, compiled and ahead-of-time decode, per-row positions and the command line
of generate.py."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate
import gdkernels
import gdkernels.aot
from common import Sampling, no_recompiles, sample
from generate import Generator
from model import ModelArgs, Transformer
from tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent


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


@pytest.mark.parametrize("V", [49152, 100])  # (a multiple of 64: two reductions; else one)
def test_greedy_argmax_is_the_first_maximum(V):
    """common.argmax, greedy's pick: torch's argmax exactly, ties included (the first of equal maxima), in bf16
    too, where the maximum sits at a slice's edge, and compiled."""
    from common import argmax

    torch.manual_seed(0)
    rows = [torch.randn(3, V), torch.randint(0, 3, (3, V)).float(), torch.zeros(2, V)]
    edge = torch.zeros(2, V)
    edge[0, V // 64 - 1:] = 1  # (the first maximum the last place of slice 0)
    edge[1, -1] = 1
    for x in [*rows, edge, rows[1].bfloat16()]:
        assert argmax(x).equal(x.argmax(-1))
    assert torch.compile(argmax, fullgraph=True)(rows[1]).equal(rows[1].argmax(-1))


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


def test_custom_ops_are_registered_with_inductor_before_it_meets_them(tiny):
    """gdkernels.apply(compiled=True) registers the graphdecode ops as Inductor fallbacks before decode compiles
    (gdkernels.register_fallbacks), with the layout constraint Inductor itself would give them, so
    Inductor never takes its implicit-fallback path: on torch 2.11 that path formats the str() of
    every argument, which grows ~2x a layer through the residual (a 32-layer int4 model never
    finished compiling). Here the CPU's int4 and int8 ops (gdkernels/cpu.py, swapped in by
    gdkernels.apply) stand for all of them; the compiled step picks eager's tokens."""
    import logging

    from gdkernels import cpu
    from quantize import quantize_model
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    assert cpu.available()  # (else the model has no graphdecode op on the CPU)
    ops = [getattr(torch.ops.graphdecode, n).default for n in ("int4_linear", "int8_linear", "attention", "gemv")]
    for op in ops:  # as in a fresh process, whatever other tests compiled before
        lowering.lowerings.pop(op, None)
        lowering._maybe_layout_constraints.pop(op, None)
    qmodel = quantize_model(tiny, "int4", 32)
    assert gdkernels.apply(qmodel, compiled=True)
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


def test_register_fallbacks_does_nothing_where_inductor_lacks_what_it_uses(monkeypatch):
    """Without the private Inductor functions register_fallbacks uses, it registers nothing and raises
    nothing (Inductor then makes its own fallbacks)."""
    from gdkernels import cpu
    from torch._inductor import lowering

    assert cpu.available()  # (a graphdecode op to register)
    op = torch.ops.graphdecode.int4_linear.default
    monkeypatch.delitem(lowering.lowerings, op, raising=False)  # (put back afterwards)
    monkeypatch.delattr(lowering, "make_fallback")
    gdkernels.register_fallbacks()
    assert op not in lowering.lowerings


def fresh(seed, args):
    """A model like `tiny` of its own (not `tiny` itself: other tests grow its cache, and the cache's
    shape is in the ahead-of-time key)."""
    torch.manual_seed(seed)
    model = Transformer(args).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.3)
    return model


@pytest.mark.slow
def test_ahead_of_time_step_equals_eager_and_is_reused(tmp_path, monkeypatch, capsys):
    """Mode aot (generate.py --compile on the CPU) exports and compiles the decode step once into
    the cache directory; aot-cached (its default) loads it, or decodes eagerly with a hint. The package
    holds no weights: another model of the same shapes loads it and follows its own. On the model
    generate.py runs on the CPU: int4, through gdkernels/cpu.py's ops. (The only test that builds a
    package: ~30 s.)"""
    from quantize import quantize_model

    monkeypatch.setattr(gdkernels.aot, "cache_dir", lambda: tmp_path)
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, intermediate_size=128,
                     max_seq_len=64)
    one, other = (quantize_model(fresh(seed, args), "int4", 32) for seed in (0, 1))
    for m in (one, other):
        assert gdkernels.apply(m)

    def aot(model, sampling, mode="aot", prompt=(1, 2, 3), new=40):
        gen = Generator(model, sampling, mode)
        gen.reserve(1, gdkernels.aot.cache_length(len(prompt) + new, args, torch.float32))  # (as the CLI does)
        out = [t for chunk in gen.generate([list(prompt)], new) for t in chunk[0]]
        return out, gen

    greedy = Sampling(temperature=0)
    # A missing package with aot-cached (generate.py's CPU default): eager decode, and a hint.
    out, gen = aot(one, greedy, "aot-cached")
    assert out == run_gen(one, greedy) and list(gen.step.fn.runners.values()) == [generate.decode_one_token]
    assert gen.step.fn.ran.startswith("eager (--compile builds a step") and not list(tmp_path.iterdir())
    out, gen = aot(one, greedy)  # builds the package
    assert "building the decode step once" in capsys.readouterr().err
    assert out == run_gen(one, greedy) and generate.decode_one_token not in gen.step.fn.runners.values()
    assert len(list((tmp_path / "aot").glob("*.pt2"))) == 1
    # Another model of the same shapes loads the package (it holds no weights) and follows its own.
    out, gen = aot(other, greedy, "aot-cached")
    assert out == run_gen(other, greedy) != run_gen(one, greedy)
    assert generate.decode_one_token not in gen.step.fn.runners.values() and len(list((tmp_path / "aot").glob("*.pt2"))) == 1
    # Other prompt and output lengths reuse it: one build for every length (the cache's length is fixed, and
    # cpu.cpp's attention reads up to each position only).
    for prompt, new in (((5, 6, 7, 8, 9, 10, 11), 12), ((4,), 60)):
        out, gen = aot(one, greedy, "aot-cached", prompt, new)
        assert gen.model.max_seq_length == 64 and gen.step.fn.ran == "compiled ahead of time"
        assert out == run_gen(one, greedy, prompt, new)
    assert len(list((tmp_path / "aot").glob("*.pt2"))) == 1 and "building" not in capsys.readouterr().err


def test_ahead_of_time_cache_length_is_the_context_or_a_few_fixed_sizes(monkeypatch):
    """The CPU step built ahead of time has one cache length whatever the prompt and output: the context, or
    (a cache over aot.CACHE_BYTES) the context halved as often as still holds what is needed."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, intermediate_size=128,
                     max_seq_len=8192)  # 256 bytes a position in float32
    assert {gdkernels.aot.cache_length(n, args, torch.float32) for n in (1, 100, 5000, 8192)} == {8192}
    monkeypatch.setattr(gdkernels.aot, "CACHE_BYTES", 1024 * 256)
    assert [gdkernels.aot.cache_length(n, args, torch.float32) for n in (1, 1024, 1025, 5000)] == [1024, 1024, 2048, 8192]
    assert gdkernels.aot.cache_length(1500, args, torch.bfloat16) == 2048  # (2048 x 128 bytes: in the budget)


def test_ahead_of_time_key_follows_the_sources_the_cpu_step_runs(tiny, tmp_path, monkeypatch):
    """The compiled CPU step's package key changes with the sources it runs (the step function's own
    file, model.py, quantize.py, gdkernels/__init__.py, gdkernels/cpu.py and cpu.cpp) and not with the CUDA
    kernels' files, which the CPU step never runs (keying on them rebuilt the CPU step at every GPU
    kernel edit)."""
    import importlib.util
    import shutil

    names = [p.relative_to(Path(gdkernels.__file__).parent.parent).as_posix() for p in gdkernels.aot.SOURCES]
    assert all(p.is_file() for p in gdkernels.aot.SOURCES), names
    assert {"model.py", "quantize.py", "gdkernels/__init__.py", "gdkernels/cpu.py", "gdkernels/cpu.cpp"} <= set(names)
    assert not {"gdkernels/gemv.py", "gdkernels/int4.py", "gdkernels/attention.py"} & set(names)
    copies = [tmp_path / f"{i}-{p.name}" for i, p in enumerate(gdkernels.aot.SOURCES)]
    for p, c in zip(gdkernels.aot.SOURCES, copies):
        shutil.copy(p, c)
    monkeypatch.setattr(gdkernels.aot, "SOURCES", copies)
    step_file = tmp_path / "step.py"
    step_file.write_text("def step(model, token, pos, tokens, s):\n    pass\n")
    spec = importlib.util.spec_from_file_location("step", step_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    token, tokens = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 64, dtype=torch.long)

    def key(step=module.step):
        return gdkernels.aot.AotStep(step).key(tiny, token, tokens, Sampling(temperature=0))

    before = key()
    assert key() == before and key(generate.decode_one_token) != before  # (generate.py is another file)
    step_file.write_text(step_file.read_text() + "# an edit of the step\n")
    after_step = key()
    assert after_step != before
    for c in copies:  # an edit of any source
        c.write_text(c.read_text() + "\n// an edit\n")
        assert key() != after_step, c.name
        after_step = key()
    assert key(step=module.step) == after_step  # (nothing else moves it)


# -- the command line -------------------------------------------------------------------------

def cli(*args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def assert_one_line_error(r, needle):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.stderr


def main(capsys, *args):
    """generate.main in this process (no Python start each): its exit status and output, as cli's."""
    capsys.readouterr()
    returncode = generate.main(list(map(str, args)))  # (an exception it lets through fails the test)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, returncode, out.out, out.err)


def test_cli_generates_greedy_text(default_ckpt):
    r = cli("--checkpoint", default_ckpt, "--prompt", "The capital of France is", "--temperature", "0",
            "--max-new-tokens", "16", "--ignore-eos", "--no-compile")
    assert r.returncode == 0, r.stderr
    # exactly the library's greedy text (Generator's greedy tokens match transformers': test_default_model.py)
    tok = load_tokenizer(default_ckpt)
    model = Transformer.from_checkpoint(default_ckpt, "cpu", torch.float32)
    out = [t for c in Generator(model, Sampling(temperature=0)).generate([tok.encode("The capital of France is")], 16)
           for t in c[0]]
    assert r.stdout == tok.decode(out) + "\n" and "Paris" in r.stdout
    stats = r.stderr.splitlines()[-1]
    ids = len(load_tokenizer(default_ckpt).encode("The capital of France is"))
    assert re.fullmatch(rf"prefill {ids} tokens in [0-9.]+ s \([0-9]+ tok/s; time to first token\); decode 15 tokens "
                        r"in [0-9.]+ s: [0-9.]+ tok/s, [0-9.]+ GB/s of weights; 16 tokens in all; peak memory [0-9.]+ GiB; "
                        r"decode: eager, kernels on", stats), stats


@pytest.mark.parametrize("args, needle", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", " \n\t "], "prompt is empty"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--top-k", "0"], "--top-k"),
    (["--prompt", "hello " * 9000], "exceeds the model's context of 8192"),
    (["--max-new-tokens", "9000"], "exceeds the model's context"),
    (["--check-graphs", "--device", "cpu"], "--check-graphs needs graphed decode"),
    (["--num-samples", "0"], "--num-samples must be >= 1"),
    (["--stop-check-interval", "0"], "--stop-check-interval must be >= 1"),
    (["--speculate-k", "0"], "--speculate-k must be >= 1"),
    (["--speculate-k", "2"], "--draft-checkpoint and --speculate-k go together"),
])
def test_cli_bad_input(default_ckpt, args, needle, capsys):
    assert_one_line_error(main(capsys, "--checkpoint", default_ckpt, *args), needle)


def test_cli_missing_and_corrupt_checkpoint(default_ckpt, tmp_path, capsys):
    assert_one_line_error(cli("--checkpoint", tmp_path / "nope"), "no config.json")  # (a process of its own)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in default_ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[:1000] if f.name == "model.safetensors" else f.read_bytes())
    assert_one_line_error(main(capsys, "--checkpoint", broken), "model.safetensors")
    (broken / "config.json").write_text("{not json")
    assert_one_line_error(main(capsys, "--checkpoint", broken), "config.json")


def test_cli_refuses_kv_cache_that_does_not_fit(default_ckpt, tmp_path, capsys):
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
    assert_one_line_error(main(capsys, "--checkpoint", big, "--max-new-tokens", "20000000"), "do not fit")


def test_cli_interactive_chat_until_eof(default_ckpt, monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n"))
    r = main(capsys, "--checkpoint", default_ckpt, "--interactive", "--temperature", "0", "--max-new-tokens", "12",
             "--no-compile")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("decode: ") == 2  # one answer per turn, then EOF ends the chat
    # the first answer is the one-shot --chat answer to the same question; the second one follows it
    one = main(capsys, "--checkpoint", default_ckpt, "--chat", "--prompt", "What is the capital of France?",
               "--temperature", "0", "--max-new-tokens", "12", "--no-compile")
    assert "Paris" in one.stdout and r.stdout.startswith(one.stdout) and len(r.stdout) > len(one.stdout) + 1
    assert "cache:" not in r.stderr and r.stderr.count("\n> ") == 3  # 512 positions held both turns
    # A turn that needs more than the cache holds doubles it (the one-shot speed: not the whole 8,192-token context)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    r = main(capsys, "--checkpoint", default_ckpt, "--interactive", "--temperature", "0", "--max-new-tokens", "600",
             "--no-compile")
    assert r.returncode == 0 and "cache: 1024 positions" in r.stderr, r.stderr


def test_compiled_decode_equals_eager_and_a_recompile_after_warm_up_is_an_error(tiny):
    """Mode compile picks eager's tokens; after warm-up, with the same buffers, nothing recompiles, and
    a recompile (here: buffers resized) is an error naming the guard that failed. (One compile of the
    plain model's step for both.)"""
    gen = Generator(tiny, Sampling(temperature=0), "compile")
    gen.reserve(1, 64)
    run = lambda n: [t for c in gen.generate([[1, 2, 3]], n) for t in c[0]]  # noqa: E731
    run(10)
    assert gen.warm
    with no_recompiles(gen.mode):
        compiled = run(40)  # same buffers: no recompile
    assert compiled == run_gen(tiny, Sampling(temperature=0), n=40)
    gen.reserve(1, 128)  # a resize reallocates the static buffers: the guard on their size fails
    with pytest.raises(RuntimeError, match="decode recompiled after warm-up.*'tokens' size mismatch"):
        with no_recompiles(gen.mode):
            run(30)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_per_row_positions_give_each_row_its_own_logits(tiny, compiled):
    """Positions per row, input_pos [B, S], flow through RoPE, the mask and the cache write (indexed per
    row): two rows at different offsets, prefilled S > 1 at a time and then decoded a few steps,
    give at every call the logits each row gets alone (batch 1, positions [S]). Row 1's later calls
    rewrite cache positions that hold other tokens (a padded prefill), so a cache write that wrote every
    row at row 0's positions, or none of the [B, S] writes, gives row 1 other logits; and the logits
    depend on what the cache holds, so a write that wrote nothing at all fails too."""
    a = [(5 * i + 1) % 64 for i in range(11)]  # row 0: 11 tokens
    b = [(3 * i + 7) % 64 for i in range(8)]  # row 1: 8 tokens
    pad = [60, 61, 62]
    # (tokens, positions) of each call, per row: a padded prefill of 6, two of S = 2 at offsets 6 and
    # 3 (row 1's overwriting its padding), then three one-token decode steps at 8.. and 5..
    calls = [((a[0:6], range(0, 6)), (b[0:3] + pad, range(0, 6))),
             ((a[6:8], range(6, 8)), (b[3:5], range(3, 5)))] + \
            [((a[8 + i:9 + i], [8 + i]), (b[5 + i:6 + i], [5 + i])) for i in range(3)]

    def clear():
        for layer in tiny.layers:
            layer.attention.kv_cache.k_cache.zero_()
            layer.attention.kv_cache.v_cache.zero_()

    tiny.setup_caches(2, 64)
    model = torch.compile(tiny, dynamic=True) if compiled else tiny  # (the batched calls below: [B, S] positions)
    alone = []
    with torch.no_grad():
        for row in (0, 1):
            clear()
            alone.append([tiny(torch.tensor([c[row][0]]), torch.tensor(list(c[row][1])))[0] for c in calls])
        clear()
        for i, c in enumerate(calls):
            idx = torch.tensor([c[0][0], c[1][0]])
            pos = torch.tensor([list(c[0][1]), list(c[1][1])])  # [2, S]: each row at its own positions
            both = model(idx, pos)
            for row in (0, 1):
                # (row 1's first call: its padding's logits are its own as well)
                assert torch.allclose(both[row], alone[row][i], atol=1e-5, rtol=1e-5), (i, row)
        # The references read the cache: row 0's last token after row 1's tokens gets other logits (with
        # a cache write that wrote nothing, attention would read zeros after any history alike).
        clear()
        tiny(torch.tensor([b[:5] + pad * 2]), torch.arange(11))
        other = tiny(torch.tensor([a[10:11]]), torch.tensor([10]))[0]
    assert not torch.allclose(other, alone[0][-1], atol=1e-2)


def test_cli_profile_writes_a_trace(default_ckpt, tmp_path, capsys):
    import json

    trace = tmp_path / "trace.json"
    r = main(capsys, "--checkpoint", default_ckpt, "--prompt", "Hi", "--max-new-tokens", "3", "--temperature", "0",
            "--no-compile", "--profile", trace)
    assert r.returncode == 0, r.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::mm" in e.get("name", "") or "aten::linear" in e.get("name", "") for e in events)


def test_cli_speculative_greedy_equals_plain_greedy(default_ckpt, capsys):
    common = ["--checkpoint", default_ckpt, "--prompt", "The capital of France is", "--temperature", "0",
              "--max-new-tokens", "24", "--ignore-eos", "--no-compile"]
    plain = main(capsys, *common)
    spec = main(capsys, *common, "--draft-checkpoint", default_ckpt, "--speculate-k", "3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    # the draft is the target's own weights: every round accepts all 3 proposals (23 tokens after
    # the prefill's first: 6 rounds of 4, the last cut short)
    line = next(line for line in spec.stderr.splitlines() if line.startswith("speculative:"))
    assert line.endswith("rounds accepting 0..3 proposals: [0, 0, 0, 6]; steps proposing nothing: 0"), line
    assert_one_line_error(main(capsys, *common, "--speculate-k", "3"), "go together")
    # prompt lookup (no draft) gives the same text; it goes without a draft
    lookup = main(capsys, *common, "--prompt-lookup", "3")
    assert lookup.returncode == 0 and lookup.stdout == plain.stdout, lookup.stderr
    assert "prompt lookup, eager" in lookup.stderr
    assert_one_line_error(main(capsys, *common, "--prompt-lookup", "2", "--draft-checkpoint", default_ckpt,
                               "--speculate-k", "2"), "--prompt-lookup goes without --draft-checkpoint")
    assert_one_line_error(main(capsys, *common, "--prompt-lookup", "0"), "--prompt-lookup must be >= 1")
    assert_one_line_error(main(capsys, *common, "--prompt-lookup", "2", "--ngram", "0"), "--ngram must be >= 1")


def test_decode_weight_bytes_counts_each_decode_step(tiny):
    """generate.py's decode GB/s of weights: a decode step reads the model once (the first token comes from
    the prefill, not counted), and so do the steps after a stop token up to the next check. (Float models read the same
    bytes at any number of rows: the rows each read is given are not checked here.)"""
    from generate import decode_weight_bytes, weight_bytes_per_step

    target_bytes = weight_bytes_per_step(tiny)
    plain = Generator(tiny, Sampling(temperature=0), stop_check_interval=8)
    tokens = [t for chunk in plain.generate([[1, 2, 3]], 20) for t in chunk[0]]
    assert len(tokens) == 20 and decode_weight_bytes(plain) == 19 * target_bytes
    # with a stop token, the steps up to the next check (after 0, 8, 16 and 19 steps) still ran and read
    first_stop = next(j for j, t in enumerate(tokens) if 1 <= j <= 8 and t not in tokens[:j])
    stopped = [t for chunk in plain.generate([[1, 2, 3]], 20, stop_ids={tokens[first_stop]}) for t in chunk[0]]
    assert stopped == tokens[:first_stop + 1] and plain.decode_steps == 8
    assert decode_weight_bytes(plain) == 8 * target_bytes


def test_decode_weight_bytes_counts_the_draft_and_the_target_of_each_round(tiny):
    """A speculative round reads the target once and the draft K + 1 times (its K one-token steps,
    and verify's feeding it d_K; the prefills apart), so a small draft is not counted as the target."""
    from generate import decode_weight_bytes, weight_bytes_per_step
    from speculative import SpeculativeGenerator

    torch.manual_seed(1)
    draft = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, intermediate_size=64,
                                  max_seq_len=512)).eval().requires_grad_(False)
    gen = SpeculativeGenerator(tiny, draft, Sampling(temperature=0), 3)
    assert sum(len(chunk) for chunk in gen.generate([1, 2, 3], 20)) == 20
    target_bytes, draft_bytes = weight_bytes_per_step(tiny), weight_bytes_per_step(draft)
    assert gen.rounds >= 5 and draft_bytes < target_bytes / 4
    assert decode_weight_bytes(gen) == gen.rounds * (target_bytes + 4 * draft_bytes)


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

    r = bench.bench_one(tiny, "eager", 2, 4, 6, ceiling=1.0, repeat=5)  # (30 steps: past the cache of 26 unless
    assert len(r["tok_s_runs"]) == 5 and all(t > 0 for t in r["tok_s_runs"])  # each run starts again at 4)
    # The record's figures agree with one another: tok/s from the step time, GB/s from the bytes a step
    # reads (the weights once, the cache of 2 rows at the mean position 4 + 6/2 = 7), the share of the ceiling.
    a = tiny.args
    step_bytes = bench.weight_bytes_per_step(tiny) + 2 * a.n_layers * 2 * a.n_kv_heads * 7 * a.head_dim * 4
    seconds = 2 * 6 / r["tok_s"]
    assert r["tok_s"] == r["tok_s_runs"][-1] and r["step_ms_median"] <= r["step_ms_p99"]
    assert r["gb_s"] == pytest.approx(step_bytes * 6 / seconds / 1e9)
    assert r["pct_of_ceiling"] == pytest.approx(100 * r["gb_s"]) and r["batch_size"] == 2
    assert bench.main(["--device", "cpu", "--repeat", "0"]) == 1
    assert "error: --repeat must be at least 1" in capsys.readouterr().err


def test_step_profile_counts_what_each_kernel_adds_to_the_chain(monkeypatch):
    """benchmarks/step_profile.py's table of a trace (made here: SmolLM2-135M's 155 kernels a step, each starting
    before the previous one ends): a kernel costs its end minus the previous end, not its own duration; the GEMVs are
    named in a layer's order and their bytes are their weights'. Steps that differ are refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import step_profile

    added = {"_gemv_kernel": 2.0, "_attention_kernel": 10.0, "triton_other": 1.0}
    names = ["triton_other"] + ["_gemv_kernel", "_attention_kernel", "_gemv_kernel", "_gemv_kernel", "_gemv_kernel"] * 30
    names += ["triton_other", "_gemv_kernel", "triton_other", "triton_other"]  # final norm, head, argmax
    events, end = [], 0.0
    for _ in range(step_profile.STEPS):
        for i, name in enumerate(names):
            cost = 24.0 if i == len(names) - 3 else added[name]  # (the head)
            events.append({"name": name, "start": end - 5, "end": end + cost})  # (started 5 µs early)
            end += cost
    trace = {"model": "smollm2-135m", "gpu": "a GPU", "torch": "2.x", "step_ms": 0.5, "ceiling": 3000.0, "events": events}
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in step_profile.table(trace).splitlines()[3:]}
    assert rows["decode attention (RoPE, cache write)"][:3] == ["30", "300", "10.0"]
    assert rows["GEMV w2 (residual fused)"][:3] == ["30", "60", "2.0"]
    assert rows["GEMV output (the head)"] == ["1", "24", "24.0", f"{49152 * 576 * 2 / 24e3:.0f} |"]
    assert rows["GEMV wqkv (RMSNorm fused)"][3] == f"{(9 + 6) * 64 * 576 * 2 / 2e3:.0f} |"
    trace["events"] = events[:-1] + [dict(events[-1], name="_gemv_kernel")]  # (the last step's argmax)
    with pytest.raises(SystemExit, match="do not hold the same kernels"):
        step_profile.table(trace)


def test_cli_refuses_a_draft_with_another_tokenizer(default_ckpt, tmp_path, capsys):
    """A draft must share the target's tokenizer: here the same model whose stop token differs."""
    draft = tmp_path / "draft"
    draft.mkdir()
    for f in default_ckpt.iterdir():
        if f.name != "generation_config.json":
            (draft / f.name).symlink_to(f)
    (draft / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": [3]}')  # stops on 3 too
    assert_one_line_error(main(capsys, "--checkpoint", default_ckpt, "--draft-checkpoint", draft, "--speculate-k", "2",
                               "--no-compile"), "does not share the target's tokenizer")


@pytest.fixture(scope="module")
def tiny_chat_ckpt(default_ckpt, tmp_path_factory) -> Path:
    """A 2-layer random Llama with the default model's tokenizer and chat template, written by transformers and
    converted: it compiles in seconds (the default model's 30 layers take ~25 s)."""
    import shutil

    import transformers

    from convert_hf_checkpoint import convert

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      initializer_range=1.0)  # (logits spread wide: no near-ties to flip)
    src = tmp_path_factory.mktemp("tiny_chat") / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default_ckpt / name, src / name)
    return convert(str(src), src.parent / "ckpt", "fp32")


def test_cli_compiled_prefill_and_chat_give_the_plain_text(tiny_chat_ckpt, capsys):
    """--compile-prefill (dynamic shapes) and --chat through the command line: the same greedy text as
    eager prefill, for a chat prompt (the template applied: the prompt is longer than the text)."""
    common = ["--checkpoint", tiny_chat_ckpt, "--prompt", "Name a planet.", "--chat", "--temperature", "0",
              "--max-new-tokens", "6", "--ignore-eos", "--no-compile"]
    plain, compiled = main(capsys, *common), main(capsys, *common, "--compile-prefill")
    assert plain.returncode == compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == plain.stdout and plain.stdout.strip()
    ids = load_tokenizer(tiny_chat_ckpt).encode_chat([{"role": "user", "content": "Name a planet."}])
    assert f"prefill {len(ids)} tokens" in plain.stderr and len(ids) > 10
