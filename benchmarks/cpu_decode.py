"""CPU decode variants of the default model, one per process (BENCHMARKS.md, CPU):

    python benchmarks/cpu_decode.py VARIANT

VARIANT names what to combine: fp32 | int8 | int4 (g32), and optionally head4 (int4 output head
instead of int8), chunk (Inductor cpp.min_chunk_size=65536, generate.py's setting; without it
Inductor's default 512), cppwrap (cpp_wrapper), noguard (the timed runs under
torch.compiler.set_stance(skip_guard_eval_unsafe=True)), eager (no compile). Prints the warm-up time (compile) and three timings of 128 greedy tokens, prefill
included; the first can include a recompile for the longer buffers; the second and third are the
figures (for noguard: without and with the stance).
Needs checkpoints/SmolLM2-135M-Instruct (python generate.py prepares it).
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from generate import Generator, Sampling  # noqa: E402
from model import Transformer  # noqa: E402
from quantize import quantize_model  # noqa: E402

torch.manual_seed(0)
variant = sys.argv[1]
model = Transformer.from_checkpoint("checkpoints/SmolLM2-135M-Instruct", "cpu", torch.float32)
head = model.tok_embeddings.weight  # the tied head, in float
if "int4" in variant:
    model = quantize_model(model, "int4", 32)
elif "int8" in variant:
    model = quantize_model(model, "int8", None)
if "head4" in variant:
    from model import Int4Linear
    from quantize import quantize_int4
    q, sc, z = quantize_int4(head, 32)
    model.output = Int4Linear(head.shape[1], head.shape[0], 32)
    model.output.load_state_dict({"weight": q, "scales": sc.float(), "zeros": z.float()}, assign=True)
gen = Generator(model, Sampling(temperature=0.0), mode="eager" if "eager" in variant else "compile")
if "eager" not in variant:  # generate.py's CPU compile options, or Inductor's defaults without "chunk"
    from generate import decode_one_token
    options = {"cpp.min_chunk_size": 65536 if "chunk" in variant else 512}
    if "cppwrap" in variant:
        options["cpp_wrapper"] = True
    gen.step = torch.compile(decode_one_token, fullgraph=True, options=options)
prompt = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]]
t = time.time(); out = [c for c in gen.generate(prompt, 16)]; print(variant, "warm-up 16 tokens", round(time.time() - t, 1), "s", flush=True)
for i in range(3):  # the last run under the stance for "noguard"
    stance = torch.compiler.set_stance(skip_guard_eval_unsafe=i == 2 and "noguard" in variant)
    with stance:
        t = time.time(); n = sum(len(c[0]) for c in gen.generate(prompt, 128)); dt = time.time() - t
    print(variant, f"{n / dt:.1f} tok/s incl. prefill", flush=True)
