"""serve.py, the engine: continuous batching over graph buckets. Each request's greedy output equals its
output generated alone (generate.Generator, batch 1), while requests join and leave mid-run, at active
counts between buckets, with padding rows, and over K-step rounds; the CLI's --prompts-file and its errors."""
import json
import random
import subprocess

import pytest
import torch

import generate
from common import Sampling
from generate import Generator
from model import ModelArgs, Transformer
from serve import LLM, Request, default_buckets, read_prompts

GREEDY = Sampling(temperature=0)
STOP = {25}  # with the tiny model below, 4 of workload()'s 13 requests stop on it, 9 run out of budget


def workload(n=13, seed=0):
    """Prompts of 1-20 tokens and budgets of 1-30: with 5 rows, requests join and leave in most rounds."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    return prompts, [rng.randint(1, 30) for _ in prompts]


def alone(model, prompt, budget, stop=STOP):
    gen = Generator(model, GREEDY, "eager")
    return [t for chunk in gen.generate([prompt], budget, stop) for t in chunk[0]]


def engine(model, prompts, budgets, stop=STOP, **kw):
    llm = LLM(model=model, **kw)
    reqs = [Request(p, n) for p, n in zip(prompts, budgets)]
    llm.run(reqs, GREEDY, stop)
    return [r.out for r in reqs], llm


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("buckets", [None, [5]], ids=["buckets-1-2-4-5", "always-padded-to-5"])
def test_engine_greedy_equals_each_request_alone(tiny, steps, buckets):
    prompts, budgets = workload()
    ref = [alone(tiny, p, n) for p, n in zip(prompts, budgets)]
    assert any(len(r) < n for r, n in zip(ref, budgets)) and any(len(r) == n for r, n in zip(ref, budgets))
    got, llm = engine(tiny, prompts, budgets, max_batch=5, max_length=64, steps=steps, buckets=buckets)
    assert got == ref
    assert llm.tokens_out == sum(map(len, ref))


def test_padding_rows_and_stale_cache_rows_change_no_real_row(tiny):
    """Free rows hold garbage (a finished request's keys, or noise): padding rows write there and
    joining requests are prefilled over it; no real row's output changes."""
    prompts, budgets = workload(9, seed=1)
    ref = [alone(tiny, p, n) for p, n in zip(prompts, budgets)]
    tiny.setup_caches(8, 64)
    for layer in tiny.layers:
        layer.attention.kv_cache.k_cache.normal_(0, 100)
        layer.attention.kv_cache.v_cache.normal_(0, 100)
    got, _ = engine(tiny, prompts, budgets, max_batch=8, max_length=64, buckets=[8])
    assert got == ref


def test_compiled_buckets_equal_eager_and_do_not_recompile(tiny):
    torch._dynamo.reset()
    prompts, budgets = workload(7, seed=2)
    ref = [alone(tiny, p, n) for p, n in zip(prompts, budgets)]
    got, llm = engine(tiny, prompts, budgets, max_batch=3, max_length=64, steps=2, compile=True)
    assert llm.mode == "compile" and llm.runner.buckets == [1, 2, 3]
    assert got == ref
    # a second run reuses the warm steps (no_recompiles would raise on a recompile)
    reqs = [Request(p, n) for p, n in zip(prompts, budgets)]
    llm.run(reqs, GREEDY, STOP)
    assert [r.out for r in reqs] == ref


def test_one_llm_serves_several_sampling_settings_and_refuses_too_long_requests(tiny):
    """A warm runner per sampling setting (compiled: several runners' buckets within Dynamo's limit); run()
    refuses a request longer than a row, which a round would otherwise clamp at the cache's last position."""
    from common import UsageError

    torch._dynamo.reset()
    llm = LLM(model=tiny, max_batch=2, max_length=64, steps=2, compile=True)
    for t in (0.5, 0.6, 0.7, 0.5):
        llm.run([Request([1, 2, 3], 4)], Sampling(temperature=t))
    assert len(llm.runners) == 3
    with pytest.raises(UsageError, match="exceed the 64 positions a row holds"):
        llm.run([Request([1] * 60, 10)], GREEDY)


def test_sampled_outputs_keep_their_budgets(tiny):
    prompts, budgets = workload(6, seed=3)
    llm = LLM(model=tiny, max_batch=4, max_length=64)
    reqs = [Request(p, n) for p, n in zip(prompts, budgets)]
    torch.manual_seed(0)
    llm.run(reqs, Sampling(temperature=1.0, top_k=None))
    assert [len(r.out) for r in reqs] == budgets
    assert all(0 <= t < 64 for r in reqs for t in r.out)


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


# -- the default model and the CLI -------------------------------------------------------------

PROMPTS = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,", "Hello", "CUDA graphs are"]


def test_llm_api_on_the_default_model_equals_generating_alone(default_ckpt):
    llm = LLM(default_ckpt, device="cpu", max_batch=3, max_length=128)
    texts = llm.generate(PROMPTS, GREEDY, max_new_tokens=20)
    for prompt, text in zip(PROMPTS, texts):
        ids = llm.tokenizer.encode(prompt)
        out = alone(llm.model, ids, 20, set(llm.tokenizer.eos_ids))
        assert text == llm.tokenizer.decode([t for t in out if t not in llm.tokenizer.eos_ids])
    assert texts[0].strip().startswith("Paris") or "Paris" in texts[0]


def cli(capsys, *args):
    capsys.readouterr()
    code = generate.main(list(map(str, args)))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_cli_prompts_file_writes_jsonl_in_order(default_ckpt, tmp_path, capsys):
    lines = [json.dumps({"prompt": PROMPTS[0], "max_new_tokens": 5}), PROMPTS[1], json.dumps({"prompt": PROMPTS[2]})]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n\n")
    common = ["--checkpoint", default_ckpt, "--temperature", "0", "--max-new-tokens", "12", "--no-compile"]
    r = cli(capsys, *common, "--prompts-file", tmp_path / "p.txt", "--max-batch", "2", "--chat")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    for row, budget in zip(rows, (5, 12, 12)):  # each as generate.py --chat gives it alone
        one = cli(capsys, *common, "--prompt", row["prompt"], "--chat", "--max-new-tokens", budget)
        assert one.returncode == 0, one.stderr
        assert row["text"] == one.stdout.removesuffix("\n")
    assert "tok/s" in r.stderr and "3 requests" in r.stderr
    r = cli(capsys, *common, "--prompts-file", tmp_path / "p.txt", "--output", tmp_path / "out.jsonl", "--chat")
    assert r.returncode == 0 and r.stdout == ""
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == rows


@pytest.mark.parametrize("content, extra, message", [
    ("", [], "holds no prompt"),
    ("\n  \n", [], "holds no prompt"),
    ('{"text": "no prompt key"}', [], 'line 1: not a JSON object with a "prompt"'),
    ('{"prompt": "Hi", "max_new_tokens": 0}', [], "prompt 1: max_new_tokens must be an integer >= 1"),
    ("Hi\n" + "word " * 9000, [], "prompt 2 .* exceeds the 8192 positions"),
    ("Hi", ["--max-batch", "0"], "--max-batch must be >= 1"),
    ("Hi", ["--decode-steps", "0"], "--decode-steps must be >= 1"),
    ("Hi", ["--buckets", "1,2"], r"buckets \[1, 2\] must be >= 1 and end at --max-batch 4"),
    ("Hi", ["--buckets", "1,two,4"], "--buckets takes comma-separated batch sizes"),
    ("Hi", ["--max-batch", "100000000"], "do not fit"),
    ("Hi", ["--interactive"], "--prompts-file goes without"),
    ("Hi", ["--output", "/nonexistent/dir/out.jsonl"], "no such directory"),
    ("Hi\n\n{\"text\": 1}", [], 'line 3: not a JSON object'),  # (the file's line number, blank lines counted)
])
def test_cli_prompts_file_bad_input_is_one_error_line(default_ckpt, tmp_path, capsys, content, extra, message):
    import re

    (tmp_path / "p.txt").write_text(content)
    out = tmp_path / "out.jsonl"
    r = cli(capsys, "--checkpoint", default_ckpt, "--no-compile", "--max-batch", "4", "--prompts-file",
            tmp_path / "p.txt", "--output", out, *extra)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_read_prompts_missing_file(tmp_path):
    from common import UsageError

    with pytest.raises(UsageError, match="cannot read"):
        read_prompts(tmp_path / "nope.txt", 10)


def test_bench_serving_record(tmp_path, capsys):
    """bench.py --serving: every request of the seeded workload runs to its budget (random weights, no stop
    token), the record's tok/s is its tokens over its seconds, and batch 1 is measured beside it."""
    import bench
    from test_quantize import write_float_checkpoint

    write_float_checkpoint(tmp_path / "tiny", ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                                        intermediate_size=128, max_seq_len=256))
    out = tmp_path / "records.json"
    assert bench.main(["--device", "cpu", "--checkpoint", str(tmp_path / "tiny"), "--modes", "eager", "--serving", "6",
                       "--max-batch", "4", "--decode-steps", "3", "--serving-length", "24", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert (r["mode"], r["batch_size"], r["requests"], r["decode_steps"]) == ("serve-eager", 4, 6, 3)
    assert r["tokens"] == sum(q.max_new_tokens for q in bench.workload(6, 64, 24))
    assert r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"])
    assert r["batch1_tok_s"] > 0 and r["vs_batch1"] == pytest.approx(r["tok_s"] / r["batch1_tok_s"])
    assert "serve-eager 6 requests, 4 rows" in capsys.readouterr().err
    for bad in (["--serving", "0"], ["--serving", "2", "--max-batch", "0"], ["--serving", "2", "--speculate-k", "1"],
                ["--serving", "2", "--serving-length", "200"]):  # (200 + 200 tokens: past the model's 256)
        assert bench.main(["--device", "cpu", "--checkpoint", str(tmp_path / "tiny"), *bad]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error:") and err.count("\n") == 1, err


# -- CUDA: graphs, one replay per step ----------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("steps, kernels", [(1, False), (4, False), (4, True)])
def test_graphed_buckets_equal_alone_and_replay_once_per_step(steps, kernels, monkeypatch):
    """With kernels, decode attention at a position per row is attention.py's kernel (counted in an eager
    round), and the graphed engine's tokens still equal each request's alone (the shared-position kernel)."""
    import gdkernels
    from generate import launches_per_call

    torch._dynamo.reset()
    torch.manual_seed(0)
    args = ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=512, intermediate_size=512,
                     max_seq_len=1024)
    model = Transformer(args).cuda().float().eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.3)  # peaky: compiled and eager rounding do not decide greedy
    if kernels:
        assert any("attention" in line for line in gdkernels.apply(model))
        calls = []
        kernel = gdkernels.attention.decode_attention
        monkeypatch.setattr(gdkernels.attention, "decode_attention",
                            lambda qkv, pos, *a: calls.append(tuple(pos.shape)) or kernel(qkv, pos, *a))
        engine(model, [[1, 2], [3, 4]], [2, 2], max_batch=2, max_length=16, steps=1, compile=False)
        assert calls == [(2, 1)] * args.n_layers  # one round of 2 rows (the first tokens come from prefill)
        monkeypatch.undo()
    prompts, budgets = workload(20, seed=4)
    ref = [alone(model, p, n) for p, n in zip(prompts, budgets)]
    got, llm = engine(model, prompts, budgets, max_batch=8, max_length=128, steps=steps, compile=True)
    assert llm.mode == "graphs"
    assert got == ref
    runner = llm.runner
    for b in runner.buckets:  # a round: K graph replays; outside them only the inputs' copies and col's reset
        rows = [Request([1], 5, out=[3]) for _ in range(b)]
        counts = launches_per_call(lambda: runner.decode(rows), runner.device, 3)
        assert counts["graph_launches_per_step"] == steps, (b, counts)
        assert counts["kernels_outside_graphs_per_step"] <= 3, (b, counts)
