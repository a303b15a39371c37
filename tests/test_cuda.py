"""GPU behaviour of the decode path: graphed and hand-captured decode equal eager, one graph replay
per token, no recompiles, kept outputs never overwritten; and the kernels (gdkernels.apply) against the
plain model: the same logits within bf16 rounding and the same greedy tokens, in bf16, int8 and int4,
with each int4 weight held once. Run with `pytest -m cuda`."""
import copy

import pytest
import torch

import gdkernels
from bench import make_generator, random_model
from common import RNG_KERNELS_PER_REPLAY, Sampling, launches_per_call, no_recompiles
from generate import check_graphs
from model import ModelArgs
from quantize import Int4Linear, quantize_model
from test_kernels import reference_attention

pytestmark = pytest.mark.cuda

ARGS = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=1000, intermediate_size=512,
                 max_seq_len=1024)
PROMPT = [[5, 17, 300, 42, 7, 99, 1, 250]]
GREEDY = Sampling(temperature=0)


@pytest.fixture(scope="module")
def model():
    """bf16, as decode runs by default: the plain model (no kernels)."""
    torch.manual_seed(0)
    return random_model(ARGS, torch.device("cuda"), torch.bfloat16)


@pytest.fixture(scope="module")
def model32():
    """float32 (TF32 off) for token-for-token equality: Inductor's fused kernels round bf16
    differently from eager ops, and over 200 greedy steps of a random model one near-tie flips."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    return random_model(ARGS, torch.device("cuda"), torch.float32)


def with_kernels(plain):
    """A copy of the model with the kernels swapped in, as generate.py runs it on CUDA."""
    fast = copy.deepcopy(plain)
    swapped = gdkernels.apply(fast)
    assert swapped, "no kernel applies on this GPU"
    return fast


@pytest.fixture(scope="module")
def fast(model):
    return with_kernels(model)


@pytest.fixture(scope="module")
def graphed(fast):
    """What generate.py runs on CUDA: the kernels, graphed."""
    gen = make_generator(fast, "graphs")
    gen.reserve(1, 400)  # every test below fits: no buffer resize, so no recompile
    return gen


def tokens_of(gen, n, prompt=PROMPT):
    return [t for chunk in gen.generate(prompt, n) for t in chunk[0]]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def teacher_forced_logits(model, prompt, tokens):
    """float32 logits [len(tokens), V] that chose each of `tokens` after `prompt`: the prefill's last
    row, then one decode step (one token at a time, as decode runs) per token before the last."""
    device = model.tok_embeddings.weight.device
    S = len(prompt)
    model.setup_caches(1, S + len(tokens) + 8)
    with torch.no_grad():
        rows = [model(torch.tensor([prompt], device=device), torch.arange(S, device=device))[0, -1]]
        for i, t in enumerate(tokens[:-1]):
            rows.append(model(torch.tensor([[t]], device=device), torch.tensor([S + i], device=device))[0, -1])
    return torch.stack(rows).float()


def assert_picks_the_plain_models_tokens(plain, fast, fast_tokens, prompt=PROMPT[0], tolerance=2e-2, minimum=5):
    """The tokens a model with kernels picked (fast_tokens, graphed decode) are the plain model's greedy
    picks (--no-kernels) wherever rounding decides them. Teacher-forced along that path, both models'
    logits agree within bf16 rounding (tolerance). Where the plain model's two best tokens lie more than
    3x the largest difference of the two models' logits apart (2x: no difference that small swaps them;
    the rest for what the graph's own ops round otherwise), the pick is the plain model's best: at least
    `minimum` steps of the path (measured ~10 to 30 of 40 in a CPU emulation: int4 at group 32 has the
    fewest). Elsewhere (near-ties, which bf16 makes common in a random model's flat distributions:
    equality over a whole path would be luck) the pick is within that distance of the best."""
    ref = teacher_forced_logits(plain, prompt, fast_tokens)
    got = teacher_forced_logits(fast, prompt, fast_tokens)
    assert rel(got, ref) < tolerance, rel(got, ref)
    margin = 3 * (got - ref).abs().amax(-1)
    top2 = ref.topk(2, dim=-1)
    picks = torch.tensor(fast_tokens, device=ref.device)
    decided = top2.values[:, 0] - top2.values[:, 1] > margin
    assert int(decided.sum()) >= minimum, f"only {int(decided.sum())} steps far from a tie: no test of the kernels"
    assert torch.equal(picks[decided], top2.indices[decided, 0]), (fast_tokens, top2.indices[:, 0].tolist())
    assert (ref.gather(1, picks[:, None])[:, 0] >= top2.values[:, 0] - margin).all()


# -- the plain model: graphed and hand-captured decode --------------------------------------------------

def test_graphed_and_manual_decode_equal_eager(model, model32, fast):
    eager = tokens_of(make_generator(model32, "eager"), 200)
    assert len(eager) == 200 and len(set(eager)) > 5
    assert tokens_of(make_generator(model32, "graphs"), 200) == eager
    assert tokens_of(make_generator(model32, "manual"), 200) == eager
    # In bf16 the hand-captured graph replays the very kernels eager runs: identical tokens, with the
    # kernels' too.
    for m in (model, fast):
        assert tokens_of(make_generator(m, "manual"), 200) == tokens_of(make_generator(m, "eager"), 200)


def test_compiled_logits_within_bf16_tolerance(model):
    idx = torch.tensor([[3]], device="cuda")
    model.setup_caches(1, 64)
    with torch.no_grad():
        model(torch.tensor([PROMPT[0]], device="cuda"), torch.arange(8, device="cuda"))
        pos = torch.tensor([8], device="cuda")
        ref = model(idx, pos).float()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # warm-up, record, replay
            got = compiled(idx, pos).float().clone()
    assert rel(got, ref) < 2e-2, rel(got, ref)


# -- the kernels against the plain model ------------------------------------------------------------------

def quantized(model, mode):
    return model if mode == "bf16" else quantize_model(model, *{"int8": ("int8",), "int4": ("int4", 32),
                                                                "int4-g128": ("int4", 128)}[mode])


@pytest.mark.parametrize("mode, B", [("bf16", 1), ("int8", 1), ("int4", 1), ("bf16", 4)])
def test_fused_decode_steps_match_the_plain_model(model, mode, B, monkeypatch):
    """With the kernels, decode does each RMSNorm, SwiGLU and residual add inside a GEMV (batch 1; and for
    bf16 batch 4, gemv.py's several-row kernel) and each layer's attention in one kernel; its logits,
    every row's, match the plain model's (the same weights, no kernels) within bf16 rounding, and every
    norm, residual add and attention of the step went through the kernels."""
    plain = quantized(model, mode)
    fast = with_kernels(plain)
    prompts = torch.tensor([PROMPT[0]] + [[(7 * b + 3 * i) % ARGS.vocab_size for i in range(8)] for b in range(1, B)],
                           device="cuda")
    idx, pos = torch.tensor([[3], [40], [500], [999]][:B], device="cuda"), torch.tensor([8], device="cuda")

    def decode_logits(m):
        m.setup_caches(B, 64)
        with torch.no_grad():
            m(prompts, torch.arange(8, device="cuda"))
            calls.clear()  # count the decode step's calls only
            return m(idx, pos).float()

    calls = []
    gemv, int4, attention = gdkernels.gemv.matmul, gdkernels.int4.matmul, gdkernels.attention.attention
    monkeypatch.setattr(gdkernels.gemv, "matmul", lambda *a, **k: calls.append(("gemv", a)) or gemv(*a, **k))
    monkeypatch.setattr(gdkernels.int4, "matmul", lambda *a, **k: calls.append(("int4", a)) or int4(*a, **k))
    monkeypatch.setattr(gdkernels.attention, "attention",
                        lambda *a, **k: calls.append(("attention", a)) or attention(*a, **k))
    got = decode_logits(fast)
    n = ARGS.n_layers
    # (x, weight, scales, norm_weight, eps, residual, swiglu) and (x, words, sz, units, w_unscale, group, ones,
    # norm_weight, eps, residual, swiglu): the fusions at the same places from the end
    gemvs = [a[:1] + a[-4:] for kind, a in calls if kind != "attention"]
    assert all(a[0].numel() // a[0].shape[-1] == B for a in gemvs) and len(gemvs) == 4 * n + 1
    assert sum(kind == "int4" for kind, _ in calls) == (4 * n if mode == "int4" else 0)  # (the head is int8)
    assert sum(a[1] is not None for a in gemvs[:-1]) == 2 * n  # the blocks' attention and ffn norms
    assert sum(a[3] is not None for a in gemvs) == 2 * n  # after attention and after the feed-forward
    assert sum(a[4] for a in gemvs) == n  # SwiGLU in the gate/up GEMV
    assert sum(kind == "attention" for kind, _ in calls) == n  # RoPE, cache write and attention in one kernel a layer
    ref = decode_logits(plain)
    assert not calls  # (the plain model: PyTorch's ops only)
    for b in range(B):  # bf16 rounding at different points (each path is ~0.8% off float32)
        assert rel(got[b], ref[b]) < 2e-2, (b, rel(got[b], ref[b]))


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "int4-g128"])
def test_kernels_decode_is_one_graph_and_picks_the_plain_models_tokens(model, mode):
    """generate.py's CUDA decode (the kernels, graphed) is one replay per token and picks the tokens the
    plain model (--no-kernels) picks, as far as rounding decides them (assert_picks_the_plain_models_tokens);
    int8 and int4 (codes at group 32, float16 pairs at 128) stay near the float model."""
    plain = quantized(model, mode)
    fast = with_kernels(plain)
    torch._dynamo.reset()  # each case compiles afresh, as a run does (else: the recompile limit)
    gen = make_generator(fast, "graphs")
    gen.reserve(1, 128)
    graphed = tokens_of(gen, 40)
    check_graphs(gen, steps=4)
    assert_picks_the_plain_models_tokens(plain, fast, graphed)
    if mode != "bf16":
        idx, pos = torch.tensor(PROMPT, device="cuda"), torch.arange(8, device="cuda")
        with torch.no_grad():
            plain.setup_caches(1, 64)
            model.setup_caches(1, 64)
            q, f = plain(idx, pos).float(), model(idx, pos).float()
        assert rel(q, f) < (0.05 if mode == "int8" else 0.25), rel(q, f)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_kernel_on_wide_layers_matches_the_plain_model(group):
    """Dims of 1024 and 2560: the int4 GEMV's gate/up loop runs two blocks and down's K ends in a partial
    block (2560 = 2048 + 512), as at 7B and not in ARGS's model; a decode step with the kernels gives the
    plain model's logits (the file's layout dequantized) within bf16 rounding and x's int8 rounding."""
    torch.manual_seed(0)
    model = random_model(ModelArgs(dim=1024, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=1000,
                                   intermediate_size=2560, max_seq_len=256), torch.device("cuda"), torch.bfloat16)
    plain = quantize_model(model, "int4", group)
    fast = with_kernels(plain)
    idx, pos = torch.tensor(PROMPT, device="cuda"), torch.arange(8, device="cuda")
    logits = []
    for m in (fast, plain):
        with torch.no_grad():
            m.setup_caches(1, 64)
            m(idx, pos)
            logits.append(m(torch.tensor([[3]], device="cuda"), torch.tensor([8], device="cuda")).float())
    # (x's int8 rounding: a step of max |x| / 127 per group, ~0.5% of x at group 32 and ~0.7% at 128)
    assert rel(*logits) < (0.02 if group == 32 else 0.03), rel(*logits)


