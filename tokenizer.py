"""One tokenizer interface over the three formats Llama-family checkpoints ship with.

    from tokenizer import load_tokenizer
    tok = load_tokenizer("checkpoints/SmolLM2-135M-Instruct")
    ids = tok.encode("Hello")                 # BOS prepended iff tok.add_bos
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])   # prompt ids for a chat model
    dec = tok.stream_decoder()
    for t in generated: print(dec.push(t), end="")
    print(dec.flush())

Backends, picked from file contents (tokenizer.json wins when both files exist):
  tokenizer.json   Hugging Face `tokenizers`                 -> HFTokenizer
  tokenizer.model  SentencePiece protobuf                    -> SentencePieceTokenizer
  tokenizer.model  tiktoken rank file (Llama 3 `original/`)  -> TiktokenTokenizer
Side files read when present: tokenizer_config.json, chat_template.jinja, generation_config.json.

encode() parses special-token text ("<|im_start|>") into special ids, except with SentencePiece, which never parses
its control symbols ("<s>") out of text (ids then match SentencePieceProcessor); encode_chat() splits them for every
backend. decode() renders special tokens as their text, so decode(encode_chat(m)) reproduces apply_chat_template(m).
"""
import base64
import binascii
import functools
import json
import re
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

# Llama 3 (tiktoken) constants, as in Meta's llama-models llama3 tokenizer.py (convert_gguf.py uses the split).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256
# Named ones first, reserved ones fill the rest, as Llama 3.1-3.3 text tokenizers name them (Meta's multimodal
# code renames reserved_2/3). <|eom_id|>: end of message (a tool call follows); <|eot_id|>: end of turn.
_LLAMA3_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED + [
    f"<|reserved_special_token_{3 + i}|>" for i in range(LLAMA3_NUM_SPECIAL - len(_LLAMA3_NAMED))]
LLAMA3_STOP_TOKENS = ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")

# Special tokens that end generation in the common chat formats; a tokenizer.json backend stops on those it
# registers as special, so that a checkpoint without generation_config.json still stops.
KNOWN_STOP_TOKENS = (*LLAMA3_STOP_TOKENS, "<|im_end|>", "<|endoftext|>", "</s>")

# Built-in chat templates, used only when the checkpoint has none. Each is one logical line (the
# Python strings are concatenated), so trim_blocks/lstrip_blocks cannot change their output.
# Meta Llama 3 Instruct: <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>...
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# ChatML: <|im_start|>user\nHi<|im_end|>\n ... <|im_start|>assistant\n
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 2 chat, as Meta's reference chat_completion builds it:
#   <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s><s>[INST] {user} [/INST]
# The model writes the answer right after "[/INST]", so add_generation_prompt changes nothing.
LLAMA2_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system_message = messages[0]['content'] | trim %}{% set turns = messages[1:] %}"
    "{% else %}{% set system_message = none %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Llama 2 chat needs alternating user/assistant messages after the system one') }}{% endif %}"
    "{% if message['role'] == 'user' %}{% if loop.first and system_message is not none %}"
    "{{ bos_token + '[INST] <<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}{% endif %}"
    "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


