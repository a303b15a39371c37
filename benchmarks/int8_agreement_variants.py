"""Issue 5's greedy check for int8 variants that are not shipped: against the bf16 checkpoint run with float32
activations (as generate.py runs it on the CPU) and with bf16 activations, the 32-token greedy continuations of
benchmarks/greedy_agreement.py's 12 prompts (how many are equal, and which) and the teacher-forced next-token
argmax on the first 1,024 tokens of tests/data/eval_text.txt (the share equal). Variants: base (quantize.py's int8),
headf (the head left float32), mse (each row's scale the best of 31 clippings of its largest weight by squared
error), gptq (the block linears rounded column by column by GPTQ with quantize.calibrate's statistics on
tests/data/calibration_text.txt; per-row absmax scales), gptq-headf. Session 30, BENCHMARKS.md.

    python benchmarks/int8_agreement_variants.py [CHECKPOINT] -- base headf mse gptq gptq-headf
"""
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import quantize  # noqa: E402
from model import Transformer  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from generate import Generator, Sampling  # noqa: E402

args = sys.argv[1:]
ck = args[0] if args and args[0] != "--" else str(ROOT / "checkpoints" / "SmolLM2-135M-Instruct")
names = args[args.index("--") + 1:] if "--" in args else ["base"]
tok = load_tokenizer(ck)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "The three primary colors are", "Water boils at"]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
        "List three fruits.", "How do I reverse a list in Python?", "Who wrote Hamlet?", "What is 12 times 7?"]
ids_all = [tok.encode(p) for p in PROMPTS] + [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT]
text = open(ROOT / "tests" / "data" / "eval_text.txt").read()
tf_tokens = torch.tensor([tok.encode(text)[:1024]])
calib = tok.encode(open(ROOT / "tests" / "data" / "calibration_text.txt").read())

f32 = Transformer.from_checkpoint(ck, "cpu", torch.float32)
bf16 = Transformer.from_checkpoint(ck, "cpu", torch.bfloat16)

def greedy(model):
    g = Generator(model, Sampling(temperature=0))
    return [[t for c in g.generate([ids], 32) for t in c[0]] for ids in ids_all]

@torch.no_grad()
def tf_argmax(model):
    model.setup_caches(1, 1024)
    return model(tf_tokens, torch.arange(1024)).float().argmax(-1)[0]

ref = {"f32act": (greedy(f32), tf_argmax(f32)), "bf16act": (greedy(bf16), tf_argmax(bf16))}
print("bf16act vs f32act: greedy", sum(a == b for a, b in zip(ref["f32act"][0], ref["bf16act"][0])),
      "tf", (ref["f32act"][1] == ref["bf16act"][1]).float().mean().item(), flush=True)

orig_int8 = quantize.quantize_int8

def mse_int8(w):
    w = w.float()
    amax = w.abs().amax(dim=1).clamp(min=1e-12)
    best, best_err = None, None
    for c in torch.linspace(0.7, 1.0, 31):
        s = (c * amax / 127).to(quantize.SCALE_DTYPE).float()
        err = ((w / s[:, None]).round().clamp(-127, 127) * s[:, None] - w).pow(2).sum(1)
        if best is None:
            best, best_err = s.clone(), err
        else:
            m = err < best_err
            best[m], best_err[m] = s[m], err[m]
    q = (w / best[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, best.to(quantize.SCALE_DTYPE)

def gptq_int8(w, H, damp=0.01):
    N, K = w.shape
    W, H = w.double().clone(), H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1; W[:, dead] = 0
    H += damp * torch.diag(H).mean() * torch.eye(K, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    s = (w.float().abs().amax(1) / 127).clamp(min=1e-12).to(quantize.SCALE_DTYPE).double()
    q = torch.zeros(N, K, dtype=torch.int8)
    for j in range(K):
        qj = (W[:, j] / s).round().clamp(-127, 127)
        q[:, j] = qj.to(torch.int8)
        e = (W[:, j] - qj * s) / U[j, j]
        W[:, j + 1:] -= e[:, None] * U[j, j + 1:][None, :]
    return q, s.to(quantize.SCALE_DTYPE)

def variant(name):
    quantize.quantize_int8 = orig_int8
    if name == "mse":
        quantize.quantize_int8 = mse_int8
    if name.startswith("gptq"):
        H = quantize.calibrate(f32, calib)
        orig_qt = quantize.quantize_tensors
        def qt(tensors, mode, groupsize, tied, hessians=None):
            for name_, t in tensors:
                module, _, kind = name_.rpartition(".")
                if kind == "weight" and module.endswith(quantize.BLOCK_LINEARS) and name_ in H:
                    q, s = gptq_int8(t, H[name_])
                    yield name_, q; yield module + ".scales", s
                else:
                    yield from orig_qt(iter([(name_, t)]), mode, groupsize, tied, None)
        quantize.quantize_tensors = qt
        try:
            m = quantize.quantize_model(f32, "int8")
        finally:
            quantize.quantize_tensors = orig_qt
    else:
        m = quantize.quantize_model(f32, "int8")
    if name.endswith("headf"):
        m.output = f32.output
    quantize.quantize_int8 = orig_int8
    return m

for name in names:
    t = time.time()
    m = variant(name)
    g, a = greedy(m), tf_argmax(m)
    for r, (rg, ra) in ref.items():
        eq = [x == y for x, y in zip(g, rg)]
        print(f"{name:12s} vs {r}: greedy {sum(eq)}/12 {''.join('1' if e else '0' for e in eq)}  "
              f"tf {(a == ra).float().mean().item():.4f}", flush=True)
    print(f"  ({time.time() - t:.0f} s)", flush=True)
