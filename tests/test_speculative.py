"""Speculative decoding (speculative.py): greedy equals plain greedy (eager and compiled), a perfect
draft accepts everything, the draft's cache holds every accepted token, sampling follows the target's
distribution exactly, stop tokens and max_new_tokens."""
import copy
import math

import pytest
import torch

import gdkernels
import speculative
from common import Sampling, logits_to_probs
from gdkernels import cpu
from generate import Generator
from model import ModelArgs, Transformer
from speculative import SpeculativeGenerator

GREEDY = Sampling(temperature=0)
PROMPT = [1, 2, 3]


def make(seed, dim=64, n_layers=2, vocab=64, std=0.3):
    torch.manual_seed(seed)
    args = ModelArgs(dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=vocab,
                     intermediate_size=2 * dim, max_seq_len=512)
    model = Transformer(args).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, std)  # peaky distributions, so greedy is not a coin toss
    return model


def perturbed(model, seed, std):
    """A draft that mostly agrees with the target: its weights plus noise."""
    other = copy.deepcopy(model)
    torch.manual_seed(seed)
    for p in other.parameters():
        p.add_(torch.randn_like(p) * std)
    return other


@pytest.fixture(scope="module")
def target():
    return make(0)


@pytest.fixture(scope="module")
def drafts(target):
    return {"random": make(1, dim=32, n_layers=1),  # an unrelated, smaller model
            "perturbed": perturbed(target, 2, 0.05),  # partial acceptance: every branch of verify
            "identical": copy.deepcopy(target)}


def plain(model, sampling, n, stop=frozenset(), prompt=PROMPT):
    gen = Generator(model, sampling, "eager", stop_check_interval=4)
    return [t for chunk in gen.generate([list(prompt)], n, set(stop)) for t in chunk[0]]


def spec(target, draft, sampling, k, n, stop=frozenset(), prompt=PROMPT, mode="eager"):
    gen = SpeculativeGenerator(target, draft, sampling, k, mode)
    chunks = list(gen.generate(list(prompt), n, set(stop)))
    return [t for c in chunks for t in c], gen


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("which", ["random", "perturbed", "identical"])
def test_greedy_equals_plain_greedy(target, drafts, which, k):
    expected = plain(target, GREEDY, 40)
    got, gen = spec(target, drafts[which], GREEDY, k, 40)
    assert got == expected
    assert gen.rounds == sum(gen.histogram) and len(gen.histogram) == k + 1
    assert gen.round_tokens == sum((n + 1) * c for n, c in enumerate(gen.histogram))
    if which == "identical":
        # every round accepts all K, and the rounds are as few as that allows
        assert gen.histogram[k] == gen.rounds == math.ceil(39 / (k + 1))
        assert gen.mean_tokens_per_round == k + 1
    if which == "perturbed" and k == 3:
        assert gen.histogram[k] < gen.rounds  # the test exercises rejections, not only acceptance


def clear_caches(*models):
    """Zero the models' KV caches: an entry no call writes then reads as zeros, not as what an earlier
    test wrote at that position (the same tokens, often)."""
    for model in models:
        for layer in model.layers:
            if layer.attention.kv_cache is not None:
                layer.attention.kv_cache.k_cache.zero_()
                layer.attention.kv_cache.v_cache.zero_()


def assert_caches_hold_the_sequence(gen, sequence):
    """The draft's and the target's KV caches at every position before gen.pos (the next round's)
    hold the keys and values of `sequence` there (prompt, then the tokens generated): what a prefill
    of those tokens writes. A cache entry no step wrote (zeros) or one a rejected proposal left fails."""
    pos = int(gen.pos)
    assert len(sequence) >= pos
    idx, positions = torch.tensor([sequence[:pos]]), torch.arange(pos)
    for name, model in (("draft", gen.draft), ("target", gen.target)):
        fresh = copy.deepcopy(model)
        with torch.no_grad():
            fresh(idx, positions)
        for i, (layer, ref) in enumerate(zip(model.layers, fresh.layers)):
            for kind in ("k_cache", "v_cache"):
                got, want = getattr(layer.attention.kv_cache, kind)[0, :, :pos], getattr(ref.attention.kv_cache, kind)[0, :, :pos]
                bad = ((got - want).abs() > 1e-4 + 1e-4 * want.abs()).any(-1).any(0).nonzero().flatten().tolist()
                assert not bad, f"{name} layer {i} {kind}: positions {bad} of {pos} differ"


