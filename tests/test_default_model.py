"""The default model (SmolLM2-135M-Instruct), converted from its GGUF, against transformers'
own loading of the same GGUF file: logits, and greedy decoding token for token, eager and
compiled. Then its int4 form (quantize.load, alone and with gdkernels.apply) against transformers on
the same, dequantized, weights."""
import copy

import pytest
import torch
import transformers
from safetensors.torch import load_file

import gdkernels
import quantize
from common import Sampling, sample
from model import Transformer, read_config
from tokenizer import load_tokenizer

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
    "wine. Before his invention, books were copied by hand, a slow and expensive process that kept "
    "literacy the privilege of a few. Within fifty years of the first printed Bible, presses were at "
    "work in more than two hundred cities across Europe, and millions of volumes had been produced. "
    "Pamphlets spread news and arguments faster than any authority could answer them, scholars could "
    "compare identical copies of a text, and the standardisation of spelling and grammar followed. "
    "Historians still debate how much of the Reformation, the scientific revolution and the rise of "
    "the modern state can be traced to this one machine, but few doubt that it changed the way ideas "
    "travel."
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three uses of a CUDA graph:",
]
NEW_TOKENS = 40
GREEDY = Sampling(temperature=0)
REFERENCE = {}  # (id of a transformers model, prompt) -> its NEW_TOKENS greedy tokens


@pytest.fixture(scope="module")
def ckpt(default_ckpt):
    return default_ckpt


@pytest.fixture(scope="module")
def hf_model(default_gguf):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate all NEW_TOKENS tokens, as ours does without stop ids
    return model


@pytest.fixture(scope="module")
def ours(ckpt):
    return Transformer.from_checkpoint(ckpt, device="cpu", dtype=torch.float32)


def assert_logits_match(ckpt, ours, hf_model):
    """Logits of a 150-token prefill within 1e-3 of transformers'."""
    ids = load_tokenizer(ckpt).encode(TEXT)
    assert len(ids) >= 150
    idx = torch.tensor([ids[:150]])
    ours.setup_caches(1, 256)
    with torch.no_grad():
        ref = hf_model(idx).logits
        got = ours(idx, torch.arange(150))
    err = (got - ref).abs().max().item()
    assert err <= 1e-3, f"max abs logit difference {err:.3g}"


def test_logits_match_transformers_gguf_loader(ckpt, ours, hf_model):
    assert_logits_match(ckpt, ours, hf_model)


