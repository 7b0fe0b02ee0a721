"""``qab serve``: mlx-lm's own OpenAI-compatible server with the backend on.

``mlx_lm.server`` does all the serving: its request handler, batching, prompt
cache, ``/v1/models``, and its tool-call and reasoning parsing (the parser is
chosen from the checkpoint's chat template, so the Qwen3.5/3.6 XML tool calls go
to ``tool_calls`` and ``<think>`` blocks to ``reasoning``). :func:`install` adds
only what mlx-lm 0.32 lacks, as a subclass of its handler and of its HTTP
server class, passed to its own ``_run_http_server``:

* a request-body limit: a ``Content-Length`` above ``max_body_bytes`` is answered
  413 without reading the body (stock reads any size into memory, and a huge
  declared size raises ``MemoryError`` in the handler: no reply at all); a
  negative one is answered 400 (stock reads until the client hangs up);
* a body that is not UTF-8 is answered 400 (stock lets ``UnicodeDecodeError``
  escape the handler: the client gets an empty reply);
* requests that would end mlx-lm's generation thread are answered 400 (an empty
  ``prompt``, ``messages`` that is not a non-empty list of objects, a ``stop``
  that is not a string or a list of non-empty strings), and so are a
  ``max_tokens`` above :data:`MAX_COMPLETION_TOKENS` and requests of the wrong
  shape that stock answers 404 with a bare Python error: a message without a
  string ``role``, a ``content`` that is not a string, a list of parts or null
  (or a text part without a string ``text``), ``tools`` that is not a list of
  objects, a ``chat_template_kwargs`` that is not an object, a ``model`` or
  ``draft_model`` that is not a string (or is empty: a path, it would name the
  server's working directory), and ``tool_calls`` that are not a list of objects
  each with a ``function`` object holding a string ``name`` (and JSON arguments);
* values stock lets through to fail later, after the reply's status line (the
  client gets no reply) or in the process itself, are answered 400 before: a
  ``seed`` outside 0..2**64-1, a non-finite ``temperature`` / ``top_p`` / other
  sampling float, ``true`` for an integer field, a ``logit_bias`` token id
  outside the model's vocabulary (it crashed the server on the CPU), and a
  ``draft_model`` on a model whose recurrent cache cannot be trimmed;
* a request whose ``model`` or ``draft_model`` cannot be loaded (a missing
  directory, a bad ``config.json``, missing weight files) is answered 404 naming
  the problem, and the served model stays loaded (stock drops it first, then fails to load the
  other: the next request loads it again); the checks are
  :func:`~qwen_apple_backend.loader.check_checkpoint`'s, before mlx-lm's own load;
* any other error that stock answers 404 once the request has reached the
  model (a chat template that rejects the messages, a prompt the model cannot
  take) is answered 400: the route exists, the request is what failed;
* ``/v1/models`` answers when there is no Hugging Face cache directory (stock
  raises ``CacheNotFound`` after the 200 status line: an empty body);
* a client that disconnects mid-stream is logged in one line, not a traceback;
* a connection that sends nothing for ``read_timeout`` seconds (default 60) is
  closed, and a request body that stops short of its ``Content-Length`` for that
  long is answered 408 (stock waits for it forever, one thread per connection).

Nothing here imports mlx-lm at import time.
"""

from __future__ import annotations

import io
import json
import logging
import math
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any, Optional

from .errors import ServeStartupError

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_READ_TIMEOUT", "MAX_COMPLETION_TOKENS", "QABHTTPServer", "ServeStartupError", "install",
           "make_handler_class", "uninstall"]

#: Largest request body accepted by default (32 MiB: a full 262,144-token context
#: is about 1 MB of text).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

#: Default seconds a connection may send nothing while a request is read
#: (``qab serve --request-timeout``); generation itself has no limit.
DEFAULT_READ_TIMEOUT = 60.0

#: The POST routes of ``mlx_lm.server.APIHandler``; other paths keep its 404.
_POST_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/chat/completions"})

#: After a 413, how long to keep reading (and discarding) the body the client is
#: still sending, so it can read the reply instead of hitting a connection reset.
_DRAIN_SECONDS = 2.0

_PATCHED: dict[str, Any] = {}
#: ``mlx_lm.server`` class attributes :func:`install` wrapped, keyed by (class, name).
_METHODS: dict[tuple[type, str], Any] = {}
#: The error of this handler thread's last ``ResponseGenerator.generate`` call.
_REQUEST = threading.local()