@pytest.mark.parametrize("mode", ["eager", pytest.param("compile", marks=pytest.mark.slow)])
@pytest.mark.parametrize("which", ["identical", "perturbed"])
def test_caches_hold_every_accepted_token(target, drafts, which, mode):
    """After rounds that accept all K proposals (the identical draft, round after round) or some (the
    perturbed one), the output is the target's greedy tokens and both caches hold every token before the
    next round's position: the draft's too, whose last proposal d_K verify feeds it (a round that accepts
    all K starts the next at pos + K + 1, one past the last position the draft steps wrote). Mode compile:
    each of the draft loop and the verification one Inductor graph, as mode graphs captures them."""
    k, n = 3, 30
    expected = plain(target, GREEDY, n + k + 2)
    torch._dynamo.reset()
    clear_caches(target, drafts[which])
    got, gen = spec(target, drafts[which], GREEDY, k, n, mode=mode)
    assert got == expected[:n]
    if which == "identical":
        assert gen.histogram[k] == gen.rounds >= 5
    else:
        assert 0 < gen.histogram[k] < gen.rounds
    assert_caches_hold_the_sequence(gen, PROMPT + expected)


def test_the_cache_check_sees_a_draft_that_misses_its_last_proposal(target, drafts):
    """(The checks above catch a hole: verify without its feeding the draft d_K leaves position
    pos + K of each all-accepting round unwritten; the draft then proposes from a cache with a hole, the
    output is still greedy's, but fewer rounds accept all K and the draft's cache differs.)"""
    k, n = 3, 30
    expected = plain(target, GREEDY, n + k + 2)
    draft = drafts["identical"]
    clear_caches(target, draft)
    gen = SpeculativeGenerator(target, draft, GREEDY, k)
    gen.verify_fn = lambda target, draft, *rest: speculative.verify(target, lambda *a: None, *rest)
    assert [t for c in gen.generate(PROMPT, n) for t in c] == expected[:n]
    assert gen.histogram[k] < gen.rounds
    with pytest.raises(AssertionError, match="draft layer 0 k_cache: positions"):
        assert_caches_hold_the_sequence(gen, PROMPT + expected)


def test_perturbed_draft_partially_accepts(target, drafts):
    _, gen = spec(target, drafts["perturbed"], GREEDY, 3, 60)
    assert gen.histogram[3] > 0 and sum(gen.histogram[:3]) > 0, gen.histogram


@pytest.mark.parametrize("k", [2, 4])
def test_identical_draft_accepts_everything_when_sampling(target, drafts, k):
    torch.manual_seed(0)
    s = Sampling(temperature=1.0, top_k=None)
    got, gen = spec(target, drafts["identical"], s, k, 31)
    assert len(got) == 31
    assert gen.histogram[k] == gen.rounds == math.ceil(30 / (k + 1)), gen.histogram


def test_seeded_sampling_is_reproducible(target, drafts):
    s = Sampling(temperature=1.0, top_k=None, top_p=0.95)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(spec(target, drafts["perturbed"], s, 3, 30)[0])
    assert runs[0] == runs[1] and len(runs[0]) == 30
    assert runs[2] != runs[0]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_stop_token_and_max_new_tokens(target, drafts, k):
    full = plain(target, GREEDY, 40)
    # a stop token first seen mid-sequence: output is plain greedy cut just after it
    j = next(i for i in range(5, 40) if full[i] not in full[:i])
    stop = {full[j]}
    for draft in (drafts["identical"], drafts["perturbed"]):
        got, _ = spec(target, draft, GREEDY, k, 40, stop)
        assert got == full[:j + 1] == plain(target, GREEDY, 40, stop)
        for n in (1, 2, 3, 7, 12):  # never more than max_new_tokens, even mid-round
            got, _ = spec(target, draft, GREEDY, k, n)
            assert got == full[:n]
    # a stop token that is the very first generated token
    got, gen = spec(target, drafts["identical"], GREEDY, k, 40, {full[0]})
    assert got == [full[0]] and gen.rounds == 0


def test_rejects_mismatched_vocabulary_and_shared_draft(target):
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeGenerator(target, make(3, vocab=32), GREEDY, 3)
    with pytest.raises(ValueError):
        SpeculativeGenerator(target, target, GREEDY, 3)


# -- sampling is unbiased ------------------------------------------------------------------------