def test_int4_with_kernels_holds_each_weight_once(model):
    """gdkernels.apply re-lays each int4 layer for int4.py's GEMV and drops the file's layout: no
    weight, scales or zeros left in the Int4Gemv layers, only words, sz and units (and the ones the
    kernel multiplies x by, not saved), and the GPU memory they took is given back. The step reads no
    more bytes than the plain int4 model's."""
    from generate import weight_bytes_per_step

    plain = quantize_model(model, "int4", 32)
    file_layout = {n for n, m in plain.named_modules() if type(m) is Int4Linear}
    file_bytes = sum(t.numel() * t.element_size() for n, m in plain.named_modules() if n in file_layout
                     for t in (m.weight, m.scales, m.zeros))
    fast = copy.deepcopy(plain)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gdkernels.apply(fast)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    layers = {n: m for n, m in fast.named_modules() if isinstance(m, Int4Linear)}
    assert set(layers) == file_layout and all(type(m) is gdkernels.Int4Gemv for m in layers.values())
    for name, m in layers.items():
        for gone in ("weight", "scales", "zeros"):
            assert not hasattr(m, gone), (name, gone)
        held = {n for n, _ in m.named_parameters()} | {n for n, _ in m.named_buffers()}
        assert held - {"bias"} <= {"words", "sz", "units", "ones"}, (name, held)
        assert {k.rsplit(".", 1)[-1] for k in m.state_dict()} - {"bias"} <= {"words", "sz", "units"}
        assert m.words.dtype == torch.int32 and m.sz.shape[0] == m.words.shape[0]
    assert after - before < file_bytes / 4, (after - before, file_bytes)  # (not both layouts at once)
    assert weight_bytes_per_step(fast) <= weight_bytes_per_step(plain)