def _is_model_not_found(exc: BaseException) -> bool:
    # A request's model that does not exist keeps mlx-lm's 404, as OpenAI answers.
    from .errors import MissingCheckpointFileError

    return isinstance(exc, (MissingCheckpointFileError, FileNotFoundError))


class QABHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` that logs a client hanging up (or going silent past the
    handler's ``timeout``) as one line."""

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError,
                            TimeoutError)):
            logging.info("client %s disconnected before the response was complete (%s)",
                         client_address[0] if client_address else "?", type(exc).__name__)
            return
        super().handle_error(request, client_address)


def make_handler_class(base: Optional[type] = None,
                       max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                       read_timeout: float = DEFAULT_READ_TIMEOUT) -> type:
    """Subclass mlx-lm's request handler with the body checks of this module.

    Args:
        base (type, optional): the handler to extend; default
            ``mlx_lm.server.APIHandler``.
        max_body_bytes (int): largest accepted request body. Default 32 MiB.
        read_timeout (float): seconds a connection may send nothing while a request
            is read (the handler's socket timeout); a body cut short that long is
            answered 408. Default 60.

    Returns:
        type: a handler class; a valid request is served by ``base`` itself.

    Raises:
        ValueError: if ``max_body_bytes`` or ``read_timeout`` is not positive.
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if not read_timeout > 0:
        raise ValueError(f"read_timeout must be positive, got {read_timeout}")
    if base is None:
        from mlx_lm import server as mlx_server

        base = mlx_server.APIHandler

    class QABAPIHandler(base):  # type: ignore[misc, valid-type]
        qab_max_body_bytes = max_body_bytes
        # socketserver's StreamRequestHandler sets it on the connection: every read (and
        # write) that waits longer raises TimeoutError. A request line that never comes
        # just closes the connection (http.server's own handling).
        timeout = read_timeout

        def do_POST(self) -> None:
            raw = self.headers.get("Content-Length")
            if self.path not in _POST_PATHS or raw is None:
                return super().do_POST()  # mlx-lm's 404 / 411
            try:
                length = int(raw)
            except ValueError:
                return super().do_POST()  # mlx-lm's 400 "Invalid Content-Length header"
            if length < 0:
                return self._qab_reject(400, f"invalid Content-Length {length}: negative",
                                        drain=True)
            if length > self.qab_max_body_bytes:
                return self._qab_reject(
                    413, f"request body of {length} bytes is larger than this server's limit "
                         f"of {self.qab_max_body_bytes} bytes (qab serve --max-request-bytes)",
                    drain=True)
            try:
                body = self.rfile.read(length)
            except TimeoutError:
                return self._qab_reject(
                    408, f"request body: the client sent nothing for {self.timeout:g} s before "
                         f"its Content-Length of {length} bytes had arrived "
                         "(qab serve --request-timeout)")
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                return self._qab_reject(400, f"request body is not UTF-8 text: {exc}")
            problem = _request_problem(self.path, text)
            if problem:
                return self._qab_reject(400, problem)
            # mlx-lm's handler reads the body again from rfile: hand it the bytes read here.
            stock_rfile = self.rfile
            self.rfile = io.BytesIO(body)
            try:
                super().do_POST()
            finally:
                self.rfile = stock_rfile

        def _set_completion_headers(self, status_code: int = 200):
            # mlx-lm answers every error of its response generator 404. Past the route
            # check (self.path is one of its routes) that is the request's fault: 400,
            # unless the request named a model that does not exist.
            if status_code == 404 and self.path in _POST_PATHS:
                exc, _REQUEST.error = getattr(_REQUEST, "error", None), None
                if exc is not None and not _is_model_not_found(exc):
                    status_code = 400
            return super()._set_completion_headers(status_code)

        def _qab_reject(self, status: int, message: str, drain: bool = False) -> None:
            payload = json.dumps({"error": message}).encode()
            self._set_completion_headers(status)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)
            self.wfile.flush()
            self.close_connection = True
            logging.warning("rejected %s %s: %d %s", self.command, self.path, status, message)
            if drain:
                self._qab_drain()

        def _qab_drain(self) -> None:
            # Lingering close: the body was not read, and closing a socket with unread
            # input sends a reset, which can reach the client before it reads the reply.
            conn = self.connection
            deadline = time.monotonic() + _DRAIN_SECONDS
            try:
                conn.shutdown(socket.SHUT_WR)
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    conn.settimeout(left)
                    if not conn.recv(1 << 16):
                        break
            except OSError:
                pass

    QABAPIHandler.__qualname__ = QABAPIHandler.__name__ = f"QAB{base.__name__}"
    return QABAPIHandler


#: Request fields mlx-lm takes as numbers without a finiteness check (JSON's ``NaN``
#: and ``Infinity`` parse as floats and pass its range checks).
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "xtc_probability", "xtc_threshold")
#: Request fields mlx-lm checks with ``isinstance(v, int)``, which ``true`` passes.
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "num_draft_tokens",
               "repetition_context_size", "presence_context_size", "frequency_context_size",
               "top_logprobs", "seed")

#: Largest ``max_tokens`` / ``max_completion_tokens`` accepted (1 Mi tokens, four
#: times the Qwen3.6 context): a larger value cannot complete and would keep
#: generating after the client gives up. ``qab serve --max-tokens``, the default of a
#: request that gives none, is held to it too (checked in ``qab``'s command line).
MAX_COMPLETION_TOKENS = 1 << 20


def _request_problem(path: str, text: str) -> Optional[str]:
    """Why a (valid-JSON) request would break mlx-lm's generation thread, or None.

    mlx-lm 0.32 hands the prompt to its batch generator without checking it,
    and an exception there (an empty prompt: ``ValueError: Sequence has an
    empty prompt``; ``messages`` that is not a list of objects; a ``stop`` of
    another type, e.g. ``5``: ``TypeError`` while it builds the stop
    sequences) ends the generation thread for every later request. Some
    fields of the wrong shape (a message's ``role`` or ``content``, ``tools``,
    ``chat_template_kwargs``, ``model``, ``draft_model``) only fail that
    request, but with a bare Python error answered 404 (e.g. ``'text'`` for a
    text part without its text): they get a 400 naming the field. Malformed
    JSON is left to mlx-lm's own 400.
    """
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return "'prompt' must be a non-empty string"
    else:
        msgs = body.get("messages")
        if (not isinstance(msgs, list) or not msgs
                or not all(isinstance(m, dict) for m in msgs)):
            return "'messages' must be a non-empty list of message objects"
        for i, m in enumerate(msgs):
            if not isinstance(m.get("role"), str):
                return f"'messages[{i}].role' must be a string (e.g. \"user\")"
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                return f"'messages[{i}].content' must be a string, a list of parts or null"
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    return f"'messages[{i}].content[{j}]' must be an object with a string 'type'"
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    return f"'messages[{i}].content[{j}].text' must be a string"
        for i, m in enumerate(msgs):
            problem = _tool_calls_problem(m.get("tool_calls"), f"messages[{i}].tool_calls")
            if problem:
                return problem
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            return "'tools' must be a list of tool objects"
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            return "'chat_template_kwargs' must be an object"
    for key in ("model", "draft_model"):
        if key in body and not isinstance(body[key], str):
            return f"'{key}' must be a string"
        if body.get(key) == "":  # a path: "" would be the server's working directory
            return f"'{key}' must be a model name or path, not empty"
    for key in _FLOAT_FIELDS:
        v = body.get(key)
        if isinstance(v, float) and not math.isfinite(v):
            return f"'{key}' must be a finite number, got {v}"
    for key in _INT_FIELDS:
        if isinstance(body.get(key), bool):
            return f"'{key}' must be an integer, not a boolean"
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < 1 << 64:
        return f"'seed' must be in 0..2**64-1 (MLX's random seed is unsigned 64-bit), got {seed}"
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(w, str) and w for w in stop)):
        return "'stop' must be a string or a list of non-empty strings"
    for key in ("max_tokens", "max_completion_tokens"):
        n = body.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > MAX_COMPLETION_TOKENS:
            return f"'{key}' of {n} is above this server's limit of {MAX_COMPLETION_TOKENS}"
    return None


def _tool_calls_problem(calls: Any, where: str) -> Optional[str]:
    # mlx-lm reads each call's function and parses string arguments as JSON before the
    # chat template runs: anything else ended in a bare Python error.
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"'{where}' must be a list of tool call objects"
    for j, call in enumerate(calls):
        func = call.get("function") if isinstance(call, dict) else None
        if not isinstance(func, dict) or not isinstance(func.get("name"), str):
            return (f"'{where}[{j}]' must be an object with a 'function' object holding a "
                    "string 'name'")
        args = func.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError:
                return f"'{where}[{j}].function.arguments' must be a JSON object or its text"
        if args not in (None, "") and not isinstance(args, dict):
            return f"'{where}[{j}].function.arguments' must be a JSON object or its text"
    return None


def _scan_cache_dir_or_empty(original):
    def scan_cache_dir(*args, **kwargs):
        from huggingface_hub import HFCacheInfo
        from huggingface_hub.errors import CacheNotFound

        try:
            return original(*args, **kwargs)
        except CacheNotFound:
            return HFCacheInfo(size_on_disk=0, repos=frozenset(),
                               incomplete_files=frozenset(), warnings=[])

    scan_cache_dir.__qab_patched__ = True
    return scan_cache_dir


def install(max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, preload: bool = False,
            read_timeout: float = DEFAULT_READ_TIMEOUT) -> None:
    """Make ``mlx_lm.server`` serve through :class:`QABHTTPServer` and the handler of
    :func:`make_handler_class`.

    ``mlx_lm.server.run`` builds its HTTP server with ``_run_http_server`` and does
    not forward a handler class, so that function is wrapped; ``scan_cache_dir`` (used
    by ``/v1/models``) is wrapped to return an empty cache listing when the cache
    directory does not exist. Calling again replaces the limit; :func:`uninstall`
    undoes both.

    With ``preload``, ``mlx_lm.server.run`` is wrapped too: the ``--model`` is
    loaded before the HTTP server starts (stock mlx-lm loads it in its generation
    thread, which dies on a bad model while the server keeps answering), so a bad
    model ends ``mlx_lm.server.main()`` with :class:`ServeStartupError`; so do a
    port that cannot be bound and a ``--draft-model`` on a model whose recurrent
    cache cannot be trimmed (every request would fail).

    Args:
        max_body_bytes (int): largest accepted request body. Default 32 MiB.
        preload (bool): load the default model before serving. Default False.
        read_timeout (float): as :func:`make_handler_class`. Default 60 s.

    Raises:
        ValueError: if ``max_body_bytes`` or ``read_timeout`` is not positive.
        RuntimeError: if the installed mlx-lm lacks ``_run_http_server``,
            ``APIHandler`` or ``scan_cache_dir`` in ``mlx_lm.server``.

    Example:
        >>> from qwen_apple_backend import enable
        >>> from qwen_apple_backend.server import install
        >>> import sys, mlx_lm.server
        >>> enable("fused"); install(max_body_bytes=1 << 20)
        >>> sys.argv = ["mlx_lm.server", "--model", "path/to/checkpoint", "--port", "8080"]
        >>> mlx_lm.server.main()
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if not read_timeout > 0:
        raise ValueError(f"read_timeout must be positive, got {read_timeout}")
    from mlx_lm import server as mlx_server

    missing = [n for n in ("_run_http_server", "APIHandler", "scan_cache_dir")
               if not hasattr(mlx_server, n)]
    if missing:
        raise RuntimeError(f"mlx_lm.server has no {', '.join(missing)}: qab serve supports "
                           "the mlx-lm 0.32 server")
    run_http_server = _PATCHED.setdefault("_run_http_server", mlx_server._run_http_server)
    scan = _PATCHED.setdefault("scan_cache_dir", mlx_server.scan_cache_dir)
    run = _PATCHED.setdefault("run", mlx_server.run)

    def qab_run_http_server(host, port, response_generator, server_class=None,
                            handler_class=None):
        if server_class is None or server_class is ThreadingHTTPServer:
            server_class = QABHTTPServer
        handler = make_handler_class(handler_class or mlx_server.APIHandler, max_body_bytes,
                                     read_timeout)
        try:
            return run_http_server(host, port, response_generator, server_class=server_class,
                                   handler_class=handler)
        except OSError as exc:
            # Address in use, no permission, unknown host: stop the generation thread
            # (not a daemon: it would keep the process alive) and say so.
            response_generator.stop_and_join()
            raise ServeStartupError(f"cannot serve on {host}:{port}: {exc}") from exc

    def qab_run(host, port, model_provider, *args, **kwargs):
        from .errors import QABError

        if not isinstance(port, int) or not 0 <= port <= 65535:
            # Stock passes it on; the socket layer then binds some other port.
            raise ServeStartupError(f"--port {port}: must be 0..65535")
        try:
            model_provider.load_default()
        except QABError:
            raise
        except Exception as exc:  # noqa: BLE001 - any load failure ends the startup
            model = getattr(getattr(model_provider, "cli_args", None), "model", None)
            raise ServeStartupError(f"cannot load the model {model!r}: "
                                    f"{type(exc).__name__}: {exc}") from exc
        if getattr(model_provider, "draft_model", None) is not None:
            try:
                _check_trimmable(model_provider.model, "--draft-model")
            except ValueError as exc:
                # Every request would be refused: say so once, at startup.
                raise ServeStartupError(str(exc)) from None
        return run(host, port, model_provider, *args, **kwargs)

    qab_run_http_server.__qab_patched__ = True
    qab_run.__qab_patched__ = True
    mlx_server._run_http_server = qab_run_http_server
    mlx_server.scan_cache_dir = _scan_cache_dir_or_empty(scan)
    mlx_server.run = qab_run if preload else run
    generator = getattr(mlx_server, "ResponseGenerator", None)
    _wrap_method(generator, "generate", _recording_generate)
    _wrap_method(generator, "_tokenize", _checked_tokenize)
    _wrap_method(getattr(mlx_server, "ModelProvider", None), "_load", _checked_provider_load)


def uninstall() -> None:
    """Undo :func:`install`."""
    if not _PATCHED:
        return
    from mlx_lm import server as mlx_server

    for name, fn in _PATCHED.items():
        setattr(mlx_server, name, fn)
    _PATCHED.clear()
    for (cls, name), fn in _METHODS.items():
        setattr(cls, name, fn)
    _METHODS.clear()


def _wrap_method(cls: Optional[type], name: str, wrapper) -> None:
    """``cls.name = wrapper(original)``, once; :func:`uninstall` restores it."""
    fn = getattr(cls, name, None)
    if fn is None or getattr(fn, "__qab_patched__", False):
        return
    _METHODS[(cls, name)] = fn
    wrapped = wrapper(fn)
    wrapped.__qab_patched__ = True
    setattr(cls, name, wrapped)


def _checked_tokenize(tokenize):
    """``ResponseGenerator._tokenize`` that refuses what would fail later in mlx-lm's
    generation thread. Raised here, that thread hands the error back to the request, and
    serving goes on: a token id past the model's embedding rows (a tokenizer that does not
    match the weights) or a logit_bias id past the logits crashed the whole server on the
    CPU, and a draft model with an untrimmable cache dropped the connection after the
    reply's status line."""
    def qab_tokenize(self, tokenizer, request, args):
        out = tokenize(self, tokenizer, request, args)
        from .loader import check_token_ids

        provider = self.model_provider
        check_token_ids(getattr(provider, "model", None), out[0])
        _check_logit_bias(getattr(provider, "model", None),
                          getattr(getattr(args, "logits", None), "logit_bias", None))
        if getattr(provider, "draft_model", None) is not None:
            _check_trimmable(provider.model, "'draft_model'")
        return out
    return qab_tokenize


def _recording_generate(generate):
    """``ResponseGenerator.generate`` that keeps its error for the handler thread,
    which then picks the status (``QABAPIHandler._set_completion_headers``)."""
    def qab_generate(self, *args, **kwargs):
        _REQUEST.error = None
        try:
            return generate(self, *args, **kwargs)
        except Exception as exc:
            _REQUEST.error = exc
            raise
    return qab_generate


def _check_trimmable(model: Any, draft: str) -> None:
    """Raise ValueError, naming ``draft`` (the request field or the flag), if ``model``'s
    prompt cache cannot be trimmed, as speculative decoding needs."""
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    if not can_trim_prompt_cache(make_prompt_cache(model)):
        raise ValueError(f"{draft} (speculative decoding) needs a prompt cache that can be "
                         "trimmed, and this model's recurrent (Gated DeltaNet) layers keep one "
                         f"that cannot be: leave {draft} out")


def _check_logit_bias(model: Any, bias: Any) -> None:
    from .errors import PromptError
    from .loader import vocab_rows

    rows = vocab_rows(model) if bias else None
    if rows is None:
        return
    bad = [k for k in bias if not isinstance(k, int) or not 0 <= k < rows]
    if bad:
        raise PromptError(f"'logit_bias' names token id {bad[0]}, outside the model's "
                          f"{rows} vocabulary rows (0..{rows - 1})")


def _checked_provider_load(load_model):
    """``ModelProvider._load`` that checks the new checkpoint before mlx-lm drops the
    served model (its ``_load`` resets first): a request naming a model that cannot be
    loaded fails alone, and the next request is served without a reload."""
    def qab_load(self, model_path, adapter_path=None, draft_model_path=None):
        if self.model is not None:
            from mlx_lm import server as mlx_server

            from .loader import check_checkpoint

            backend = getattr(mlx_server.load, "qab_backend", None)
            for path in (model_path, draft_model_path):
                if path is not None:
                    check_checkpoint(path, backend)
            if (draft_model_path is not None and self.model_key
                    and self.model_key[0] == model_path):
                _check_trimmable(self.model, "'draft_model'")  # before it is dropped
        return load_model(self, model_path, adapter_path, draft_model_path)
    return qab_load
