"""Read a GGUF file (llama.cpp's format) into graphdecode's checkpoint format.

    src = read_gguf(path)              # ConversionError (one line) on any bad input
    src.model_args                     # dict of ModelArgs fields
    for name, tensor in src.tensors(): # our names, float32, one at a time
    src.tokenizer_files()              # tokenizer.json, tokenizer_config.json, generation_config.json
    src.description                    # "gguf:FILE (arch, file type)"

Weights stay in the memory-mapped file and are dequantized one tensor at a time by gguf-py.
Architectures: llama (Llama 2/3, Mistral, Mixtral, SmolLM2, TinyLlama), qwen2, qwen3, qwen3moe. The embedded
vocabulary is rebuilt as a Hugging Face tokenizer.json with the pre-tokenizer `tokenizer.ggml.pre` names.
"""
import contextlib
import json
import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from gguf import TokenType as TT
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from common import ConversionError
from tokenizer import LLAMA3_PATTERN


SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")

# tokenizer.ggml.pre value -> pre-tokenizer kind (byte-level BPE vocabularies only).
_PRE_TOKENIZERS = {"default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2", "llama-bpe": "llama3", "llama3": "llama3",
                   "llama-v3": "llama3", "qwen2": "qwen2", "smollm": "smollm"}
# The split regexes of the original tokenizer.json files: Qwen2's takes digits one at a time.
_SPLIT_PATTERNS = {"llama3": LLAMA3_PATTERN, "qwen2": LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")}


def _one_line(exc: BaseException) -> str:  # ConversionError joins its lines
    return f"{type(exc).__name__}: {exc}" if str(exc).strip() else type(exc).__name__


class _StrictGGUFReader(gguf.GGUFReader):
    """gguf-py's GGUFReader, made to fail on any read past the end of the file, and faster.

    The stock reader slices its memory map, so a read past EOF yields a short (or empty) array: a
    truncated file fails late with an odd error, and a corrupt array length can loop for a very
    long time over empty reads. Slicing a plain ndarray view of the map (nothing is copied) also
    skips np.memmap's per-slice overhead, which dominates parsing a 100k-entry vocabulary."""

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


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a `llama`-arch Q or K projection (weight or bias).

    Hugging Face applies RoPE "rotate-half" (a head's rows [0, d/2) pair with [d/2, d)); llama.cpp
    rotates adjacent rows, so convert_hf_to_gguf.py (LlamaModel.permute) stores HF row h * d/2 + j
    of each head as row 2j + h. For K, `n_heads` is the number of KV heads. qwen2/qwen3 use
    NEOX-style RoPE in llama.cpp, HF's layout, and are stored unpermuted."""
    rows = w.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads) != 0:
        raise ConversionError(f"cannot un-permute {rows} rows into {n_heads} heads")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Llama 3 rope_scaling parameters that reproduce the stored factors exactly, or fail.

    The factors (llama.cpp's rope_freqs.weight) divide the RoPE inverse frequencies: 1 for short wavelengths,
    `factor` for long ones, interpolated between. Only ratios are determined by the factors (scaling the original
    context and both frequency factors together changes nothing), so the original context is fixed at Llama 3's
    8192 and the two thresholds are fitted from the smooth band; the fit must recompute the stored factors."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2 or not np.all(np.isfinite(factors)):
        raise ConversionError(f"rope_freqs.weight has {factors.shape[0]} values, expected {head_dim // 2}")
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    old, factor, candidates = 8192, float(factors.max()), [(1.0, 4.0)]
    inv_wavelen = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)) / (2 * math.pi)
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
        smooth = np.clip((old * inv_wavelen - low) / (high - low), 0, 1)
        if np.allclose(1.0 / ((1 - smooth) / factor + smooth), factors, rtol=1e-4, atol=1e-6):
            return {"factor": float(f"{factor:.6g}"), "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": old}
    raise ConversionError("rope_freqs.weight holds RoPE frequency factors that do not follow Llama 3 "
                          "rope scaling; this kind of RoPE scaling is not supported yet")