def test_decode_attention_kernel_matches_pytorch_many_slices_repeated():
    """gdkernels.attention.decode_attention with many cache slices (merged by the last slice to finish, an
    atomic count), batch 8 and grouped heads on a long cache, launched again and again, eagerly
    and as replays of one captured graph: every output matches PyTorch's and the counts are back at
    zero. (The CPU interpreter runs programs one after another, so only a GPU tests the merge's
    ordering.)"""
    from gdkernels.attention import decode_attention

    B, H, Hkv, D, L, splits = 8, 32, 8, 128, 4096, 16
    torch.manual_seed(0)
    k_cache = torch.randn(B, Hkv, L, D, device="cuda").bfloat16()
    v_cache = torch.randn(B, Hkv, L, D, device="cuda").bfloat16()
    cos = torch.randn(L, D, device="cuda").bfloat16()
    sin = torch.randn(L, D, device="cuda").bfloat16()
    counts = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D, device="cuda").bfloat16()
    pos = torch.zeros(1, dtype=torch.long, device="cuda")

    def expected(p):
        return reference_attention(qkv, p, cos, sin, k_cache.clone(), v_cache.clone(), H, Hkv)

    def check(y, p):
        ref = expected(p)
        assert (y.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), p
        assert not counts.any()

    for p in (0, 255, 256, 1000, 4095):
        pos.fill_(p)
        for _ in range(20):
            check(decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, Hkv, splits), p)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, Hkv, splits)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        y = decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, Hkv, splits)
    for p in (17, 3000, 4000):
        pos.fill_(p)
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            check(y, p)


