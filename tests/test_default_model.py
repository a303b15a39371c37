"""The default model (SmolLM2-135M-Instruct), converted from its GGUF, against transformers'
own loading of the same GGUF file: logits, and greedy generation token for token."""
import pytest
import torch
import transformers

from generate import Generator, Sampling
from model import Transformer
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


@pytest.fixture(scope="module")
def ckpt(default_ckpt):
    return default_ckpt


@pytest.fixture(scope="module")
def hf_model(default_gguf):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate all 64 tokens, as ours does without stop ids
    return model


@pytest.fixture(scope="module")
def ours(ckpt):
    return Transformer.from_checkpoint(ckpt, device="cpu", dtype=torch.float32)


def test_logits_match_transformers_gguf_loader(ckpt, ours, hf_model):
    tok = load_tokenizer(ckpt)
    ids = tok.encode(TEXT)
    assert len(ids) >= 150
    idx = torch.tensor([ids[:150]])
    ours.setup_caches(1, 256)
    with torch.no_grad():
        ref = hf_model(idx).logits
        got = ours(idx, torch.arange(150))
    err = (got - ref).abs().max().item()
    assert err <= 1e-3, f"max abs logit difference {err:.3g}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_greedy_generation_matches_transformers(ckpt, ours, hf_model, compiled):
    tok = load_tokenizer(ckpt)
    gen = Generator(ours, Sampling(temperature=0), "compile" if compiled else "eager")
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                    pad_token_id=2)[0, len(ids):].tolist()
        got = [t for chunk in gen.generate([ids], 64) for t in chunk[0]]
        assert got == ref, f"{prompt!r}: first difference at {next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}"
