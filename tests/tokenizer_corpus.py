"""Texts for comparing tokenizers: code, numbers, scripts, whitespace, special tokens.

Shared by tests/test_tokenizer.py (transformers as the oracle) and
tests/peers/test_llamacpp_tokenizer.py (llama.cpp itself). ``random_texts`` adds seeded
random mixes of the same kinds of characters, which land on boundaries no hand-written
text thinks of.
"""

from __future__ import annotations

import random

STUDY_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nExplain how a CPU cache works.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

PYTHON = '''\
import numpy as np


class Cache:
    """A tiny LRU cache."""

    def __init__(self, size: int = 128) -> None:
        self.size = size
        self._data: dict[str, bytes] = {}

    def get(self, key):
        if key not in self._data:  # miss
            return None
        return self._data[key]


if __name__ == "__main__":
    print(f"{Cache(16).size=}", end="\\n")
'''

C_CODE = """\
#include <stdio.h>
#define N 64

static int sum(const int *a, size_t n) {
\tint s = 0;
\tfor (size_t i = 0; i < n; ++i) { s += a[i] >> 1; }
\treturn s;   /* half */
}

int main(void) {
    int a[N] = {0};
    printf("%d\\n", sum(a, N));
    return a[0] != 0 ? -1 : 0;
}
"""

JSON = (
    '{"model": "SmolLM2-135M", "layers": 30, "rope_theta": 100000.0, "tied": true,\n'
    ' "tokens": [1, 2, 3], "nested": {"a": null, "b": [{"c": "d"}]}, "pi": 3.14159e+00}'
)

# (name, text); names are test ids, so keep them short and unique
CORPUS: list[tuple[str, str]] = [
    ("empty", ""),
    ("prose", "The quick brown fox jumps over the lazy dog. Isn't it?"),
    ("contractions", "I'm sure you're right: it's theirs, we'll see, they've gone, he'd know."),
    ("contractions-upper", "DON'T SHOUT, I'LL HEAR YOU'RE THERE"),
    ("study-user", "Explain how a CPU cache works."),
    ("study-prompt", STUDY_PROMPT),
    ("python", PYTHON),
    ("c", C_CODE),
    ("json", JSON),
    ("markdown", "# Title\n\n- item *one*\n- item **two**\n\n```py\nx = 1\n```\n> quote"),
    ("url", "See https://example.com/a/b?c=d&e=f#g or mailto:someone@example.org."),
    ("digits", "1234567890"),
    ("number-separators", "1,000,000 and 3.14159 and 1_000 and 1'000 and 10^6 and -42"),
    ("dates-times", "2024-01-31T12:30:59Z, 31/01/2024, 12:30 pm"),
    ("mixed-alnum", "x1y22z333 abc123def 0x1F 1e-9 v2.0.1 IPv6 ::1"),
    ("unicode-digits", "٣٤٥ ۱۲۳ १२३ １２３ ①②③ ½ ¾ Ⅻ ² ³"),
    ("cjk", "你好，世界！今天天气很好。"),
    ("japanese", "こんにちは世界。カタカナとひらがな、漢字。"),
    ("korean", "안녕하세요 세계"),
    ("emoji", "👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🎉🎉🎉 😀😃"),
    ("combining", "e\u0301 a\u0308 n\u0303 Z\u0335\u0321a\u0336l\u0337g\u0338o\u0334"),
    ("arabic", "مرحبا بالعالم، كيف حالك؟"),
    ("hebrew", "שלום עולם"),
    ("devanagari", "नमस्ते दुनिया"),
    ("thai", "สวัสดีชาวโลก"),
    ("greek-cyrillic", "Καλημέρα κόσμε. Привет, мир!"),
    ("math-symbols", "∑ᵢ xᵢ² ≤ ∫₀¹ √x dx ≠ ∞ ± ∂ → ⇒ ∀ ∃"),
    ("currency", "€10 £5 ¥1000 $3.50 ₹99 ₿"),
    ("spaces", "a  b   c    d"),
    ("leading-spaces", "   leading"),
    ("trailing-spaces", "trailing   "),
    ("only-spaces", "     "),
    ("tabs", "\t\tx\ty\t"),
    ("newlines", "\n\n\nx\n\ny\n"),
    ("space-newline", " \n \n  \n"),
    ("crlf", "line one\r\nline two\r\n\r\n"),
    ("mixed-whitespace", "a \t\n b\t \n\tc  \n\n  d"),
    ("unicode-spaces", "a\u00a0b\u3000c\u2028d\u2009e\u202ff\x0bg\x0ch\x85i"),
    ("control-chars", "\x00\x01\x1b[0m\x7f"),
    ("invisible", "\ufeffBOM \u200bzero\u200dwidth \u00adsoft \u2060joiner"),
    ("private-use", "\ue000\uf8ff \U000f0000"),
    ("repeats", "a" * 200 + " " + "!" * 50 + " " + "." * 30 + " " + "=" * 40),
    ("punctuation", "Hello!!! What?! (yes) [no] {maybe} <tag> 'quoted' \"double\" --- ..."),
    ("apostrophes", "rock 'n' roll ' s 's 'S 'll 'LL ’s"),
    ("specials-inline", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("specials-adjacent", "<|im_start|><|im_end|><|endoftext|>"),
    ("specials-in-words", "x<|endoftext|>y and a<|im_end|>b"),
    ("specials-partial", "<|im_start <|im_end| |im_end|> <|endoftext"),
    ("specials-nested", "<<|im_start|>> <|<|im_end|>|>"),
    ("specials-spaces", " <|im_start|> user \n <|im_end|> "),
    ("code-specials", "<filename>main.py\n<gh_stars>100\n<file_sep>"),
]


def long_text(n_chars: int = 10_000) -> str:
    """A mix of every entry above, repeated to ``n_chars`` characters."""
    body = "\n\n".join(text for _, text in CORPUS if text)
    return (body * (n_chars // len(body) + 1))[:n_chars]


_ALPHABET = (
    "aeiou xyzABC   \t\n\r0123456789.,;:'\"!?-_()[]{}<>|/\\@#$%^&*+=~`"
    "éüñçß你好世界こんにちは안녕مرحباשלוםनमस्तेสวัสดี"
    "٣۱१１①½Ⅻ²∑√≤€£👍🏽🎉❤️\u0301\u0308\u00a0\u3000\u2028\u200d\ufeff\x00\x0b"
)
_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<", "|", ">", "'s", "'ll"]


def random_texts(n: int, *, seed: int = 0, max_len: int = 60) -> list[str]:
    """``n`` seeded random strings of the characters and fragments above."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, max_len)):
            if rng.random() < 0.05:
                parts.append(rng.choice(_SPECIALS))
            else:
                parts.append(rng.choice(_ALPHABET))
        out.append("".join(parts))
    return out
