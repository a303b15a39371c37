"""GPU behaviour of the decode path: graphed and hand-captured decode equal eager, one graph
replay per token, no recompiles, kept outputs never overwritten. Run with `pytest -m cuda`."""
import pytest
import torch

import bench
from bench import make_generator, random_model
from generate import (RNG_KERNELS_PER_REPLAY, Sampling, check_graphs, check_speculative_graphs,
                      count_launches)
from model import ModelArgs

pytestmark = pytest.mark.cuda

ARGS = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=1000, intermediate_size=512,
                 max_seq_len=1024)
PROMPT = [[5, 17, 300, 42, 7, 99, 1, 250]]


@pytest.fixture(scope="module")
def model():
    """bf16, as decode runs by default."""
    torch.manual_seed(0)
    return random_model(ARGS, torch.device("cuda"), torch.bfloat16)


@pytest.fixture(scope="module")
def model32():
    """float32 (TF32 off) for token-for-token equality: Inductor's fused kernels round bf16
    differently from eager ops, and over 200 greedy steps of a random model one near-tie flips."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    return random_model(ARGS, torch.device("cuda"), torch.float32)


@pytest.fixture(scope="module")
def graphed(model):
    gen = make_generator(model, "graphs")
    gen.reserve(1, 400)  # every test below fits: no buffer resize, so no recompile
    return gen


def tokens_of(gen, n, prompt=PROMPT):
    return [t for chunk in gen.generate(prompt, n) for t in chunk[0]]


def assert_graphed_is_one_replay_and_picks_eager_tokens(qmodel):
    """Graphed decode of qmodel is one replay a token, and its first 8 greedy tokens are eager decode's."""
    gen = make_generator(qmodel, "graphs")
    gen.reserve(1, 128)
    graphed = tokens_of(gen, 24)
    check_graphs(gen, steps=4)
    eager = make_generator(qmodel, "eager")
    eager.reserve(1, 128)
    assert graphed[:8] == tokens_of(eager, 24)[:8]


def test_graphed_and_manual_decode_equal_eager(model, model32):
    eager = tokens_of(make_generator(model32, "eager"), 200)
    assert len(eager) == 200 and len(set(eager)) > 5
    assert tokens_of(make_generator(model32, "graphs"), 200) == eager
    assert tokens_of(make_generator(model32, "manual"), 200) == eager
    # In bf16 the hand-captured graph replays the very kernels eager runs: identical tokens.
    assert tokens_of(make_generator(model, "manual"), 200) == tokens_of(make_generator(model, "eager"), 200)


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
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel


