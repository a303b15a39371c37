"""Mixtures of experts (model.MoEFeedForward; Mixtral and Qwen3-MoE, whose logits tests/test_convert_hf.py checks
against transformers'): greedy tokens through generate.py against transformers' greedy, eager and compiled;
int8 experts (quantize.py) within their measured error; the serving engine and speculative decoding unchanged;
a GGUF file's stacked experts (written with gguf-py) against the same model converted from safetensors."""
import numpy as np
import pytest
import torch

import convert_hf_checkpoint as conv
from common import Sampling, weight_bytes_per_step
from generate import Generator
from model import MoEFeedForward, Transformer
from quantize import Int8Experts, Int8Linear, load, quantize_checkpoint, quantize_model
from serve import LLM, SamplingParams
from speculative import SpeculativeGenerator
from test_convert_hf import make_hf_model, save

GREEDY = Sampling(temperature=0)
VOCAB = 268  # test_gguf.py's tiny tokenizer's


@pytest.fixture(scope="module", params=["mixtral_moe", "qwen3_moe"])
def moe(request, tmp_path_factory):
    """(transformers' model, our float32 checkpoint of it, converted from shards that split a layer's experts):
    8 experts, 2 a token."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, seed=3, vocab_size=VOCAB)
    src = save(hf, path / "hf", max_shard_size="40KB")
    assert len(list(src.glob("*.safetensors"))) > 4
    return hf, conv.convert(str(src), path / "ours", dtype="fp32")


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


def greedy(model, prompt, n, mode="eager") -> list[int]:
    return [t for chunk in Generator(model, GREEDY, mode).generate([prompt], n) for t in chunk[0]]


PROMPT = [5, 17, 99, 3, 250, 42, 7, 17, 99, 3]


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_greedy_tokens_equal_transformers(moe, mode):
    hf, ckpt = moe
    model = Transformer.from_checkpoint(ckpt, "cpu", torch.float32)
    assert isinstance(model.layers[0].feed_forward, MoEFeedForward)
    assert greedy(model, PROMPT, 24, mode) == hf_greedy(hf, PROMPT, 24)  # (compile: fullgraph, no data shapes)


def test_a_step_reads_the_gathered_experts_or_all_of_them(moe, monkeypatch):
    model = Transformer.from_checkpoint(moe[1], "cpu", torch.float32)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith(("w1", "w2", "w3")))
    dense = weight_bytes_per_step(model, 4)  # 4 rows x 2 experts: all 8 read
    assert dense - weight_bytes_per_step(model, 1) == experts * 6 // 8 and weight_bytes_per_step(model, 9) == dense
    gathered = []  # what the model does at 3 rows (6 experts gathered) and at 4 (all 8), as counted above
    monkeypatch.setattr(MoEFeedForward, "experts", lambda self, name, index: gathered.append(index is not None) or
                        getattr(self, name)[index])
    model.setup_caches(4, 16)
    for rows in (3, 4):
        gathered.clear()
        model(torch.zeros(rows, 1, dtype=torch.long), torch.zeros(rows, 1, dtype=torch.long))
        assert set(gathered) == {rows == 3}


def test_what_cannot_be_converted_or_split_is_one_error(moe, tmp_path):
    import json
    import shutil

    from common import ConversionError, UsageError
    from tp import local_args
    src = shutil.copytree(moe[1].parent / "hf", tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    for edit, message in (({"num_experts_per_tok": 9}, "n_active_experts"), ({"mlp_only_layers": [0]}, "dense layers")):
        (src / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ConversionError, match=message):
            conv.convert(str(src), tmp_path / "out", dtype="fp32")
        assert not (tmp_path / "out").exists()
    with pytest.raises(UsageError, match="mixtures of experts"):
        local_args(Transformer.from_checkpoint(moe[1], "meta").args, 2)


def test_int8_experts_are_close_to_float(moe, tmp_path):
    _, ckpt = moe
    float_model = Transformer.from_checkpoint(ckpt, "cpu", torch.float32)
    for mode, groupsize in (("int8", None), ("int4", 32)):
        q = load(quantize_checkpoint(ckpt, mode, groupsize, tmp_path / mode), "cpu", torch.float32)
        ffn = q.layers[1].feed_forward
        assert type(ffn) is Int8Experts and ffn.w1.dtype == torch.int8 and ffn.w2_scales.shape == (8, 64)
        assert type(ffn.gate) is torch.nn.Linear and type(q.output) is Int8Linear
        idx = torch.tensor([PROMPT * 3])
        for m in (float_model, q):
            m.setup_caches(1, 64)
        ref, got = (m(idx, torch.arange(idx.shape[1])) for m in (float_model, q))
        # Per token (a perturbed router may pick another expert for a token: 1 of 30 here, 0.2 off): measured
        # medians 0.015 (int8, both families), 0.12-0.17 (int4 g32 attention, Gaussian weights); 2x that.
        per_token = ((got - ref).norm(dim=-1) / ref.norm(dim=-1))[0]
        assert per_token.median() < (0.03 if mode == "int8" else 0.35), per_token


def test_engine_and_speculative_decoding_are_unchanged(moe):
    _, ckpt = moe
    model = Transformer.from_checkpoint(ckpt, "cpu", torch.float32)
    prompts = [PROMPT, PROMPT[3:], [1, 2, 3, 1, 2, 3, 1, 2], PROMPT[::-1], [200] * 5]
    ref = [greedy(model, p, 12) for p in prompts]
    llm = LLM(model=model, max_batch=3, max_length=64, steps=2, prefill_budget=16)
    reqs = [llm.make_request(p, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)) for p in prompts]
    llm.run(reqs)
    assert [r.out for r in reqs] == ref
    draft = quantize_model(model, "int8")  # (its experts int8 too)
    for k, d in ((2, None), (4, None), (3, draft)):  # drafts from the context or a draft model, verified by the
        gen = SpeculativeGenerator(model, d, GREEDY, k)  # MoE target in one forward of K + 1 tokens
        assert [t for c in gen.generate(prompts[2], 12) for t in c] == ref[2]


def test_gguf_stacked_experts_equal_the_safetensors_conversion(moe, tmp_path):
    pytest.importorskip("gguf", reason="gguf is in requirements.txt; the GPU machine's image lacks it")
    from test_gguf import QT, write_tiny_gguf

    from convert_gguf import read_gguf
    hf, ckpt = moe
    ours = {k: v for k, v in Transformer.from_checkpoint(ckpt, "cpu", torch.float32).state_dict().items()}
    c = hf.config
    names = {"attention_norm": "attn_norm", "ffn_norm": "ffn_norm", "feed_forward.gate": "ffn_gate_inp",
             "feed_forward.w1": "ffn_gate_exps", "feed_forward.w3": "ffn_up_exps", "feed_forward.w2": "ffn_down_exps",
             "attention.wo": "attn_output", "attention.q_norm": "attn_q_norm", "attention.k_norm": "attn_k_norm"}
    tensors = {"token_embd.weight": ours["tok_embeddings.weight"], "output_norm.weight": ours["norm.weight"],
               "output.weight": ours["output.weight"]}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        wq, wk, wv = ours[p + "attention.wqkv.weight"].split([64, 32, 32] if "qwen" not in c.model_type else
                                                               [96, 48, 48])
        tensors.update({f"blk.{i}.attn_{n}.weight": w for n, w in zip("qkv", (wq, wk, wv))})
        for stem, theirs in names.items():
            key = p + stem if p + stem in ours else p + stem + ".weight"
            if key in ours:
                tensors[f"blk.{i}.{theirs}.weight"] = ours[key]
    arch = "qwen3moe" if c.model_type == "qwen3_moe" else "llama"
    if arch == "llama":  # llama.cpp permutes Q and K rows for the llama arch (convert_gguf.unpermute_qk)
        from test_gguf import llama_cpp_permute
        for i in range(c.num_hidden_layers):
            for n, heads in (("q", 4), ("k", 2)):
                t = tensors[f"blk.{i}.attn_{n}.weight"]
                tensors[f"blk.{i}.attn_{n}.weight"] = torch.from_numpy(llama_cpp_permute(t.numpy(), 4, heads))
    head_dim = getattr(c, "head_dim", None) or 16
    expert_size = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    path = tmp_path / "moe.gguf"
    write_tiny_gguf(path, {"arch": arch, "head_dim": head_dim, "ffn": c.intermediate_size, "eps": c.rms_norm_eps,
                           "theta": c.rope_parameters["rope_theta"], "ctx": 128}, weights={}, extra_kv={
        f"{arch}.expert_count": ("uint32", 8), f"{arch}.expert_used_count": ("uint32", 2),
        f"{arch}.expert_feed_forward_length": ("uint32", expert_size),
        f"{arch}.expert_weights_norm": ("bool", bool(getattr(c, "norm_topk_prob", True)))},
        extra_tensors={n: (t.numpy().astype(np.float32), QT.F32) for n, t in tensors.items()})
    src = read_gguf(path)
    assert {k: src.model_args[k] for k in ("n_experts", "n_active_experts", "expert_size", "norm_topk")} == \
        {k: getattr(Transformer.from_checkpoint(ckpt, "cpu").args, k)
         for k in ("n_experts", "n_active_experts", "expert_size", "norm_topk")}
    out = conv.convert(str(path), tmp_path / "from-gguf", dtype="fp32")
    got = Transformer.from_checkpoint(out, "cpu", torch.float32).state_dict()
    assert got.keys() == ours.keys()
    for k in ours:
        assert torch.equal(got[k], ours[k]), k
