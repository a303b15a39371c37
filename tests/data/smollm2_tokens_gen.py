"""Regenerate smollm2_tokens.json: SmolLM2 token ids pinned from llama.cpp (an independent
tokenizer implementation), for tests/test_gguf.py::test_smollm2_tokenizer_parity.

Not part of the test suite (it needs llama-cpp-python, built from source). Run it as

    python -m venv /tmp/llamaenv && CMAKE_BUILD_PARALLEL_LEVEL=2 /tmp/llamaenv/bin/pip install llama-cpp-python
    /tmp/llamaenv/bin/python tests/data/smollm2_tokens_gen.py ~/.cache/graphdecode/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import sys
from pathlib import Path

TEXTS = [
    # English prose
    "The quick brown fox jumps over the lazy dog. It's a well-known pangram; we've used it since the 1880s!",
    "Hello world",
    " Hello world",
    "  leading and trailing spaces  ",
    "It's I'M we'LL they'd you're don't",
    # Python code with indentation
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint(fib(10))\n",
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}  # comment\n\t\treturn None\n",
    "    x = [i ** 2 for i in range(100) if i % 3 == 0]\n        \n",
    # numbers
    "12345 3.14159 1,000,000",
    "0 00 007 2024-01-15 10:30:00 +1-800-555-0199 1e-5 0x1F -42 $3.50 50%",
    # runs of spaces and tabs
    "   spaces   and\ttabs\t\tmixed \t \t end",
    "a  b   c    d     e\t\tf \t g",
    "   ",
    "\t",
    " ",
    # newlines before digits
    "\n\n  0.",
    "\n0",
    "\n\n1. First\n2. Second\n\n  3. Third",
    "line one\nline two\r\nline three\n\n\n",
    "x\n 1\n  22\n   333\n\t4444",
    # non-Latin scripts
    "中文测试：你好，世界！这是一个句子。",
    "Русский текст: Привет, мир! Как дела?",
    "النص العربي: مرحبا بالعالم",
    "हिन्दी पाठ: नमस्ते दुनिया",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장",
    # emoji, including ZWJ sequences, skin tones, flags
    "Emoji 😀🎉 and ZWJ 👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈 flags 🇫🇷🇯🇵",
    "❤️‍🔥 👍🏿 🧑‍🤝‍🧑",
    # special token text
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>Text after<repo_name>x<file_sep>",
    # mixed
    "Mixed: café naïve résumé — “quotes” ‘single’ … ½ ² ٣ ١٢٣ 𝟘𝟙",
    "URL: https://example.com/path?query=1&x=2#frag user@mail.org",
    "$$\\frac{a}{b}$$ `code` **bold** <div class=\"x\">&amp;</div>",
    "Temperature: 23.5°C at 14:05, 2×3=6, π≈3.14159…",
    "",
    "a",
]


def main(model_path: str) -> None:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, vocab_only=True, verbose=False)
    cases = [{"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)} for t in TEXTS]
    doc = {
        "note": (f"ids from llama.cpp via llama-cpp-python {llama_cpp.__version__}: "
                 "Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=True) "
                 f"on {Path(model_path).name}; regenerate with tests/data/smollm2_tokens_gen.py"),
        "cases": cases,
    }
    out = Path(__file__).with_name("smollm2_tokens.json")
    rows = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    out.write_text(f'{{\n "note": {json.dumps(doc["note"])},\n "cases": [\n{rows}\n ]\n}}\n', encoding="utf-8")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