def chi2_sf(stat: float, df: int) -> float:
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def exact_pair_distribution(model, prompt, s, V, first_model=None):
    """P(second, third generated token) under `model`, marginalised over the first (drawn from
    first_model, default `model`): [V, V]."""
    def dist(seq, m=model):
        idx = torch.tensor([seq])
        return logits_to_probs(m(idx, torch.arange(len(seq)))[:, -1], s)[0].double()
    p1 = dist(prompt, first_model or model)
    pair = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        p2 = dist(prompt + [a])
        for b in range(V):
            pair[b] += p1[a] * p2[b] * dist(prompt + [a, b])
    return pair


def chi2_test(counts, expected_probs, n):
    """Pearson chi-square, cells with expected count < 5 pooled into one. -> (stat, df, p)."""
    expected = expected_probs.flatten() * n
    counts = counts.flatten().double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().view(1)])
    c = torch.cat([counts[big], counts[~big].sum().view(1)])
    keep = e > 0
    e, c = e[keep], c[keep]
    stat = (((c - e) ** 2) / e).sum().item()
    return stat, len(e) - 1, chi2_sf(stat, len(e) - 1)


@pytest.mark.parametrize("k,sampling,lookup", [(2, Sampling(temperature=1.0, top_k=None), False),
                                               (1, Sampling(temperature=0.8, top_k=5, top_p=0.9), False),
                                               (2, Sampling(temperature=1.0, top_k=None), True)])
def test_sampling_follows_the_target_distribution(k, sampling, lookup, monkeypatch):
    """The joint law of the 2nd and 3rd generated tokens (produced by the first speculative
    round(s): accepted proposals, residual resamples and bonus tokens) equals the target's exact
    law, by a chi-square test at alpha = 1e-3 (fixed seed: deterministic). The draft is an
    unrelated model, so accepting its proposals blindly would fail the same test (checked); or
    prompt lookup's deterministic proposals."""
    V, N, alpha = 8, 2000, 1e-3
    target = make(10, dim=16, n_layers=1, vocab=V, std=0.5)
    draft = make(11, dim=16, n_layers=1, vocab=V, std=0.5)
    prompt = [1, 2]
    for m in (target, draft):
        m.setup_caches(1, 16)
    with torch.no_grad():
        exact = exact_pair_distribution(target, prompt, sampling, V)
        wrong = exact_pair_distribution(draft, prompt, sampling, V, target)  # blind acceptance
    assert abs(exact.sum().item() - 1) < 1e-5
    monkeypatch.setattr(speculative, "LOOKUP_MIN_MATCH", 0)  # (prompt lookup: a round whatever the match)
    gen = SpeculativeGenerator(target, None if lookup else draft, sampling, k)
    counts = torch.zeros(V, V)
    histogram = [0] * (k + 1)
    torch.manual_seed(1234)
    for _ in range(N):
        toks = [t for c in gen.generate(prompt, 3) for t in c]
        assert len(toks) == 3
        counts[toks[1], toks[2]] += 1
        histogram = [a + b for a, b in zip(histogram, gen.histogram)]
    # both the residual resample (0 accepted) and the bonus token (all K accepted) were exercised
    assert histogram[0] > 30 and histogram[k] > 30, histogram
    stat, df, p = chi2_test(counts, exact, N)
    assert p > alpha, f"chi2 {stat:.1f} on {df} df: p = {p:.2e}"
    # power: the expected statistic had the tokens followed the draft instead is far past the bar
    # (the noncentrality N * sum((q - p)^2 / p) over the cells where p > 0)
    mask = exact > 0
    noncentrality = N * (((wrong - exact)[mask] ** 2) / exact[mask]).sum().item()
    assert chi2_sf(noncentrality + df, df) < 1e-6


def test_bench_measures_speculative_decoding(target, drafts):
    """benchmarks/speculation.py's speculative record: tokens per round consistent with the histogram, and the
    draft loop timed against single draft steps (on the CPU, eagerly: the loop is K steps)."""
    from benchmarks.speculation import bench_speculative

    k = 3
    r = bench_speculative(target, drafts["perturbed"], k, "eager", prompt_tokens=4, new_tokens=24,
                          sampling=Sampling(temperature=1.0, top_k=None))
    assert r["mode"] == "speculative-eager" and r["speculate_k"] == k and r["tok_s"] > 0
    hist = r["acceptance_histogram"]
    assert len(hist) == k + 1 and sum(hist) == r["rounds"] > 0
    assert r["mean_tokens_per_round"] == pytest.approx(sum((n + 1) * c for n, c in enumerate(hist)) / r["rounds"])
    assert 1 <= r["mean_tokens_per_round"] <= k + 1
    assert r["draft_loop_ms"] > 0 and r["draft_step_ms"] > 0
    assert r["draft_loop_vs_k_steps"] == pytest.approx(r["draft_loop_ms"] / (k * r["draft_step_ms"]))
    assert r["gb_s"] > 0 and r["peak_mem_gb"] > 0  # with the other fields DESIGN.md's records require


