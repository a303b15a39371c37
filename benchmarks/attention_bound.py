"""What the decode step would take without its attention kernel: an upper bound on what any faster or fused
attention could buy (timing only, the tokens are meaningless).

`python benchmarks/attention_bound.py [bench.py flags]` runs bench.py with model.Attention.fused_attention
replaced by views of its input: no kernel runs in its place (y is qkv's first H*D numbers, its int8 copy the
same bytes read as words and scales), so the step is every other kernel of the real one, back to back.
The cache is never written, so the outputs are garbage; only the time means anything.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402
import model  # noqa: E402


def no_attention(self, qkv, input_pos, rope_cos, rope_sin, out_group=0, block_l=0):
    width = self.n_heads * self.head_dim
    y = qkv[..., :width]
    if not out_group:
        return y
    return y, qkv.reshape(-1).view(model.torch.int32)[:width // 4 + 4 * width // out_group]


if __name__ == "__main__":
    model.Attention.fused_attention = no_attention
    sys.exit(bench.main(sys.argv[1:]))
