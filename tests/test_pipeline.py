"""``pipeline("text-generation")``: token-for-token equal to mlx-lm, inputs, streaming, errors.

The reference for every output is mlx-lm itself (``mlx_lm.generate`` /
``stream_generate`` with ``make_sampler`` / ``make_logits_processors``) on the
same loaded model and tokenizer. The checkpoint is the tiny real-layout one with
the full vocabulary, so real text and the real Qwen3.6 chat template work.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import mlx.core as mx
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from qwen_apple_backend import hookimpl, pipeline, plugins
from qwen_apple_backend.errors import (BackendCapabilityError, InvalidInputError, PromptError,
                                       UnknownBackendError, UnknownTaskError,
                                       UnsupportedArgumentError)
from qwen_apple_backend.pipeline import GENERATION_DEFAULTS, TextGenerationStream

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def pipe(tiny_real_vocab):
    return pipeline("text-generation", model=str(tiny_real_vocab), backend="fused")


def _ref_tokens(pipe, prompt, max_tokens, **kwargs):
    """Token ids and text of mlx-lm's own stream_generate."""
    ids, text = [], ""
    for r in stream_generate(pipe.model, pipe.tokenizer, prompt, max_tokens=max_tokens,
                             **kwargs):
        ids.append(r.token)
        text += r.text
    return ids, text


def _chat_ids(tok, messages, **kwargs):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                   **kwargs)
    return tok.encode(text, add_special_tokens=False)


# ---- equality with mlx-lm ----------------------------------------------------------------


def test_loaded_through_the_registry(pipe):
    assert pipe.backend == "fused"
    report = pipe.model.qab_report
    assert report.backend == "fused" and any(m.kind == "moe" for m in report.modules)


def test_greedy_string_equals_mlx_lm_token_for_token(pipe):
    ref_text = generate(pipe.model, pipe.tokenizer, PROMPT, max_tokens=12)
    ref_ids, _ = _ref_tokens(pipe, PROMPT, 12)
    out = pipe(PROMPT, max_new_tokens=12)
    assert out == [{"generated_text": PROMPT + ref_text}]
    ids = pipe(PROMPT, max_new_tokens=12, return_tensors=True)[0]["generated_token_ids"]
    prompt_ids = pipe.tokenizer.encode(PROMPT)
    assert ids[:len(prompt_ids)] == prompt_ids and ids[len(prompt_ids):] == ref_ids
    assert len(ref_ids) == 12
    assert pipe(PROMPT, max_new_tokens=12, return_full_text=False) == [
        {"generated_text": ref_text}]


def test_list_of_strings_is_a_batch_of_independent_runs(pipe):
    prompts = [PROMPT, "1, 2, 3,", "Bonjour"]
    out = pipe(prompts, max_new_tokens=6, return_full_text=False)
    assert out == [[{"generated_text": generate(pipe.model, pipe.tokenizer, p, max_tokens=6)}]
                   for p in prompts]


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.8, 1.0, 0), (1.3, 0.9, 20)])
def test_seeded_sampling_equals_mlx_lm(pipe, temperature, top_p, top_k):
    kwargs = dict(max_new_tokens=10, do_sample=True, temperature=temperature, top_p=top_p,
                  top_k=top_k)
    mx.random.seed(1234)
    ids = pipe(PROMPT, return_tensors=True, **kwargs)[0]["generated_token_ids"]
    mx.random.seed(1234)
    text = pipe(PROMPT, return_full_text=False, **kwargs)[0]["generated_text"]
    sampler = make_sampler(temp=temperature, top_p=top_p, top_k=top_k)
    mx.random.seed(1234)
    ref_ids, ref_text = _ref_tokens(pipe, PROMPT, 10, sampler=sampler)
    assert ids[-10:] == ref_ids and text == ref_text
    greedy, _ = _ref_tokens(pipe, PROMPT, 10)
    assert ref_ids != greedy  # sampling really happened (near-flat random-weight logits)


