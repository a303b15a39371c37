"""Tests for convert_gguf.py: reading GGUF files (llama.cpp's format) into graphdecode's format.

Tiny GGUF files are written here with gguf-py's GGUFWriter (real files, nothing mocked); the
real default model (SmolLM2-135M-Instruct Q4_1) comes from the `default_gguf` fixture.
"""
import inspect
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

gguf = pytest.importorskip("gguf", reason="gguf is in requirements.txt; the GPU machine's image lacks it")
QT = gguf.GGMLQuantizationType
from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from convert_gguf import ConversionError, read_gguf, unpermute_qk

DATA = Path(__file__).parent / "data"


# ---------------------------------------------------------------------------------------------
# helpers: an independent copy of llama.cpp's permutation, tiny vocabularies, a tiny GGUF writer


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


BYTE_CHARS = [bytes_to_unicode()[b] for b in range(256)]  # GPT-2's printable character for each byte
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "Ġ w", "o r", "l d"]
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>"]
TINY_TOKENS = TINY_SPECIALS + BYTE_CHARS + ["Ġt", "he", "Ġthe", "ll", "llo", "Ġw", "or", "ld"]
TINY_TYPES = [3] * len(TINY_SPECIALS) + [1] * (len(TINY_TOKENS) - len(TINY_SPECIALS))
TID = {t: i for i, t in enumerate(TINY_TOKENS)}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}")

BASE_CFG = dict(arch="llama", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=None, ffn=96,
                ctx=2048, eps=1e-5, theta=10000.0, tied=True, bias=False, qk_norm=False)


def make_weights(cfg: dict, rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """Random weights in our names and Hugging Face layout (float32)."""
    dim, nq, nkv, ffn = cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"], cfg["ffn"]
    hd = cfg["head_dim"] or dim // nq
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"tok_embeddings.weight": r(vocab, dim)}
    for i in range(cfg["n_layers"]):
        p = f"layers.{i}."
        w[p + "attention_norm.weight"] = 1 + 0.1 * r(dim)
        for proj, rows in (("wq", nq * hd), ("wk", nkv * hd), ("wv", nkv * hd)):
            w[f"{p}attention.{proj}.weight"] = r(rows, dim)
            if cfg["bias"]:
                w[f"{p}attention.{proj}.bias"] = r(rows)
        w[p + "attention.wo.weight"] = r(dim, nq * hd)
        if cfg["qk_norm"]:
            w[p + "attention.q_norm.weight"] = 1 + 0.1 * r(hd)
            w[p + "attention.k_norm.weight"] = 1 + 0.1 * r(hd)
        w[p + "ffn_norm.weight"] = 1 + 0.1 * r(dim)
        w[p + "feed_forward.w1.weight"] = r(ffn, dim)
        w[p + "feed_forward.w3.weight"] = r(ffn, dim)
        w[p + "feed_forward.w2.weight"] = r(dim, ffn)
    w["norm.weight"] = 1 + 0.1 * r(dim)
    if not cfg["tied"]:
        w["output.weight"] = r(vocab, dim)
    return w


def gguf_name(ours: str) -> str:
    fixed = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "output.weight": "output.weight"}
    if ours in fixed:
        return fixed[ours]
    _, i, rest = ours.split(".", 2)
    table = {"attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k",
             "attention.wv": "attn_v", "attention.wo": "attn_output", "attention.q_norm": "attn_q_norm",
             "attention.k_norm": "attn_k_norm", "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate",
             "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down"}
    stem, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{table[stem]}.{kind}"


def encode_tensor(arr: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT | None]:
    if qtype == QT.F32:
        return arr.astype(np.float32), None
    if qtype == QT.F16:
        return arr.astype(np.float16), None
    return gguf.quants.quantize(arr, qtype), qtype