class StreamDecoder:
    """Incremental detokenizer: push(id) returns the newly completed text.

    It emits decode(context + pending ids) minus decode(context), so position-dependent rendering (SentencePiece
    drops the first piece's "▁" space) is the same in both. The context is the last emission's tokens, extended
    while they show no visible character (a context decoding to "" would make SentencePiece strip the next piece's
    space too). Text ending in U+FFFD, an incomplete UTF-8 character (an emoji split over byte tokens), is held back."""

    def __init__(self, tokenizer: "Tokenizer"):
        self._tok = tokenizer
        self._ids: list[int] = []  # context + pending tokens
        self._read = 0  # ids[:read] is the context (already emitted)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        before = self._tok.decode(self._ids[:self._read])
        out = self._tok.decode(self._ids)[len(before):]
        if not out or out.endswith("\ufffd"):
            return ""
        if out.strip():  # the new tokens alone are a safe context; forget the old one
            self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return out

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD) and reset."""
        before = self._tok.decode(self._ids[:self._read])
        text = self._tok.decode(self._ids)
        self._ids, self._read = [], 0
        return text[len(before):]


class Tokenizer:
    """The interface plus everything that does not depend on the backend: side files, BOS/EOS
    resolution, chat templates, streaming. Backends implement the hooks, set _default_stop_tokens
    and, if the model wants BOS prepended, _default_bos_id, then call Tokenizer.__init__ with the
    checkpoint directory, which merges the side files with those defaults."""

    _default_bos_id: int | None = None

    def __init__(self, directory: Path) -> None:
        config = _read_json(directory / "tokenizer_config.json")
        gen = _read_json(directory / "generation_config.json")

        self._added_tokens = {e["content"]: int(k) for k, e in (config.get("added_tokens_decoder") or {}).items()}

        bos_text, eos_text = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        self.bos_id: int | None = self._resolve(bos_text, "bos_token")
        if self.bos_id is None:
            gen_bos = gen.get("bos_token_id")
            self.bos_id = gen_bos if isinstance(gen_bos, int) else self._default_bos_id

        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids: set[int] = set(self._default_stop_tokens)
        self.eos_ids.update(i for i in [self._resolve(eos_text, "eos_token"), *gen_eos] if isinstance(i, int))

        add_bos = config.get("add_bos_token")
        self.add_bos: bool = add_bos if isinstance(add_bos, bool) else self._default_bos_id is not None
        if self.add_bos and self.bos_id is None:
            raise ValueError(f"{directory}: the tokenizer should add a BOS token but none is defined")

        # The text of BOS / EOS as chat templates see them: the config's, else the vocabulary's.
        self.bos_token = bos_text or (self._vocab_text(self.bos_id) if self.bos_id is not None else None) or ""
        stop = min(self._default_stop_tokens, default=None)
        self.eos_token = eos_text or (self._vocab_text(stop) if stop is not None else None) or ""
        self.chat_template: str | None = _chat_template(directory, config)  # the checkpoint's own, if any

    # ---- backend hooks: _encode_text(text) (ids, no BOS added), decode(ids) (special tokens
    # rendered as text), _vocab_lookup(token string) -> id or None, _vocab_text(id) -> string.
    def _encode_chat_text(self, text: str) -> list[int]:
        """Token ids of rendered chat text, with every special-token string mapped to its id."""
        return self._encode_text(text)

    # ---- public API
    def token_to_id(self, token: str) -> int | None:
        found = self._vocab_lookup(token)
        return found if found is not None else self._added_tokens.get(token)

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        """Token ids of text; bos=None prepends BOS iff self.add_bos. BOS is never doubled: when
        the text's own ids already start with BOS (its special-token text), none is added."""
        ids = self._encode_text(text)
        return self._with_bos(ids) if (self.add_bos if bos is None else bos) else ids

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the checkpoint's Jinja template (or the built-in for its format)."""
        template = _compile_template(self.chat_template or self._fallback_template())
        # Hugging Face passes tools and documents too; templates with tool support test them.
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token, eos_token=self.eos_token, tools=None, documents=None)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a chat: the rendered template with its special-token text (SentencePiece's
        "<s>"/"</s>" too, which encode() leaves as text) mapped to the special ids. When the model
        expects BOS, the result starts with exactly one, whether or not the template emitted it."""
        ids = self._encode_chat_text(self.apply_chat_template(messages, add_generation_prompt))
        return self._with_bos(ids) if self.add_bos else ids

    # ---- shared helpers
    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.bos_id is None:
            raise ValueError("this tokenizer has no BOS token to prepend")
        return ids if ids[:1] == [self.bos_id] else [self.bos_id] + ids

    def _fallback_template(self) -> str:
        for marker, template in (("<|start_header_id|>", LLAMA3_TEMPLATE), ("<|im_start|>", CHATML_TEMPLATE)):
            if self.token_to_id(marker) is not None:
                return template
        return LLAMA2_TEMPLATE

    def _resolve(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        found = self.token_to_id(token)
        if found is None:
            # Hugging Face would add the token to the vocabulary; the model cannot produce it, so
            # it is useless as BOS/EOS. Say so rather than fail a checkpoint that otherwise works.
            warnings.warn(f"tokenizer_config.json {what} {token!r} is not in the vocabulary; ignored")
        return found


class HFTokenizer(Tokenizer):
    """tokenizer.json through the Hugging Face `tokenizers` library."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _HF

        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for every parse error
            raise ValueError(f"cannot read {path}: {_one_line(e)}") from e
        # A saved truncation/padding setting would silently cut or pad prompts.
        self._tok.no_truncation()
        self._tok.no_padding()
        self._vocab_lookup, self._vocab_text = self._tok.token_to_id, self._tok.id_to_token  # already the hooks

        # The post-processor (e.g. TemplateProcessing "<s> $A") shows whether the model wants BOS.
        # We always encode with add_special_tokens=False and add BOS ourselves, so it is never doubled.
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        if len(full) > len(plain) and full[1:len(plain) + 1] == plain:  # "<s> $A" or "<s> $A </s>"
            self._default_bos_id = full[0]
        specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._default_stop_tokens = {specials[t] for t in KNOWN_STOP_TOKENS if t in specials}
        super().__init__(path.parent)

    def _encode_text(self, text: str) -> list[int]:
        # Added (special) tokens in the text are matched whatever add_special_tokens says.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """tokenizer.model holding a SentencePiece ModelProto (Llama 1/2, Mistral, Gemma...)."""

    def __init__(self, data: bytes, path: Path):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        except RuntimeError as e:
            raise ValueError(f"{path} is neither a SentencePiece model nor a tiktoken file: {_one_line(e)}") from e
        n = self._sp.vocab_size()
        if n == 0:  # an empty protobuf parses fine
            raise ValueError(f"{path} is a SentencePiece model with an empty vocabulary")
        # Control symbols (<s>, </s>, Mistral's [INST]...) are never matched in text by
        # SentencePiece; encode_chat splits them out itself and decode renders them as text.
        self._control = {self._sp.id_to_piece(i): i for i in range(n) if self._sp.is_control(i)}
        self._control.pop("", None)
        self._control_ids = set(self._control.values())
        longest_first = sorted(self._control, key=len, reverse=True)
        self._control_re = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if self._control else None
        self._vocab_text = self._sp.id_to_piece  # (the hook)
        bos, eos = self._sp.bos_id(), self._sp.eos_id()
        self._default_bos_id = bos if bos >= 0 else None
        self._default_stop_tokens = {eos} if eos >= 0 else set()
        super().__init__(path.parent)

    def _encode_text(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def _encode_chat_text(self, text: str) -> list[int]:
        # Each text segment is encoded on its own, as Meta's Llama 2 chat code encodes each
        # "[INST] ... [/INST] answer" segment separately (each gets the "▁" dummy prefix).
        ids: list[int] = []
        for i, part in enumerate(self._control_re.split(text) if self._control_re else [text]):
            if i % 2:
                ids.append(self._control[part])
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: list[int]) -> str:
        # Runs between control tokens are decoded separately: the inverse of _encode_chat_text.
        out, run = [], []
        for i in ids:
            if i in self._control_ids:
                out += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(int(i))
        return "".join([*out, self._sp.decode(run)])

    def _vocab_lookup(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)  # unknown pieces map to unk_id
        return i if self._sp.id_to_piece(i) == token else None