def test_repetition_penalty_equals_mlx_lm_processor(pipe):
    n = 10
    prompt_ids = pipe.tokenizer.encode(PROMPT)
    procs = make_logits_processors(repetition_penalty=1.5,
                                   repetition_context_size=len(prompt_ids) + n)
    ref_ids, ref_text = _ref_tokens(pipe, PROMPT, n, logits_processors=procs)
    out = pipe(PROMPT, max_new_tokens=n, repetition_penalty=1.5, return_tensors=True)
    assert out[0]["generated_token_ids"][len(prompt_ids):] == ref_ids
    # 1.0 is "no penalty", as in transformers.
    assert pipe(PROMPT, max_new_tokens=n, repetition_penalty=1.0) == pipe(PROMPT,
                                                                           max_new_tokens=n)


def test_chat_applies_the_template_and_appends_the_reply(pipe):
    tok = pipe.tokenizer
    ids = _chat_ids(tok, CHAT, enable_thinking=False)
    ref_text = generate(pipe.model, tok, ids, max_tokens=8)
    out = pipe(CHAT, max_new_tokens=8, enable_thinking=False)
    assert out == [{"generated_text": CHAT + [{"role": "assistant", "content": ref_text}]}]
    assert CHAT[-1] == {"role": "user", "content": "Name a colour."}  # input left untouched
    assert pipe(CHAT, max_new_tokens=8, enable_thinking=False, return_full_text=False) == [
        {"generated_text": ref_text}]
    batch = pipe([CHAT, CHAT[1:]], max_new_tokens=4, enable_thinking=False,
                 return_full_text=False)
    assert len(batch) == 2 and batch[0][0]["generated_text"] == generate(
        pipe.model, tok, ids, max_tokens=4)


def test_enable_thinking_reaches_the_chat_template(pipe):
    tok = pipe.tokenizer
    prompts = {}
    for flag in (True, False):
        ids = pipe(CHAT, max_new_tokens=2, enable_thinking=flag,
                   return_tensors=True)[0]["generated_token_ids"][:-2]
        assert ids == _chat_ids(tok, CHAT, enable_thinking=flag)
        prompts[flag] = tok.decode(ids)
    assert prompts[True] != prompts[False]
    assert prompts[False].endswith("<think>\n\n</think>\n\n")
    assert "</think>" not in prompts[True]


# ---- stop strings, end of sequence, streaming ---------------------------------------------


def test_stop_strings_cut_the_text(pipe):
    _, full = _ref_tokens(pipe, PROMPT, 12)
    pieces = [r.text for r in stream_generate(pipe.model, pipe.tokenizer, PROMPT, max_tokens=12)]
    # One stop string inside a piece, one across the boundary of two pieces.
    inside = pieces[5]
    across = pieces[2][-1:] + pieces[3][:1]
    for stop in (inside, across):
        want = full[:full.index(stop)]
        out = pipe(PROMPT, max_new_tokens=12, stop=[stop, "never-generated-xyz"],
                   return_full_text=False)
        assert out == [{"generated_text": want}]
        stream = pipe.stream(PROMPT, max_new_tokens=12, stop=stop)
        assert "".join(stream) == want and stream.finish_reason == "stop"
    assert pipe(PROMPT, max_new_tokens=12, stop="never-generated-xyz",
                return_full_text=False) == [{"generated_text": full}]


def test_end_of_sequence_token_stops_like_mlx_lm(pipe):
    ids, _ = _ref_tokens(pipe, PROMPT, 6)
    tok = copy.copy(pipe.tokenizer)
    tok.eos_token_ids = [ids[3]]
    eos_pipe = pipeline(model=(pipe.model, tok))
    stream = eos_pipe.stream(PROMPT, max_new_tokens=6)
    text = "".join(stream)
    assert text == generate(pipe.model, tok, PROMPT, max_tokens=6)
    assert stream.finish_reason == "stop"
    assert stream.token_ids == ids[:4]  # the end-of-sequence token included, as transformers


def test_streaming_concatenates_to_the_non_streamed_text(pipe):
    plain = pipe(PROMPT, max_new_tokens=10)
    stream = pipe(PROMPT, max_new_tokens=10, stream=True)
    assert isinstance(stream, TextGenerationStream) and stream.result is None
    pieces = list(stream)
    assert len(pieces) > 1 and all(isinstance(p, str) for p in pieces)
    assert PROMPT + "".join(pieces) == plain[0]["generated_text"]
    assert stream.result == plain and stream.finish_reason == "length"
    assert len(stream.token_ids) == 10
    chat_stream = pipe.stream(CHAT, max_new_tokens=6, enable_thinking=False)
    text = "".join(chat_stream)
    assert chat_stream.result[0]["generated_text"][-1] == {"role": "assistant", "content": text}