def decode_step(model: Transformer, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """token [1, 1] at position pos [1] -> the greedy next token [1, 1]: fixed shapes, one graph."""
    return sample(model(token, pos)[:, -1], GREEDY).view(1, 1)


def greedy_tokens(model: Transformer, ids: list[int], step) -> list[int]:
    """NEW_TOKENS greedy tokens after ids: the prompt in one call, then one step per token."""
    model.setup_caches(1, 256)
    with torch.no_grad():
        token = sample(model(torch.tensor([ids]), torch.arange(len(ids)))[:, -1], GREEDY).view(1, 1)
        out = [token.item()]
        for pos in range(len(ids), len(ids) + NEW_TOKENS - 1):
            token = step(model, token, torch.tensor([pos]))
            out.append(token.item())
    return out


def assert_greedy_matches(ckpt, ours, hf_model, compiled: bool):
    """NEW_TOKENS greedy tokens of ours equal transformers' generate on each of PROMPTS."""
    tok = load_tokenizer(ckpt)
    # (Inductor on the CPU hands loops over 512+ elements to OpenMP threads; decode's are tiny: as generate.py)
    step = torch.compile(decode_step, fullgraph=True, options={"cpp.min_chunk_size": 65536}) if compiled \
        else decode_step
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        if (id(hf_model), prompt) not in REFERENCE:  # (computed once per reference model and prompt)
            with torch.no_grad():
                REFERENCE[id(hf_model), prompt] = hf_model.generate(
                    torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                    pad_token_id=2)[0, len(ids):].tolist()
        ref = REFERENCE[id(hf_model), prompt]
        got = greedy_tokens(ours, ids, step)
        assert got == ref, f"{prompt!r}: first difference at {next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_greedy_generation_matches_transformers(ckpt, ours, hf_model, compiled):
    assert_greedy_matches(ckpt, ours, hf_model, compiled)


@pytest.fixture(scope="module")
def int4_ckpt(ckpt, tmp_path_factory):
    float_ckpt = tmp_path_factory.mktemp("int4") / ckpt.name  # (the int4 form is written next to it)
    float_ckpt.symlink_to(ckpt, target_is_directory=True)
    return quantize.prepare_default_int4(float_ckpt)


@pytest.fixture(scope="module")
def hf_int4(int4_ckpt, hf_model):
    """transformers' Llama with the int4 checkpoint's weights, dequantized to float32 (the int8
    head too, so untied): the very weights our int4 model multiplies by."""
    f = {k: v.float() if v.is_floating_point() else v for k, v in load_file(int4_ckpt / "model.safetensors").items()}

    def weight(name):
        if name + ".zeros" in f:
            return quantize.dequantize_int4(f[name + ".weight"], f[name + ".scales"], f[name + ".zeros"], 32)
        if name + ".scales" in f:
            return f[name + ".weight"] * f[name + ".scales"][:, None]  # (int8)
        return f[name + ".weight"]

    state = {"model.embed_tokens.weight": f["tok_embeddings.weight"], "model.norm.weight": f["norm.weight"],
             "lm_head.weight": weight("output")}
    hf_names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
                "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
    for i in range(hf_model.config.num_hidden_layers):
        for ours_name, theirs in hf_names.items():
            state[f"model.layers.{i}.{theirs}.weight"] = weight(f"layers.{i}.{ours_name}")
    config = copy.deepcopy(hf_model.config)
    config.tie_word_embeddings = False
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.load_state_dict(state, strict=True)
    model.generation_config.eos_token_id = None
    return model


def test_int4_default_logits_match_transformers_on_its_weights(int4_ckpt, hf_int4):
    """quantize.py's plain int4 and int8 layers (dequantize, then F.linear), on a 150-token prefill."""
    assert read_config(int4_ckpt)["quantization"] == {"mode": "int4", "groupsize": 32}
    model = quantize.load(int4_ckpt, device="cpu", dtype=torch.float32)
    assert_logits_match(int4_ckpt, model, hf_int4)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_int4_default_greedy_matches_transformers_on_its_weights(int4_ckpt, hf_int4, compiled):
    """What generate.py runs on the CPU: gdkernels.apply's matmuls (cpu.cpp where it builds), the step
    eager or compiled. (Its ahead-of-time step is held to the eager one in test_generate.py.)"""
    model = quantize.load(int4_ckpt, device="cpu", dtype=torch.float32)
    gdkernels.apply(model)
    assert_greedy_matches(int4_ckpt, model, hf_int4, compiled)


@pytest.mark.parametrize("conversation", [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2? Say it   twice.\n"}],
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, in French: déjà vu?"}],  # no system turn: the template adds one
], ids=["system-and-three-turns", "no-system"])
def test_chat_template_renders_and_tokenizes_as_transformers_does(default_ckpt, conversation):
    """The default model's chat template (from its GGUF) through tokenizer.py against transformers' own
    apply_chat_template over the same checkpoint directory: the text, and the ids."""
    from transformers import AutoTokenizer

    hf, ours = AutoTokenizer.from_pretrained(default_ckpt), load_tokenizer(default_ckpt)
    for prompt in (True, False):
        text = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(conversation, add_generation_prompt=prompt) == text
        ids = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=prompt)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        assert ours.encode_chat(conversation, add_generation_prompt=prompt) == ids


def test_perplexity_equals_transformers_on_the_same_windows(ckpt, ours, hf_model):
    """eval.perplexity on the shipped text against the same windows scored with transformers' model of the
    default GGUF: within float32 rounding (this replaces a bare 5 < ppl < 60)."""
    import math
    from pathlib import Path

    import torch.nn.functional as F

    from eval import perplexity

    text = (Path(__file__).parent / "data" / "eval_text.txt").read_text(encoding="utf-8")
    tokens = load_tokenizer(ckpt).encode(text)[:700]
    got = perplexity(ours, tokens, window=256, stride=192)
    ids, nll, scored = torch.tensor(tokens), 0.0, 1
    with torch.no_grad():
        for end in [*range(256, len(tokens), 192), len(tokens)]:
            begin = max(0, end - 256)
            logits = hf_model(ids[None, begin:end]).logits[0]
            nll += F.cross_entropy(logits[scored - 1 - begin:end - 1 - begin], ids[scored:end], reduction="sum").item()
            scored = end
    assert scored == len(tokens)
    assert got == pytest.approx(math.exp(nll / (len(tokens) - 1)), rel=1e-4)
    assert 5 < got < 60  # and it is a working model on ordinary English
