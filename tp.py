"""Tensor parallelism on torch.distributed: one model across the N processes of

    torchrun --nproc-per-node N generate.py ...        (NCCL on CUDA, one GPU a process; gloo on the CPU)

Each rank builds the plain model.py Transformer with its share of the heads and of the feed-forward width
(local_args: ModelArgs divided by N), so every shape, the KV cache included, is the rank's own:
  wq, wk, wv   split by output rows: whole heads, K/V heads too (each rank caches its heads' keys and values)
  w1, w3       split by output rows
  wo, w2       split by input columns, then summed over the ranks (all_reducing: an all-reduce)
  the rest     (embedding, norms, head) replicated
Weights are read per rank from the safetensors file's slices: no rank holds the whole model. The all-reduce
leaves every rank the same logits, and every rank samples with the same seed, so all pick the same token.
It is a functional collective (torch.distributed._functional_collectives): torch.compile traces it, and on
CUDA it is captured in the decode step's graph with the rest (NCCL supports capture).
"""
import functools
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from common import UsageError
from model import ModelArgs, Transformer, read_config


def world() -> tuple[int, int]:
    """(rank, number of processes) as torchrun sets them; (0, 1) without torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init(device: torch.device) -> torch.device:
    """Join the process group (once); on CUDA each rank takes the GPU of its local rank. Returns the device."""
    rank, n = world()
    if n > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if n > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def local_args(args: ModelArgs, n: int) -> ModelArgs:
    """The config of one rank's share; an error unless the heads and the feed-forward width divide by n."""
    if args.n_experts:
        raise UsageError("tensor parallel does not split mixtures of experts")
    if args.n_heads % n or args.n_kv_heads % n or args.intermediate_size % n:
        raise UsageError(f"tensor parallel over {n} processes needs n_heads ({args.n_heads}), n_kv_heads "
                         f"({args.n_kv_heads}) and intermediate_size ({args.intermediate_size}) divisible by {n}")
    return replace(args, n_heads=args.n_heads // n, n_kv_heads=args.n_kv_heads // n,
                   intermediate_size=args.intermediate_size // n, head_dim=args.head_dim)


@functools.cache
def all_reducing(cls: type) -> type:
    """cls (nn.Linear, a quantized linear, or a kernel's) whose output is summed over the ranks: for a layer
    split by input columns, each rank's partial product becomes the whole one."""
    def forward(self, x):
        return funcol.all_reduce(cls.forward(self, x), "sum", dist.group.WORLD)

    return type(f"AllReduce{cls.__name__}", (cls,), {"forward": forward, "__doc__": all_reducing.__doc__})


ROWS = (".attention.wq.", ".attention.wk.", ".attention.wv.", ".feed_forward.w1.", ".feed_forward.w3.")
COLUMNS = (".attention.wo.", ".feed_forward.w2.")


def shard(name: str, tensor_slice, rank: int, n: int) -> torch.Tensor:
    """Rank's part of one tensor of the checkpoint, read from its safetensors slice."""
    shape = tensor_slice.get_shape()
    if any(p in name for p in ROWS):
        part = shape[0] // n
        return tensor_slice[rank * part:(rank + 1) * part]
    if any(p in name for p in COLUMNS) and len(shape) == 2:  # weights; int4's scales and zeros by group too
        part = shape[1] // n
        return tensor_slice[:, rank * part:(rank + 1) * part]
    return tensor_slice[:]


def load(path, device, dtype=torch.bfloat16, kernels: bool = False, compiled: bool | None = None
         ) -> tuple[Transformer, list[str]]:
    """This rank's share of the checkpoint at `path` (float, int8, or int4 whose split falls on group
    boundaries), split as the module docstring says, and what gdkernels.apply swapped when `kernels`
    (fuse=False: a fused residual would be summed N times; compiled: apply's)."""
    from quantize import check_quantization, load as load_checkpoint

    rank, n = world()
    config = read_config(Path(path))
    local, quantization = local_args(config["args"], n), config.get("quantization")
    if quantization:
        mode, groupsize = check_quantization(quantization)
        for width in (local.n_heads * local.head_dim, local.intermediate_size):  # wo's and w2's input columns
            if mode == "int4" and width % groupsize:
                raise UsageError(f"tensor parallel over {n} processes splits wo and w2 into {width} input columns, "
                                 f"not a whole number of int4 groups of {groupsize}")
    # (from_checkpoint's load hook fuses the rank's q, k, v and w1, w3)
    model = load_checkpoint(path, device, dtype, split=(lambda args: local_args(args, n),
                                                       lambda name, tensor_slice: shard(name, tensor_slice, rank, n)))
    swapped = []
    if kernels:
        import gdkernels

        swapped = gdkernels.apply(model, fuse=False, compiled=compiled)
    return reduce_outputs(model), swapped


def reduce_outputs(model: Transformer) -> Transformer:
    """Sum wo's and w2's partial products over the ranks (their classes become all_reducing ones, weights kept)."""
    for layer in model.layers:
        for m in (layer.attention.wo, layer.feed_forward.w2):
            m.__class__ = all_reducing(type(m))
    return model


def say(*args, file=None, end: str = "\n") -> None:  # print(), flushed, from rank 0 only: once, not once a rank
    if world()[0] == 0:
        print(*args, file=file, end=end, flush=True)


def common_seed(seed: int | None, device: torch.device) -> int:
    """A seed every rank shares: the given one, or rank 0's random draw, broadcast."""
    if seed is None:
        pick = torch.randint(0, 2**62, (1,), device=device)  # (NCCL broadcasts GPU tensors, gloo CPU ones)
        dist.broadcast(pick, src=0)
        seed = int(pick.item())
    return seed


def join(args: ModelArgs, device: torch.device, seed: int | None = None) -> torch.device:
    """A CLI's start under torchrun: check that the model splits (an error before any rank waits for the others),
    join the process group, seed the ranks alike -> this rank's device. (Rank 0 speaks for all: say.)"""
    local_args(args, world()[1])
    device = init(device)
    torch.manual_seed(common_seed(seed, device))
    return device