def test_streamer_object_gets_every_piece(pipe):
    class Collect:
        def __init__(self):
            self.pieces, self.ends = [], 0

        def put(self, text):
            self.pieces.append(text)

        def end(self):
            self.ends += 1

    s = Collect()
    out = pipe([PROMPT, "Bonjour"], max_new_tokens=6, return_full_text=False, streamer=s)
    assert "".join(s.pieces) == out[0][0]["generated_text"] + out[1][0]["generated_text"]
    assert s.ends == 2


def test_same_tokens_on_the_stock_backend(pipe, tiny_real_vocab):
    from qwen_apple_backend.loader import load_model

    stock_model, _, _ = load_model(tiny_real_vocab, "stock")
    stock = pipeline("text-generation", model=(stock_model, pipe.tokenizer), max_new_tokens=8)
    assert stock.backend == "stock" and stock.defaults == {"max_new_tokens": 8}
    assert stock(PROMPT) == pipe(PROMPT, max_new_tokens=8)


# ---- backends through the registry --------------------------------------------------------


class _TextTokenizer:
    bos_token = None
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        return " | ".join(m["content"] for m in messages) + " ->"


class TextOnlyBackend:
    """A non-MLX backend that drives its own model through stream_text()."""

    name = "text-only"
    calls: list = []

    def available(self):
        return True, ""

    def load(self, path, **kwargs):
        return object(), _TextTokenizer()

    def stream_text(self, model, tokenizer, prompt_ids, *, max_new_tokens, temperature, top_p,
                    top_k, repetition_penalty):
        TextOnlyBackend.calls.append(dict(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                          temperature=temperature, top_k=top_k))
        for i in range(max_new_tokens):
            yield f" w{i}"


class NoTextBackend:
    name = "no-text"

    def available(self):
        return True, ""

    def load(self, path, **kwargs):
        return object(), _TextTokenizer()


class UnavailableBackend(NoTextBackend):
    def available(self):
        return False, "its library is not installed"


class _Plugin:
    @staticmethod
    @hookimpl
    def qab_register_backends(register):
        register("text-only", "tests.test_pipeline:TextOnlyBackend")
        register("no-text", "tests.test_pipeline:NoTextBackend")
        register("unavailable", "tests.test_pipeline:UnavailableBackend")


@pytest.fixture
def fake_backends():
    name = plugins.register_plugin(_Plugin(), name="pipeline-test-backends")
    try:
        yield
    finally:
        plugins.unregister_plugin(name)


def test_plugin_backend_with_stream_text_runs_the_pipeline(fake_backends, tmp_path):
    TextOnlyBackend.calls.clear()
    pipe = pipeline("text-generation", model=str(tmp_path), backend="text-only")
    assert pipe.backend == "text-only"
    assert pipe("ab", max_new_tokens=3) == [{"generated_text": "ab w0 w1 w2"}]
    assert TextOnlyBackend.calls[-1] == dict(prompt_ids=[97, 98], max_new_tokens=3,
                                            temperature=0.0, top_k=0)
    out = pipe([{"role": "user", "content": "hi"}], max_new_tokens=2, stop=" w1",
               do_sample=True, temperature=0.5)
    assert out[0]["generated_text"][-1] == {"role": "assistant", "content": " w0"}
    assert TextOnlyBackend.calls[-1]["temperature"] == 0.5
    assert TextOnlyBackend.calls[-1]["prompt_ids"] == [ord(c) for c in "hi ->"]


def test_unknown_backend_lists_auto_too(tmp_path):
    # "auto" is accepted too, so it is listed (it was "registered backends: fused, stock").
    for model in (str(tmp_path), (object(), _TextTokenizer())):
        with pytest.raises(UnknownBackendError) as info:
            pipeline("text-generation", model=model, backend="nope")
        assert str(info.value) == "unknown backend 'nope'; available: auto, fused, stock"


