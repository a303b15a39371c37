"""Perplexity of a checkpoint on a text file: the standard strided sliding-window evaluation (see perplexity).

The text is tokenized whole (BOS first when the tokenizer adds one). Used to check what quantize.py costs.
"""
import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from common import DTYPES, UsageError, default_device, default_dtype
from model import Transformer, read_config
from quantize import load
from tokenizer import load_tokenizer


@torch.no_grad()
def perplexity(model: Transformer, tokens: list[int], window: int = 512, stride: int = 256) -> float:
    """exp(mean NLL) of tokens[1:] under the model, by windows of `window` tokens whose ends are `stride` apart, each
    scoring the tokens after the previous window's end: every token but the first is scored once, with at least
    window - stride tokens of left context after the first window (1 <= stride < window)."""
    if not 1 <= stride < window:
        raise ValueError(f"need 1 <= stride < window (got stride {stride}, window {window})")
    if len(tokens) < 2:
        raise ValueError("the text has fewer than 2 tokens")
    model.setup_caches(max_batch_size=1, max_seq_length=min(window, len(tokens)))
    ids = torch.tensor(tokens, device=model.tok_embeddings.weight.device)
    nll, scored = 0.0, 1  # tokens[:scored] are done; token 0 has no context
    for end in [*range(window, len(tokens), stride), len(tokens)]:
        begin = max(0, end - window)
        logits = model(ids[None, begin:end], torch.arange(end - begin, device=ids.device))[0]  # [L, V]
        pred = logits[scored - 1 - begin:end - 1 - begin].float()  # logits[i] predicts token begin + i + 1
        nll += F.cross_entropy(pred, ids[scored:end], reduction="sum").item()
        scored = end
    return math.exp(nll / (len(tokens) - 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory (float or quantized)")
    p.add_argument("--text", type=Path, required=True, help="UTF-8 text file")
    p.add_argument("--window", type=int, default=512, help="most tokens in one forward (default 512)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window ends, < window (default window/2)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    args = p.parse_args(argv)
    stride = args.stride if args.stride is not None else max(1, args.window // 2)
    try:
        device = default_device(args.device)
        dtype = default_dtype(args.dtype, device)
        if not 1 <= stride < args.window:
            raise ValueError(f"need 1 <= --stride < --window (got --stride {stride}, --window {args.window})")
        read_config(args.checkpoint)  # a missing or broken checkpoint says so before anything loads
        try:
            text = args.text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{args.text}: cannot read the text ({e})") from None
        tokens = load_tokenizer(args.checkpoint).encode(text)
        model = load(args.checkpoint, device=device, dtype=dtype)
        if args.window > model.args.max_seq_len:
            raise ValueError(f"--window {args.window} exceeds the model's context of {model.args.max_seq_len}")
        ppl = perplexity(model, tokens, args.window, stride)
    except (ValueError, FileNotFoundError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"perplexity {ppl:.4f} ({len(tokens) - 1} tokens scored, window {args.window}, stride {stride}, "
          f"{args.checkpoint})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