def test_pdl_chain_of_dependent_kernels_equals_plain_launches(monkeypatch):
    """The kernels launch with programmatic dependent launch on sm_90+: each GEMV loads its first
    weight block before it waits for the kernel that writes its input. A chain of GEMVs, each
    reading the one before's output (norm, SwiGLU and residual fused in, as in decode), with the
    attention kernel in between, gives bit for bit what plain launches give, eagerly and as replays
    of one captured graph."""
    from gdkernels import attention, gemv

    torch.manual_seed(0)
    D, F = 1024, 2816
    wqkv = [(torch.randn(3 * D // 2, D, device="cuda") / D ** 0.5).bfloat16() for _ in range(3)]
    wo = [(torch.randn(D, D, device="cuda") / D ** 0.5).bfloat16() for _ in range(3)]
    w13 = [(torch.randn(2 * F, D, device="cuda") / D ** 0.5).bfloat16() for _ in range(3)]
    w2 = [(torch.randn(D, F, device="cuda") / F ** 0.5).bfloat16() for _ in range(3)]
    g = (1 + 0.1 * torch.randn(D, device="cuda")).bfloat16()
    H, Hkv, L = 8, 2, 512
    Dh = D // H
    k_cache = torch.randn(1, Hkv, L, Dh, device="cuda").bfloat16()
    v_cache = torch.randn(1, Hkv, L, Dh, device="cuda").bfloat16()
    cos, sin = torch.randn(L, Dh, device="cuda").bfloat16(), torch.randn(L, Dh, device="cuda").bfloat16()
    counts = torch.zeros(Hkv, dtype=torch.int32, device="cuda")
    pos = torch.tensor([300], device="cuda")
    x = torch.randn(1, 1, D, device="cuda").bfloat16()
    caches = (k_cache.clone(), v_cache.clone())

    def chain(h):
        k_cache.copy_(caches[0])
        v_cache.copy_(caches[1])
        for i in range(12):
            j = i % 3
            qkv = gemv.gemv(h, wqkv[j], norm_weight=g, eps=1e-5)  # (H + 2 Hkv) Dh = 3 D / 2
            a = attention.decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, Hkv, 4)
            h = gemv.gemv(a, wo[j], residual=h)
            m = gemv.gemv(h, w13[j], norm_weight=g, eps=1e-5, swiglu=True)
            h = gemv.gemv(m, w2[j], residual=h)
        return h

    if torch.cuda.get_device_capability()[0] >= 9:
        assert gemv.pdl(x), "this GPU takes PDL: the suite should test it"
    with monkeypatch.context() as off:  # plain launches: pdl() says no to each module that asks
        for module in (gemv, attention):
            off.setattr(module, "pdl", lambda x: False)
        plain = chain(x).clone()
    assert plain.isfinite().all()
    for _ in range(5):
        assert torch.equal(chain(x), plain)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain(x)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, plain)


# -- graphs: one replay a token, no recompiles, outputs kept ------------------------------------------------

def test_one_graph_replay_per_token(model, graphed):
    tokens_of(graphed, 20)  # warm: compiled and recorded
    counts = check_graphs(graphed, steps=8)
    assert counts == {"graph_launches_per_step": 1, "kernels_outside_graphs_per_step": 0}
    for mode in ("graphs", "manual"):  # the plain model too, graphed by Inductor and by hand
        gen = make_generator(model, mode)
        gen.reserve(1, 64)
        tokens_of(gen, 5)
        assert check_graphs(gen, steps=8)["graph_launches_per_step"] == 1
    gen = _warm_eager(model)
    eager = launches_per_call(gen.decode_step, gen.device, 4)
    assert eager["graph_launches_per_step"] == 0 and eager["kernels_outside_graphs_per_step"] > 20


def _warm_eager(model):
    gen = make_generator(model, "eager")
    gen.reserve(1, 64)  # (room for the checks' steps after the 2 tokens, whatever cache the model had)
    tokens_of(gen, 2)
    return gen


def test_check_graphs_fails_on_eager_decode(model):
    with pytest.raises(RuntimeError, match="not one graph replay per call"):
        check_graphs(_warm_eager(model), steps=2)


def test_check_graphs_fails_when_a_graph_is_skipped(model):
    """Buffers the step mutates but nobody marked static: CUDAGraph Trees skips the graph (mutated inputs) and
    Inductor's kernels run one by one. The check must fail, not pass on a slow step."""
    from common import GraphCheckError, Step, check_graphs as check
    from generate import decode_one_token

    torch._dynamo.reset()
    model.setup_caches(1, 64)
    token, pos, tokens = (torch.zeros(*s, dtype=torch.long, device="cuda") for s in ((1, 1), (1,), (1, 64)))
    step = Step(decode_one_token, "graphs", token.device)  # (no step.static(...))
    run = lambda: step(model, token, pos, tokens, Sampling(temperature=0))  # noqa: E731
    for _ in range(3):
        run()
    with pytest.raises(GraphCheckError, match="not one graph replay per call"):
        check(run, token.device, 2, "decode")


def test_no_recompiles_over_300_tokens(graphed):
    from torch._dynamo.utils import counters

    tokens_of(graphed, 10)  # warm
    before = dict(counters["stats"])
    with no_recompiles(graphed.mode):
        out = tokens_of(graphed, 300)
    assert len(out) == 300
    assert counters["stats"].get("unique_graphs", 0) == before.get("unique_graphs", 0)


def test_kept_outputs_not_overwritten_by_replays(graphed):
    """Tokens handed to the host earlier must not change when later replays run (the step
    writes each token into its own slot of a static buffer; nothing aliases a graph output)."""
    gen = graphed.generate(PROMPT, 120)
    early = [list(next(gen)[0]) for _ in range(3)]
    tokens = graphed.tokens
    snapshot = tokens[0, : 8 + 1 + 16].clone()
    rest = [c[0] for c in gen]
    assert tokens[0, : 8 + 1 + 16].equal(snapshot)
    assert sum(early, []) == snapshot[8:].tolist()
    assert len(sum(early, []) + sum(rest, [])) == 120


@pytest.mark.parametrize("k", [2, 4])
def test_speculative_graphs_equal_plain_greedy_and_draft_loop_is_one_replay(model32, k):
    """Graphed speculative decoding (draft loop and verification, one CUDA graph each), with the kernels
    in both models as generate.py runs them, gives the target's greedy tokens; the draft's K steps are
    one graph launch with nothing outside it, and so is the verification."""
    from speculative import SpeculativeGenerator

    torch._dynamo.reset()  # each K compiles afresh (static shapes), as in a real run
    target = with_kernels(model32)
    draft = with_kernels(quantize_model(model32, "int8"))  # mostly agrees: rounds accept some, reject some
    gen = SpeculativeGenerator(target, draft, GREEDY, k, "graphs")
    spec = [t for chunk in gen.generate(PROMPT[0], 60) for t in chunk]
    assert spec == tokens_of(make_generator(target, "eager"), 60)
    assert gen.mean_tokens_per_round > 1 and gen.histogram[k] < gen.rounds
    # (the calls write K + 1 positions from just after the prompt: inside the cache)
    counts = check_graphs(gen, len(PROMPT[0]) + 1)
    one = {"graph_launches_per_step": 1, "kernels_outside_graphs_per_step": 0}
    assert counts == {"draft_loop": one, "verify": one}


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0, top_k=50)])
def test_prompt_lookup_graphs_equal_plain_greedy_and_a_round_is_one_replay(model32, sampling):
    """Prompt lookup (no draft): the proposal and the verification of K + 1 tokens replay as one graph with
    nothing outside it but the RNG's kernels, and so does a step that proposes nothing; greedy, the tokens
    equal plain greedy decoding."""
    from speculative import SpeculativeGenerator

    torch._dynamo.reset()
    target = with_kernels(model32)
    gen = SpeculativeGenerator(target, None, sampling, 4, "graphs")
    prompt = PROMPT[0] * 3  # (something to look up)
    spec = [t for chunk in gen.generate(prompt, 60) for t in chunk]
    if sampling is GREEDY:
        assert spec == tokens_of(make_generator(target, "eager"), 60, [prompt])
    counts = check_graphs(gen, len(prompt) + 1)
    rng = RNG_KERNELS_PER_REPLAY if sampling.temperature > 0 else 0
    one = {"graph_launches_per_step": 1, "kernels_outside_graphs_per_step": rng}
    assert counts == {"verify": one, "plain_step": one}