class TiktokenTokenizer(Tokenizer):
    """tokenizer.model holding tiktoken BPE ranks (Llama 3's `original/tokenizer.model`), with
    Llama 3's split pattern and its 256 special tokens after the base vocabulary. Meta splits inputs
    over 400k characters (a tiktoken limit) and long runs without whitespace; prompts here are shorter."""

    def __init__(self, data: bytes, path: Path):
        import tiktoken

        self._ranks = _parse_tiktoken_ranks(data, path)
        base = len(self._ranks)
        if max(self._ranks.values()) >= base:  # special ids would collide with base ranks
            raise ValueError(f"{path}: tiktoken ranks are not 0..{base - 1}")
        self._special = {t: base + i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self._enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=self._ranks,
                                      special_tokens=self._special)
        self._default_bos_id = self._special["<|begin_of_text|>"]
        self._default_stop_tokens = {self._special[t] for t in LLAMA3_STOP_TOKENS}
        super().__init__(path.parent)

    def _encode_text(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([int(i) for i in ids])  # errors="replace": partial UTF-8 is U+FFFD

    def _vocab_lookup(self, token: str) -> int | None:
        return self._special.get(token, self._ranks.get(token.encode("utf-8")))

    def _vocab_text(self, token_id: int) -> str | None:
        return self._enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")  # specials too


_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+")


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory; see the module docstring for what is read."""
    directory = Path(checkpoint_dir)
    json_path, model_path = directory / "tokenizer.json", directory / "tokenizer.model"
    if json_path.is_file():
        return HFTokenizer(json_path)
    if not model_path.is_file():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {directory}")
    data = model_path.read_bytes()
    # A tiktoken file is text lines "<base64 bytes> <rank>"; a SentencePiece protobuf is binary
    # and starts with a field tag (0x0a), so the first line decides.
    is_tiktoken = _TIKTOKEN_LINE.fullmatch(data.split(b"\n", 1)[0].strip()) is not None
    return (TiktokenTokenizer if is_tiktoken else SentencePieceTokenizer)(data, model_path)


def _parse_tiktoken_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        if not _TIKTOKEN_LINE.fullmatch(line.strip()):
            raise ValueError(f"{path}:{lineno}: not a tiktoken '<base64> <rank>' line")
        token, rank = line.split()
        try:
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except binascii.Error as e:
            raise ValueError(f"{path}:{lineno}: bad base64: {e}") from e
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: duplicate tiktoken ranks")
    return ranks


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {_one_line(e)}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """tokenizer_config bos_token/eos_token: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    # As in transformers, a chat_template.jinja file takes precedence over the config entry.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        if "default" not in named:
            raise ValueError(f"{directory}: chat_template list has no 'default' entry")
        template = named["default"]
    return template or None


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    """A chat template, compiled in the environment Hugging Face renders chat templates in."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
