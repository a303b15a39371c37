"""Greedy agreement over 32 tokens: int8 (quantized in memory) against the bf16 and the fp32 model, on
five raw and seven chat prompts (issue 5 asks for the int8 vs bf16 rate).

    python benchmarks/greedy_agreement.py [FLOAT32_CHECKPOINT]
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import Transformer  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from generate import Generator, Sampling  # noqa: E402
from quantize import quantize_model  # noqa: E402

ck = sys.argv[1] if len(sys.argv) > 1 else "checkpoints/SmolLM2-135M-Instruct"  # a float32 conversion
tok = load_tokenizer(ck)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "The three primary colors are", "Water boils at"]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
        "List three fruits.", "How do I reverse a list in Python?", "Who wrote Hamlet?", "What is 12 times 7?"]
f32 = Transformer.from_checkpoint(ck, "cpu", torch.float32)
bf16 = Transformer.from_checkpoint(ck, "cpu", torch.bfloat16)
int8 = quantize_model(f32, "int8")
def greedy(model, ids):
    g = Generator(model, Sampling(temperature=0))
    return [t for c in g.generate([ids], 32) for t in c[0]]
rows = []
for p in PROMPTS + CHAT:
    ids = tok.encode(p) if p in PROMPTS else tok.encode_chat([{"role": "user", "content": p}])
    t = time.time()
    a, b, c = greedy(bf16, ids), greedy(int8, ids), greedy(f32, ids)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    rows.append((p, a == b, first, c == b, c == a))
    print(f"{p[:40]:40s} int8==bf16 {a == b} (first diff {first})  int8==fp32 {c == b}  bf16==fp32 {c == a}  {time.time()-t:.0f}s", flush=True)
print("int8 == bf16:", sum(r[1] for r in rows), "/", len(rows), "; int8 == fp32:", sum(r[3] for r in rows), "; bf16 == fp32:", sum(r[4] for r in rows))