def test_sampling_graphs_add_only_the_rng_seed_kernels(fast):
    """At temperature > 0 each replay is still one graph launch; outside it run exactly the two
    kernels with which PyTorch gives the graph's RNG a fresh seed and offset (RNG_KERNELS_PER_REPLAY),
    which check_graphs allows."""
    gen = make_generator(fast, "graphs", Sampling(temperature=1.0, top_k=50))
    gen.reserve(1, 64)
    assert len(tokens_of(gen, 20)) == 20
    gen.pos.fill_(len(PROMPT[0]))
    counts = check_graphs(gen, steps=4)
    assert counts == {"graph_launches_per_step": 1, "kernels_outside_graphs_per_step": RNG_KERNELS_PER_REPLAY}


def test_generate_cli_check_graphs(tmp_path, capsys):
    """generate.py --check-graphs on a small random checkpoint with a real tokenizer: plain decode
    (greedy and sampling, one with a prompt near the end of the context; with the kernels and with
    --no-kernels) and speculative decoding pass the check, with one line on stderr and exit status 0."""
    import generate
    from test_quantize import write_float_checkpoint
    from test_tokenizer import train_bytelevel_bpe

    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, intermediate_size=256,
                     max_seq_len=96)
    ckpt, draft = tmp_path / "target", tmp_path / "draft"
    for path, seed in ((ckpt, 0), (draft, 1)):
        write_float_checkpoint(path, args, seed)
        train_bytelevel_bpe(512, ["<|endoftext|>"]).save(str(path / "tokenizer.json"))
    long_prompt = "the " * 80  # ends within a few tokens of the 96-token context
    for extra in (["--temperature", "0"], ["--temperature", "1", "--seed", "3"],
                  ["--temperature", "0", "--no-kernels"],
                  ["--temperature", "0", "--prompt", long_prompt, "--max-new-tokens", "4"],
                  ["--temperature", "0", "--draft-checkpoint", str(draft), "--speculate-k", "3"],
                  ["--temperature", "0", "--prompt-lookup", "3"]):
        argv = ["--checkpoint", str(ckpt), "--device", "cuda", "--max-new-tokens", "12", "--ignore-eos",
                "--check-graphs", *extra]
        torch._dynamo.reset()  # a fresh compile, as each run of generate.py is (and no recompile limit)
        assert generate.main(argv) == 0, capsys.readouterr().err
        err = capsys.readouterr().err
        assert "check-graphs: one graph replay per call" in err
        assert ("kernels: off" in err) == ("--no-kernels" in extra), err