def write_tiny_gguf(path: Path, cfg: dict | None = None, *, qtype: QT = QT.F32, weights=None, seed=0,
                    tokenizer="gpt2", pre="gpt2", tokens=None, types=None, scores=None, merges=None,
                    raw_tensors=None, skip_keys=(), extra_kv=None, drop_tensors=(), extra_tensors=None,
                    special_ids=None):
    """Write a tiny model as llama.cpp would: Q/K permuted for `llama`, 2-D weights in `qtype`,
    1-D tensors in F32. `raw_tensors` maps GGUF names to (uint8 bytes, qtype) written as-is.
    Returns the weights in our names and Hugging Face layout."""
    cfg = {**BASE_CFG, **(cfg or {})}
    arch = cfg["arch"]
    if tokens is None:
        tokens, types = TINY_TOKENS, TINY_TYPES
        merges = TINY_MERGES if merges is None else merges
    rng = np.random.default_rng(seed)
    w = weights if weights is not None else make_weights(cfg, rng, len(tokens))
    hd = cfg["head_dim"] or cfg["dim"] // cfg["n_heads"]

    writer = gguf.GGUFWriter(str(path), arch)
    kv = {
        f"{arch}.block_count": ("uint32", cfg["n_layers"]),
        f"{arch}.context_length": ("uint32", cfg["ctx"]),
        f"{arch}.embedding_length": ("uint32", cfg["dim"]),
        f"{arch}.feed_forward_length": ("uint32", cfg["ffn"]),
        f"{arch}.attention.head_count": ("uint32", cfg["n_heads"]),
        f"{arch}.attention.head_count_kv": ("uint32", cfg["n_kv_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", cfg["eps"]),
        f"{arch}.rope.freq_base": ("float32", cfg["theta"]),
        f"{arch}.rope.dimension_count": ("uint32", hd),
        f"{arch}.vocab_size": ("uint32", len(tokens)),
        "general.file_type": ("uint32", 0),
        "tokenizer.ggml.model": ("string", tokenizer),
        "tokenizer.ggml.pre": ("string", pre),
        "tokenizer.ggml.bos_token_id": ("uint32", TID["<|im_start|>"] if special_ids is None else special_ids[0]),
        "tokenizer.ggml.eos_token_id": ("uint32", TID["<|im_end|>"] if special_ids is None else special_ids[1]),
        "tokenizer.chat_template": ("string", CHATML),
    }
    if cfg["head_dim"]:
        kv[f"{arch}.attention.key_length"] = ("uint32", hd)
        kv[f"{arch}.attention.value_length"] = ("uint32", hd)
    kv.update(extra_kv or {})
    for key, (kind, value) in kv.items():
        if key not in skip_keys:
            getattr(writer, f"add_{kind}")(key, value)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)

    raw_tensors = dict(raw_tensors or {})
    for ours, arr in w.items():
        name = gguf_name(ours)
        if name in drop_tensors:
            continue
        if name in raw_tensors:
            data, raw_type = raw_tensors.pop(name)
            writer.add_tensor(name, data, raw_dtype=raw_type)
            continue
        if arch == "llama" and ".wq." in ours:
            arr = llama_cpp_permute(arr, cfg["n_heads"], cfg["n_heads"])
        elif arch == "llama" and ".wk." in ours:
            arr = llama_cpp_permute(arr, cfg["n_heads"], cfg["n_kv_heads"])
        data, raw_type = encode_tensor(arr, qtype if arr.ndim == 2 else QT.F32)
        writer.add_tensor(name, data, raw_dtype=raw_type)
    for name, (data, raw_type) in {**raw_tensors, **(extra_tensors or {})}.items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w


def assert_one_line_error(excinfo, *fragments):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg and "Traceback" not in msg
    for f in fragments:
        assert f in msg, (f, msg)


# ---------------------------------------------------------------------------------------------
# 1. tiny files: mapping, permutation, dequantization


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(1)
    for n_head, n_kv, hd, cols in [(4, 4, 16, 8), (9, 3, 64, 5), (8, 2, 32, 3), (2, 1, 4, 1)]:
        q = rng.standard_normal((n_head * hd, cols))
        k = rng.standard_normal((n_kv * hd, cols))
        pq, pk = llama_cpp_permute(q, n_head, n_head), llama_cpp_permute(k, n_head, n_kv)
        assert not np.array_equal(pq, q)
        np.testing.assert_array_equal(unpermute_qk(pq, n_head), q)
        np.testing.assert_array_equal(unpermute_qk(pk, n_kv), k)
        bias = rng.standard_normal(n_kv * hd)  # 1-D (q/k bias) works the same way
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(bias, n_head, n_kv), n_kv), bias)


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_tiny_llama_f32_exact(tmp_path, tied, bias):
    path = tmp_path / "tiny.gguf"
    w = write_tiny_gguf(path, {"tied": tied, "bias": bias})  # llama.cpp permutes q/k biases too
    src = read_gguf(path)
    assert src.model_args == {
        "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "vocab_size": len(TINY_TOKENS), "norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None, "max_seq_len": 2048,
        "tie_embeddings": tied, "attention_bias": bias, "qk_norm": False,
    }
    assert src.description == "gguf:tiny.gguf (llama, F32)"
    gen = src.tensors()
    assert inspect.isgenerator(gen)
    names = []
    for name, t in gen:
        names.append(name)
        assert t.dtype == torch.float32
        assert tuple(t.shape) == w[name].shape, name
        # F32 is lossless, so Q/K un-permutation must give back the original rows exactly
        np.testing.assert_array_equal(t.numpy(), w[name], err_msg=name)
    assert names == list(w)  # same names, in our canonical order
    assert ("output.weight" in names) == (not tied)
    assert ("layers.1.attention.wk.bias" in names) == bias
    assert list(src.tensor_shapes) == names


