"""What the decode step would take without its attention kernel: an upper bound on what any faster or fused
attention could buy (timing only, the tokens are meaningless).

`python benchmarks/attention_bound.py [bench.py flags]` runs bench.py with model.Attention.fused_attention
replaced by views of its input: no kernel runs in its place (y is qkv's first H*D numbers, its int8 copy the
same bytes read as words and scales), so the step is every other kernel of the real one, back to back.
The cache is never written, so the outputs are garbage; only the time means anything.

`--floor` instead keeps a kernel in its place: cuda_kernels._attention_one_kernel in one slice at position 0, so it
waits for wqkv, ropes q and k, attends to the new token only, writes the cache at 0 and y in bf16 and int8:
the dependent chain of any separate attention kernel with none of its cached positions (one query head a KV
head only). Again the tokens are garbage.
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


def floor_attention(self, qkv, input_pos, rope_cos, rope_sin, out_group=0, block_l=0):
    cache = self.kv_cache
    return model.cuda_kernels.attention(qkv, model.torch.zeros_like(input_pos), rope_cos, rope_sin, cache.k_cache,
                                   cache.v_cache, cache.counts, self.n_heads, self.n_kv_heads, out_group=out_group,
                                   block_l=block_l)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--floor" in argv:
        argv.remove("--floor")
        model.Attention.fused_attention = floor_attention
        argv += ["--attention-splits", "1", "--attention-one", "1"]
    else:
        model.Attention.fused_attention = no_attention
    sys.exit(bench.main(argv))