@pytest.mark.parametrize("mode, B", [("bf16", 1), ("int8", 1), ("bf16", 4)])
def test_fused_decode_steps_match_unfused(model, mode, B, monkeypatch):
    """Decode does each RMSNorm, SwiGLU and residual add inside a GEMV (batch 1; and for bf16 batch 4,
    cuda_kernels.py's several-row kernel) and each layer's attention in one kernel; its logits, every row's,
    match the same model run one PyTorch op at a time (cuda_kernels.usable and model.FUSE_ATTENTION off)
    within bf16 rounding, and every norm, residual add and attention of the step went through the
    kernels."""
    import cuda_kernels
    import model as model_module
    from quantize import quantize_model

    m = model if mode == "bf16" else quantize_model(model, "int8")
    prompts = torch.tensor([PROMPT[0]] + [[(7 * b + 3 * i) % ARGS.vocab_size for i in range(8)] for b in range(1, B)],
                           device="cuda")
    idx, pos = torch.tensor([[3], [40], [500], [999]][:B], device="cuda"), torch.tensor([8], device="cuda")

    def decode_logits():
        m.setup_caches(B, 64)
        with torch.no_grad():
            m(prompts, torch.arange(8, device="cuda"))
            calls.clear()  # count the decode step's calls only
            return m(idx, pos).float()

    calls = []
    gemv, attention = cuda_kernels.gemv, cuda_kernels.decode_attention
    monkeypatch.setattr(cuda_kernels, "gemv", lambda *a, **k: calls.append(a) or gemv(*a, **k))
    monkeypatch.setattr(cuda_kernels, "decode_attention", lambda *a, **k: calls.append("attention") or attention(*a, **k))
    fused = decode_logits()
    n = ARGS.n_layers
    gemvs = [a for a in calls if a != "attention"]
    assert all(a[0].numel() // a[0].shape[-1] == B for a in gemvs) and len(gemvs) == 4 * n + 1
    assert sum(a[3] is not None for a in gemvs) == 2 * n + 1  # attention, ffn and final norms
    assert sum(a[5] is not None for a in gemvs) == 2 * n  # after attention and after the feed-forward
    assert sum(a[6] for a in gemvs) == n  # SwiGLU in the gate/up GEMV
    assert calls.count("attention") == n  # RoPE, cache write and attention in one kernel per layer
    monkeypatch.setattr(cuda_kernels, "usable", lambda *a, **k: False)
    monkeypatch.setattr(model_module, "FUSE_ATTENTION", False)
    plain = decode_logits()
    assert "attention" not in calls
    if B > 1:
        assert not calls
    for b in range(B):  # bf16 rounding at different points (each path is ~0.8% off float32)
        rel = ((fused[b] - plain[b]).norm() / plain[b].norm()).item()
        assert rel < 2e-2, (b, rel)


def test_one_graph_replay_per_token(model, graphed):
    tokens_of(graphed, 20)  # warm: compiled and recorded
    counts = check_graphs(graphed, steps=8)
    assert counts == {"graph_launches_per_step": 1, "kernels_outside_graphs_per_step": 0}
    manual = make_generator(model, "manual")
    tokens_of(manual, 5)
    assert check_graphs(manual, steps=8)["graph_launches_per_step"] == 1
    eager = count_launches(_warm_eager(model), 4)
    assert eager["graph_launches_per_step"] == 0 and eager["kernels_outside_graphs_per_step"] > 20


def _warm_eager(model):
    gen = make_generator(model, "eager")
    tokens_of(gen, 2)
    return gen


def test_check_graphs_fails_on_eager_decode(model):
    with pytest.raises(RuntimeError, match="not one graph replay per token"):
        check_graphs(_warm_eager(model), steps=2)


def test_no_recompiles_over_300_tokens(model, graphed):
    from torch._dynamo.utils import counters

    tokens_of(graphed, 10)  # warm
    before = dict(counters["stats"])
    with graphed.no_recompiles():
        out = tokens_of(graphed, 300)
    assert len(out) == 300
    assert counters["stats"].get("unique_graphs", 0) == before.get("unique_graphs", 0)


def test_kept_outputs_not_overwritten_by_replays(graphed):
    """Tokens handed to the host earlier must not change when later replays run (the step
    writes each token into its own slot of a static buffer; nothing aliases a graph output)."""
    gen = graphed.generate(PROMPT, 120)
    early = [list(next(gen)[0]) for _ in range(3)]
    token, pos, tokens = graphed.buffers
    snapshot = tokens[0, : 8 + 1 + 16].clone()
    rest = [c[0] for c in gen]
    assert tokens[0, : 8 + 1 + 16].equal(snapshot)
    assert sum(early, []) == snapshot[8:].tolist()
    assert len(sum(early, []) + sum(rest, [])) == 120


@pytest.mark.parametrize("mode, group, int4_gemv, codes", [("int8", None, False, False), ("int4", 32, False, False),
                                                          ("int4", 32, True, False), ("int4", 32, True, True),
                                                          ("int4", 128, True, False)])
def test_quantized_decode_is_one_graph_and_matches_eager(model, mode, group, int4_gemv, codes, monkeypatch):
    """Weight-only int8/int4 layers are capture-safe: graphed decode is one replay per token, each
    token it picks is the top one (up to bf16 rounding) of an eager forward over the same history,
    and the quantized logits stay near the float model's. int4_gemv: the one-row steps through
    cuda_kernels.int4_gemv (model.INT4_GEMV), against an eager forward of the prompt and history, whose
    rows go through tinygemm. codes: its scales and zeros read as 8-bit codes (model.INT4_CODES)."""
    import cuda_kernels
    import model as model_module
    from quantize import quantize_model

    monkeypatch.setattr(model_module, "INT4_GEMV", int4_gemv)  # (read when the layers load)
    monkeypatch.setattr(model_module, "INT4_CODES", "1" if codes else "0")
    monkeypatch.setattr(cuda_kernels, "INT4_DP4A", "1" if codes else cuda_kernels.INT4_DP4A)  # (codes are for integers)
    qmodel = quantize_model(model, mode, group)
    assert any(hasattr(m, "gemv_weight") for m in qmodel.modules()) == int4_gemv
    assert any(getattr(m, "gemv_units", None) is not None for m in qmodel.modules()) == codes
    wo, one_row = qmodel.layers[0].attention.wo, torch.zeros(1, 1, ARGS.dim, device="cuda", dtype=torch.bfloat16)
    assert getattr(wo, "x_group", lambda x: 0)(one_row) == (16 if int4_gemv and cuda_kernels.int4_dp4a() and group == 32
                                                            else 0)  # (wo reads the attention output in int8)
    gen = make_generator(qmodel, "graphs")
    gen.reserve(1, 128)
    graphed = tokens_of(gen, 40)
    check_graphs(gen, steps=4)
    # Greedy paths of a random model part at near-ties (bf16 rounds differently in Inductor's fused
    # kernels and in eager ops), so compare each choice with eager logits on the graphed history.
    seq = PROMPT[0] + graphed
    with torch.no_grad():
        qmodel.setup_caches(1, 128)
        logits = qmodel(torch.tensor([seq[:-1]], device="cuda"), torch.arange(len(seq) - 1, device="cuda"))[0].float()
    for i, token in enumerate(graphed):
        row = logits[len(PROMPT[0]) - 1 + i]
        assert row[token] >= row.max() - 0.02 * (row.max() - row.min()), (i, token, row.argmax().item())
    idx, pos = torch.tensor([PROMPT[0]], device="cuda"), torch.arange(8, device="cuda")
    with torch.no_grad():
        qmodel.setup_caches(1, 64)
        model.setup_caches(1, 64)
        q, f = qmodel(idx, pos).float(), model(idx, pos).float()
    rel = ((q - f).norm() / f.norm()).item()
    assert rel < (0.05 if mode == "int8" else 0.25), rel


@pytest.mark.parametrize("dp4a, codes", [("0", False), ("1", False), ("1", True)])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_one_row_kernel_matches_tinygemm(model, group, wide, dp4a, codes, monkeypatch):
    """With model.INT4_GEMV (the default) an int4 model's one-row steps run cuda_kernels.int4_gemv (the
    norm, SwiGLU and the residual fused): a decode step gives the logits of the same step through
    PyTorch's tinygemm (the layout dropped), both built from the same file tensors, within bf16
    rounding, in either arithmetic (cuda_kernels.INT4_DP4A), and with the scales and zeros as codes
    (model.INT4_CODES: every layer, quantize.py's grid), whose step reads fewer bytes
    (generate.weight_bytes_per_step). `wide`: dims of 1024 and 2560, so that gate/up's loop runs
    two blocks (with PREFETCH in float16 pairs) and down's K ends in a partial block (2560 = 2048 +
    512), as at 7B and not in ARGS's model."""
    import cuda_kernels
    import model as model_module
    from generate import weight_bytes_per_step
    from quantize import quantize_model

    if wide:
        torch.manual_seed(0)
        model = random_model(ModelArgs(dim=1024, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=1000,
                                       intermediate_size=2560, max_seq_len=256), torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(model_module, "INT4_GEMV", True)  # (read when the layers load)
    monkeypatch.setattr(cuda_kernels, "INT4_DP4A", dp4a)  # float16 pairs or integers everywhere
    monkeypatch.setattr(model_module, "INT4_CODES", "1" if codes else "0")
    qmodel = quantize_model(model, "int4", group)
    layers = [m for m in qmodel.modules() if isinstance(m, model_module.Int4Linear)]
    assert layers and all(hasattr(m, "gemv_weight") and m.gemv_dp4a == (dp4a == "1") for m in layers)
    assert all((m.gemv_units is not None) == codes for m in layers)
    # codes: 2 bytes a group instead of float16's 4, and 8 a row for the units
    saved = sum(2 * m.gemv_sz.numel() - 4 * m.gemv_units.numel() for m in layers) if codes else 0
    assert weight_bytes_per_step(qmodel, 2) - weight_bytes_per_step(qmodel) == saved
    idx, pos = torch.tensor([PROMPT[0]], device="cuda"), torch.arange(8, device="cuda")
    logits = {}
    for ours in (True, False):
        if not ours:
            for m in layers:
                del m.gemv_weight
        with torch.no_grad():
            qmodel.setup_caches(1, 64)
            qmodel(idx, pos)
            logits[ours] = qmodel(torch.tensor([[3]], device="cuda"), torch.tensor([8], device="cuda")).float()
    rel = ((logits[True] - logits[False]).norm() / logits[False].norm()).item()
    assert rel < 0.02, rel


@pytest.mark.parametrize("group, x_group", [(32, "auto"), (32, "32"), (128, "8")])
def test_int4_wo_reads_the_attention_output_in_int8(model, group, x_group, monkeypatch):
    """With an int4 wo in integers, the attention kernel also writes its output in int8 and wo reads
    that (cuda_kernels.INT4_XQ; auto: groups of 16 at int4 groups of 32): a decode step's logits stay within bf16 rounding of
    the step with wo quantizing it itself (INT4_XQ 0), and equal them to float rounding where the
    groups are the int4 groups (32 at 32: the same quantization); graphed decode of it is one replay
    a token, and it picks eager decode's tokens."""
    import cuda_kernels
    from quantize import quantize_model

    monkeypatch.setattr(cuda_kernels, "INT4_DP4A", "1")
    qmodel = quantize_model(model, "int4", group)
    wo, one_row = qmodel.layers[0].attention.wo, torch.zeros(1, 1, ARGS.dim, device="cuda", dtype=torch.bfloat16)
    idx, pos = torch.tensor([PROMPT[0]], device="cuda"), torch.arange(8, device="cuda")
    logits, calls = {}, []
    attention = cuda_kernels.decode_attention
    monkeypatch.setattr(cuda_kernels, "decode_attention", lambda *a, **k: calls.append(k.get("out_group", 0)) or attention(*a, **k))
    for setting in (x_group, "0"):
        monkeypatch.setattr(cuda_kernels, "INT4_XQ", setting)
        expect = 0 if setting == "0" else 16 if setting == "auto" else int(setting)
        assert wo.x_group(one_row) == expect
        calls.clear()
        with torch.no_grad():
            qmodel.setup_caches(1, 64)
            qmodel(idx, pos)
            logits[setting] = qmodel(torch.tensor([[3]], device="cuda"), torch.tensor([8], device="cuda")).float()
        assert calls == [expect] * ARGS.n_layers  # (the one-row step: every layer's attention)
    rel = ((logits[x_group] - logits["0"]).norm() / logits["0"].norm()).item()
    assert rel < (1e-3 if x_group == "32" else 0.02), rel
    monkeypatch.setattr(cuda_kernels, "INT4_XQ", x_group)
    torch._dynamo.reset()  # each case compiles afresh, as a run with one setting does (else: the recompile limit)
    assert_graphed_is_one_replay_and_picks_eager_tokens(qmodel)


def test_int4_int8_flow_matches_the_triton_kernels(monkeypatch):
    """Turned on (int4_ring.ENABLED), one-token int4 g32 decode on sm_90 runs TransformerBlock.forward_int8: every
    GEMV but the first layer's wqkv by int4_ring.py's kernel, x handed from GEMV to GEMV in int8. A decode step's
    logits stay within bf16 rounding of the step with cuda_kernels.int4_gemv everywhere (gemv_ring off); prefill never
    takes it; graphed decode of it is one replay a token and picks eager decode's tokens."""
    import model as model_module
    from quantize import quantize_model

    from test_kernels import ring_or_skip

    int4_ring = ring_or_skip(monkeypatch)  # (turned on: read as layers load)
    args = ModelArgs(dim=512, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=1000, intermediate_size=1536,
                     max_seq_len=512)
    torch.manual_seed(0)
    qmodel = quantize_model(random_model(args, torch.device("cuda"), torch.bfloat16), "int4", 32)
    layers = [m for m in qmodel.layers.modules() if isinstance(m, model_module.Int4Linear)]
    assert len(layers) == 4 * args.n_layers and all(m.gemv_ring for m in layers)
    calls = []
    gemv = int4_ring.gemv
    monkeypatch.setattr(int4_ring, "gemv", lambda *a, **k: calls.append(1) or gemv(*a, **k))
    idx, pos = torch.tensor([PROMPT[0]], device="cuda"), torch.arange(8, device="cuda")
    logits = {}
    for ring in (True, False):
        for m in layers:
            m.gemv_ring = ring
        with torch.no_grad():
            qmodel.setup_caches(1, 64)
            qmodel(idx, pos)
            assert not calls  # (prefill: 8 rows)
            logits[ring] = qmodel(torch.tensor([[3]], device="cuda"), torch.tensor([8], device="cuda")).float()
        assert len(calls) == (4 * args.n_layers - 1 if ring else 0)
        calls.clear()
    rel = ((logits[True] - logits[False]).norm() / logits[False].norm()).item()
    assert rel < 0.02, rel
    for m in layers:
        m.gemv_ring = True
    # graphs and bench.py's manual mode capture one step by hand first and drop it (generate.prime_capture), the
    # buffers left as they were: their tokens are still eager decode's
    import generate
    primes = []
    prime = generate.prime_capture
    monkeypatch.setattr(generate, "prime_capture", lambda *a: primes.append(1) or prime(*a))
    monkeypatch.setattr(bench, "prime_capture", generate.prime_capture)
    assert generate.uses_int4_ring(qmodel)
    torch._dynamo.reset()
    assert_graphed_is_one_replay_and_picks_eager_tokens(qmodel)
    assert len(primes) == 1
    manual, eager = make_generator(qmodel, "manual"), make_generator(qmodel, "eager")
    for gen in (manual, eager):
        gen.reserve(1, 128)
    assert tokens_of(manual, 12) == tokens_of(eager, 12)
    assert len(primes) == 2
    # The prime's uncaptured step draws from the CUDA generator when sampling; capture_step puts it back, so a
    # seeded sampler picks the same tokens with the prime as without it.
    sampled = {}
    for on in (True, False):
        monkeypatch.setattr(generate, "PRIME_CAPTURE", on)
        gen = make_generator(qmodel, "graphs", Sampling(temperature=1.0))
        gen.reserve(1, 128)
        torch.manual_seed(1)
        sampled[on] = tokens_of(gen, 24)
    assert len(primes) == 4 and len(set(sampled[True])) > 5
    assert sampled[True] == sampled[False]


@pytest.mark.parametrize("k", [2, 4])
def test_speculative_graphs_equal_plain_greedy_and_draft_loop_is_one_replay(model32, k):
    """Graphed speculative decoding (draft loop and verification, one CUDA graph each) gives the
    target's greedy tokens; the draft's K steps are one graph launch with nothing outside it."""
    from quantize import quantize_model
    from speculative import SpeculativeGenerator

    torch._dynamo.reset()  # each K compiles afresh (static shapes), as in a real run
    draft = quantize_model(model32, "int8")  # mostly agrees: rounds accept some, reject some
    gen = SpeculativeGenerator(model32, draft, Sampling(temperature=0), k, "graphs")
    spec = [t for chunk in gen.generate(PROMPT[0], 60) for t in chunk]
    assert spec == tokens_of(make_generator(model32, "eager"), 60)
    assert gen.mean_tokens_per_round > 1
    # (the calls write K + 1 positions from just after the prompt: inside the cache)
    counts = check_speculative_graphs(gen, len(PROMPT[0]) + 1)
    one = {"graph_launches_per_step": 1, "kernels_outside_graphs_per_step": 0}
    assert counts == {"draft_loop": one, "verify": one}


def test_sampling_graphs_add_only_the_rng_seed_kernels(model):
    """At temperature > 0 each replay is still one graph launch; outside it run exactly the two
    kernels with which PyTorch gives the graph's RNG a fresh seed and offset (RNG_KERNELS_PER_REPLAY),
    which check_graphs allows."""
    gen = make_generator(model, "graphs", Sampling(temperature=1.0, top_k=50))
    gen.reserve(1, 64)
    assert len(tokens_of(gen, 20)) == 20
    gen.buffers[1].fill_(len(PROMPT[0]))
    counts = check_graphs(gen, steps=4)
    assert counts == {"graph_launches_per_step": 1, "kernels_outside_graphs_per_step": RNG_KERNELS_PER_REPLAY}


def test_generate_cli_check_graphs(tmp_path, capsys):
    """generate.py --check-graphs on a small random checkpoint with a real tokenizer: plain decode
    (greedy and sampling, one with a prompt near the end of the context) and speculative decoding
    pass the check, with one line on stderr and exit status 0."""
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
                  ["--temperature", "0", "--prompt", long_prompt, "--max-new-tokens", "4"],
                  ["--temperature", "0", "--draft-checkpoint", str(draft), "--speculate-k", "3"]):
        argv = ["--checkpoint", str(ckpt), "--device", "cuda", "--max-new-tokens", "12", "--ignore-eos",
                "--check-graphs", *extra]
        assert generate.main(argv) == 0, capsys.readouterr().err
        assert "check-graphs: one graph replay per call" in capsys.readouterr().err


def test_decode_attention_many_slices_repeated():
    """cuda_kernels.decode_attention with many cache slices (merged by the last slice to finish, an
    atomic count), batch 8 and grouped heads on a long cache, launched again and again, eagerly
    and as replays of one captured graph: every output matches the PyTorch path and the counts are
    back at zero. (The CPU interpreter runs programs one after another, so only a GPU tests the
    merge's ordering.)"""
    import cuda_kernels
    from test_kernels import reference_attention

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
        k, v = k_cache.clone(), v_cache.clone()
        return reference_attention(qkv, torch.tensor([p], device="cuda"), cos[p:p + 1], sin[p:p + 1], k, v, H, Hkv).float()

    def check(y, p):
        ref = expected(p)
        assert (y.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), p
        assert not counts.any()

    for p in (0, 255, 256, 1000, 4095):
        pos.fill_(p)
        for _ in range(20):
            check(cuda_kernels.decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, Hkv, splits), p)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cuda_kernels.decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, Hkv, splits)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        y = cuda_kernels.decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, Hkv, splits)
    for p in (17, 3000, 4000):
        pos.fill_(p)
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            check(y, p)