# per-block absolute error bound, as a fraction of the block's max |x|: half a quantization step
# (a full step for the symmetric 4/5-bit types, which clamp one end), plus 2^-10 for the fp16 scale
QUANT_BOUNDS = {QT.F16: 2 ** -11, QT.BF16: 2 ** -8, QT.Q8_0: 0.5 / 127 + 2 ** -10, QT.Q4_0: 1 / 8 + 2 ** -10,
                QT.Q4_1: 1 / 15 + 2 ** -10, QT.Q5_0: 1 / 16 + 2 ** -10, QT.Q5_1: 1 / 31 + 2 ** -10}


@pytest.mark.parametrize("qtype", list(QUANT_BOUNDS), ids=lambda q: q.name)
def test_tiny_llama_quantized(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    w = write_tiny_gguf(path, {"tied": False}, qtype=qtype)
    src = read_gguf(path)
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    assert raw["blk.0.attn_q.weight"].tensor_type == qtype
    bound = QUANT_BOUNDS[qtype]
    seen = 0
    for name, t in src.tensors():
        ref = w[name]
        got = t.numpy()
        assert got.shape == ref.shape
        if ref.ndim == 1:
            np.testing.assert_array_equal(got, ref)  # norms are stored as F32
            continue
        blk = 32 if qtype not in (QT.F16, QT.BF16) else 1
        amax = np.abs(ref.reshape(ref.shape[0], -1, blk)).max(-1, keepdims=True)
        err = np.abs((got - ref).reshape(amax.shape[0], -1, blk))
        assert np.all(err <= bound * amax + 1e-7), (name, float((err / amax).max()))
        # plumbing: exactly gguf-py's dequantization of the same bytes, rows un-permuted
        lib = gguf.quants.dequantize(raw[gguf_name(name)].data, qtype).reshape(ref.shape)
        if ".wq." in name:
            lib = unpermute_qk(lib, 4)
        elif ".wk." in name:
            lib = unpermute_qk(lib, 2)
        np.testing.assert_array_equal(got, lib)
        seen += 1
    assert seen == 1 + 2 * 7 + 1


def _fp16_bytes(rng, n, lo, hi) -> np.ndarray:
    return rng.uniform(lo, hi, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_k_blocks(qtype: QT, n_blocks: int, rng) -> np.ndarray:
    """Random but valid super-blocks: random quants/scales, finite fp16 d (and dmin)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype in (QT.Q4_K, QT.Q5_K):  # d, dmin first
        b[:, 0:2] = _fp16_bytes(rng, n_blocks, 0.001, 0.02)
        b[:, 2:4] = _fp16_bytes(rng, n_blocks, 0.001, 0.02)
    elif qtype == QT.Q6_K:  # d last
        b[:, 208:210] = _fp16_bytes(rng, n_blocks, 0.0005, 0.005)
    return b


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_dequant_k_block(qtype: QT, b: bytes) -> np.ndarray:
    """A straight transcription of ggml-quants.c's dequantize_row_q{4,5,6}_K for one block."""
    f32 = np.float32
    y = []
    if qtype in (QT.Q4_K, QT.Q5_K):
        d = f32(np.frombuffer(b[0:2], np.float16)[0])
        dmin = f32(np.frombuffer(b[2:4], np.float16)[0])
        scales = b[4:16]
        qh, ql = (b[16:48], b[48:176]) if qtype == QT.Q5_K else (None, b[16:144])
        u1, u2 = 1, 2
        for n, j in enumerate(range(0, 256, 64)):
            sc, m = _scale_min_k4(2 * n, scales)
            d1, m1 = d * f32(sc), dmin * f32(m)
            sc, m = _scale_min_k4(2 * n + 1, scales)
            d2, m2 = d * f32(sc), dmin * f32(m)
            q = ql[32 * n:32 * n + 32]
            for l in range(32):
                hi = 16 if qh is not None and qh[l] & u1 else 0
                y.append(d1 * f32((q[l] & 0xF) + hi) - m1)
            for l in range(32):
                hi = 16 if qh is not None and qh[l] & u2 else 0
                y.append(d2 * f32((q[l] >> 4) + hi) - m2)
            u1, u2 = u1 << 2, u2 << 2
    else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d
        ql, qh = b[0:128], b[128:192]
        sc = np.frombuffer(b[192:208], np.int8)
        d = f32(np.frombuffer(b[208:210], np.float16)[0])
        out = [f32(0)] * 256
        for half in range(2):
            L, H, S, Y = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
            for l in range(32):
                s = l // 16
                q1 = ((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32
                q2 = ((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32
                q3 = ((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32
                q4 = ((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32
                out[Y + l] = d * f32(S[s]) * f32(q1)
                out[Y + l + 32] = d * f32(S[s + 2]) * f32(q2)
                out[Y + l + 64] = d * f32(S[s + 4]) * f32(q3)
                out[Y + l + 96] = d * f32(S[s + 6]) * f32(q4)
        y = out
    return np.array(y, dtype=np.float32)


def test_tiny_llama_k_quants(tmp_path):
    """gguf-py cannot quantize K-quants: write random valid blocks and compare our output with
    a transcription of ggml's C dequantization (Q/K rows permuted back as llama.cpp stores them)."""
    cfg = {"n_layers": 1, "dim": 256, "n_heads": 4, "n_kv_heads": 2, "ffn": 256, "tied": True}
    rng = np.random.default_rng(5)
    plan = {"blk.0.attn_q.weight": QT.Q4_K, "blk.0.attn_k.weight": QT.Q5_K, "blk.0.attn_v.weight": QT.Q6_K,
            "blk.0.attn_output.weight": QT.Q5_K, "blk.0.ffn_gate.weight": QT.Q6_K,
            "blk.0.ffn_up.weight": QT.Q4_K, "blk.0.ffn_down.weight": QT.Q6_K}
    rows = {"blk.0.attn_q.weight": 256, "blk.0.attn_k.weight": 128, "blk.0.attn_v.weight": 128}
    raw = {name: (random_k_blocks(qt, rows.get(name, 256), rng), qt) for name, qt in plan.items()}
    path = tmp_path / "kquant.gguf"
    write_tiny_gguf(path, cfg, raw_tensors=raw)
    src = read_gguf(path)
    got = dict(src.tensors())
    for name, (blocks, qt) in raw.items():
        ref = np.stack([ref_dequant_k_block(qt, bytes(b)) for b in blocks])  # [rows, 256]
        ours = got[[k for k in got if gguf_name(k) == name][0]].numpy()
        if name == "blk.0.attn_q.weight":
            ours = llama_cpp_permute(ours, 4, 4)
        elif name == "blk.0.attn_k.weight":
            ours = llama_cpp_permute(ours, 4, 2)
        assert np.isfinite(ref).all() and np.abs(ref).max() > 0
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6, err_msg=f"{name} {qt.name}")


def test_qwen2_bias_not_permuted(tmp_path):
    path = tmp_path / "qwen2.gguf"
    w = write_tiny_gguf(path, {"arch": "qwen2", "bias": True, "tied": False, "theta": 1000000.0,
                               "eps": 1e-6}, pre="qwen2")
    src = read_gguf(path)
    m = src.model_args
    assert m["attention_bias"] is True and m["qk_norm"] is False and m["tie_embeddings"] is False
    assert m["rope_theta"] == 1000000.0 and m["norm_eps"] == 1e-6
    assert src.description.startswith("gguf:qwen2.gguf (qwen2,")
    got = dict(src.tensors())
    assert set(got) == set(w)
    for name in ("wq", "wk", "wv"):
        assert f"layers.1.attention.{name}.bias" in got
    for name, t in got.items():  # qwen2 is stored unpermuted: everything equals the original
        np.testing.assert_array_equal(t.numpy(), w[name], err_msg=name)


def test_qwen3_qk_norm_and_head_dim(tmp_path):
    path = tmp_path / "qwen3.gguf"
    cfg = {"arch": "qwen3", "qk_norm": True, "head_dim": 32, "dim": 64, "n_heads": 4, "n_kv_heads": 2}
    w = write_tiny_gguf(path, cfg, pre="qwen2")
    src = read_gguf(path)
    m = src.model_args
    assert (m["head_dim"], m["n_heads"], m["n_kv_heads"], m["dim"]) == (32, 4, 2, 64)
    assert m["qk_norm"] is True and m["attention_bias"] is False and m["tie_embeddings"] is True
    shapes = src.tensor_shapes
    assert shapes["layers.0.attention.wq.weight"] == (128, 64)
    assert shapes["layers.0.attention.wk.weight"] == (64, 64)
    assert shapes["layers.0.attention.wo.weight"] == (64, 128)
    assert shapes["layers.1.attention.q_norm.weight"] == (32,)
    assert shapes["layers.1.attention.k_norm.weight"] == (32,)
    got = dict(src.tensors())
    assert set(got) == set(w)
    for name, t in got.items():
        np.testing.assert_array_equal(t.numpy(), w[name], err_msg=name)


def _llama3_factors(head_dim, theta, factor, lo, hi, old):
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, transcribed
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs(tmp_path):
    cfg = {"n_layers": 1, "dim": 128, "n_heads": 2, "n_kv_heads": 1, "ffn": 64, "theta": 500000.0}
    factors = _llama3_factors(64, 500000.0, 8.0, 1.0, 4.0, 8192)
    path = tmp_path / "llama31.gguf"
    write_tiny_gguf(path, cfg, extra_tensors={"rope_freqs.weight": (factors, None)})
    src = read_gguf(path)
    assert src.model_args["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in src.tensor_shapes and len(list(src.tensors())) == 1 + 9 + 1

    # other thresholds: parameters are recovered up to a common scale and must reproduce the factors
    factors = _llama3_factors(64, 500000.0, 16.0, 2.0, 8.0, 4096)
    path = tmp_path / "llama3x.gguf"
    write_tiny_gguf(path, cfg, extra_tensors={"rope_freqs.weight": (factors, None)})
    rs = read_gguf(path).model_args["rope_scaling"]
    assert rs["factor"] == 16.0
    again = _llama3_factors(64, 500000.0, rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                            rs["original_max_position_embeddings"])
    np.testing.assert_allclose(again, factors, rtol=1e-4)

    # anything that is not Llama 3 scaling is refused, not approximated
    path = tmp_path / "odd.gguf"
    odd = np.random.default_rng(0).uniform(1, 4, 32).astype(np.float32)
    write_tiny_gguf(path, cfg, extra_tensors={"rope_freqs.weight": (odd, None)})
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "rope_freqs", "not supported")


# ---------------------------------------------------------------------------------------------
# tokenizer of the tiny files


def test_tiny_byte_level_tokenizer(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, extra_kv={"tokenizer.ggml.eot_token_id": ("uint32", TID["<|eot|>"])})
    files = read_gguf(path).tokenizer_files()
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    text = "hello the world"
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.tokens == ["he", "llo", "Ġthe", "Ġw", "or", "ld"]
    assert enc.ids == [TID[t] for t in enc.tokens]
    chat = "<|im_start|>user\nhello<|im_end|>"
    ids = tok.encode(chat).ids  # no BOS added for a gpt2 vocabulary by default
    assert ids[0] == TID["<|im_start|>"] and ids[-1] == TID["<|im_end|>"]
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.decode(tok.encode("añ€😀\t\n").ids) == "añ€😀\t\n"
    cfg = json.loads(files["tokenizer_config.json"])
    assert cfg["chat_template"] == CHATML and cfg["add_bos_token"] is False
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    gen = json.loads(files["generation_config.json"])
    assert gen["bos_token_id"] == TID["<|im_start|>"]
    assert gen["eos_token_id"] == [TID["<|im_end|>"], TID["<|eot|>"]]


@pytest.mark.parametrize("pre,expected", [
    ("gpt2", ["Ġ12345", "ĠĠ", "Ġx"]),
    ("default", ["Ġ12345", "ĠĠ", "Ġx"]),
    ("llama-bpe", ["Ġ", "123", "45", "ĠĠ", "Ġx"]),
    ("qwen2", ["Ġ", "1", "2", "3", "4", "5", "ĠĠ", "Ġx"]),
    ("smollm", ["Ġ", "1", "2", "3", "4", "5", "ĠĠ", "Ġx"]),
])
def test_pre_tokenizers(tmp_path, pre, expected):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre=pre)
    files = read_gguf(path).tokenizer_files()
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(" 12345   x")]
    assert pieces == expected
    assert tok.decode(tok.encode(" 12345   x").ids) == " 12345   x"
    cfg = json.loads(files["tokenizer_config.json"])
    assert cfg["add_bos_token"] is (pre == "llama-bpe")  # llama.cpp's default for Llama 3 vocabularies


def spm_training_text() -> list[str]:
    """About 6 KB of varied lines: English, digits, punctuation, whitespace runs, non-Latin scripts."""
    rng = np.random.default_rng(0)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards hex jolly boxing tokens "
             "merge pieces into larger pieces and models learn from text").split()
    lines = []
    for i in range(120):
        s = " ".join(rng.choice(words, size=rng.integers(3, 13)))
        if i % 3 == 0:
            s = s.capitalize() + ".!?;:,"[i % 6]
        if i % 5 == 0:
            s += f" {rng.integers(0, 10 ** rng.integers(1, 8))}"
        if i % 7 == 0:
            s = "   " + s + "  "
        if i % 11 == 0:
            s += "\t(x=1, y=[2,3]) {'k': \"v\"} <a/> 3.14 -42% $5 #tag @me"
        lines.append(s)
    lines += ["Привет мир, как дела? Сегодня хорошая погода.", "Καλημέρα κόσμε, τι κάνεις;",
              "日本語のテキストも少し入れます。東京は大きい都市です。", "中文文本也在这里。",
              "Ünïcödé çåfé naïve façade"] * 3
    return lines


def test_sentencepiece_vocab_matches_sentencepiece(tmp_path):
    """`llama` (SentencePiece) vocabulary: a small BPE model trained here with sentencepiece, written
    to GGUF the way llama.cpp's convert_hf_to_gguf.py does (pieces, scores, token types), converted,
    and compared with SentencePieceProcessor itself as the reference.

    Trained like Llama 2's tokenizer (BPE, byte fallback, identity normalization, whitespace kept,
    dummy space prefix), because those are the models that use the `llama` kind. llama.cpp's SPM
    tokenizer, and so our converted one, greedily merges the adjacent pair that makes the best-scoring
    piece (leftmost first), which is SentencePiece's BPE encoding. A *unigram* SentencePiece model
    (Viterbi over all pieces, vocabulary not closed under merges) is a different algorithm that
    llama.cpp handles as tokenizer.ggml.model "t5" (UGM), which the converter rejects; it is not
    compared here. SentencePiece's default nmt_nfkc normalization / whitespace collapsing are not
    done by llama.cpp either, hence "identity" and remove_extra_whitespaces=False.
    """
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(spm_training_text()), model_writer=model, model_type="bpe", vocab_size=640,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    assert n == 640
    tokens = [sp.id_to_piece(i) for i in range(n)]
    scores = [sp.get_score(i) for i in range(n)]
    # token types as convert_hf_to_gguf.py's _create_vocab_sentencepiece assigns them
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i)
             else 1 for i in range(n)]
    assert types[:3] == [2, 3, 3] and types.count(6) == 256 and tokens[3] == "<0x00>"
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, {"n_layers": 1, "dim": 32, "n_heads": 2, "n_kv_heads": 2, "ffn": 32}, qtype=QT.F16,
                    tokenizer="llama", pre="default", tokens=tokens, types=types, scores=scores,
                    special_ids=(sp.bos_id(), sp.eos_id()),
                    extra_kv={"tokenizer.ggml.unknown_token_id": ("uint32", sp.unk_id()),
                              "tokenizer.ggml.add_bos_token": ("bool", True),
                              "tokenizer.ggml.add_space_prefix": ("bool", True)})
    files = read_gguf(path).tokenizer_files()
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())

    texts = spm_training_text()[::7] + [
        "Hello world", "The quick brown fox.", " leading", "trailing ", "  two  spaces   three    four",
        " ", "   ", " " * 17, "", "\n", "a\nb\n\nc\n", "\t tab\t", "12345 67.89 -0.5e10", "(x=1, y=[2,3])",
        "jumps jumps jumpsjumps", "aaaaaaaa", "Сегодня хорошая погода", "東京は大きい",
        "Ωmega ✓ ß ñ €", "Emoji 😀🦙 and 日本 mixed ÿ",  # characters not in the training text: byte fallback
    ]
    merged = byte_fallback = 0
    for text in texts:
        ref = sp.encode(text)
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ref, (repr(text), [tokens[i] for i in ids], [tokens[i] for i in ref])
        if sp.decode(ref) == text:
            assert tok.decode(ids) == text, repr(text)
        merged += sum(len(tokens[i]) > 1 and types[i] == 1 for i in ids)
        byte_fallback += sum(types[i] == 6 for i in ids)
    assert merged > 100 and byte_fallback > 20  # the comparison exercises both merges and byte fallback

    assert tok.encode("Hello").ids == [sp.bos_id()] + sp.encode("Hello")  # add_bos_token
    assert tok.encode("\U0001F999", add_special_tokens=False).tokens[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    cfg = json.loads(files["tokenizer_config.json"])
    assert (cfg["bos_token"], cfg["eos_token"], cfg["unk_token"], cfg["add_bos_token"]) == ("<s>", "</s>", "<unk>", True)
    assert json.loads(files["generation_config.json"]) == {"bos_token_id": sp.bos_id(), "eos_token_id": [sp.eos_id()]}


# ---------------------------------------------------------------------------------------------
# 2. bad input: ConversionError with a one-line message, and nothing else


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, qtype=QT.Q8_0)
    return path.read_bytes()


@pytest.mark.parametrize("cut", [3, 20, 100, 1000, 0.2, 0.5, 0.9, -40])
def test_truncated_tiny(tmp_path, tiny_bytes, cut):
    """Cut in the header, the metadata, the tensor infos and the tensor data (-40: inside the
    last tensor, before its alignment padding)."""
    path = tmp_path / "cut.gguf"
    n = cut if isinstance(cut, int) and cut > 0 else int(len(tiny_bytes) * cut) if cut > 0 else len(tiny_bytes) + cut
    path.write_bytes(tiny_bytes[:n])
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "cut.gguf")


def test_truncated_real_file(tmp_path, default_gguf):
    path = tmp_path / "half.gguf"
    with open(default_gguf, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(default_gguf.stat().st_size // 2))
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "half.gguf")


@pytest.mark.parametrize("content", [b"", b"GGUF", np.random.default_rng(0).bytes(4096),
                                     b"GGUF\x03\x00\x00\x00" + np.random.default_rng(1).bytes(4096),
                                     b"PK\x03\x04 not a gguf file at all"],
                         ids=["empty", "magic-only", "random", "magic-then-random", "zip"])
def test_not_a_gguf(tmp_path, content):
    path = tmp_path / "junk.gguf"
    path.write_bytes(content)
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "junk.gguf")


def test_missing_file(tmp_path):
    with pytest.raises(ConversionError) as e:
        read_gguf(tmp_path / "nope.gguf")
    assert_one_line_error(e, "nope.gguf")


def test_unknown_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(path, {"arch": "falcon"})
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "'falcon'", "architecture")