def test_bench_cli_writes_plain_and_speculative_records(tmp_path):
    """benchmarks/speculation.py on a checkpoint (a tiny one: the presets are real models' shapes), with the kernels
    where they apply (the int8 draft's, on the CPU)."""
    import json

    from benchmarks.speculation import main
    from test_quantize import write_float_checkpoint

    write_float_checkpoint(tmp_path / "tiny", ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                                        intermediate_size=128, max_seq_len=256))
    out = tmp_path / "records.json"
    assert main(["--device", "cpu", "--checkpoint", str(tmp_path / "tiny"), "--modes", "eager",
                 "--prompt-tokens", "2", "--new-tokens", "4", "--speculate-k", "1", "--draft-quantize", "int8",
                 "--json", str(out)]) == 0
    plain, spec = json.loads(out.read_text())
    assert (plain["mode"], spec["mode"], spec["draft"], plain["model"]) == ("eager", "speculative-eager", "int8", "tiny")
    for r in (plain, spec):  # the fields DESIGN.md promises
        assert {"gpu", "torch", "model", "dtype", "mode", "batch_size", "prompt_tokens", "new_tokens", "tok_s",
                "gb_s", "ceiling_gb_s", "compile_s", "peak_mem_gb", "date", "command"} <= set(r)


@pytest.mark.parametrize("argv", [["--speculate-k", "2"], ["--draft-quantize", "int8"],
                                  ["--speculate-k", "0", "--draft-quantize", "int8"],
                                  ["--speculate-k", "2", "--draft-quantize", "int8", "--draft-checkpoint", "x"]])
def test_bench_refuses_incomplete_speculative_flags(argv, capsys):
    from benchmarks.speculation import main

    assert main(["--device", "cpu", "--model", "smollm2-135m", *argv]) == 1
    assert capsys.readouterr().err.startswith("error:")


def test_graphs_mode_needs_cuda(target, drafts):  # (these models are on the CPU)
    with pytest.raises(ValueError, match="CUDA"):
        SpeculativeGenerator(target, drafts["identical"], GREEDY, 2, "graphs")


# -- prompt lookup (draft=None): the proposals are n-grams of the prompt and output so far ------------------

@pytest.mark.parametrize("history,pos,n,expected,matched", [
    ([1, 2, 3, 4, 1, 2, 0, 0], 5, 3, [3, 4, 1], 2),  # "1 2" occurred before: what followed it
    ([5, 2, 8, 1, 2, 9, 5, 2], 7, 2, [8, 1, 2], 2),  # the longest n-gram that occurs ("5 2"), not the latest "2"
    ([5, 2, 8, 1, 2, 9, 5, 2], 7, 1, [9, 5, 2], 1),  # n = 1: the latest earlier "2"
    ([1, 2, 3, 4, 9, 9, 9, 9], 3, 3, [1, 2, 3], 0),  # no repeat: the first K (positions past pos never match)
    ([7, 7, 7, 1, 1, 1, 1, 1], 2, 3, [7, 7, 7], 2),  # a match at the very end: its continuation runs past pos
    ([4, 6, 4, 6, 4, 6, 0, 0], 5, 3, [4, 6, 4], 3),  # the latest occurrence wins
])
def test_prompt_lookup_proposes_what_followed_the_longest_match(history, pos, n, expected, matched):
    got = speculative.propose(torch.tensor(history), torch.tensor([pos]), 3, n)
    assert got.tolist() == expected
    assert speculative.match(torch.tensor(history), torch.tensor([pos]), n)[1].tolist() == [matched]


