"""tokenizer.py against real tokenizer files built here: a SentencePiece model, a tiktoken rank
file (converted from a byte-level BPE trained with `tokenizers`) and tokenizer.json files."""
import base64
import io
import json
import random
import shutil

import pytest
import sentencepiece as spm
import tiktoken
from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> printable character

from tokenizer import (
    CHATML_TEMPLATE,
    LLAMA3_PATTERN,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
)

WORDS = (
    "the quick brown fox jumps over a lazy dog while hello world models stream tokens and decode "
    "text in many languages café naïve über déjà Привет мир как дела 你好 中文 日本語 ελληνικά "
    "don't it's we'll I'm"
).split()
PUNCT = [".", ",", "!", "?", ":", ";", "-", "(", ")", "\n"]


def corpus(n_lines=250, seed=0):
    """A few KB of deterministic text. Digits appear, 世界 and emoji do not (byte fallback)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice(PUNCT))
    return lines


TEXTS = [
    "Hello world",
    "the quick brown fox jumps over the lazy dog.",
    "digits 1234567 and 3.14159, 42!",
    "whitespace   runs\t\ttabs\n\nnewlines  \n   indented",
    "  leading and trailing spaces  ",
    "Привет, мир! ελληνικά café naïve",
    "你好 世界, 日本語のテキスト",
    "emoji 😀 and 🎉🎉 and 👩‍👩‍👧 family",
    "mixed: über 😀世界 x\u00a0y",
]
STREAM_TEXTS = ["😀 世界 你好🎉, 中文 👩‍👩‍👧 ok", "  a😀b  世界\n\n🎉", TEXTS[3], TEXTS[5]]
SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]


def stream(tok, ids):
    dec = tok.stream_decoder()
    return [dec.push(i) for i in ids] + [dec.flush()]


def assert_stream_ok(tok, ids):
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    # A half character would surface as U+FFFD (or, in a str, cannot exist at all).
    for piece in pieces:
        assert "\ufffd" not in piece


# ---------------------------------------------------------------------------- SentencePiece
@pytest.fixture(scope="session")
def sp_model_bytes():
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=buf,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        # Llama's settings: no normalization, keep whitespace runs, so decode(encode(t)) == t.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return buf.getvalue()


@pytest.fixture()
def sp_dir(tmp_path, sp_model_bytes):
    (tmp_path / "tokenizer.model").write_bytes(sp_model_bytes)
    return tmp_path


@pytest.fixture(scope="session")
def sp_ref(sp_model_bytes):
    return spm.SentencePieceProcessor(model_proto=sp_model_bytes)


def test_sp_ids_match_sentencepiece(sp_dir, sp_ref):
    tok = load_tokenizer(sp_dir)
    assert isinstance(tok, SentencePieceTokenizer)
    for text in TEXTS:
        assert tok.encode(text, bos=False) == sp_ref.encode(text), text
    # The emoji really goes through byte-fallback pieces.
    assert "<0xF0>" in [sp_ref.id_to_piece(i) for i in tok.encode("😀", bos=False)]


def test_sp_roundtrip_bos_eos(sp_dir, sp_ref):
    tok = load_tokenizer(str(sp_dir))
    assert tok.bos_id == sp_ref.bos_id() == 1
    assert tok.eos_ids == {sp_ref.eos_id()}
    assert tok.add_bos is True
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
        assert ids[1:] == tok.encode(text, bos=False)
        assert tok.decode(ids[1:]) == text
    # decode renders control tokens as text (nothing skipped).
    assert tok.decode(tok.encode("hi") + [sp_ref.eos_id()]) == "<s>hi</s>"


def test_sp_stream_decoder(sp_dir):
    tok = load_tokenizer(sp_dir)
    for text in STREAM_TEXTS + TEXTS:
        ids = tok.encode(text, bos=False)
        assert_stream_ok(tok, ids)
        assert "".join(stream(tok, ids)) == text
        assert_stream_ok(tok, tok.encode(text))  # with BOS first
    # Leading "▁" handling between pieces: "▁" alone then "▁word" must keep both spaces.
    ids = tok.encode("a  the   world", bos=False)
    assert "".join(stream(tok, ids)) == "a  the   world"


def test_sp_stream_never_splits_a_character(sp_dir, sp_ref):
    tok = load_tokenizer(sp_dir)
    ids = tok.encode("🎉世界", bos=False)
    assert len(ids) >= 8  # 4 + 3 + 3 byte tokens (plus "▁")
    pieces = stream(tok, ids)
    assert [p for p in pieces if p] == ["🎉", "世", "界"]


def test_sp_llama2_fallback_template_and_encode_chat(sp_dir, sp_ref):
    tok = load_tokenizer(sp_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there [/INST] Hello. </s>"
        "<s>[INST] Bye [/INST]"
    )
    assert tok.apply_chat_template(messages[1:2]) == "<s>[INST] Hi there [/INST]"
    # As Meta's chat_completion: each segment encoded on its own between BOS/EOS ids.
    ids = tok.encode_chat(messages)
    bos, eos = sp_ref.bos_id(), sp_ref.eos_id()
    assert ids == (
        [bos] + sp_ref.encode("[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there [/INST] Hello. ")
        + [eos, bos] + sp_ref.encode("[INST] Bye [/INST]")
    )
    assert tok.decode(ids) == text
    with pytest.raises(TemplateError, match="alternating"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_sp_config_overrides(sp_dir):
    (sp_dir / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False,
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ bos_token }}<{{ m['content'] }}>{{ eos_token }}{% endfor %}",
    }))
    tok = load_tokenizer(sp_dir)
    assert tok.add_bos is False
    assert tok.encode("hi") == tok.encode("hi", bos=False)
    assert tok.encode("hi", bos=True)[0] == tok.bos_id
    # The model's own template wins over the Llama-2 fallback.
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s><x></s>"
    # encode_chat does not add BOS when the model does not want one, but maps "<s>" text.
    assert tok.encode_chat([{"role": "user", "content": "x"}])[0] == tok.bos_id


def test_stream_decoder_window_stays_small(sp_dir):
    tok = load_tokenizer(sp_dir)
    text = " ".join(corpus(60, seed=3)) + " 😀世界🎉" * 20
    ids = tok.encode(text, bos=False)
    assert len(ids) > 1000
    sizes = []
    real_decode = tok.decode

    def counting_decode(window):
        sizes.append(len(window))
        return real_decode(window)

    tok.decode = counting_decode  # instance attribute shadows the method
    pieces = stream(tok, ids)
    del tok.decode
    assert "".join(pieces) == text
    assert max(sizes) <= 12, max(sizes)


# ---------------------------------------------------------------------------- tiktoken
def train_bytelevel_bpe(vocab_size, special_tokens=()):
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


@pytest.fixture(scope="session")
def bpe_ref():
    return train_bytelevel_bpe(256 + 300)


@pytest.fixture(scope="session")
def tiktoken_ranks(bpe_ref):
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    # Ids are assigned in merge order (the 256 bytes first), so rank = id respects merge order.
    return {bytes(byte_of[ch] for ch in token): i for token, i in bpe_ref.get_vocab().items()}


@pytest.fixture()
def tt_dir(tmp_path, tiktoken_ranks):
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(tiktoken_ranks.items(), key=lambda kv: kv[1])]
    (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    return tmp_path


# Meta's published split pattern (meta-llama/llama3, llama/tokenizer.py, pat_str), written out here so
# that the reference does not come from the code under test.
META_LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def test_tiktoken_ids_match_references(tt_dir, tiktoken_ranks, bpe_ref):
    tok = load_tokenizer(tt_dir)
    assert isinstance(tok, TiktokenTokenizer)
    assert LLAMA3_PATTERN == META_LLAMA3_PATTERN
    direct = tiktoken.Encoding("ref", pat_str=META_LLAMA3_PATTERN, mergeable_ranks=tiktoken_ranks, special_tokens={})
    # digits in runs of 1-7, contractions in both cases, whitespace runs before words and at the end
    for text in TEXTS + ["I'm sure you've 12 or 123456 of THEM'LL   go\n\n  now  ", "a1b22c333d4444 5 55 555"]:
        assert tok.encode(text, bos=False) == direct.encode(text), text
    # Where the Llama 3 split and the ByteLevel split agree (no digits, no contractions, single
    # spaces), the tokenizers BPE itself is the reference.
    for text in ["the quick brown fox jumps over a lazy dog", "hello world, models stream tokens!",
                 "Привет мир как дела", "café naïve über déjà 你好"]:
        assert tok.encode(text, bos=False) == bpe_ref.encode(text).ids, text


def test_tiktoken_special_tokens(tt_dir, tiktoken_ranks):
    tok = load_tokenizer(tt_dir)
    base = len(tiktoken_ranks)
    expected = {
        "<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|reserved_special_token_0|>": 2,
        "<|reserved_special_token_1|>": 3, "<|finetune_right_pad_id|>": 4,
        "<|reserved_special_token_2|>": 5, "<|start_header_id|>": 6, "<|end_header_id|>": 7,
        "<|eom_id|>": 8, "<|eot_id|>": 9, "<|python_tag|>": 10, "<|reserved_special_token_3|>": 11,
        "<|reserved_special_token_247|>": 255,
    }
    for name, offset in expected.items():
        assert tok.token_to_id(name) == base + offset, name
    assert tok.token_to_id("<|reserved_special_token_248|>") is None
    assert tok.bos_id == base
    assert tok.eos_ids == {base + 1, base + 8, base + 9}
    assert tok.add_bos is True
    assert tok.encode("<|eot_id|>", bos=False) == [base + 9]
    ids = tok.encode("hi<|eot_id|>there")
    assert ids[0] == base and ids.count(base) == 1 and base + 9 in ids
    assert tok.decode(ids) == "<|begin_of_text|>hi<|eot_id|>there"
    # Text that already starts with BOS gets no second one.
    assert tok.encode("<|begin_of_text|>hi")[:2] == [base, tok.encode("hi", bos=False)[0]]


def test_tiktoken_roundtrip_and_stream(tt_dir):
    tok = load_tokenizer(tt_dir)
    for text in TEXTS + STREAM_TEXTS:
        ids = tok.encode(text, bos=False)
        assert tok.decode(ids) == text
        assert_stream_ok(tok, ids)
        assert "".join(stream(tok, ids)) == text
    # An emoji unseen in training is four single-byte tokens; it comes out whole.
    ids = tok.encode("🎉", bos=False)
    assert len(ids) == 4
    assert [p for p in stream(tok, ids) if p] == ["🎉"]


def test_tiktoken_llama3_fallback_template(tt_dir):
    tok = load_tokenizer(tt_dir)
    text = tok.apply_chat_template(SYSTEM_USER)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode_chat(SYSTEM_USER)
    assert ids == tok.encode(text, bos=False)
    assert ids[:2] == [tok.bos_id, tok.token_to_id("<|start_header_id|>")]
    assert ids.count(tok.bos_id) == 1 and ids.count(tok.token_to_id("<|eot_id|>")) == 2
    assert not tok.apply_chat_template(SYSTEM_USER, add_generation_prompt=False).endswith("<|end_header_id|>\n\n")


# ---------------------------------------------------------------------------- tokenizer.json
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="session")
def chatml_ref():
    return train_bytelevel_bpe(256 + 3 + 300, CHATML_SPECIALS)


@pytest.fixture()
def hf_dir(tmp_path, chatml_ref):
    chatml_ref.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": SMOL_TEMPLATE,
    }))
    return tmp_path


def test_hf_ids_and_specials(hf_dir, chatml_ref):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        assert tok.encode(text) == chatml_ref.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    start, end = chatml_ref.token_to_id("<|im_start|>"), chatml_ref.token_to_id("<|im_end|>")
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == start
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == end
    assert tok.add_bos is False
    assert tok.bos_id == start
    assert tok.eos_ids == {end, chatml_ref.token_to_id("<|endoftext|>")}


def test_hf_chat_template_renders_exactly(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    text = tok.apply_chat_template(SYSTEM_USER, add_generation_prompt=False)
    assert text == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    ids = tok.encode_chat(SYSTEM_USER)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(tok.token_to_id("<|im_end|>")) == 2
    assert tok.decode(ids) == tok.apply_chat_template(SYSTEM_USER)


def test_hf_chatml_fallback(hf_dir):
    (hf_dir / "tokenizer_config.json").unlink()
    tok = load_tokenizer(hf_dir)
    assert tok.chat_template is None
    assert tok.apply_chat_template(SYSTEM_USER) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_hf_stream_decoder(hf_dir):
    tok = load_tokenizer(hf_dir)
    for text in STREAM_TEXTS + TEXTS + ["<|im_start|>assistant\n😀<|im_end|>"]:
        ids = tok.encode(text)
        assert_stream_ok(tok, ids)
        assert "".join(stream(tok, ids)) == text
    ids = tok.encode("👩‍👩‍👧")
    assert len(ids) > 3
    pieces = [p for p in stream(tok, ids) if p]
    assert "".join(pieces) == "👩‍👩‍👧" and all("\ufffd" not in p for p in pieces)


def test_hf_post_processor_bos_not_doubled(tmp_path):
    ref = train_bytelevel_bpe(256 + 2 + 200, ["<s>", "</s>"])
    bos = ref.token_to_id("<s>")
    ref.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert ref.encode("hi").ids[0] == bos  # the post-processor really adds BOS
    ref.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.add_bos is True and tok.bos_id == bos
    assert tok.encode("hello world") == ref.encode("hello world").ids
    assert tok.encode("hello world").count(bos) == 1
    assert tok.encode("hello world", bos=False) == ref.encode("hello world", add_special_tokens=False).ids
    assert tok.encode("<s>hello").count(bos) == 1
    assert tok.eos_ids == {ref.token_to_id("</s>")}
    # No template, no ChatML/Llama-3 tokens: Llama 2 format with this vocabulary's BOS/EOS text.
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == tok.encode("<s>[INST] hi [/INST]", bos=False)


def test_generation_config_eos_union(hf_dir, chatml_ref):
    (hf_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7, 9]}))
    tok = load_tokenizer(hf_dir)
    assert tok.eos_ids == {chatml_ref.token_to_id("<|endoftext|>"), chatml_ref.token_to_id("<|im_end|>"), 7, 9}
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert 11 in load_tokenizer(hf_dir).eos_ids


# ---------------------------------------------------------------------------- chat templates
def test_chat_template_list_form_and_jinja_file(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0]['content'] | upper }}"},
    ]}))
    assert load_tokenizer(hf_dir).apply_chat_template([{"role": "user", "content": "hey"}]) == "HEY"
    (hf_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}\n    {% if m['role'] == 'user' %}\n[{{ m['role'] }}]\n    {% endif %}\n{% endfor %}\n"
    )
    # The file wins; trim_blocks/lstrip_blocks drop the block-tag lines' indentation and newlines.
    assert load_tokenizer(hf_dir).apply_chat_template(SYSTEM_USER) == "[user]\n"


def test_template_helpers(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}{{ eos_token }}"
        "{% if messages | length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
    ), "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    tok = load_tokenizer(hf_dir)
    one = [{"role": "user", "content": "<b>é</b>"}]
    assert tok.apply_chat_template(one) == '[{"role": "user", "content": "<b>é</b>"}]|4|<|im_start|><|im_end|>'
    with pytest.raises(TemplateError, match="only one message"):
        tok.apply_chat_template(SYSTEM_USER)


def test_builtin_chatml_matches_module_constant(hf_dir):
    # The fallback is the module's CHATML_TEMPLATE, and the model's own template differs from it.
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = load_tokenizer(hf_dir)
    assert tok._fallback_template() == CHATML_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------- selection and errors
def test_tokenizer_json_preferred(hf_dir):
    (hf_dir / "tokenizer.model").write_bytes(b"not a tokenizer at all")
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)


def test_backend_chosen_by_contents_not_names(tmp_path, sp_model_bytes, tiktoken_ranks):
    # A directory named like a Llama 3 checkpoint holding a SentencePiece model, and vice versa.
    sp = tmp_path / "Meta-Llama-3-8B"
    sp.mkdir()
    (sp / "tokenizer.model").write_bytes(sp_model_bytes)
    assert isinstance(load_tokenizer(sp), SentencePieceTokenizer)
    tt = tmp_path / "llama-2-7b-sentencepiece"
    tt.mkdir()
    (tt / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in tiktoken_ranks.items()))
    assert isinstance(load_tokenizer(tt), TiktokenTokenizer)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)) as err:
        load_tokenizer(tmp_path)
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "does-not-exist")


@pytest.mark.parametrize("content", [
    bytes(range(256)) * 4,  # binary garbage: not a SentencePiece protobuf
    b"",  # empty file
    b"aGVsbG8= 0\nd29ybGQ= 1\nthis is not a rank line\n",  # tiktoken file broken on line 3
    b"aGVsbG8= 0\nd29ybGQ= 0\n",  # duplicate ranks
])
def test_corrupt_tokenizer_model(tmp_path, content):
    (tmp_path / "tokenizer.model").write_bytes(content)
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path)
    assert "\n" not in str(err.value) and "tokenizer.model" in str(err.value)


def test_truncated_tokenizer_json(hf_dir):
    data = (hf_dir / "tokenizer.json").read_bytes()
    (hf_dir / "tokenizer.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as err:
        load_tokenizer(hf_dir)
    assert "\n" not in str(err.value) and "tokenizer.json" in str(err.value)


def test_corrupt_config(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(hf_dir)


def test_copy_is_independent(hf_dir, tmp_path_factory):
    # load_tokenizer reads only the directory it is given (accepts str and Path alike).
    other = tmp_path_factory.mktemp("copy")
    shutil.copy(hf_dir / "tokenizer.json", other / "tokenizer.json")
    a, b = load_tokenizer(str(hf_dir)), load_tokenizer(other)
    assert a.encode("hello") == b.encode("hello")
    assert a.chat_template is not None and b.chat_template is None