class GGUFSource:
    """A parsed GGUF file: metadata mapped to ModelArgs, tensors dequantized lazily."""

    def __init__(self, path: Path, reader):
        self.path, self._reader = path, reader
        if getattr(reader, "byte_order", "I") != "I":
            raise ConversionError(f"{path.name}: big-endian GGUF files are not supported")
        self.arch = arch = self._value("general.architecture", str, required=True)
        if arch not in SUPPORTED_ARCHS:
            raise ConversionError(f"{path.name}: unsupported architecture {arch!r} "
                                  f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        self._tensors = {t.name: t for t in reader.tensors}
        self.model_args = self._model_args()
        self._plan = self._tensor_plan()
        self.tensor_shapes = {ours: shape for ours, _, shape, _ in self._plan}  # in tensors()'s order
        self._check_tensor_types()
        self._tokenizer_meta = self._tokenizer_metadata()
        self.description = f"gguf:{path.name} ({arch}, {self._file_type()})"

    # -- metadata ------------------------------------------------------------------------------
    def _value(self, key: str, kind: type = object, default: Any = None, required: bool = False) -> Any:
        """Metadata `key`, which must be a `kind`; `default` when absent (an error when required)."""
        field = self._reader.fields.get(key)
        if field is None:
            if required:
                raise ConversionError(f"{self.path.name}: missing required metadata {key}")
            return default
        try:
            v = field.contents()
        except Exception as e:  # corrupt string/array contents
            raise ConversionError(f"{self.path.name}: bad metadata {key} ({_one_line(e)})") from None
        if not isinstance(v, kind):
            what = "string" if kind is str else kind.__name__
            raise ConversionError(f"{self.path.name}: metadata {key} should be a {what}, got {v!r:.60}")
        return v

    def _int(self, key: str, required: bool = True, default: int | None = None) -> int | None:
        v = self._value(key, default=default, required=required)
        if isinstance(v, list):  # per-layer arrays (e.g. head_count): accept only uniform ones
            if not v or len(set(v)) != 1:
                raise ConversionError(f"{self.path.name}: metadata {key} varies per layer; not supported")
            v = v[0]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise ConversionError(f"{self.path.name}: metadata {key} should be a non-negative integer, got {v!r:.60}")
        return None if v is None else int(v)

    def _float(self, key: str, required: bool = True, default: float | None = None) -> float | None:
        v = self._value(key, default=default, required=required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
            raise ConversionError(f"{self.path.name}: metadata {key} should be a number, got {v!r:.60}")
        # stored as float32: give the shortest decimal that round-trips (1e-05, not 9.99999974e-06)
        return float(str(np.float32(v)))

    def _model_args(self) -> dict:
        a, name = self.arch, self.path.name
        dim = self._int(f"{a}.embedding_length")
        n_layers = self._int(f"{a}.block_count")
        n_heads = self._int(f"{a}.attention.head_count")
        n_kv_heads = self._int(f"{a}.attention.head_count_kv", required=False, default=n_heads)
        ffn = self._int(f"{a}.feed_forward_length")
        max_seq_len = self._int(f"{a}.context_length")
        eps = self._float(f"{a}.attention.layer_norm_rms_epsilon")
        theta = self._float(f"{a}.rope.freq_base", required=False, default=10000.0)
        if min(dim, n_layers, n_heads, n_kv_heads, ffn, max_seq_len) <= 0:
            raise ConversionError(f"{name}: model dimensions must be positive")
        if n_heads % n_kv_heads:
            raise ConversionError(f"{name}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
        head_dim = self._int(f"{a}.attention.key_length", required=False)
        if head_dim is None:
            if dim % n_heads:
                raise ConversionError(f"{name}: embedding_length {dim} is not a multiple of head_count {n_heads}")
            head_dim = dim // n_heads
        v_dim = self._int(f"{a}.attention.value_length", required=False, default=head_dim)
        if v_dim != head_dim or head_dim <= 0 or head_dim % 2:
            raise ConversionError(f"{name}: unsupported head sizes (key {head_dim}, value {v_dim})")
        rope_dim = self._int(f"{a}.rope.dimension_count", required=False, default=head_dim)
        if rope_dim != head_dim:
            raise ConversionError(f"{name}: partial rotary embeddings "
                                  f"(rope.dimension_count {rope_dim} != head size {head_dim}) are not supported")
        scaling_type = self._value(f"{a}.rope.scaling.type", str)
        if scaling_type not in (None, "none"):
            raise ConversionError(f"{name}: rope scaling type {scaling_type!r} is not supported yet")

        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise ConversionError(f"{name}: missing tensor token_embd.weight")
        emb_shape = self._shape(emb)
        if len(emb_shape) != 2 or emb_shape[1] != dim:
            raise ConversionError(f"{name}: token_embd.weight has shape {list(emb_shape)}, expected [vocab, {dim}]")
        vocab_size = emb_shape[0]
        meta_vocab = self._int(f"{a}.vocab_size", required=False)
        if meta_vocab is not None and meta_vocab != vocab_size:
            raise ConversionError(f"{name}: {a}.vocab_size {meta_vocab} does not match "
                                  f"token_embd.weight ({vocab_size} rows)")
        rope_scaling = None
        if "rope_freqs.weight" in self._tensors:
            factors = self._dequantize("rope_freqs.weight", self._tensors["rope_freqs.weight"])
            rope_scaling = _rope_scaling_from_factors(factors, head_dim, theta)
        experts = {}  # a mixture of experts': stacked expert tensors (ffn_gate_exps, ...), a router (ffn_gate_inp)
        if n_experts := self._int(f"{a}.expert_count", required=False, default=0):
            experts = dict(n_experts=n_experts, n_active_experts=self._int(f"{a}.expert_used_count"),
                           expert_size=self._int(f"{a}.expert_feed_forward_length", required=False, default=ffn),
                           norm_topk=bool(self._value(f"{a}.expert_weights_norm", default=True)))
        return experts | dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                    intermediate_size=ffn, vocab_size=vocab_size, norm_eps=eps, rope_theta=theta,
                    rope_scaling=rope_scaling, max_seq_len=max_seq_len,
                    tie_embeddings="output.weight" not in self._tensors,
                    attention_bias="blk.0.attn_q.bias" in self._tensors,
                    qk_norm="blk.0.attn_q_norm.weight" in self._tensors)

    def _file_type(self) -> str:
        ft = self._value("general.file_type")
        if isinstance(ft, int) and not isinstance(ft, bool):
            with contextlib.suppress(ValueError):  # an unknown file type: named from the tensors below
                return gguf.LlamaFileType(ft).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        counts = Counter(t.tensor_type.name for t in self._reader.tensors if len(t.shape) >= 2)
        return counts.most_common(1)[0][0] if counts else "unknown"

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
        layer = [("attention_norm.weight", "attn_norm.weight", (dim,), None)]
        for ours, theirs, rows, heads in (("wq", "attn_q", nq * hd, nq), ("wk", "attn_k", nkv * hd, nkv),
                                          ("wv", "attn_v", nkv * hd, None)):
            heads = heads if self.arch == "llama" else None  # see unpermute_qk
            layer.append((f"attention.{ours}.weight", f"{theirs}.weight", (rows, dim), heads))
            if m["attention_bias"]:
                layer.append((f"attention.{ours}.bias", f"{theirs}.bias", (rows,), heads))
        layer.append(("attention.wo.weight", "attn_output.weight", (dim, nq * hd), None))
        if m["qk_norm"]:
            layer += [("attention.q_norm.weight", "attn_q_norm.weight", (hd,), None),
                      ("attention.k_norm.weight", "attn_k_norm.weight", (hd,), None)]
        layer.append(("ffn_norm.weight", "ffn_norm.weight", (dim,), None))
        if E := m.get("n_experts"):
            ffn = m["expert_size"]
            layer += [("feed_forward.gate.weight", "ffn_gate_inp.weight", (E, dim), None),
                      ("feed_forward.w1", "ffn_gate_exps.weight", (E, ffn, dim), None),
                      ("feed_forward.w3", "ffn_up_exps.weight", (E, ffn, dim), None),
                      ("feed_forward.w2", "ffn_down_exps.weight", (E, dim, ffn), None)]
        else:
            layer += [("feed_forward.w1.weight", "ffn_gate.weight", (ffn, dim), None),
                      ("feed_forward.w3.weight", "ffn_up.weight", (ffn, dim), None),
                      ("feed_forward.w2.weight", "ffn_down.weight", (dim, ffn), None)]
        plan = [("tok_embeddings.weight", "token_embd.weight", (vocab, dim), None)]
        plan += [(f"layers.{i}.{ours}", f"blk.{i}.{theirs}", shape, heads)
                 for i in range(m["n_layers"]) for ours, theirs, shape, heads in layer]
        plan.append(("norm.weight", "output_norm.weight", (dim,), None))
        if not m["tie_embeddings"]:
            plan.append(("output.weight", "output.weight", (vocab, dim), None))

        for _, theirs, shape, _ in plan:
            t = self._tensors.get(theirs)
            if t is None:
                raise ConversionError(f"{self.path.name}: missing tensor {theirs}")
            if self._shape(t) != shape:
                raise ConversionError(f"{self.path.name}: tensor {theirs} has shape {list(self._shape(t))}, "
                                      f"expected {list(shape)}")
        expected = {theirs for _, theirs, _, _ in plan} | {"rope_freqs.weight"}
        if extra := [n for n in self._tensors if n not in expected]:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise ConversionError(f"{self.path.name}: unexpected tensor {extra[0]}{more} for {self.arch}")
        return plan

    def _check_tensor_types(self) -> None:
        """Fail early (before any output is written) on tensor types gguf-py cannot dequantize."""
        for qt in dict.fromkeys(t.tensor_type for t in self._reader.tensors):  # each type once, in file order
            block, type_size = gguf.GGML_QUANT_SIZES[qt]
            out = None  # stays None if gguf-py raises
            with contextlib.suppress(Exception), warnings.catch_warnings(action="ignore"), np.errstate(all="ignore"):
                out = gguf.quants.dequantize(np.zeros((type_size,), dtype=np.uint8), qt)
            if out is None or out.dtype != np.float32 or out.size != block:
                first = next(t.name for t in self._reader.tensors if t.tensor_type == qt)
                raise ConversionError(f"{self.path.name}: tensor {first} has type {qt.name}, "
                                      f"which cannot be dequantized (not supported)")

    def _dequantize(self, name: str, t) -> np.ndarray:
        try:
            with warnings.catch_warnings(action="ignore"):
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
                return np.array(arr, dtype=np.float32, copy=True).reshape(self._shape(t))  # copy: off the mmap
        except Exception as e:
            raise ConversionError(f"{self.path.name}: cannot dequantize tensor {name} "
                                  f"({t.tensor_type.name}): {_one_line(e)}") from None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for ours, theirs, _shape, heads in self._plan:
            arr = self._dequantize(theirs, self._tensors[theirs])
            if heads is not None:
                arr = unpermute_qk(arr, heads)
            yield ours, torch.from_numpy(np.ascontiguousarray(arr))

    # -- tokenizer -----------------------------------------------------------------------------
    def _tokenizer_metadata(self) -> dict:
        name = self.path.name
        kind = self._value("tokenizer.ggml.model", str)
        if kind is None:
            raise ConversionError(f"{name}: no embedded tokenizer (tokenizer.ggml.model missing)")
        if kind not in ("gpt2", "llama"):
            raise ConversionError(f"{name}: unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        pre = self._value("tokenizer.ggml.pre", str)
        if kind == "gpt2":
            if pre is None:
                raise ConversionError(f"{name}: byte-level BPE vocabulary without tokenizer.ggml.pre")
            if pre not in _PRE_TOKENIZERS:
                raise ConversionError(f"{name}: unknown pre-tokenizer {pre!r} "
                                      f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})")
            if "tokenizer.ggml.merges" not in self._reader.fields:
                raise ConversionError(f"{name}: missing required metadata tokenizer.ggml.merges")
        tokens_field = self._reader.fields.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens_field.data) if tokens_field is not None else 0
        if n_tokens == 0:
            raise ConversionError(f"{name}: missing required metadata tokenizer.ggml.tokens")
        if n_tokens > self.model_args["vocab_size"]:
            raise ConversionError(f"{name}: {n_tokens} tokens but only {self.model_args['vocab_size']} embedding rows")
        ids = {}
        for key in ("bos", "eos", "eot", "eom", "unknown", "padding"):
            v = self._int(f"tokenizer.ggml.{key}_token_id", required=False)
            if v is not None and v >= n_tokens:
                raise ConversionError(f"{name}: tokenizer.ggml.{key}_token_id {v} is out of range")
            ids[key] = v
        llama3 = kind == "gpt2" and _PRE_TOKENIZERS[pre] == "llama3"
        return dict(kind=kind, pre=pre, ids=ids,
                    add_bos=self._value("tokenizer.ggml.add_bos_token", bool, kind == "llama" or llama3),
                    add_eos=self._value("tokenizer.ggml.add_eos_token", bool, False),
                    add_space_prefix=self._value("tokenizer.ggml.add_space_prefix", bool, kind == "llama"),
                    chat_template=self._value("tokenizer.chat_template", str))

    def tokenizer_files(self) -> dict[str, bytes]:
        meta, ids = self._tokenizer_meta, self._tokenizer_meta["ids"]
        tokens = self._value("tokenizer.ggml.tokens", required=True)
        n = len(tokens)
        types = self._value("tokenizer.ggml.token_type") or [TT.NORMAL] * n
        if not isinstance(tokens, list) or not isinstance(types, list) or len(types) != n \
                or not all(isinstance(t, str) for t in tokens):
            raise ConversionError(f"{self.path.name}: malformed tokenizer.ggml.tokens / token_type arrays")
        if meta["kind"] == "gpt2":
            merges = self._value("tokenizer.ggml.merges", required=True)
            if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
                raise ConversionError(f"{self.path.name}: malformed tokenizer.ggml.merges")
            tok = _byte_level_tokenizer(tokens, merges, _PRE_TOKENIZERS[meta["pre"]])
        else:
            scores = self._value("tokenizer.ggml.scores", default=[-float(i) for i in range(n)])
            if not isinstance(scores, list) or len(scores) != n:
                raise ConversionError(f"{self.path.name}: malformed tokenizer.ggml.scores")
            tok = _sentencepiece_tokenizer(tokens, types, scores, meta)
        post = _post_processor(tokens, meta, byte_level=meta["kind"] == "gpt2")
        if post is not None:
            tok.post_processor = post
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, tt in zip(tokens, types)
                                if tt in (TT.UNKNOWN, TT.CONTROL, TT.USER_DEFINED) and t])

        token = lambda key: tokens[ids[key]] if ids[key] is not None else None  # noqa: E731
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(meta["add_bos"]),
                  "add_eos_token": bool(meta["add_eos"]), "bos_token": token("bos"), "eos_token": token("eos")}
        config.update({k: token(key) for k, key in (("unk_token", "unknown"), ("pad_token", "padding"))
                       if ids[key] is not None})
        config.update(model_max_length=self.model_args["max_seq_len"], clean_up_tokenization_spaces=False)
        if meta["chat_template"] is not None:
            config["chat_template"] = meta["chat_template"]
        eos_ids = list(dict.fromkeys(ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None))
        gen = {"bos_token_id": ids["bos"], "eos_token_id": eos_ids}
        if ids["padding"] is not None:
            gen["pad_token_id"] = ids["padding"]
        dump = lambda obj: (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()  # noqa: E731
        return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": dump(config),
                "generation_config.json": dump(gen)}


