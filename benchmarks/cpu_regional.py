"""CPU decode compiled two ways: the whole step (generate.py's mode "compile") or each transformer
block on its own ("regional": Dynamo traces one block and every layer reuses it). Prints the first
calls' time (compile; prefill included) and decode tok/s over 128 greedy tokens.

    TORCHINDUCTOR_CACHE_DIR=DIR python benchmarks/cpu_regional.py CHECKPOINT regional|full
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from generate import Generator, Sampling, prefill  # noqa: E402
from model import Transformer  # noqa: E402

ck = sys.argv[1]; variant = sys.argv[2]
model = Transformer.from_checkpoint(ck, "cpu", torch.float32)
opts = {"cpp.min_chunk_size": 65536}
if variant == "regional":
    for layer in model.layers:
        layer.compile(options=opts)
    gen = Generator(model, Sampling(temperature=0), "eager")
else:
    gen = Generator(model, Sampling(temperature=0), "compile")
token, pos, tokens = gen.reserve(1, 8 + 160)
prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 5]])
with torch.no_grad():
    t = time.perf_counter()
    first = prefill(model, prompt, gen.sampling)
    token[:, 0] = first; pos.fill_(8)
    for _ in range(3):
        gen._decode_step(token, pos, tokens)
    warm = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(128):
        gen._decode_step(token, pos, tokens)
    dt = time.perf_counter() - t
print(f"{variant}: first calls {warm:.1f} s, decode {128/dt:.1f} tok/s", flush=True)