@pytest.mark.parametrize("qtype", [QT.Q8_1, QT.I32], ids=lambda q: q.name)
def test_unsupported_tensor_type(tmp_path, qtype):
    path = tmp_path / "odd.gguf"
    if qtype == QT.I32:
        data = np.ones((len(TINY_TOKENS), BASE_CFG["dim"]), dtype=np.int32)
        raw = {"token_embd.weight": (data, None)}
    else:  # a type gguf-py cannot dequantize
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = np.random.default_rng(0).integers(0, 256, (len(TINY_TOKENS), BASE_CFG["dim"] // block * size),
                                                 dtype=np.uint8)
        raw = {"token_embd.weight": (data, qtype)}
    write_tiny_gguf(path, raw_tensors=raw)
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "token_embd.weight", qtype.name)


def test_unknown_pre_tokenizer(tmp_path):
    path = tmp_path / "pre.gguf"
    write_tiny_gguf(path, pre="mystery-bpe")
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "unknown pre-tokenizer", "mystery-bpe")


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "llama.context_length",
                                 "llama.attention.head_count", "tokenizer.ggml.model"])
def test_missing_metadata(tmp_path, key):
    path = tmp_path / "meta.gguf"
    write_tiny_gguf(path, skip_keys=(key,))
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, key if key != "tokenizer.ggml.model" else "tokenizer")


