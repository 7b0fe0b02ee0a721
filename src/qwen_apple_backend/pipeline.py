"""A transformers-style ``pipeline("text-generation", ...)`` on top of mlx-lm.

:func:`pipeline` loads a checkpoint through a registered backend (``auto``,
``fused``, ``stock`` or one a plugin adds) and returns a
:class:`TextGenerationPipeline`. Calling it behaves like a transformers
text-generation pipeline: a string, a list of strings, a chat (a list of
``{"role", "content"}`` messages, the chat template applied) or a list of
chats in; ``[{"generated_text": ...}]`` per input out. Everything generic is
mlx-lm's own: ``mlx_lm.generate.stream_generate`` runs the model,
``mlx_lm.sample_utils.make_sampler`` and ``make_logits_processors`` build the
sampler and the repetition penalty, so the pipeline produces exactly the
tokens ``mlx_lm.generate`` produces under the same settings.

Streaming: ``pipe(inputs, stream=True)`` returns a :class:`TextGenerationStream`,
an iterator of text pieces whose concatenation is the non-streamed
``generated_text`` (without the prompt); once exhausted it holds the final
result. Alternatively ``streamer=`` takes any object with ``put(text)`` and
``end()`` methods (such as :class:`TextStreamer`, which prints), called while
the usual list result is being built.

A backend whose ``load`` returns an MLX model (``stock``, ``fused``, or a
plugin's MLX backend) is driven by mlx-lm. A backend with another kind of model
(e.g. ``llama.cpp``) can still serve the pipeline by giving its backend class a
method::

    def stream_text(self, model, tokenizer, prompt_ids, *, max_new_tokens,
                    temperature, top_p, top_k, repetition_penalty):
        # yield str pieces, or objects with .text (and optionally .token)

``temperature`` is ``0.0`` for greedy decoding, ``top_k`` ``0`` and ``top_p``
``1.0`` mean "off", ``repetition_penalty`` is None for none. ``prompt_ids``
come from the tokenizer the backend's ``load`` returned (its
``apply_chat_template`` for chats, ``encode`` for text). A backend with neither
raises :class:`~qwen_apple_backend.errors.BackendCapabilityError`.

MLX and mlx-lm are imported inside functions, so importing this module is cheap.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO, Union

from .errors import (BackendCapabilityError, InvalidInputError, PromptError, UnknownTaskError,
                     UnsupportedArgumentError)

__all__ = [
    "GENERATION_DEFAULTS",
    "SUPPORTED_TASKS",
    "TextGenerationPipeline",
    "TextGenerationStream",
    "TextStreamer",
    "pipeline",
]

SUPPORTED_TASKS = ("text-generation",)

#: Keyword arguments a :class:`TextGenerationPipeline` call takes, with their defaults.
#: Sampling defaults are transformers' ``GenerationConfig`` defaults.
GENERATION_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 256,
    "do_sample": False,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "repetition_penalty": None,
    "return_full_text": True,
    "return_tensors": False,
    "stop": None,
    "enable_thinking": None,
    "stream": False,
    "streamer": None,
}

_PIPELINE_ARGS = ("task", "model", "tokenizer", "backend", "model_kwargs")
_SAMPLING_ARGS = ("temperature", "top_p", "top_k")


# ---- streaming ---------------------------------------------------------------------------


class TextStreamer:
    """A ``streamer=`` that writes each text piece to a stream as it is generated.

    The contract of a streamer is two methods, ``put(text: str)`` and ``end()``
    (like transformers' ``TextStreamer``, but it receives decoded text, not
    token ids). Any object with both works.

    Args:
        file (TextIO, optional): where to write; default ``sys.stdout``.
    """

    def __init__(self, file: Optional[TextIO] = None):
        self.file = file

    def put(self, text: str) -> None:
        out = self.file or sys.stdout
        out.write(text)
        out.flush()

    def end(self) -> None:
        out = self.file or sys.stdout
        out.write("\n")
        out.flush()


class TextGenerationStream:
    """Iterator over the text pieces of one generation (``pipe(x, stream=True)``).

    Iterating yields ``str`` pieces as the model produces them; joined, they
    equal the non-streamed ``generated_text`` without the prompt. Text that
    could be the beginning of a ``stop`` string is held back until it is known
    not to be one. When the iterator is exhausted:

    Attributes:
        result (list[dict] | None): what the non-streamed call returns,
            e.g. ``[{"generated_text": ...}]``; None until the stream ends.
        text (str): the generated text so far (no prompt, no stop string).
        token_ids (list[int]): generated token ids so far (an end-of-sequence
            token included, as transformers includes it).
        finish_reason (str | None): ``"stop"`` (end-of-sequence token or a stop
            string) or ``"length"`` (``max_new_tokens`` reached); None until the end.
    """

    def __init__(self, pipe: "TextGenerationPipeline", prepared: "_Prepared",
                 params: "_Params"):
        self._pipe = pipe
        self._prepared = prepared
        self._params = params
        self._tokens: list = []
        self._gen = pipe._generate(prepared, params, self._tokens)
        self._outcome: Optional[_Outcome] = None
        self.result: Optional[list] = None
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        return list(self._tokens)

    @property
    def finish_reason(self) -> Optional[str]:
        return self._outcome.finish_reason if self._outcome else None

    def __iter__(self) -> "TextGenerationStream":
        return self

    def __next__(self) -> str:
        if self._outcome is not None:
            raise StopIteration
        try:
            piece = next(self._gen)
        except StopIteration as stop:
            self._outcome = stop.value
            self.text = self._outcome.text
            self.result = self._pipe._postprocess(self._prepared, self._outcome, self._params)
            raise
        self.text += piece
        return piece

    def close(self) -> None:
        """Stop generating early (the result stays None)."""
        self._gen.close()

    def __repr__(self) -> str:
        state = "done" if self._outcome else "running"
        return f"TextGenerationStream({state}, {len(self.text)} chars)"


# ---- settings and inputs -----------------------------------------------------------------


@dataclass(frozen=True)
class _Params:
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: Optional[float]
    return_full_text: bool
    return_tensors: bool
    stop: tuple
    enable_thinking: Optional[bool]
    stream: bool
    streamer: Any


@dataclass
class _Prepared:
    prompt_ids: list
    prompt_text: Optional[str] = None  # a string input
    messages: Optional[list] = None  # a chat input


@dataclass
class _Outcome:
    text: str
    token_ids: list = field(default_factory=list)
    finish_reason: str = "length"


def _supported(names) -> str:
    return ", ".join(sorted(names))


def _check_kwargs(kwargs: Mapping, allowed, where: str, also=()) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise UnsupportedArgumentError(
            f"{where} got unsupported keyword argument{plural} "
            f"{', '.join(repr(k) for k in unknown)}; supported: "
            f"{_supported(set(allowed) | set(also))}")


def _number(name: str, value: Any, kind=float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise InvalidInputError(f"{name} must be {'a number' if kind is float else 'an int'}, "
                                f"got {value!r}")
    return kind(value)


def _make_params(merged: dict, explicit: set) -> _Params:
    """Validate merged call settings; ``explicit`` names the ones the caller set."""
    max_new = merged["max_new_tokens"]
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise InvalidInputError(f"max_new_tokens must be an int >= 1, got {max_new!r}")
    do_sample = merged["do_sample"]
    if not isinstance(do_sample, bool):
        raise InvalidInputError(f"do_sample must be True or False, got {do_sample!r}")
    temperature = _number("temperature", merged["temperature"])
    top_p = _number("top_p", merged["top_p"])
    top_k = _number("top_k", merged["top_k"], int)
    if do_sample:
        if temperature <= 0:
            raise InvalidInputError(f"temperature must be > 0 when do_sample=True, got "
                                    f"{temperature} (use do_sample=False for greedy decoding)")
        if not 0 < top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise InvalidInputError(f"top_k must be >= 0 (0 = off), got {top_k}")
    else:
        ignored = [k for k in _SAMPLING_ARGS
                   if k in explicit and merged[k] != GENERATION_DEFAULTS[k]]
        if ignored:
            warnings.warn(f"do_sample=False: greedy decoding ignores {', '.join(ignored)}; "
                          "pass do_sample=True to sample", UserWarning, stacklevel=3)
    rp = merged["repetition_penalty"]
    if rp is not None:
        rp = _number("repetition_penalty", rp)
        if rp <= 0:
            raise InvalidInputError(f"repetition_penalty must be > 0, got {rp}")
        if rp == 1.0:
            rp = None
    stop = merged["stop"]
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise InvalidInputError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise InvalidInputError("stop strings must not be empty")
    thinking = merged["enable_thinking"]
    if thinking is not None and not isinstance(thinking, bool):
        raise InvalidInputError(f"enable_thinking must be True, False or None, got {thinking!r}")
    streamer = merged["streamer"]
    if streamer is not None and not (callable(getattr(streamer, "put", None))
                                     and callable(getattr(streamer, "end", None))):
        raise InvalidInputError("streamer must have put(text) and end() methods, got "
                                f"{type(streamer).__name__}")
    return _Params(max_new, do_sample, temperature, top_p, top_k, rp,
                   bool(merged["return_full_text"]), bool(merged["return_tensors"]), stop,
                   thinking, bool(merged["stream"]), streamer)


def _check_messages(chat: Any, where: str) -> list:
    if not isinstance(chat, (list, tuple)) or not chat:
        raise InvalidInputError(f"{where}: a chat must be a non-empty list of messages, "
                                f"got {chat!r}")
    for i, msg in enumerate(chat):
        if not isinstance(msg, Mapping):
            raise InvalidInputError(f"{where}, message {i}: expected a dict with 'role' and "
                                    f"'content', got {type(msg).__name__} {msg!r}")
        missing = [k for k in ("role", "content") if k not in msg]
        if missing:
            raise InvalidInputError(f"{where}, message {i}: missing key(s) {missing} "
                                    f"(got keys {sorted(msg)})")
        if not isinstance(msg["role"], str) or not msg["role"]:
            raise InvalidInputError(f"{where}, message {i}: 'role' must be a non-empty string, "
                                    f"got {msg['role']!r}")
        content = msg["content"]
        if not (isinstance(content, (str, list)) or (content is None and msg.get("tool_calls"))):
            raise InvalidInputError(f"{where}, message {i}: 'content' must be a string (or a "
                                    f"list of content parts), got {type(content).__name__}")
    return [dict(m) for m in chat]


def _split_inputs(inputs: Any) -> tuple[list, bool]:
    """Inputs as a list of ``str`` / chat items, and whether the call was batched."""
    if isinstance(inputs, str):
        return [inputs], False
    if isinstance(inputs, Mapping):
        raise InvalidInputError("got a single message dict; a chat is a list of messages, "
                                "e.g. [{'role': 'user', 'content': 'Hi'}]")
    if not isinstance(inputs, (list, tuple)):
        raise InvalidInputError(f"inputs must be a string, a list of strings, a chat (list of "
                                f"message dicts) or a list of chats, got "
                                f"{type(inputs).__name__}")
    if not inputs:
        raise InvalidInputError("inputs is an empty list")
    first = inputs[0]
    if isinstance(first, Mapping):
        return [_check_messages(inputs, "chat")], False
    items = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, (list, tuple)):
            items.append(_check_messages(item, f"chat {i}"))
        else:
            raise InvalidInputError(f"inputs[{i}]: expected a string or a chat (list of "
                                    f"message dicts), got {type(item).__name__} {item!r}")
    return items, True


class _StopFilter:
    """Cuts generated text at the first stop string; holds back possible stop prefixes."""

    def __init__(self, stops: tuple):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.emitted = 0
        self.hit = False

    def feed(self, piece: str) -> str:
        before = len(self.text)
        self.text += piece
        if not self.stops:
            return self._emit(len(self.text))
        start = max(0, before - self.longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.hit = True
            self.text = self.text[:min(hits)]
            return self._emit(len(self.text))
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self._emit(len(self.text) - hold)

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out


# ---- the pipeline ------------------------------------------------------------------------


class TextGenerationPipeline:
    """Text generation with a loaded model, called like transformers' pipeline.

    Build it with :func:`pipeline`. Inputs are processed one after another.

    Attributes:
        task (str): ``"text-generation"``.
        model: the loaded model (an MLX ``nn.Module`` for MLX backends).
        tokenizer: its tokenizer (mlx-lm's ``TokenizerWrapper`` for MLX backends).
        backend (str): the backend name it was loaded with.
        defaults (dict): generation settings given to :func:`pipeline`, used
            unless a call overrides them.
    """

    task = "text-generation"

    def __init__(self, model: Any, tokenizer: Any, *, backend: str = "mlx",
                 backend_obj: Any = None, defaults: Optional[dict] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.backend = backend
        self._backend_obj = backend_obj
        defaults = dict(defaults or {})
        _check_kwargs(defaults, GENERATION_DEFAULTS, "pipeline()")
        _make_params({**GENERATION_DEFAULTS, **defaults}, set(defaults))  # validate early
        self.defaults = defaults

    def __repr__(self) -> str:
        return (f"TextGenerationPipeline(backend={self.backend!r}, "
                f"model={type(self.model).__name__})")

    # -- public ---------------------------------------------------------------------------

    def __call__(self, text_inputs: Any, **kwargs: Any) -> Union[list, TextGenerationStream]:
        """Generate a continuation for each input.

        Args:
            text_inputs (str | list[str] | list[dict] | list[list[dict]]): a prompt,
                a batch of prompts, a chat (``[{"role": ..., "content": ...}, ...]``,
                rendered with the tokenizer's chat template and an assistant
                generation prompt) or a batch of chats.
            max_new_tokens (int): tokens to generate at most. Default 256.
            do_sample (bool): sample (True) or pick the most likely token
                (False, greedy). Default False.
            temperature (float): sampling temperature, > 0. Default 1.0.
            top_p (float): nucleus sampling mass in (0, 1]; 1.0 = off. Default 1.0.
            top_k (int): sample among the k most likely tokens; 0 = off. Default 50.
            repetition_penalty (float, optional): > 1 discourages tokens already in
                the prompt or the output (mlx-lm's sign-aware penalty over the whole
                context). Default None (off).
            return_full_text (bool): for a string input, prepend the prompt; for a
                chat, return the messages with the assistant reply appended (False:
                the reply text only). Default True.
            return_tensors (bool): return ``{"generated_token_ids": prompt + new
                ids}`` instead of text (as transformers does). Default False.
            stop (str | list[str], optional): stop when the generated text contains
                one of these; the text is cut before it. Default None.
            enable_thinking (bool, optional): passed to the chat template (Qwen3.5/3.6:
                False adds an empty ``<think></think>`` block). Chats only. Default:
                the template's own default.
            stream (bool): return a :class:`TextGenerationStream` of text pieces
                instead of the result list (single input only). Default False.
            streamer (object, optional): gets ``put(text)`` for each piece and
                ``end()`` after each input (see :class:`TextStreamer`).

        Returns:
            list[dict] | list[list[dict]] | TextGenerationStream: for one input,
            ``[{"generated_text": str | list[dict]}]``; for a batch, one such list
            per input; with ``stream=True``, the stream.

        Raises:
            UnsupportedArgumentError: an unknown keyword argument (the message lists
                the supported ones).
            InvalidInputError: malformed inputs (e.g. a message without ``role``) or an
                out-of-range setting.
            PromptError: an empty prompt, or one longer than the model's context.
        """
        _check_kwargs(kwargs, GENERATION_DEFAULTS, "text-generation pipeline call")
        explicit = set(self.defaults) | set(kwargs)
        params = _make_params({**GENERATION_DEFAULTS, **self.defaults, **kwargs}, explicit)
        items, batched = _split_inputs(text_inputs)
        if params.stream:
            if batched:
                raise InvalidInputError("stream=True takes one input (a string or one chat), "
                                        f"got a batch of {len(items)}")
            return TextGenerationStream(self, self._preprocess(items[0], params), params)
        results = []
        for item in items:
            prepared = self._preprocess(item, params)
            gen = self._generate(prepared, params, [])
            while True:
                try:
                    next(gen)
                except StopIteration as stop:
                    outcome = stop.value
                    break
            results.append(self._postprocess(prepared, outcome, params))
        return results if batched else results[0]

    def stream(self, text_input: Any, **kwargs: Any) -> TextGenerationStream:
        """Shorthand for ``self(text_input, stream=True, **kwargs)``."""
        return self(text_input, stream=True, **kwargs)

    # -- steps ----------------------------------------------------------------------------

    def _preprocess(self, item: Any, params: _Params) -> _Prepared:
        tok = self.tokenizer
        if isinstance(item, str):
            if item == "":
                raise PromptError("the prompt is empty: give at least one token")
            bos = getattr(tok, "bos_token", None)
            # The rule mlx_lm.generate.stream_generate applies to a string prompt.
            special = bos is None or not item.startswith(bos)
            try:
                ids = tok.encode(item, add_special_tokens=special)
            except TypeError:  # a tokenizer without that keyword
                ids = tok.encode(item)
            prepared = _Prepared(list(ids), prompt_text=item)
        else:
            if getattr(tok, "chat_template", None) is None and \
                    not getattr(tok, "has_chat_template", False):
                raise InvalidInputError("this tokenizer has no chat template: pass the prompt "
                                        "as a string instead of chat messages")
            extra = {} if params.enable_thinking is None else \
                {"enable_thinking": params.enable_thinking}
            try:
                text = tok.apply_chat_template(item, add_generation_prompt=True,
                                               tokenize=False, **extra)
            except Exception as exc:  # noqa: BLE001 - the template's own error, e.g. a bad role
                raise InvalidInputError(f"the chat template rejected the messages: "
                                        f"{type(exc).__name__}: {exc}") from exc
            ids = tok.encode(text, add_special_tokens=False)
            prepared = _Prepared(list(ids), messages=item)
        if not prepared.prompt_ids:
            raise PromptError("the prompt is empty: give at least one token")
        if self._backend_obj is None:
            from .loader import check_prompt

            check_prompt(self.model, prepared.prompt_ids)
        return prepared

    def _generate(self, prepared: _Prepared, params: _Params, tokens: list):
        """Generator of emitted text pieces (also sent to ``params.streamer``);
        appends generated ids to ``tokens``; returns an :class:`_Outcome`."""
        stops = _StopFilter(params.stop)
        streamer = params.streamer
        finish = "length"
        source = (self._backend_tokens if self._backend_obj is not None
                  else self._mlx_tokens)(prepared, params)
        try:
            for text, token, reason in source:
                if token is not None:
                    tokens.append(token)
                piece = stops.feed(text)
                if piece:
                    if streamer is not None:
                        streamer.put(piece)
                    yield piece
                if stops.hit:
                    finish = "stop"
                    break
                if reason is not None:
                    finish = reason
        finally:
            source.close()
        tail = "" if stops.hit else stops.flush()
        if tail:
            if streamer is not None:
                streamer.put(tail)
            yield tail
        if streamer is not None:
            streamer.end()
        return _Outcome(stops.text, list(tokens), finish)

    def _mlx_tokens(self, prepared: _Prepared, params: _Params):
        import importlib

        import mlx.core as mx
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        # Looked up at call time so enable()'s checked stream_generate applies too.
        stream_generate = importlib.import_module("mlx_lm.generate").stream_generate
        if params.do_sample:
            sampler = make_sampler(temp=params.temperature, top_p=params.top_p,
                                   top_k=params.top_k)
        else:
            sampler = make_sampler(temp=0.0)
        processors = None
        if params.repetition_penalty is not None:
            # The whole context, as transformers penalises every earlier token.
            processors = make_logits_processors(
                repetition_penalty=params.repetition_penalty,
                repetition_context_size=len(prepared.prompt_ids) + params.max_new_tokens)
        for r in stream_generate(self.model, self.tokenizer, mx.array(prepared.prompt_ids),
                                 max_tokens=params.max_new_tokens, sampler=sampler,
                                 logits_processors=processors):
            yield r.text, r.token, r.finish_reason

    def _backend_tokens(self, prepared: _Prepared, params: _Params):
        temperature = params.temperature if params.do_sample else 0.0
        items = self._backend_obj.stream_text(
            self.model, self.tokenizer, list(prepared.prompt_ids),
            max_new_tokens=params.max_new_tokens, temperature=temperature,
            top_p=params.top_p if params.do_sample else 1.0,
            top_k=params.top_k if params.do_sample else 0,
            repetition_penalty=params.repetition_penalty)
        for item in items:
            if isinstance(item, str):
                yield item, None, None
            else:
                yield (getattr(item, "text", ""), getattr(item, "token", None),
                       getattr(item, "finish_reason", None))

    def _postprocess(self, prepared: _Prepared, outcome: _Outcome, params: _Params) -> list:
        if params.return_tensors:
            return [{"generated_token_ids": list(prepared.prompt_ids) + list(outcome.token_ids)}]
        if prepared.messages is not None:
            if not params.return_full_text:
                return [{"generated_text": outcome.text}]
            reply = {"role": "assistant", "content": outcome.text}
            return [{"generated_text": [dict(m) for m in prepared.messages] + [reply]}]
        if params.return_full_text:
            return [{"generated_text": prepared.prompt_text + outcome.text}]
        return [{"generated_text": outcome.text}]


# ---- construction ------------------------------------------------------------------------


def _is_mlx_model(model: Any) -> bool:
    try:
        import mlx.nn as nn
    except Exception:  # noqa: BLE001 - no MLX here
        return False
    return isinstance(model, nn.Module)


def _load_with_backend(name: str, path: str, model_kwargs: dict):
    """Load ``path`` through backend ``name``; return (model, tokenizer, driver or None)."""
    if name == "auto":
        from .loader import load

        model, tok = load(path, "auto", **model_kwargs)
        return model, tok, None
    from .backends import get_backend

    backend = get_backend(name, also=("auto",))  # UnknownBackendError lists them
    available = getattr(backend, "available", None)
    if available is not None:
        ok, why = available()
        if not ok:
            raise BackendCapabilityError(f"backend {name!r} cannot run here: {why}")
    drives_itself = callable(getattr(backend, "stream_text", None))
    if not drives_itself and not getattr(backend, "mlx_backend", None) and \
            not callable(getattr(backend, "load", None)):
        raise BackendCapabilityError(f"backend {name!r} has no load(); it cannot serve the "
                                     "text-generation pipeline")
    model, tok = backend.load(path, **model_kwargs)
    if drives_itself:
        return model, tok, backend
    if not _is_mlx_model(model):
        raise BackendCapabilityError(
            f"backend {name!r} loaded a {type(model).__name__}, not an MLX model, and its "
            f"backend class {type(backend).__name__} has no stream_text() method, so the "
            "pipeline cannot generate text with it (see qwen_apple_backend.pipeline)")
    return model, tok, None


def pipeline(task: str = "text-generation", model: Any = None, tokenizer: Any = None, *,
             backend: Optional[str] = None, model_kwargs: Optional[dict] = None,
             **kwargs: Any) -> TextGenerationPipeline:
    """Build a transformers-style text-generation pipeline on a registered backend.

    Args:
        task (str): only ``"text-generation"``. Default ``"text-generation"``.
        model (str | os.PathLike | tuple): a checkpoint directory (or Hugging Face
            repo id) loaded through ``backend``, or an already loaded
            ``(model, tokenizer)`` pair (e.g. from :func:`qwen_apple_backend.load`).
        tokenizer (optional): tokenizer of an already loaded ``model`` given alone.
        backend (str, optional): ``"auto"`` (fused where a plugin claims the
            architecture, stock otherwise), ``"fused"``, ``"stock"`` or any backend a
            plugin registers (``qab backends`` lists them). Default ``QAB_BACKEND``
            or ``"auto"``. With an already loaded model, a backend that offers
            ``stream_text`` drives it; otherwise the model must be an MLX model.
        model_kwargs (dict, optional): passed to the backend's ``load`` (for the MLX
            backends, the keyword arguments of :func:`qwen_apple_backend.load`,
            e.g. ``{"disable": ["moe"]}``).
        **kwargs: default generation settings for every call (``max_new_tokens``,
            ``do_sample``, ``temperature``, ``top_p``, ``top_k``,
            ``repetition_penalty``, ``return_full_text``, ``return_tensors``,
            ``stop``, ``enable_thinking``, ``stream``, ``streamer``); see
            :meth:`TextGenerationPipeline.__call__`.

    Returns:
        TextGenerationPipeline: call it with a string, a list of strings, a chat or a
        list of chats.

    Raises:
        UnknownTaskError: a task other than ``"text-generation"``.
        UnsupportedArgumentError: an unknown keyword argument.
        UnknownBackendError: a backend name no plugin registered.
        BackendCapabilityError: the backend cannot run here or cannot generate text
            for the pipeline.
        MissingCheckpointFileError, CheckpointError: as :func:`qwen_apple_backend.load`.

    Example:
        >>> from qwen_apple_backend import pipeline
        >>> pipe = pipeline("text-generation", model="path/to/Qwen3.6-35B-A3B-4bit",
        ...                 backend="fused")
        >>> pipe("The capital of France is", max_new_tokens=8)
        [{'generated_text': 'The capital of France is ...'}]
        >>> chat = [{"role": "user", "content": "Say hi."}]
        >>> out = pipe(chat, max_new_tokens=32, enable_thinking=False)
        >>> out[0]["generated_text"][-1]["role"]
        'assistant'
        >>> for piece in pipe("Once upon a time", stream=True, max_new_tokens=16):
        ...     print(piece, end="", flush=True)
    """
    if task not in SUPPORTED_TASKS:
        raise UnknownTaskError(f"unknown task {task!r}; supported tasks: "
                               f"{', '.join(SUPPORTED_TASKS)}")
    _check_kwargs(kwargs, GENERATION_DEFAULTS, "pipeline()", also=_PIPELINE_ARGS)
    if model is None:
        raise InvalidInputError("pipeline() needs model=: a checkpoint path or a "
                                "(model, tokenizer) pair")
    if model_kwargs is not None and not isinstance(model_kwargs, Mapping):
        raise InvalidInputError(f"model_kwargs must be a dict, got {type(model_kwargs).__name__}")
    model_kwargs = dict(model_kwargs or {})
    if backend is not None and not isinstance(backend, str):
        raise InvalidInputError(f"backend must be a backend name (str), got {backend!r}")

    if tokenizer is not None and isinstance(tokenizer, (str, os.PathLike)):
        raise InvalidInputError("tokenizer= takes a loaded tokenizer object; a checkpoint "
                                "path given as model= loads its own tokenizer")
    if isinstance(model, (str, os.PathLike)):
        from . import envs

        name = (backend or envs.backend()).lower()
        loaded, tok, driver = _load_with_backend(name, os.fspath(model), model_kwargs)
        if tokenizer is not None:
            tok = tokenizer
        return TextGenerationPipeline(loaded, tok, backend=name, backend_obj=driver,
                                      defaults=kwargs)

    if isinstance(model, tuple):
        if len(model) != 2:
            raise InvalidInputError(f"model= as a tuple must be (model, tokenizer), got "
                                    f"{len(model)} items")
        model, tok = model
        tokenizer = tokenizer if tokenizer is not None else tok
    if tokenizer is None:
        raise InvalidInputError("an already loaded model needs its tokenizer: pass "
                                "model=(model, tokenizer) or tokenizer=")
    if model_kwargs:
        raise InvalidInputError("model_kwargs applies only when model= is a path to load")
    driver = None
    name = backend
    if backend is not None and backend.lower() != "auto":
        from .backends import get_backend

        obj = get_backend(backend.lower(), also=("auto",))
        if callable(getattr(obj, "stream_text", None)):
            driver = obj
    if driver is None and not _is_mlx_model(model):
        raise BackendCapabilityError(
            f"cannot drive a {type(model).__name__}: the pipeline runs MLX models through "
            "mlx-lm, or another model through a backend that offers stream_text() "
            "(pass backend=<its name>)")
    if name is None:
        report = getattr(model, "qab_report", None)
        name = getattr(report, "backend", None) or "mlx"
    return TextGenerationPipeline(model, tokenizer, backend=name.lower(), backend_obj=driver,
                                  defaults=kwargs)