REPEATS = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompt", [REPEATS, list(range(10, 30)), PROMPT])
def test_prompt_lookup_greedy_equals_plain_greedy(target, prompt, k):
    expected = plain(target, GREEDY, 40, prompt=prompt)
    got, gen = spec(target, None, GREEDY, k, 40, prompt=prompt)
    assert got == expected
    assert gen.round_tokens == sum((n + 1) * c for n, c in enumerate(gen.histogram))
    assert gen.plain_steps > 0  # (where no 2 tokens repeat: steps that propose nothing)
    # sampling's acceptance, and its steps that propose nothing, at top-k 1: greedy's tokens again
    top1 = Sampling(temperature=1.0, top_k=1)
    torch.manual_seed(7)
    got, gen = spec(target, None, top1, k, 40, prompt=prompt)
    assert got == expected and gen.plain_steps > 0


def test_prompt_lookup_proposes_only_after_a_repeat(target, monkeypatch):
    """A round runs only where the last LOOKUP_MIN_MATCH tokens occurred before (a proposal after a shorter match is
    rarely accepted), elsewhere a plain step: greedy's tokens either way."""
    prompt, matched = REPEATS + list(range(10, 30)), []
    gen = SpeculativeGenerator(target, None, GREEDY, 3)
    real = gen.round
    monkeypatch.setattr(gen, "round", lambda: matched.append(int(speculative.match(gen.history[0], gen.pos, 3)[1]))
                        or real())
    assert [t for c in gen.generate(prompt, 40) for t in c] == plain(target, GREEDY, 40, prompt=prompt)
    assert gen.plain_steps > 0 and matched and min(matched) >= speculative.LOOKUP_MIN_MATCH == 2, matched


@pytest.mark.skipif(cpu.unsupported() is not None, reason=f"gdkernels/cpu.cpp does not run here: {cpu.unsupported()}")
def test_prompt_lookup_built_ahead_of_time_equals_plain_greedy(target, tmp_path, monkeypatch):
    """On the CPU with the kernels, prompt lookup's verification and its step that proposes nothing are built ahead
    of time (gdkernels/aot.py, --compile), as plain decode's step is: the same tokens as plain greedy."""
    import gdkernels.aot

    monkeypatch.setattr(gdkernels.aot, "cache_dir", lambda: tmp_path)
    model = copy.deepcopy(target)
    assert gdkernels.apply(model) == ["2 x attention -> cpu.cpp (each query reads up to its position)"]
    gen = SpeculativeGenerator(model, None, GREEDY, 3, "aot", ahead_of_time=gdkernels.aot.AotStep)
    got = [t for c in gen.generate(REPEATS, 40) for t in c]
    assert got == plain(model, GREEDY, 40, prompt=REPEATS) and gen.plain_steps > 0 and gen.rounds > 0
    assert gen.verify_fn.fn.ran == gen.plain_fn.fn.ran == "compiled ahead of time"
    assert len(list((tmp_path / "aot").glob("lookup_verify-*.pt2"))) == 2  # (K + 1 tokens and 1 token)


def test_prompt_lookup_accepts_runs_and_stops_inside_them(target):
    """Where the output repeats itself, rounds accept whole runs; a stop token anywhere in the output, inside
    an accepted run or not, ends it there, as a per-token check would."""
    model = make(3)  # its greedy output falls into repeating patterns
    out = plain(model, GREEDY, 60, prompt=REPEATS)
    got, gen = spec(model, None, GREEDY, 4, 60, prompt=REPEATS)
    assert got == out and gen.histogram[4] > 0
    for stop in set(out[1:40]):
        cut = plain(model, GREEDY, 60, {stop}, prompt=REPEATS)
        assert spec(model, None, GREEDY, 4, 60, {stop}, prompt=REPEATS)[0] == cut and len(cut) < 60


def test_prompt_lookup_on_the_default_model_copies_a_passage_exactly(default_ckpt):
    """The real model asked to repeat a passage: the output equals plain greedy decoding token for token, and
    rounds accept several tokens each."""
    from quantize import load
    from tokenizer import load_tokenizer

    model, tok = load(default_ckpt, device="cpu", dtype=torch.float32), load_tokenizer(default_ckpt)
    passage = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
               "How vexingly quick daft zebras jump.")
    prompt = tok.encode_chat([{"role": "user", "content": f"Repeat this text exactly: {passage}"}])
    got, gen = spec(model, None, GREEDY, 4, 32, prompt=prompt)
    assert got == plain(model, GREEDY, 32, prompt=prompt)
    assert gen.mean_tokens_per_round > 2.5, gen.histogram