def test_missing_and_misshaped_tensors(tmp_path):
    path = tmp_path / "gap.gguf"
    write_tiny_gguf(path, drop_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "blk.1.ffn_up.weight")

    path = tmp_path / "shape.gguf"  # says 3 layers, holds 2
    write_tiny_gguf(path, extra_kv={"llama.block_count": ("uint32", 3)})
    with pytest.raises(ConversionError) as e:
        read_gguf(path)
    assert_one_line_error(e, "blk.2.")


# ---------------------------------------------------------------------------------------------
# 3 + 4. the real default model (SmolLM2-135M-Instruct Q4_1)


@pytest.fixture(scope="module")
def smollm2(default_gguf):
    return read_gguf(default_gguf)


def test_smollm2_tokenizer_parity(smollm2):
    pinned = json.loads((DATA / "smollm2_tokens.json").read_text(encoding="utf-8"))
    assert "llama-cpp-python" in pinned["note"]
    files = smollm2.tokenizer_files()
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    assert len(pinned["cases"]) >= 20
    texts = [c["text"] for c in pinned["cases"]]
    assert "\n\n  0." in texts
    for case in pinned["cases"]:
        ids = tok.encode(case["text"], add_special_tokens=False).ids
        assert ids == case["ids"], repr(case["text"])
        assert tok.decode(ids, skip_special_tokens=False) == case["text"], repr(case["text"])
    # the original SmolLM2 split (not transformers' GGUF loader): "\n\n  " "0" "."
    assert tok.encode("\n\n  0.", add_special_tokens=False).tokens == ["ĊĊĠĠ", "0", "."]
    assert tok.encode("hi").ids == tok.encode("hi", add_special_tokens=False).ids  # no BOS
    cfg = json.loads(files["tokenizer_config.json"])
    assert cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>"
    assert cfg["add_bos_token"] is False
    assert cfg["chat_template"].startswith("{% for message in messages %}")
    assert "'<|im_start|>' + message['role']" in cfg["chat_template"] and "add_generation_prompt" in cfg["chat_template"]
    gen = json.loads(files["generation_config.json"])
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == [2]
    vocab = json.loads(files["tokenizer.json"])
    assert len(vocab["model"]["merges"]) == 48900 and len(vocab["model"]["vocab"]) == 49152