def test_backend_that_cannot_generate_is_a_clear_error(fake_backends, tmp_path):
    with pytest.raises(BackendCapabilityError, match="no stream_text"):
        pipeline("text-generation", model=str(tmp_path), backend="no-text")
    with pytest.raises(BackendCapabilityError, match="its library is not installed"):
        pipeline("text-generation", model=str(tmp_path), backend="unavailable")
    with pytest.raises(UnknownBackendError, match="no-such-backend"):
        pipeline("text-generation", model=str(tmp_path), backend="no-such-backend")
    with pytest.raises(BackendCapabilityError, match="cannot drive"):
        pipeline(model=(object(), _TextTokenizer()))


# ---- errors -------------------------------------------------------------------------------


def test_unknown_task(tmp_path):
    with pytest.raises(UnknownTaskError, match="'summarization'.*text-generation") as info:
        pipeline("summarization", model=str(tmp_path))
    assert isinstance(info.value, ValueError)


def test_unsupported_kwargs_are_named_with_the_supported_list(pipe, tmp_path):
    with pytest.raises(UnsupportedArgumentError, match="'device'") as info:
        pipeline("text-generation", model=str(tmp_path), device="cpu")
    assert isinstance(info.value, TypeError)
    assert "max_new_tokens" in str(info.value) and "backend" in str(info.value)
    with pytest.raises(UnsupportedArgumentError, match="'max_length'") as info:
        pipe(PROMPT, max_length=5)
    for name in GENERATION_DEFAULTS:
        assert name in str(info.value)


@pytest.mark.parametrize("bad,match", [
    ([{"content": "hi"}], r"missing key\(s\) \['role'\]"),
    ([{"role": "user"}], r"missing key\(s\) \['content'\]"),
    ([{"role": 3, "content": "hi"}], "'role' must be a non-empty string"),
    ([{"role": "user", "content": 5}], "'content' must be a string"),
    ([{"role": "user", "content": "hi"}, "oops"], "message 1: expected a dict"),
    ({"role": "user", "content": "hi"}, "single message dict"),
    ([], "empty list"),
    ([[]], "non-empty list of messages"),
    (["fine", 3], r"inputs\[1\]"),
    (42, "got int"),
])
def test_bad_inputs(pipe, bad, match):
    with pytest.raises(InvalidInputError, match=match) as info:
        pipe(bad, max_new_tokens=2)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(stop=[""]), "must not be empty"),
    (dict(stop=5), "stop must be"),
    (dict(enable_thinking="yes"), "enable_thinking"),
    (dict(streamer=object()), "put"),
])
def test_bad_settings(pipe, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        pipe(PROMPT, **kwargs)


def test_other_call_errors(pipe):
    with pytest.raises(PromptError, match="empty"):
        pipe("")
    with pytest.raises(InvalidInputError, match="one input"):
        pipe([PROMPT, PROMPT], stream=True)
    with pytest.raises(InvalidInputError, match="tokenizer"):
        pipeline(model=pipe.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe(PROMPT, max_new_tokens=2, temperature=0.3)
    assert any("greedy decoding ignores temperature" in str(w.message) for w in caught)


def test_readme_import_paths_work_in_any_order():
    # README: TextStreamer and the error classes from the package. Importing
    # TextStreamer first must not turn `qwen_apple_backend.pipeline` into the module.
    code = ("from qwen_apple_backend import TextStreamer, UnknownTaskError\n"
            "from qwen_apple_backend import pipeline\n"
            "import sys\n"
            "import qwen_apple_backend\n"
            "import qwen_apple_backend.errors as e\n"
            "m = sys.modules['qwen_apple_backend.pipeline']\n"
            "assert pipeline is m.pipeline and TextStreamer is m.TextStreamer\n"
            "assert qwen_apple_backend.pipeline is m.pipeline\n"
            "assert UnknownTaskError is e.UnknownTaskError\n"
            "names = [n for n, v in vars(e).items() if isinstance(v, type) and "
            "issubclass(v, e.QABError)]\n"
            "assert all(getattr(qwen_apple_backend, n) is getattr(e, n) for n in names), names\n"
            "assert set(names) <= set(qwen_apple_backend.__all__)\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