# -- tokenizer builders ---------------------------------------------------------------------------

def _post_processor(tokens: list[str], meta: dict, byte_level: bool):
    ids = meta["ids"]
    pre = [ids["bos"]] if meta["add_bos"] and ids["bos"] is not None else []
    post = [ids["eos"]] if meta["add_eos"] and ids["eos"] is not None else []
    if not pre and not post:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    seq = lambda ids_, type_id: [f"{tokens[i]}:{type_id}" for i in ids_]  # noqa: E731
    single = seq(pre, 0) + ["$A:0"] + seq(post, 0)
    return processors.TemplateProcessing(single=single, pair=single + seq(pre, 1) + ["$B:1"] + seq(post, 1),
                                         special_tokens=sorted({(tokens[i], i) for i in pre + post}))


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    return {t: i for i, t in reversed(list(enumerate(tokens)))}  # a duplicated string keeps its first id


def _byte_level_tokenizer(tokens: list[str], merges: list[str], kind: str):
    """GPT-2 style byte-level BPE (tokenizer.ggml.model == "gpt2"); kind: a _PRE_TOKENIZERS value."""
    pairs = []
    for m in merges:
        pos = m.find(" ", 1)  # as llama.cpp: the first part may itself start with a space
        if pos <= 0 or pos == len(m) - 1:
            raise ConversionError(f"malformed BPE merge {m!r}")
        pairs.append((m[:pos], m[pos + 1:]))
    tok = Tokenizer(models.BPE(vocab=_vocab_dict(tokens), merges=pairs, fuse_unk=False, byte_fallback=False,
                               ignore_merges=(kind == "llama3")))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind in ("gpt2", "smollm"))
    if kind == "gpt2":
        tok.pre_tokenizer = byte_level
    elif kind == "smollm":  # SmolLM2's own tokenizer.json: every digit on its own, then the GPT-2 split
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        split = pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[kind]), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_tokenizer(tokens: list[str], types: list[int], scores: list[float], meta: dict):
    """SentencePiece-style BPE with byte fallback (tokenizer.ggml.model == "llama").

    llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is the highest-scoring
    vocabulary piece. The equivalent Hugging Face BPE model has one merge per way of splitting a piece into two
    pieces, ranked by the merged piece's score."""
    vocab = _vocab_dict(tokens)
    mergeable = {t: i for t, i in vocab.items() if types[i] in (TT.NORMAL, TT.USER_DEFINED, TT.UNUSED)}
    ranked = []
    for piece, i in mergeable.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in mergeable and right in mergeable:
                ranked.append((-float(scores[i]), i, mergeable[left], mergeable[right], left, right))
    ranked.sort()
    unk_id = meta["ids"]["unknown"]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(r[4], r[5]) for r in ranked], fuse_unk=True, byte_fallback=True,
                               unk_token=tokens[unk_id] if unk_id is not None else None))
    prefix = meta["add_space_prefix"]  # (a bool: each list below has the step or not)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581")] * prefix
                                          + [normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + [decoders.Strip(" ", 1, 0)] * prefix)
    return tok


def read_gguf(path) -> GGUFSource:
    """Open and validate a GGUF file; ConversionError (one line) on any bad input."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    try:
        with warnings.catch_warnings(action="ignore"), np.errstate(all="ignore"):
            reader = _StrictGGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, KeyError, ... on bad files
        raise ConversionError(f"{path.name}: not a valid GGUF file or truncated ({_one_line(e)})") from None
    try:
        return GGUFSource(path, reader)
    except ConversionError:
        raise
    except Exception as e:  # anything unforeseen in a corrupt file: still one line
        raise ConversionError(f"{path.name}: cannot read GGUF ({_one_line(e)})") from None