def test_smollm2_model_args(smollm2):
    assert smollm2.model_args == {
        "dim": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64,
        "intermediate_size": 1536, "vocab_size": 49152, "norm_eps": 1e-5, "rope_theta": 100000.0,
        "rope_scaling": None, "max_seq_len": 8192, "tie_embeddings": True, "attention_bias": False,
        "qk_norm": False,
    }
    assert smollm2.description == "gguf:SmolLM2-135M-Instruct.Q4_1.gguf (llama, Q4_1)"


def test_smollm2_tensors(smollm2, default_gguf):
    raw = {t.name: t for t in gguf.GGUFReader(default_gguf).tensors}
    assert raw["token_embd.weight"].tensor_type == QT.Q8_0
    assert raw["blk.0.attn_q.weight"].tensor_type == QT.Q4_1
    expected_shapes = {"attention_norm.weight": (576,), "attention.wq.weight": (576, 576),
                       "attention.wk.weight": (192, 576), "attention.wv.weight": (192, 576),
                       "attention.wo.weight": (576, 576), "ffn_norm.weight": (576,),
                       "feed_forward.w1.weight": (1536, 576), "feed_forward.w3.weight": (1536, 576),
                       "feed_forward.w2.weight": (576, 1536)}
    gen = smollm2.tensors()
    assert inspect.isgenerator(gen)
    count = 0
    for name, t in gen:  # streamed: only the current tensor is held
        count += 1
        assert t.dtype == torch.float32 and torch.isfinite(t).all(), name
        if name == "tok_embeddings.weight":
            assert tuple(t.shape) == (49152, 576)
            rows = [0, 1, 2, 1000, 49151]
            ref = gguf.quants.dequantize(raw["token_embd.weight"].data[rows], QT.Q8_0)
            np.testing.assert_array_equal(t[rows].numpy(), ref)
        elif name == "norm.weight":
            assert tuple(t.shape) == (576,)
            np.testing.assert_array_equal(t.numpy(), raw["output_norm.weight"].data)
        else:
            _, i, rest = name.split(".", 2)
            assert 0 <= int(i) < 30 and tuple(t.shape) == expected_shapes[rest], name
            if name in ("layers.0.attention.wq.weight", "layers.29.attention.wk.weight"):
                # permuting our rows the llama.cpp way must give the stored rows back
                g = raw[gguf_name(name)]
                stored = gguf.quants.dequantize(g.data, QT.Q4_1)
                heads = 9 if ".wq." in name else 3
                np.testing.assert_array_equal(llama_cpp_permute(t.numpy(), 9, heads), stored)
                assert not np.array_equal(t.numpy(), stored)
        del t
    assert count == 30 * 9 + 2
    assert "output.weight" not in smollm2.tensor_shapes


