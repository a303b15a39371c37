"""tp.py, tensor parallelism: processes on the CPU (gloo), spawned here, give the logits and the greedy tokens
of one process: 2 for tiny random configs of each family, 3 for the default model (9 heads, 3 KV heads: not
divisible by 2); a model whose heads do not divide by the number of processes is one `error:` line."""
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from common import Sampling
from generate import Generator
from model import ModelArgs, Transformer
from quantize import load, quantize_checkpoint
from test_quantize import write_float_checkpoint

FAMILIES = {  # (tiny configs: MHA, GQA, Qwen2's q/k/v bias, Qwen3's q/k norm and head_dim, tied embeddings)
    "llama-mha": ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=96, intermediate_size=128, max_seq_len=64),
    "gqa": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, intermediate_size=96, max_seq_len=64),
    "qwen2-bias": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, intermediate_size=128,
                            max_seq_len=64, attention_bias=True),
    "qwen3-qknorm": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, vocab_size=96,
                              intermediate_size=128, max_seq_len=64, qk_norm=True),
    "tied": ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=96, intermediate_size=64,
                      max_seq_len=64, tie_embeddings=True),
}
PROMPT = [5, 17, 3, 42, 8, 9, 11]


def run_model(model: Transformer, mode: str = "eager"):
    """(prefill logits, 12 greedy tokens) of PROMPT."""
    device = model.tok_embeddings.weight.device
    model.setup_caches(1, 64)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT], device=device), torch.arange(len(PROMPT), device=device)).cpu()
    gen = Generator(model, Sampling(temperature=0), mode)
    return logits, [t for chunk in gen.generate([PROMPT], 12) for t in chunk[0]]


def worker(rank: int, n: int, port: int, checkpoints: list, out: str, device_type: str = "cpu"):
    import torch.distributed as dist

    import tp

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = tp.init(torch.device(device_type))
    mode = "graphs" if device_type == "cuda" else "eager"  # (CUDA: the all-reduces inside each step's graph)
    results = {str(c): run_model(tp.load(c, device, torch.float32)[0], mode) for c in checkpoints}
    # sampling without --seed: rank 0's seed, broadcast, so every rank draws the same tokens
    torch.manual_seed(rank)  # (different on each rank until the common seed)
    torch.manual_seed(tp.common_seed(None, torch.device("cpu")))
    gen = Generator(tp.load(checkpoints[0], "cpu", torch.float32)[0], Sampling(temperature=1.0, top_k=None), "eager")
    gen.model.setup_caches(1, 64)
    results["sampled"] = [t for chunk in gen.generate([PROMPT], 16) for t in chunk[0]]
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(n: int, checkpoints: list, root, device_type: str = "cpu") -> list[dict]:
    """Each checkpoint's results on each of n ranks."""
    sys.path.insert(0, os.path.dirname(__file__))  # (the spawned processes import this module by name)
    mp.spawn(worker, args=(n, free_port(), checkpoints, str(root / f"out{n}"), device_type), nprocs=n, join=True)
    return [torch.load(f"{root / f'out{n}'}.{r}") for r in range(n)]


def assert_ranks_equal_one_process(checkpoints, ranks):
    for c in checkpoints:
        logits, tokens = run_model(load(c, "cpu", torch.float32))
        for r in ranks:  # every rank holds the same result (the all-reduce), and it is one process's
            got_logits, got_tokens = r[str(c)]
            torch.testing.assert_close(got_logits, logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item())
            assert got_tokens == tokens, c.name


def test_two_ranks_give_one_process_logits_and_tokens_for_each_family(tmp_path):
    checkpoints = []
    for name, args in FAMILIES.items():
        write_float_checkpoint(tmp_path / name, args)
        checkpoints.append(tmp_path / name)
    # quantized: int8's per-row scales go with the rows; int4's scales and zeros with their groups of 32
    checkpoints += [quantize_checkpoint(tmp_path / "qwen2-bias", "int8"),
                    quantize_checkpoint(tmp_path / "qwen2-bias", "int4", 32)]
    ranks = spawn(2, checkpoints, tmp_path)
    assert_ranks_equal_one_process(checkpoints, ranks)
    assert ranks[0]["sampled"] == ranks[1]["sampled"] and len(set(ranks[0]["sampled"])) > 3


def test_three_ranks_give_the_default_models_logits_and_tokens(default_ckpt, tmp_path):
    assert_ranks_equal_one_process([default_ckpt], spawn(3, [default_ckpt], tmp_path))


def test_int4_groups_cut_by_the_split_are_an_error(tmp_path, monkeypatch):
    """wo's 64 input columns split in 2 are 32 a rank: not a whole number of groups of 64."""
    import tp
    from common import UsageError

    write_float_checkpoint(tmp_path / "f", FAMILIES["qwen2-bias"])
    q = quantize_checkpoint(tmp_path / "f", "int4", 64)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="splits wo and w2 into 32 input columns, not a whole number of int4 groups of 64"):
        tp.load(q, "cpu", torch.float32)


def test_heads_that_do_not_divide_are_one_error_line(tmp_path, monkeypatch, capsys):
    """Checked before the process group is joined: no rank waits for the others to fail."""
    import generate

    write_float_checkpoint(tmp_path / "odd", ModelArgs(dim=48, n_layers=1, n_heads=3, vocab_size=96,
                                                       intermediate_size=64, max_seq_len=64))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert generate.main(["--checkpoint", str(tmp_path / "odd"), "--device", "cpu", "--prompt", "Hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "needs n_heads (3)" in err and "divisible by 2" in err, err
    # and without --checkpoint: the ranks would all prepare the default model at once
    assert generate.main(["--device", "cpu", "--prompt", "Hi"]) == 1
    assert "under torchrun: a --checkpoint and a --prompt" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_graphed_give_one_process_tokens(tmp_path):
    """NCCL on 2 GPUs, decode as CUDA graphs with the all-reduces captured inside: one process's tokens."""
    checkpoints = []
    for name in ("gqa", "qwen3-qknorm"):
        write_float_checkpoint(tmp_path / name, FAMILIES[name])
        checkpoints.append(tmp_path / name)
    ranks = spawn(2, checkpoints, tmp_path, "cuda")
    for c in checkpoints:
        logits, tokens = run_model(load(c, "cpu", torch.float32))
        for r in ranks:
            torch.testing.assert_close(r[str(c)][0], logits, rtol=1e-3, atol=1e-3 * logits.abs().max().item())
            assert r[str(c)][1] == tokens, c.name
