"""Read a GGUF file (llama.cpp's format) into graphdecode's checkpoint format.

    from convert_gguf import ConversionError, read_gguf
    src = read_gguf(path)          # ConversionError (one line) on any bad input
    src.model_args                 # dict of ModelArgs fields
    for name, tensor in src.tensors():   # our names, torch.float32, one at a time
        ...
    src.tokenizer_files()          # {"tokenizer.json": bytes, "tokenizer_config.json": ..., "generation_config.json": ...}
    src.description                # "gguf:FILE (arch, file type)"

Weights stay in the memory-mapped file and are dequantized one tensor at a time with
gguf-py (`gguf.quants.dequantize`). Supported architectures: llama (Llama 2/3, Mistral,
SmolLM2, TinyLlama), qwen2 and qwen3. The embedded vocabulary is rebuilt as a Hugging Face
`tokenizer.json` with the pre-tokenizer that `tokenizer.ggml.pre` names.
"""
from __future__ import annotations

import importlib
import json
import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch


class ConversionError(Exception):
    """A problem with the input, reported as one line by the CLI."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

# GGUF token types (gguf.TokenType)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, as in the original tokenizer.json files (llama.cpp's llama-vocab.cpp
# uses the same expressions, rewritten without the (?i:) group).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                   r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# tokenizer.ggml.pre value -> pre-tokenizer kind (byte-level BPE vocabularies only).
_PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "qwen2": "qwen2",
    "smollm": "smollm",
}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_gguf():
    try:
        import gguf  # noqa: F401
        import gguf.quants  # noqa: F401
    except ImportError as e:
        raise ConversionError(f"reading GGUF files needs the gguf package (pip install gguf): {e}") from None
    return gguf


def _strict_reader_class(gguf_mod):
    """gguf-py's GGUFReader, made to fail on any read past the end of the file (and faster).

    The stock reader slices its memory map, so a read past EOF silently yields a short (or
    empty) array: a truncated file may then fail late with an odd error, and a corrupt array
    length can make it loop for a very long time over empty reads. Slicing a plain ndarray view
    of the map (still memory-mapped, nothing is copied) also skips np.memmap's per-slice
    overhead, which dominates parsing a 100k-entry vocabulary.
    """

    class StrictGGUFReader(gguf_mod.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            buf = self.__dict__.get("_buf")
            if buf is None or buf.base is not self.data:
                buf = self._buf = self.data.view(np.ndarray)
            offset, count, dtype = int(offset), int(count), np.dtype(dtype)
            end = offset + dtype.itemsize * count
            if offset < 0 or count < 0 or end > buf.shape[0]:
                raise ValueError(f"unexpected end of file (a read of {end - offset} bytes at offset {offset} "
                                 f"passes the end, {buf.shape[0]} bytes)")
            arr = buf[offset:end].view(dtype=dtype)
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return StrictGGUFReader


# ---------------------------------------------------------------------------------------------
# Q/K row permutation


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a `llama`-arch Q or K projection (weight or bias).

    Why: Hugging Face Llama checkpoints apply RoPE in the "rotate-half" layout (within each head,
    rows [0, d/2) are the first element of each rotated pair and rows [d/2, d) the second).
    llama.cpp's "normal" RoPE for the llama arch rotates *adjacent* rows (Meta's original
    interleaved layout), so convert_hf_to_gguf.py (LlamaModel.permute) reorders each head's rows:

        w.reshape(n_heads, 2, d // 2, *rest).swapaxes(1, 2).reshape(w.shape)

    i.e. GGUF row 2*j + h of a head is HF row h * d/2 + j. This is its exact inverse. For K,
    llama.cpp passes n_kv_heads, so `n_heads` must be the number of KV heads there. qwen2/qwen3
    use NEOX-style RoPE in llama.cpp, which matches HF's layout, so they are stored unpermuted.
    """
    rows = w.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads) != 0:
        raise ConversionError(f"cannot un-permute {rows} rows into {n_heads} heads")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Llama 3 RoPE scaling, stored by llama.cpp as per-frequency factors (rope_freqs.weight)


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """The divisors of the RoPE inverse frequencies that Llama 3 scaling uses (llama.cpp's rope_freqs)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    old = original_max_position_embeddings
    low_wavelen, high_wavelen = old / low_freq_factor, old / high_freq_factor
    out = np.empty_like(freqs)
    for i, wl in enumerate(wavelen):
        if wl < high_wavelen:
            out[i] = 1.0
        elif wl > low_wavelen:
            out[i] = factor
        else:
            smooth = (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out[i] = 1.0 / ((1 - smooth) / factor + smooth)
    return out


def _rope_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Recover Llama 3 rope_scaling parameters that reproduce the stored factors exactly, or fail.

    Only ratios are determined by the factors (scaling original_max_position_embeddings,
    low_freq_factor and high_freq_factor together changes nothing), so the original context is
    fixed at Llama 3's 8192 and the two thresholds are fitted from the smooth band; the result is
    accepted only when it recomputes the stored factors.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2 or not np.all(np.isfinite(factors)):
        raise ConversionError(f"rope_freqs.weight has {factors.shape[0]} values, expected {head_dim // 2}")
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    old = 8192
    factor = float(factors.max())
    candidates = [(1.0, 4.0)]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    inv_wavelen = freqs / (2 * math.pi)
    smooth_band = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor > 1 and smooth_band.sum() >= 2:
        # 1/r = (1 - s)/factor + s  =>  s = (1/r - 1/factor) / (1 - 1/factor);  s = old/wl*a' + b'
        s = (1 / factors[smooth_band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelen[smooth_band], s, 1)
        if slope > 0:
            width = old / slope  # high_freq_factor - low_freq_factor
            low = -intercept * width
            candidates.append((float(f"{low:.6g}"), float(f"{low + width:.6g}")))
    for low, high in candidates:
        if not 0 < low < high:
            continue
        expect = llama3_rope_factors(head_dim, theta, factor, low, high, old)
        if np.allclose(expect, factors, rtol=1e-4, atol=1e-6):
            return {"factor": float(f"{factor:.6g}"), "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": old}
    raise ConversionError("rope_freqs.weight holds RoPE frequency factors that do not follow Llama 3 "
                          "rope scaling; this kind of RoPE scaling is not supported yet")


# ---------------------------------------------------------------------------------------------
# the source object


class GGUFSource:
    """A parsed GGUF file: metadata mapped to ModelArgs, tensors dequantized lazily."""

    def __init__(self, path: Path, reader, gguf_mod):
        self.path = path
        self._reader = reader
        self._gguf = gguf_mod
        self._tokenizer_cache: dict[str, bytes] | None = None

        if getattr(reader, "byte_order", "I") != "I":
            raise ConversionError(f"{path.name}: big-endian GGUF files are not supported")
        arch = self._str("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ConversionError(f"{path.name}: unsupported architecture {arch!r} "
                                  f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        self.arch = arch
        self._tensors = {t.name: t for t in reader.tensors}
        self.model_args = self._model_args()
        self._plan = self._tensor_plan()
        self._check_tensor_types()
        self._tokenizer_meta = self._tokenizer_metadata()
        self.description = f"gguf:{path.name} ({arch}, {self._file_type()})"

    # -- metadata helpers --------------------------------------------------------------------

    def _value(self, key: str, required: bool = True, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if required:
                raise ConversionError(f"{self.path.name}: missing required metadata {key}")
            return default
        try:
            return field.contents()
        except Exception as e:  # corrupt string/array contents
            raise ConversionError(f"{self.path.name}: bad metadata {key} ({_one_line(e)})") from None

    def _str(self, key: str, required: bool = True, default: str | None = None) -> str | None:
        v = self._value(key, required, default)
        if v is not None and not isinstance(v, str):
            raise ConversionError(f"{self.path.name}: metadata {key} should be a string, got {v!r:.60}")
        return v

    def _int(self, key: str, required: bool = True, default: int | None = None) -> int | None:
        v = self._value(key, required, default)
        if isinstance(v, list):  # per-layer arrays (e.g. head_count): accept only uniform ones
            if not v or len(set(v)) != 1:
                raise ConversionError(f"{self.path.name}: metadata {key} varies per layer; not supported")
            v = v[0]
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ConversionError(f"{self.path.name}: metadata {key} should be a non-negative integer, got {v!r:.60}")
        return int(v)

    def _float(self, key: str, required: bool = True, default: float | None = None) -> float | None:
        v = self._value(key, required, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
            raise ConversionError(f"{self.path.name}: metadata {key} should be a number, got {v!r:.60}")
        # stored as float32: give the shortest decimal that round-trips (1e-05, not 9.99999974e-06)
        return float(str(np.float32(v)))

    def _bool(self, key: str, default: bool | None) -> bool | None:
        v = self._value(key, False, None)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConversionError(f"{self.path.name}: metadata {key} should be a bool, got {v!r:.60}")
        return v

    # -- model args ----------------------------------------------------------------------------

    def _model_args(self) -> dict:
        a = self.arch
        if self._int(f"{a}.expert_count", required=False, default=0):
            raise ConversionError(f"{self.path.name}: mixture-of-experts models are not supported")
        dim = self._int(f"{a}.embedding_length")
        n_layers = self._int(f"{a}.block_count")
        n_heads = self._int(f"{a}.attention.head_count")
        n_kv_heads = self._int(f"{a}.attention.head_count_kv", required=False, default=n_heads)
        ffn = self._int(f"{a}.feed_forward_length")
        max_seq_len = self._int(f"{a}.context_length")
        eps = self._float(f"{a}.attention.layer_norm_rms_epsilon")
        theta = self._float(f"{a}.rope.freq_base", required=False, default=10000.0)
        if min(dim, n_layers, n_heads, n_kv_heads, ffn, max_seq_len) <= 0:
            raise ConversionError(f"{self.path.name}: model dimensions must be positive")
        if n_heads % n_kv_heads:
            raise ConversionError(f"{self.path.name}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
        head_dim = self._int(f"{a}.attention.key_length", required=False)
        if head_dim is None:
            if dim % n_heads:
                raise ConversionError(f"{self.path.name}: embedding_length {dim} is not a multiple of head_count {n_heads}")
            head_dim = dim // n_heads
        v_dim = self._int(f"{a}.attention.value_length", required=False, default=head_dim)
        if v_dim != head_dim or head_dim <= 0 or head_dim % 2:
            raise ConversionError(f"{self.path.name}: unsupported head sizes (key {head_dim}, value {v_dim})")
        rope_dim = self._int(f"{a}.rope.dimension_count", required=False, default=head_dim)
        if rope_dim != head_dim:
            raise ConversionError(f"{self.path.name}: partial rotary embeddings "
                                  f"(rope.dimension_count {rope_dim} != head size {head_dim}) are not supported")
        scaling_type = self._str(f"{a}.rope.scaling.type", required=False)
        if scaling_type not in (None, "none"):
            raise ConversionError(f"{self.path.name}: rope scaling type {scaling_type!r} is not supported yet")

        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise ConversionError(f"{self.path.name}: missing tensor token_embd.weight")
        emb_shape = self._shape(emb)
        if len(emb_shape) != 2 or emb_shape[1] != dim:
            raise ConversionError(f"{self.path.name}: token_embd.weight has shape {list(emb_shape)}, expected [vocab, {dim}]")
        vocab_size = emb_shape[0]
        meta_vocab = self._int(f"{a}.vocab_size", required=False)
        if meta_vocab is not None and meta_vocab != vocab_size:
            raise ConversionError(f"{self.path.name}: {a}.vocab_size {meta_vocab} does not match "
                                  f"token_embd.weight ({vocab_size} rows)")

        rope_scaling = None
        if "rope_freqs.weight" in self._tensors:
            factors = self._dequantize("rope_freqs.weight", self._tensors["rope_freqs.weight"])
            rope_scaling = _rope_scaling_from_factors(factors, head_dim, theta)

        return {
            "dim": dim,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "n_kv_heads": n_kv_heads,
            "head_dim": head_dim,
            "intermediate_size": ffn,
            "vocab_size": vocab_size,
            "norm_eps": eps,
            "rope_theta": theta,
            "rope_scaling": rope_scaling,
            "max_seq_len": max_seq_len,
            "tie_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "qk_norm": "blk.0.attn_q_norm.weight" in self._tensors,
        }

    # -- tensors -------------------------------------------------------------------------------

    @staticmethod
    def _shape(t) -> tuple[int, ...]:
        # GGUF lists dimensions in ggml "ne" order (fastest-varying first): reverse for torch
        return tuple(int(d) for d in reversed(t.shape.tolist()))

    def _tensor_plan(self) -> list[tuple[str, str, tuple[int, ...], int | None]]:
        """(our name, GGUF name, expected shape, heads to un-permute or None), in output order."""
        m = self.model_args
        dim, hd, ffn, vocab = m["dim"], m["head_dim"], m["intermediate_size"], m["vocab_size"]
        nq, nkv = m["n_heads"], m["n_kv_heads"]
        permuted = self.arch == "llama"
        plan = [("tok_embeddings.weight", "token_embd.weight", (vocab, dim), None)]
        for i in range(m["n_layers"]):
            p, b = f"layers.{i}.", f"blk.{i}."
            plan.append((p + "attention_norm.weight", b + "attn_norm.weight", (dim,), None))
            for ours, theirs, rows, heads in (("wq", "attn_q", nq * hd, nq),
                                              ("wk", "attn_k", nkv * hd, nkv),
                                              ("wv", "attn_v", nkv * hd, None)):
                heads = heads if permuted else None
                plan.append((f"{p}attention.{ours}.weight", f"{b}{theirs}.weight", (rows, dim), heads))
                if m["attention_bias"]:
                    plan.append((f"{p}attention.{ours}.bias", f"{b}{theirs}.bias", (rows,), heads))
            plan.append((p + "attention.wo.weight", b + "attn_output.weight", (dim, nq * hd), None))
            if m["qk_norm"]:
                plan.append((p + "attention.q_norm.weight", b + "attn_q_norm.weight", (hd,), None))
                plan.append((p + "attention.k_norm.weight", b + "attn_k_norm.weight", (hd,), None))
            plan.append((p + "ffn_norm.weight", b + "ffn_norm.weight", (dim,), None))
            plan.append((p + "feed_forward.w1.weight", b + "ffn_gate.weight", (ffn, dim), None))
            plan.append((p + "feed_forward.w3.weight", b + "ffn_up.weight", (ffn, dim), None))
            plan.append((p + "feed_forward.w2.weight", b + "ffn_down.weight", (dim, ffn), None))
        plan.append(("norm.weight", "output_norm.weight", (dim,), None))
        if not m["tie_embeddings"]:
            plan.append(("output.weight", "output.weight", (vocab, dim), None))

        expected = {theirs for _, theirs, _, _ in plan}
        for _, theirs, shape, _ in plan:
            t = self._tensors.get(theirs)
            if t is None:
                raise ConversionError(f"{self.path.name}: missing tensor {theirs}")
            if self._shape(t) != shape:
                raise ConversionError(f"{self.path.name}: tensor {theirs} has shape {list(self._shape(t))}, "
                                      f"expected {list(shape)}")
        extra = [n for n in self._tensors if n not in expected and n != "rope_freqs.weight"]
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise ConversionError(f"{self.path.name}: unexpected tensor {extra[0]}{more} for {self.arch}")
        return plan

    def _check_tensor_types(self) -> None:
        """Fail early (before any output is written) on tensor types gguf-py cannot dequantize."""
        q = self._gguf.quants
        sizes = self._gguf.GGML_QUANT_SIZES
        ok: dict[Any, bool] = {}
        for t in self._reader.tensors:
            qt = t.tensor_type
            if qt not in ok:
                block, type_size = sizes[qt]
                try:
                    with warnings.catch_warnings(), np.errstate(all="ignore"):
                        warnings.simplefilter("ignore")
                        out = q.dequantize(np.zeros((type_size,), dtype=np.uint8), qt)
                    ok[qt] = out.dtype == np.float32 and out.size == block
                except Exception:
                    ok[qt] = False
            if not ok[qt]:
                raise ConversionError(f"{self.path.name}: tensor {t.name} has type {qt.name}, "
                                      f"which cannot be dequantized (not supported)")
            if int(t.data.nbytes) != int(t.n_bytes):
                raise ConversionError(f"{self.path.name}: tensor {t.name} data is truncated")

    def _dequantize(self, name: str, t) -> np.ndarray:
        shape = self._shape(t)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                arr = self._gguf.quants.dequantize(t.data, t.tensor_type)
                arr = np.array(arr, dtype=np.float32, copy=True).reshape(shape)  # copy: off the mmap
        except ConversionError:
            raise
        except Exception as e:
            raise ConversionError(f"{self.path.name}: cannot dequantize tensor {name} "
                                  f"({t.tensor_type.name}): {_one_line(e)}") from None
        return arr

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Our tensor names and shapes, in the order tensors() yields them (nothing is read)."""
        return {ours: shape for ours, _, shape, _ in self._plan}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (our name, float32 tensor) one at a time, dequantized from the memory-mapped file."""
        for ours, theirs, _shape, heads in self._plan:
            arr = self._dequantize(theirs, self._tensors[theirs])
            if heads is not None:
                arr = unpermute_qk(arr, heads)
            yield ours, torch.from_numpy(np.ascontiguousarray(arr))

    def _file_type(self) -> str:
        ft = self._value("general.file_type", required=False)
        if isinstance(ft, int) and not isinstance(ft, bool):
            try:
                name = self._gguf.LlamaFileType(ft).name
                for prefix in ("MOSTLY_", "ALL_"):
                    name = name.removeprefix(prefix)
                return name
            except ValueError:
                pass
        counts = Counter(t.tensor_type.name for t in self._reader.tensors if len(t.shape) >= 2)
        return counts.most_common(1)[0][0] if counts else "unknown"

    # -- tokenizer -----------------------------------------------------------------------------

    def _tokenizer_metadata(self) -> dict:
        kind = self._str("tokenizer.ggml.model", required=False)
        if kind is None:
            raise ConversionError(f"{self.path.name}: no embedded tokenizer (tokenizer.ggml.model missing)")
        if kind not in ("gpt2", "llama"):
            raise ConversionError(f"{self.path.name}: unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        pre = self._str("tokenizer.ggml.pre", required=False)
        if kind == "gpt2":
            if pre is None:
                raise ConversionError(f"{self.path.name}: byte-level BPE vocabulary without tokenizer.ggml.pre")
            if pre not in _PRE_TOKENIZERS:
                raise ConversionError(f"{self.path.name}: unknown pre-tokenizer {pre!r} "
                                      f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})")
            if "tokenizer.ggml.merges" not in self._reader.fields:
                raise ConversionError(f"{self.path.name}: missing required metadata tokenizer.ggml.merges")
        n_tokens = len(self._reader.fields["tokenizer.ggml.tokens"].data) \
            if "tokenizer.ggml.tokens" in self._reader.fields else 0
        if n_tokens == 0:
            raise ConversionError(f"{self.path.name}: missing required metadata tokenizer.ggml.tokens")
        if n_tokens > self.model_args["vocab_size"]:
            raise ConversionError(f"{self.path.name}: {n_tokens} tokens but only "
                                  f"{self.model_args['vocab_size']} embedding rows")
        ids = {}
        for key in ("bos", "eos", "eot", "eom", "unknown", "padding"):
            v = self._int(f"tokenizer.ggml.{key}_token_id", required=False)
            if v is not None and v >= n_tokens:
                raise ConversionError(f"{self.path.name}: tokenizer.ggml.{key}_token_id {v} is out of range")
            ids[key] = v
        llama3 = kind == "gpt2" and _PRE_TOKENIZERS[pre] == "llama3"
        return {
            "kind": kind,
            "pre": pre,
            "ids": ids,
            "add_bos": self._bool("tokenizer.ggml.add_bos_token", kind == "llama" or llama3),
            "add_eos": self._bool("tokenizer.ggml.add_eos_token", False),
            "add_space_prefix": self._bool("tokenizer.ggml.add_space_prefix", kind == "llama"),
            "chat_template": self._str("tokenizer.chat_template", required=False),
        }

    def tokenizer_files(self) -> dict[str, bytes]:
        """tokenizer.json, tokenizer_config.json and generation_config.json, as bytes."""
        if self._tokenizer_cache is None:
            self._tokenizer_cache = self._build_tokenizer_files()
        return dict(self._tokenizer_cache)

    def _build_tokenizer_files(self) -> dict[str, bytes]:
        try:
            importlib.import_module("tokenizers")  # (checked up front: the builders below import from it)
        except ImportError as e:
            raise ConversionError(f"converting a GGUF vocabulary needs the tokenizers package: {e}") from None
        meta = self._tokenizer_meta
        tokens = self._value("tokenizer.ggml.tokens")
        n = len(tokens)
        types = self._value("tokenizer.ggml.token_type", required=False) or [_TT_NORMAL] * n
        if not isinstance(tokens, list) or not isinstance(types, list) or len(types) != n \
                or not all(isinstance(t, str) for t in tokens):
            raise ConversionError(f"{self.path.name}: malformed tokenizer.ggml.tokens / token_type arrays")
        if meta["kind"] == "gpt2":
            merges = self._value("tokenizer.ggml.merges")
            if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
                raise ConversionError(f"{self.path.name}: malformed tokenizer.ggml.merges")
            tok = _byte_level_tokenizer(tokens, types, merges, meta)
        else:
            scores = self._value("tokenizer.ggml.scores", required=False)
            if scores is None:
                scores = [-float(i) for i in range(n)]
            if not isinstance(scores, list) or len(scores) != n:
                raise ConversionError(f"{self.path.name}: malformed tokenizer.ggml.scores")
            tok = _sentencepiece_tokenizer(tokens, types, scores, meta)

        ids = meta["ids"]
        name = lambda i: tokens[i] if i is not None else None  # noqa: E731
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": bool(meta["add_bos"]),
            "add_eos_token": bool(meta["add_eos"]),
            "bos_token": name(ids["bos"]),
            "eos_token": name(ids["eos"]),
        }
        if ids["unknown"] is not None:
            config["unk_token"] = name(ids["unknown"])
        if ids["padding"] is not None:
            config["pad_token"] = name(ids["padding"])
        config["model_max_length"] = self.model_args["max_seq_len"]
        config["clean_up_tokenization_spaces"] = False
        if meta["chat_template"] is not None:
            config["chat_template"] = meta["chat_template"]

        eos_ids: list[int] = []
        for key in ("eos", "eot", "eom"):
            if ids[key] is not None and ids[key] not in eos_ids:
                eos_ids.append(ids[key])
        gen: dict[str, Any] = {"bos_token_id": ids["bos"], "eos_token_id": eos_ids}
        if ids["padding"] is not None:
            gen["pad_token_id"] = ids["padding"]

        dump = lambda obj: (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()  # noqa: E731
        return {
            "tokenizer.json": tok.to_str().encode(),
            "tokenizer_config.json": dump(config),
            "generation_config.json": dump(gen),
        }


# ---------------------------------------------------------------------------------------------
# tokenizer builders


def _special_tokens(tokens: list[str], types: list[int]):
    from tokenizers import AddedToken

    return [AddedToken(tokens[i], special=True, normalized=False)
            for i, tt in enumerate(types)
            if tt in (_TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED) and tokens[i]]


def _post_processor(tokens: list[str], meta: dict, byte_level: bool):
    from tokenizers import processors

    ids = meta["ids"]
    pre, post = [], []
    if meta["add_bos"] and ids["bos"] is not None:
        pre.append(ids["bos"])
    if meta["add_eos"] and ids["eos"] is not None:
        post.append(ids["eos"])
    if not pre and not post:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    specials = sorted({(tokens[i], i) for i in pre + post})
    a = [f"{tokens[i]}:0" for i in pre]
    z = [f"{tokens[i]}:0" for i in post]
    b = [f"{tokens[i]}:1" for i in pre]
    zb = [f"{tokens[i]}:1" for i in post]
    return processors.TemplateProcessing(single=a + ["$A:0"] + z, pair=a + ["$A:0"] + z + b + ["$B:1"] + zb,
                                         special_tokens=specials)


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated string keeps its first id
    return vocab


def _byte_level_tokenizer(tokens: list[str], types: list[int], merges: list[str], meta: dict):
    """GPT-2 style byte-level BPE (tokenizer.ggml.model == "gpt2")."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pairs = []
    for m in merges:
        pos = m.find(" ", 1)  # as llama.cpp: the first part may itself start with a space
        if pos <= 0 or pos == len(m) - 1:
            raise ConversionError(f"malformed BPE merge {m!r}")
        pairs.append((m[:pos], m[pos + 1:]))
    kind = _PRE_TOKENIZERS[meta["pre"]]
    model = models.BPE(vocab=_vocab_dict(tokens), merges=pairs, fuse_unk=False, byte_fallback=False,
                       ignore_merges=(kind == "llama3"))
    tok = Tokenizer(model)
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif kind == "smollm":
        # SmolLM2's own tokenizer.json: every digit on its own, then the GPT-2 split
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        pattern = {"llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}[kind]
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    tok.decoder = decoders.ByteLevel()
    post = _post_processor(tokens, meta, byte_level=True)
    if post is not None:
        tok.post_processor = post
    tok.add_special_tokens(_special_tokens(tokens, types))
    return tok


def _sentencepiece_tokenizer(tokens: list[str], types: list[int], scores: list[float], meta: dict):
    """SentencePiece-style BPE with byte fallback (tokenizer.ggml.model == "llama").

    llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is the
    highest-scoring vocabulary piece. The equivalent Hugging Face BPE model has one merge per
    way of splitting a piece into two pieces, ranked by the merged piece's score.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = _vocab_dict(tokens)
    mergeable = {t: i for t, i in vocab.items() if types[i] in (_TT_NORMAL, _TT_USER_DEFINED, _TT_UNUSED)}
    ranked = []
    for piece, i in mergeable.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in mergeable and right in mergeable:
                ranked.append((-float(scores[i]), i, mergeable[left], mergeable[right], left, right))
    ranked.sort()
    merges = [(r[4], r[5]) for r in ranked]
    unk_id = meta["ids"]["unknown"]
    model = models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                       fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta["add_space_prefix"]:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta["add_space_prefix"]:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    post = _post_processor(tokens, meta, byte_level=False)
    if post is not None:
        tok.post_processor = post
    tok.add_special_tokens(_special_tokens(tokens, types))
    return tok


# ---------------------------------------------------------------------------------------------


def read_gguf(path) -> GGUFSource:
    """Open and validate a GGUF file; ConversionError (one line) on any bad input."""
    gguf = _import_gguf()
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            reader = _strict_reader_class(gguf)(path)
    except Exception as e:  # the reader raises ValueError, IndexError, KeyError, ... on bad files
        raise ConversionError(f"{path.name}: not a valid GGUF file or truncated ({_one_line(e)})") from None
    try:
        return GGUFSource(path, reader, gguf)
    except ConversionError:
        raise
    except Exception as e:  # anything unforeseen in a corrupt file: still one line
        raise ConversionError(f"{path.name}: cannot read GGUF ({_one_line(e)})") from None
