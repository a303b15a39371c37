"""serve.py, the engine: continuous batching over graph buckets. Each request's greedy output equals its
output generated alone (generate.Generator, batch 1), while requests join and leave mid-run, at active
counts between buckets, with padding rows, and over K-step rounds; the CLI's --prompts-file and its errors."""
import json
import random
from dataclasses import replace

import pytest
import torch

import generate
from common import Sampling
from generate import Generator
from model import ModelArgs, Transformer
from serve import LLM, Request, SamplingParams, default_buckets, read_prompts, row_settings

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


def params(n, stop_ids=STOP, **kw):
    return SamplingParams(**{"temperature": 0, **kw}, max_new_tokens=n, stop_ids=tuple(stop_ids))


def engine(model, prompts, budgets, stop=STOP, **kw):
    llm = LLM(model=model, **kw)
    reqs = [llm.make_request(p, params(n, stop)) for p, n in zip(prompts, budgets)]
    llm.run(reqs)
    return [r.out for r in reqs], llm


@pytest.mark.parametrize("budget", [1024, 7], ids=["prefill-together", "prefill-in-chunks"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("buckets", [None, [5]], ids=["buckets-1-2-4-5", "always-padded-to-5"])
def test_engine_greedy_equals_each_request_alone(tiny, steps, buckets, budget):
    prompts, budgets = workload()
    ref = [alone(tiny, p, n) for p, n in zip(prompts, budgets)]
    assert any(len(r) < n for r, n in zip(ref, budgets)) and any(len(r) == n for r, n in zip(ref, budgets))
    got, llm = engine(tiny, prompts, budgets, max_batch=5, max_length=64, steps=steps, buckets=buckets,
                      prefill_budget=budget)
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
    got, _ = engine(tiny, prompts, budgets, max_batch=8, max_length=64, buckets=[8], prefill_budget=9)
    assert got == ref


def test_compiled_buckets_equal_eager_mix_settings_and_never_recompile(tiny, monkeypatch):
    """Compiled buckets and prefill give each request's output alone; greedy and sampled rows then share one batch:
    greedy rows equal their output alone, sampled rows are reproducible with a seed; a second run, a new mix of
    settings and prefill in chunks compile nothing new. (Dynamo's limit on entries a function, 8 by default, at 1:
    the engine's warm-up must allow one a bucket, or --max-batch 256's 9 buckets fail, and prefill's two.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    prompts, budgets = workload(7, seed=2)
    ref = [alone(tiny, p, n) for p, n in zip(prompts, budgets)]
    got, llm = engine(tiny, prompts, budgets, max_batch=2, max_length=64, steps=2, compile=True)
    assert llm.runner.mode == "compile" and llm.runner.buckets == [1, 2]
    assert got == ref
    frames = counters["stats"]["unique_graphs"]
    settings = [dict(temperature=0), dict(temperature=1.0, top_k=None), dict(temperature=0.7, top_k=5),
                dict(temperature=0), dict(temperature=1.3, top_p=0.9), dict(temperature=0.5, top_k=3, top_p=0.5)]

    def run(seed, mix):
        torch.manual_seed(seed)
        reqs = [llm.make_request(p, params(n, (), **kw)) for p, n, kw in zip(prompts, budgets, mix)]
        llm.run(reqs)
        return [r.out for r in reqs]

    first = run(0, settings)
    assert run(0, settings) == first
    assert run(1, settings[::-1]) != first[::-1]  # (other draws)
    for i in (0, 3):
        assert first[i] == alone(tiny, prompts[i], budgets[i], stop=())
    assert all(len(o) == n for o, n in zip(first, budgets))
    assert counters["stats"]["unique_graphs"] == frames  # nothing compiled for the new mix
    llm.scheduler.budget = 7  # prompts in chunks over rounds (some of one token), into any cache row: the compiled
    reqs = [llm.make_request(p, params(n)) for p, n in zip(prompts, budgets)]  # prefill's shapes, all warm already
    llm.run(reqs)  # (no_recompiles would raise on a recompile)
    assert [r.out for r in reqs] == ref and counters["stats"]["unique_graphs"] == frames


@pytest.mark.slow
def test_cpu_buckets_built_ahead_of_time_once_equal_eager(tiny, tmp_path, monkeypatch):
    """On the CPU with the kernels (cpu.cpp's attention) --compile builds each bucket's step ahead of time, once, for
    a fixed cache length whatever max_length; a later engine (the default, aot-cached) loads it: no new build. Each
    output equals the request's alone. (One bucket: each build takes ~20 s.)"""
    import copy

    import gdkernels.aot

    monkeypatch.setattr(gdkernels.aot, "cache_dir", lambda: tmp_path)
    model = copy.deepcopy(tiny)
    assert gdkernels.apply(model) == ["2 x attention -> cpu.cpp (each query reads up to its position)"]
    prompts, budgets = workload(5, seed=3)
    ref = [alone(model, p, n) for p, n in zip(prompts, budgets)]
    for compile, max_length in ((True, 64), (None, 128)):
        got, llm = engine(model, prompts, budgets, max_batch=2, max_length=max_length, buckets=[2], compile=compile)
        assert got == ref and llm.runner.how == f"aot{'' if compile else '-cached'} (compiled ahead of time)"
        assert llm.runner.length == max_length and model.max_seq_length == 512  # (the context: a small cache)
        assert len(list((tmp_path / "aot").glob("serve_step-*.pt2"))) == 1


def test_requests_added_while_others_run_and_abort(tiny):
    """The online API: requests join between steps, each output equal to its output alone; a long prompt goes
    in in chunks while the others decode (each gets its K tokens at every step meanwhile); an aborted request's
    row is freed at the next step and nobody else's output changes."""
    prompts, budgets = [[3, 1, 4], [1, 5], [9, 2, 6, 5], [(7 * i) % 64 for i in range(40)]], [30, 30, 30, 12]
    more, more_budgets = workload(5, seed=5)
    ref = [alone(tiny, p, n, stop=()) for p, n in zip(prompts + more, budgets + more_budgets)]
    llm = LLM(model=tiny, max_batch=5, max_length=128, steps=2, prefill_budget=16)  # (4 rows x 4 tokens fit)
    reqs = [llm.add_request(p, params(n, ())) for p, n in zip(prompts[:3], budgets[:3])]
    victim = llm.add_request([1, 2, 3], params(50, ()))
    assert {r for r, new, _ in llm.step()} == {*reqs, victim}  # all four prefilled together, then a round
    reqs.append(llm.add_request(prompts[3], params(budgets[3], ())))  # 40 tokens: chunks of 16, 16 and 8
    for i in range(3):
        events = {r: new for r, new, _ in llm.step()}
        assert all(len(events[r]) == 2 for r in reqs[:3]) and (reqs[3] in events) == (i == 2)
    llm.abort(victim)
    reqs += [llm.add_request(p, params(n, ())) for p, n in zip(more, more_budgets)]
    finished = []
    for _ in range(100):
        finished += [r for r, _, done in llm.step() if done]
        if not llm.scheduler.live():
            break
    assert [r.out for r in reqs] == ref
    assert victim.finish_reason == "abort" and victim in finished and len(victim.out) == 1 + 4 * 2  # prefill, 4 rounds of 2
    assert sorted(map(id, finished)) == sorted(map(id, reqs + [victim])) and llm.runner.rows == []


def test_chunked_prefill_and_logprobs_equal_the_reference_forward(tiny):
    """Prompt log-probabilities from a prefill in chunks of 3 equal the one-shot forward's log_softmax (tight
    tolerance), and each generated token's log-probability equals the reference's at its position; so do the top
    alternatives (torch.topk of it), the prompt's from prefill and the generated tokens' from the decode step, also
    beside a row that asks for none."""
    prompt = [(5 * i + 3) % 64 for i in range(17)]
    p = params(6, (), prompt_logprobs=True, logprobs=True, top_logprobs=3)
    outs = {}
    for budget in (3, 64):
        llm = LLM(model=tiny, max_batch=2, max_length=64, steps=4, prefill_budget=budget)
        outs[budget], other = llm.make_request(prompt, p), llm.make_request(prompt[:5], params(9, ()))
        llm.run([outs[budget], other])
        assert other.logprobs == other.top_logprobs == other.prompt_top_logprobs == [] and len(other.out) == 9
    a, b = outs[3], outs[64]
    assert a.out == b.out == alone(tiny, prompt, 6, stop=())
    assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(prompt)
    tiny.setup_caches(1, 64)
    seq = torch.tensor([prompt + a.out])
    ref = tiny(seq, torch.arange(seq.shape[1]))[0].log_softmax(-1)  # [S, V]
    want = ref[:-1].gather(-1, seq[0, 1:, None])[:, 0]  # each token's, from the position before it
    top = ref[:-1].topk(3)  # [S - 1, 3]: position j's likeliest, scoring token j + 1
    for r in (a, b):
        assert torch.allclose(torch.tensor(r.prompt_logprobs[1:]), want[:len(prompt) - 1], atol=1e-5, rtol=0)
        assert torch.allclose(torch.tensor(r.logprobs), want[len(prompt) - 1:], atol=1e-5, rtol=0)
        alternatives = r.prompt_top_logprobs[1:] + r.top_logprobs
        assert r.prompt_top_logprobs[0] is None and len(alternatives) == len(top.indices)
        assert [[t for t, _ in alt] for alt in alternatives] == top.indices.tolist()
        values = torch.tensor([[v for _, v in alt] for alt in alternatives])
        assert torch.allclose(values, top.values, atol=1e-5, rtol=0)


def test_bucket_1s_plain_step_only_for_a_lone_greedy_row_and_with_the_same_tokens(tiny):
    """Bucket 1's plain step (the argmax alone; CUDA's, set here by hand) runs for a lone greedy row that asks no
    log-probabilities, and gives the general step's tokens; a row that asks them, or samples, gets the general step."""
    llm = LLM(model=tiny, max_batch=2, max_length=64, steps=3)
    llm.runner.plain, step, used = 1, llm.runner.step.fn, []
    llm.runner.step.fn = lambda *a: used.append((len(a[1]), a[-1])) or step(*a)  # (bucket, plain)
    prompt = [5, 9, 2, 40]
    greedy, asks, samples = (llm.make_request(prompt, params(7, (), **kw)) for kw in
                             ({}, {"logprobs": True}, {"temperature": 1.0, "seed": 3}))
    for r, plain in [(greedy, True), (asks, False), (samples, False)]:
        used.clear()
        llm.run([r])
        assert used and set(used) == {(1, plain)}, used
    assert greedy.out == asks.out == alone(tiny, prompt, 7, stop=()) and len(asks.logprobs) == 7


def test_a_seeded_request_draws_the_same_tokens_whatever_its_batch(tiny):
    """SamplingParams.seed: the same request alone, among others and in another round's rows draws the same tokens;
    another seed others; the first token, drawn at prefill, from the exact seed (one float32 cannot hold too). The noise
    hashed from (seed, position, token) is Exponential(1): draws follow p."""
    from common import draw, sample_rows, seeded_noise

    llm = LLM(model=tiny, max_batch=4, max_length=64, steps=3)
    mine = params(20, (), temperature=1.0, top_k=None, seed=1234)

    def run(prompts, first_params):
        reqs = [llm.make_request(p, first_params if i == 0 else params(20, (), temperature=0.9)) for i, p in
                enumerate(prompts)]
        llm.run(reqs)
        return reqs[0].out

    alone_ = run([[5, 6, 7]], mine)
    assert run([[5, 6, 7], [1, 2], [9] * 10, [3]], mine) == alone_ == run([[5, 6, 7], [4, 4, 4]], mine)
    assert run([[5, 6, 7]], replace(mine, seed=99)) != alone_
    seeds = range(2 ** 30 + 1, 2 ** 30 + 9)  # (float32 rounds each to 2 ** 30)
    firsts = [run([[5, 6, 7]], replace(mine, seed=seed))[0] for seed in seeds]
    tiny.setup_caches(1, 64)
    logits, V = tiny(torch.tensor([[5, 6, 7]]), torch.arange(3))[0, -1:], tiny.args.vocab_size
    assert firsts == [sample_rows(logits, torch.ones(1), torch.tensor([V]), torch.tensor([float("inf")]),
                                  torch.tensor([seed]), torch.tensor([2])).item() for seed in seeds]
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    for seed, pos in ((torch.arange(20000), torch.full((20000,), 7)), (torch.full((20000,), 3), torch.arange(20000))):
        counts = torch.bincount(draw(p.expand(20000, 4), seeded_noise(seed, pos, 4)), minlength=4)
        assert ((counts / 20000 - p).abs() < 0.015).all(), counts


def test_row_probs_equal_logits_to_probs_for_each_rows_setting():
    from common import logits_to_probs, row_probs, sample_rows

    torch.manual_seed(0)
    V = 300
    logits = torch.randn(8, V) * 3
    logits[3, :10] = logits[3, 0]  # ties at the top-k boundary: kept, as logits_to_probs keeps them
    settings = [SamplingParams(1.0, None, None), SamplingParams(0.7, 20, None), SamplingParams(1.3, None, 0.8),
                SamplingParams(1.0, 5, None), SamplingParams(0.5, 50, 0.3), SamplingParams(2.0, V, 1.0),
                SamplingParams(1e-45, None, None), SamplingParams(1.0, 2 ** 63, 1e-300)]  # (the last two: argmax's)
    t, k, p, _ = torch.tensor(row_settings(settings, V), dtype=torch.double)
    t, k, p = t.float(), k.long(), p.float()  # (as the engine's buffers hold them)
    got = row_probs(logits, t, k, p)
    for i, s in enumerate(settings):
        assert torch.allclose(got[i], logits_to_probs(logits[i:i + 1], s)[0], atol=1e-6, rtol=1e-5), s
    argmax = torch.nn.functional.one_hot(logits[6:].argmax(-1), V).float()
    assert got[6:].equal(argmax) and logits_to_probs(logits[6:], Sampling(1e-46, None, None)).equal(argmax)
    greedy = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    drawn = sample_rows(logits, greedy, k, p)
    assert drawn[greedy == 0].equal(logits.argmax(-1)[greedy == 0])


def test_submit_and_receive_from_another_thread(tiny):
    """The engine loop in a background thread; two threads submit and read their tokens as they come."""
    import threading

    prompts, budgets = workload(4, seed=6)
    ref = [alone(tiny, p, n, stop=()) for p, n in zip(prompts, budgets)]
    llm = LLM(model=tiny, max_batch=2, max_length=64, steps=3)
    stop = threading.Event()
    loop = threading.Thread(target=llm.loop, args=(stop,), daemon=True)
    loop.start()
    got = [None] * 4

    def client(i):
        r, out = llm.submit(prompts[i], params(budgets[i], ())), []
        for _ in range(100):
            new, finished = llm.receive(r, timeout=30)
            out += new
            if finished:
                break
        got[i] = out
    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=60)
    stop.set()
    loop.join(timeout=10)
    assert got == ref and not loop.is_alive()


def test_a_loop_that_ends_finishes_every_live_request(tiny, monkeypatch):
    """When loop() ends, stopped or because a step raised (re-raised in its thread), each submitted request still
    live ends as "abort" with a last (no tokens, finished): no reader waits for ever, and no row stays taken."""
    import threading

    llm = LLM(model=tiny, max_batch=2, max_length=64, steps=2)
    for fail in (False, True):
        stop, errors = threading.Event(), []
        reqs = [llm.submit([1, 2, 3], params(40, ())) for _ in range(3)]  # (3 requests, 2 rows: one waits)

        def run():
            try:
                llm.loop(stop)
            except RuntimeError as e:
                errors.append(e)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert llm.receive(reqs[0], timeout=30)[1] is False  # (running)
        if fail:
            monkeypatch.setattr(llm.runner, "decode", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
        else:
            stop.set()
        thread.join(timeout=30)
        for r in reqs:
            messages = []
            while not messages or not messages[-1][1]:
                messages.append(llm.receive(r, timeout=5))  # (queue.Empty, not a hang, if the end never came)
            assert r.finish_reason == "abort" and messages[-1] == ([], True)
        assert not thread.is_alive() and len(errors) == fail and not llm.runner.rows and not llm.scheduler.live()
        monkeypatch.undo()


def test_bad_requests_are_usage_errors(tiny):
    from common import UsageError

    llm = LLM(model=tiny, max_batch=2, max_length=64)
    for prompt, p, message in [([], params(4), "non-empty list of token ids"), ([64], params(4), "token ids in"),
                               ([1] * 60, params(10), "exceeds the 64 positions a row holds"),
                               ([1], params(0), "max_new_tokens must be"), ([1], params(4, temperature=-1), "temperature"),
                               ([1], params(4, stop=("x",)), "stop strings need the engine's tokenizer"),
                               ([1], params(4, ("x",)), "stop_ids must be")]:
        with pytest.raises(UsageError, match=message):
            llm.add_request(prompt, p)
    assert not llm.scheduler.live()


@pytest.mark.parametrize("field, value", [
    ("stop", None), ("stop", "x"), ("temperature", "0.5"), ("temperature", None), ("temperature", float("nan")),
    ("max_new_tokens", True), ("max_new_tokens", 2.0), ("top_k", 1.5), ("top_k", True), ("top_p", "x"),
    ("top_logprobs", 6), ("top_logprobs", True), ("stop_ids", None), ("stop_ids", (True,))])
def test_wrong_types_and_values_are_usage_errors_naming_the_field(field, value):
    """Not a TypeError: a bool is not a number here, nor a string."""
    from common import UsageError

    with pytest.raises(UsageError, match=field):
        SamplingParams(**{field: value}).check()


def test_streamed_text_never_shrinks_with_stop_strings():
    """text[:final] is all a stream may send: with stop strings it holds back what a stop string could still begin
    in (longest - 1 characters), so a cut never takes back text sent; without stop strings, nothing is held."""
    class Pieces:  # a stream decoder giving these texts, one a token
        def __init__(self, pieces):
            self.pieces = iter(pieces)

        def push(self, token):
            return next(self.pieces)

        def flush(self):
            return ""

    pieces = ["hel", "lo x", "y", "z", " more a", "b, and on"]  # "ab" completes in the last piece
    for stop, want in [(("xyz!", "ab"), "hello xyz more "), ((), "".join(pieces))]:
        r = Request([1], SamplingParams(max_new_tokens=20, stop=stop), decoder=Pieces(pieces))
        released, texts = [], []
        for t in range(len(pieces)):
            r.accept([t + 3], [0.0], [None])
            released.append(r.text[:r.final])
            texts.append(r.text)
        assert r.text == want and r.finish_reason == ("stop" if stop else None)
        assert all(want.startswith(s) for s in released) and released[-1] == want
        assert released == (texts if not stop else ["", "hell", "hello", "hello ", "hello xyz mor", want])
        assert stop == () or not all(want.startswith(t) for t in texts)  # (sending all the text would take some back)


def test_sampled_outputs_keep_their_budgets(tiny):
    prompts, budgets = workload(6, seed=3)
    llm = LLM(model=tiny, max_batch=4, max_length=64)
    reqs = [llm.make_request(p, SamplingParams(temperature=1.0, top_k=None, max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    torch.manual_seed(0)
    llm.run(reqs)
    assert [len(r.out) for r in reqs] == budgets and all(r.finish_reason == "length" for r in reqs)
    assert all(0 <= t < 64 for r in reqs for t in r.out)


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


# -- the default model and the CLI -------------------------------------------------------------

PROMPTS = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,", "Hello", "CUDA graphs are"]


def test_llm_api_on_the_default_model_equals_generating_alone(default_ckpt):
    llm = LLM(default_ckpt, device="cpu", max_batch=3, max_length=128)
    texts = llm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=20))
    for prompt, text in zip(PROMPTS, texts):
        ids = llm.tokenizer.encode(prompt)
        out = alone(llm.model, ids, 20, set(llm.tokenizer.eos_ids))
        assert text == llm.tokenizer.decode([t for t in out if t not in llm.tokenizer.eos_ids])
    assert texts[0].strip().startswith("Paris") or "Paris" in texts[0]


def test_stop_strings_cut_the_text_even_across_rounds(default_ckpt):
    """A stop string ends the text just before it, found token by token: the same cut at 1 and 8 steps a
    round (a string spanning two read-backs), and equal to cutting the unstopped text at its first match."""
    llm = LLM(default_ckpt, device="cpu", max_batch=2, max_length=128, steps=1)
    full = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))[0]
    stop = full[full.index(",", 3):][:3]  # two or three characters, from the fourth output character on
    assert len(stop) >= 2 and full.count(stop) >= 1
    want = full[:full.index(stop)]
    for steps in (1, 8):
        llm = LLM(model=llm.model, tokenizer=llm.tokenizer, max_batch=2, max_length=128, steps=steps)
        reqs = [llm.make_request(llm.tokenizer.encode("1, 2, 3, 4,"),
                                 SamplingParams(temperature=0, max_new_tokens=24, stop=(stop, "never!")))]
        llm.run(reqs)
        assert reqs[0].text == want and reqs[0].finish_reason == "stop", (steps, stop, reqs[0].text)


def test_a_stop_string_the_decoder_held_back_to_the_end_still_cuts(default_ckpt):
    """A token ending in part of a character waits in the stream decoder; if the request ends there (its budget, or a
    stop token next), the flushed text is searched too: a stop string it completes cuts the text, finish "stop"."""
    from tokenizer import load_tokenizer

    tok = load_tokenizer(default_ckpt)
    ids = tok.encode("Done \u2122")  # "Done", " " with the first byte of the trade mark sign, ...
    k = next(i for i, t in enumerate(ids) if tok.decode([t]) == " \ufffd") + 1
    for out in (ids[:k], ids[:k] + [min(tok.eos_ids)]):
        r = Request([1], SamplingParams(max_new_tokens=len(out), stop=("Done ",)), stop_ids=frozenset(tok.eos_ids),
                    decoder=tok.stream_decoder())
        r.accept(out, [0.0] * len(out), [None] * len(out))
        assert (r.text, r.final, r.finish_reason) == ("", 0, "stop"), out


def test_cli_prompts_file_writes_jsonl_in_order(default_ckpt, tmp_path, run_main):
    lines = [json.dumps({"prompt": PROMPTS[0], "max_new_tokens": 5}), PROMPTS[1], json.dumps({"prompt": PROMPTS[2]})]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n\n")
    common = ["--checkpoint", default_ckpt, "--temperature", "0", "--max-new-tokens", "12", "--no-compile"]
    r = run_main(generate.main, *common, "--prompts-file", tmp_path / "p.txt", "--max-batch", "2", "--chat")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    for row, budget in zip(rows, (5, 12, 12)):  # each as generate.py --chat gives it alone
        one = run_main(generate.main, *common, "--prompt", row["prompt"], "--chat", "--max-new-tokens", budget)
        assert one.returncode == 0, one.stderr
        assert row["text"] == one.stdout.removesuffix("\n")
    assert "tok/s" in r.stderr and "3 requests" in r.stderr
    r = run_main(generate.main, *common, "--prompts-file", tmp_path / "p.txt", "--output", tmp_path / "out.jsonl", "--chat")
    assert r.returncode == 0 and r.stdout == ""
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == rows


@pytest.mark.parametrize("content, extra, message", [
    ("", [], "holds no prompt"),
    ("\n  \n", [], "holds no prompt"),
    ('{"text": "no prompt key"}', [], 'line 1: not a JSON object with a "prompt"'),
    ('{"prompt": "Hi", "max_new_tokens": 0}', [], "line 1: max_new_tokens must be an integer >= 1"),
    ("Hi\n" + "word " * 9000, [], "prompt 2: .* exceeds the 8192 positions"),
    ("Hi", ["--max-batch", "0"], "--max-batch must be >= 1"),
    ("Hi", ["--stop-check-interval", "0"], "--stop-check-interval must be >= 1"),
    ("Hi", ["--buckets", "1,2"], r"buckets \[1, 2\] must be >= 1 and end at max_batch 4"),
    ("Hi", ["--buckets", "1,two,4"], "--buckets takes comma-separated batch sizes"),
    ("Hi", ["--max-batch", "100000000"], "do not fit"),
    ("Hi", ["--interactive"], "--prompts-file goes without"),
    ("Hi", ["--output", "/nonexistent/dir/out.jsonl"], "no such directory"),
    ("Hi\n\n{\"text\": 1}", [], 'line 3: not a JSON object'),  # (the file's line number, blank lines counted)
])
def test_cli_prompts_file_bad_input_is_one_error_line(default_ckpt, tmp_path, run_main, content, extra, message):
    import re

    (tmp_path / "p.txt").write_text(content)
    out = tmp_path / "out.jsonl"
    r = run_main(generate.main, "--checkpoint", default_ckpt, "--no-compile", "--max-batch", "4", "--prompts-file",
            tmp_path / "p.txt", "--output", out, *extra)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_read_prompts_missing_file(tmp_path):
    from common import UsageError

    with pytest.raises(UsageError, match="cannot read"):
        read_prompts(tmp_path / "nope.txt")


def test_bench_serving_record(tmp_path, capsys):
    """benchmarks/serving.py: every request of the seeded workload runs to its budget (random weights, no stop),
    once per prefill budget; the record's tok/s is its tokens over its seconds, its share of the bound is
    tok/s over the bound, and the same requests one by one through Generator are measured beside it."""
    from benchmarks import serving
    from test_quantize import write_float_checkpoint

    write_float_checkpoint(tmp_path / "tiny", ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                                        intermediate_size=128, max_seq_len=256))
    out = tmp_path / "records.json"
    assert serving.main(["--device", "cpu", "--checkpoint", str(tmp_path / "tiny"), "--modes", "eager", "--requests", "6",
                         "--max-batch", "4", "--stop-check-interval", "3", "--length", "24", "--prefill-budget", "8,64",
                         "--alone", "3", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["mode"], r["batch_size"], r["requests"], r["decode_steps"], r["prefill_budget"]) for r in records] == \
        [("serve-eager", 4, 6, 3, 8), ("serve-eager", 4, 6, 3, 64)]
    for r in records:
        assert r["tokens"] == sum(p.max_new_tokens for _, p in serving.workload(6, 64, 24))
        assert r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["share_of_bound"] == pytest.approx(r["tok_s"] / r["bound_tok_s"])
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"] and 0 < r["ttft_s_p50"] <= r["ttft_s_p99"] <= r["seconds"]
        assert r["alone"] == 3 and r["alone_tok_s"] > 0 and r["generator_step_ms"] > 0
        assert 0 < r["bucket1_step_ms"] and 0 < r["bucket1_round_ms_per_step"] and 0 < r["bucket1_full_step_ms"]
    assert "serve-eager 6 requests, 4 rows, prefill budget 8" in capsys.readouterr().err
    for bad in (["--requests", "0"], ["--max-batch", "0"], ["--length", "200"], ["--prefill-budget", "x"]):
        assert serving.main(["--device", "cpu", "--checkpoint", str(tmp_path / "tiny"), *bad]) == 1  # (200 + 200 > 256)
        err = capsys.readouterr().err
        assert err.startswith("error:") and err.count("\n") == 1, err


# -- CUDA: graphs, one replay per step ----------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("steps, kernels", [(1, False), (4, False), (4, True)])
def test_graphed_buckets_equal_alone_and_replay_once_per_step(steps, kernels, monkeypatch):
    """With kernels, decode attention at a position per row is attention.py's kernel (counted in an eager
    round), and the graphed engine's tokens still equal each request's alone (the shared-position kernel)."""
    import gdkernels
    from common import check_graphs

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
    assert llm.runner.mode == "graphs"
    assert got == ref
    runner = llm.runner
    for b in runner.buckets:  # a round: K graph replays; outside them the six inputs' copies (token, position,
        # temperature, top-k, top-p, seed) and col's reset; no RNG seeding (the noise is hashed from each row's seed)
        runner.rows, runner.decoding = [Request([1], params(5), out=[3]) for _ in range(b)], b
        check_graphs(runner.decode, runner.device, 3, f"bucket {b}'s round", graphs=steps, outside=7)
    assert set(runner.step.calls) == {(b, False) for b in runner.buckets} | {(1, True)}  # (bucket 1's plain step)


@pytest.mark.cuda
def test_compiled_bf16_prefill_with_kernels_equals_the_float32_forward():
    """On CUDA in bf16 with the kernels the packed prefill, compiled once for any shape: chunks within a budget of 12
    (a prompt continued after its cached part beside prompts that start, the least prefill's padding in the last row)
    give prompt log-probabilities equal to the float32 model's one-shot forward's within bf16 rounding, and no
    recompile (LLM.step raises on one)."""
    import gdkernels

    torch._dynamo.reset()
    torch.manual_seed(0)
    args = ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=512, intermediate_size=512,
                     max_seq_len=1024)
    ref = Transformer(args).cuda().eval().requires_grad_(False)
    for p in ref.parameters():
        p.normal_(0, 0.3)  # peaky: attention decides the log-probabilities
    fast = Transformer(args).cuda().to(torch.bfloat16).eval().requires_grad_(False)
    fast.load_state_dict(ref.state_dict())
    assert any("attention" in line for line in gdkernels.apply(fast))
    prompts = [[(7 * i + 3 * j) % 512 for i in range(n)] for j, n in enumerate([17, 3, 9, 2])]
    llm = LLM(model=fast, max_batch=4, max_length=64, steps=2, prefill_budget=12, compile=True)
    reqs = [llm.make_request(p, params(2, (), prompt_logprobs=True)) for p in prompts]
    llm.run(reqs)
    ref.setup_caches(1, 64)
    want = torch.cat([ref(torch.tensor([p], device="cuda"), torch.arange(len(p), device="cuda"))[0].log_softmax(-1)[
        range(len(p) - 1), p[1:]] for p in prompts])  # (position j scores token j + 1)
    got = torch.tensor([lp for r in reqs for lp in r.prompt_logprobs[1:]], device="cuda")
    assert ((got - want).norm() / (want - want.mean()).norm()).item() < 5e-2, (got, want)