def test_cli_unsupported_type_and_truncated_file_leave_nothing_behind(tmp_path):
    """Through the command line: one error line, exit status 1, no output directory left."""
    import subprocess
    import sys

    block, size = gguf.GGML_QUANT_SIZES[QT.Q8_1]
    data = np.random.default_rng(0).integers(0, 256, (len(TINY_TOKENS), BASE_CFG["dim"] // block * size),
                                             dtype=np.uint8)
    odd = tmp_path / "odd.gguf"
    write_tiny_gguf(odd, raw_tensors={"token_embd.weight": (data, QT.Q8_1)})
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    root = Path(__file__).resolve().parent.parent
    for src, needle in [(odd, "Q8_1"), (cut, "cut.gguf")]:
        out = tmp_path / "out"
        r = subprocess.run([sys.executable, str(root / "convert_hf_checkpoint.py"), str(src), "--out", str(out)],
                           capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert lines[-1].startswith("error:") and needle in lines[-1], r.stderr
        assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    r = subprocess.run([sys.executable, str(root / "convert_hf_checkpoint.py"), str(good), "--out",
                        str(tmp_path / "ok"), "--dtype", "fp32"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ok" / "tokenizer.json").is_file() and (tmp_path / "ok" / "config.json").is_file()


def test_llama3_rope_freqs_give_llama_cpps_frequencies_and_logits(tmp_path):
    """rope_freqs holds a factor per frequency (llama.cpp divides each base frequency by it). The converted
    model's RoPE, from the recovered Llama-3.1 parameters, equals that reading: the frequencies, and the
    logits of a sequence against the same weights with the rotation tables built from the factors."""
    from convert_hf_checkpoint import convert
    from model import Transformer, rope_frequencies

    cfg = {"n_layers": 1, "dim": 128, "n_heads": 2, "n_kv_heads": 1, "ffn": 64, "theta": 500000.0}
    factors = _llama3_factors(64, 500000.0, 8.0, 1.0, 4.0, 8192)
    write_tiny_gguf(tmp_path / "l.gguf", cfg, extra_tensors={"rope_freqs.weight": (factors, None)})
    model = Transformer.from_checkpoint(convert(str(tmp_path / "l.gguf"), tmp_path / "ck", dtype="fp32"),
                                        "cpu", torch.float32)
    direct = torch.tensor(1 / 500000.0 ** (np.arange(0, 64, 2) / 64) / factors, dtype=torch.float32)
    assert len(set(factors.tolist())) > 2  # (scaled, unscaled and interpolated frequencies)
    torch.testing.assert_close(rope_frequencies(model.args), direct, rtol=1e-5, atol=0)
    idx = torch.randint(0, model.args.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    model.setup_caches(1, 48)
    with torch.no_grad():
        ours = model(idx, torch.arange(48))
        angles = torch.outer(torch.arange(48, dtype=torch.float32), direct).repeat(1, 2)  # rotate-half: both halves
        model.rope_cos.copy_(angles.cos())
        model.rope_sin.copy_(angles.sin())
        torch.testing.assert_close(ours, model(idx, torch.arange(48)), rtol=1e-5, atol=1e-5)