def test_pdl_chain_of_dependent_kernels_equals_plain_launches(monkeypatch):
    """cuda_kernels.py launches with programmatic dependent launch on sm_90+: each GEMV loads its first
    weight block before it waits for the kernel that writes its input. A chain of GEMVs, each
    reading the one before's output (norm, SwiGLU and residual fused in, as in decode), with the
    attention kernel in between, gives bit for bit what plain launches give, eagerly and as replays
    of one captured graph."""
    import cuda_kernels

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
            qkv = cuda_kernels.gemv(h, wqkv[j], norm_weight=g, eps=1e-5)  # (H + 2 Hkv) Dh = 3 D / 2
            a = cuda_kernels.decode_attention(qkv, pos, cos, sin, k_cache, v_cache, counts, H, Hkv, 4)
            h = cuda_kernels.gemv(a, wo[j], residual=h)
            m = cuda_kernels.gemv(h, w13[j], norm_weight=g, eps=1e-5, swiglu=True)
            h = cuda_kernels.gemv(m, w2[j], residual=h)
        return h

    if torch.cuda.get_device_capability()[0] >= 9:
        assert cuda_kernels.pdl(x), "this GPU takes PDL: the suite should test it"
    monkeypatch.setattr(cuda_kernels, "PDL", False)
    plain = chain(x).clone()
    assert plain.isfinite().all()
    monkeypatch.setattr(cuda_kernels, "PDL", True)
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
