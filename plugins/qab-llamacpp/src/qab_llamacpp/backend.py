"""The ``llama.cpp`` backend: GGUF models through llama-cpp-python.

:class:`LlamaCppBackend` is what the plugin registers under the name
``llama.cpp``. It loads a ``.gguf`` file (or a directory holding exactly one)
and hands the benchmark harness a :class:`LlamaCppTarget`, which follows
``qwen_apple_backend.bench.target.BenchTarget``: prefill, greedy decode and
teacher-forced logits straight on llama.cpp's context and batch (every logit
row copied out as float32, argmax taken in numpy, so greedy ties break the
same way as on MLX).

Nothing here imports MLX, and ``llama_cpp`` is imported only when a model is
loaded or :meth:`LlamaCppBackend.available` is asked.

Example:
    >>> from qwen_apple_backend.backends import get_backend
    >>> backend = get_backend("llama.cpp")
    >>> backend.available()
    (True, '')
    >>> target = backend.bench_target("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> target.tokenizer.decode([target.prefill(target.tokenizer.encode("The sky is"))])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple, Union

__all__ = ["LlamaCppBackend", "LlamaCppTarget", "LlamaCppTokenizer", "find_gguf"]

#: Context length a target starts with; it grows (the context is rebuilt) when a
#: prompt needs more.
DEFAULT_N_CTX = 4096
#: Tokens per llama.cpp batch when the harness gives no prefill step size.
DEFAULT_N_BATCH = 512
#: Cap on the logits copied out per batch in :meth:`LlamaCppTarget.logits` (bytes).
LOGITS_CHUNK_BYTES = 64 << 20
#: Environment variable: threads for decode and prefill (default: llama-cpp-python's,
#: half the cores for decode and all of them for prefill).
THREADS_ENV = "QAB_LLAMACPP_THREADS"


def _env_threads() -> Optional[int]:
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{THREADS_ENV}={value!r}: expected a positive integer") from None
    if n < 1:
        raise ValueError(f"{THREADS_ENV}={value!r}: expected a positive integer")
    return n


def find_gguf(path: Union[str, Path]) -> Path:
    """The GGUF file behind ``path``: the file itself, or the only ``*.gguf`` in a directory.

    Raises:
        FileNotFoundError: if ``path`` does not exist or a directory holds no ``.gguf``.
        ValueError: if ``path`` is a file that is not ``.gguf``, or a directory holds
            several (name one).
    """
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p}: the llama.cpp backend loads .gguf files")
        return p
    if p.is_dir():
        found = sorted(q for q in p.glob("*.gguf") if q.is_file())
        if len(found) == 1:
            return found[0]
        if not found:
            raise FileNotFoundError(f"{p}: no .gguf file in this directory (the llama.cpp "
                                    "backend needs one; give it with --backends "
                                    "llama.cpp=PATH.gguf)")
        raise ValueError(f"{p}: {len(found)} .gguf files ({', '.join(q.name for q in found)}); "
                         "name one")
    raise FileNotFoundError(f"{p}: no such file or directory")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("llama-cpp-python")
    except Exception:  # noqa: BLE001
        return "unknown"


class LlamaCppBackend:
    """Registry backend ``llama.cpp`` (llama-cpp-python).

    Attributes:
        name (str): ``"llama.cpp"``.
    """

    name = "llama.cpp"

    def available(self) -> Tuple[bool, str]:
        """``(True, "")`` when ``llama_cpp`` imports and loads its shared library."""
        try:
            import llama_cpp  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - ImportError or a missing shared library
            return False, (f"llama-cpp-python not importable ({type(exc).__name__}: {exc}); "
                           "pip install llama-cpp-python==0.3.36")
        return True, ""

    def load(self, path: Union[str, Path], **kwargs: Any) -> Tuple[Any, "LlamaCppTokenizer"]:
        """Load a GGUF model.

        Args:
            path (str | Path): a ``.gguf`` file or a directory holding exactly one.
            **kwargs: passed to ``llama_cpp.Llama`` (e.g. ``n_ctx``, ``n_threads``).

        Returns:
            tuple[llama_cpp.Llama, LlamaCppTokenizer]: the model and its GGUF tokenizer.
        """
        from llama_cpp import Llama

        kwargs.setdefault("n_ctx", DEFAULT_N_CTX)
        kwargs.setdefault("verbose", False)
        threads = _env_threads()
        if threads:
            kwargs.setdefault("n_threads", threads)
            kwargs.setdefault("n_threads_batch", threads)
        llm = Llama(model_path=str(find_gguf(path)), **kwargs)
        return llm, LlamaCppTokenizer(llm)

    def bench_target(self, path_or_model: Any, *, label: Optional[str] = None,
                     prefill_step_size: Optional[int] = None, extra: Optional[dict] = None,
                     disable: Any = None, config: Any = None, tokenizer: Any = None,
                     **kwargs: Any) -> "LlamaCppTarget":
        """A benchmark target over a GGUF file.

        Args:
            path_or_model (str | Path): a ``.gguf`` file or a directory holding exactly one.
            label (str, optional): report name; default ``"llama.cpp"``.
            prefill_step_size (int, optional): llama.cpp batch size (``n_batch``);
                default 512.
            extra (dict, optional): more facts for ``describe()``.
            disable: fused module kinds; llama.cpp has none, so it must be empty.
            config, tokenizer: accepted for the harness's signature; unused.
            **kwargs: ``n_ctx``, ``n_threads``, ``n_threads_batch`` for :class:`LlamaCppTarget`.

        Raises:
            BackendUnavailableError: for an in-memory model (``--preset``): llama.cpp
                loads only GGUF files.
            ValueError: for a non-empty ``disable``.
        """
        from qwen_apple_backend.bench.target import BackendUnavailableError

        if not isinstance(path_or_model, (str, Path)):
            raise BackendUnavailableError(
                "the llama.cpp backend loads GGUF files, not in-memory MLX models: use --model "
                "with a GGUF, or --backends llama.cpp=PATH.gguf")
        if disable:
            raise ValueError(f"llama.cpp has no fused module kinds to disable ({sorted(disable)})")
        return LlamaCppTarget(find_gguf(path_or_model), label=label or self.name,
                              n_batch=prefill_step_size, extra=extra, **kwargs)


class LlamaCppTokenizer:
    """The GGUF's own tokenizer, as llama.cpp runs it (``encode``/``decode``/chat template).

    ``encode`` matches special tokens written in the text (as a Hugging Face
    tokenizer does) and adds BOS only when the GGUF says so; ``decode`` keeps
    special tokens. ``apply_chat_template`` renders the GGUF's
    ``tokenizer.chat_template`` with llama-cpp-python's Jinja2 formatter.
    """

    def __init__(self, llm: Any):
        self._llm = llm
        meta = dict(getattr(llm, "metadata", {}) or {})
        self.chat_template: Optional[str] = meta.get("tokenizer.chat_template")
        self._add_bos = bool(llm._model.add_bos_token())

    @property
    def bos_token(self) -> str:
        return self._piece(self._llm.token_bos())

    @property
    def eos_token(self) -> str:
        return self._piece(self._llm.token_eos())

    @property
    def eos_token_id(self) -> int:
        return int(self._llm.token_eos())

    def _piece(self, token: int) -> str:
        if token is None or token < 0:
            return ""
        return self._llm._model.token_get_text(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"),
                                       add_bos=self._add_bos and add_special_tokens,
                                       special=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        raw = self._llm._model.detokenize([int(i) for i in ids], special=not skip_special_tokens)
        return raw.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs: Any):
        if not self.chat_template:
            raise ValueError("this GGUF has no tokenizer.chat_template")
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        fmt = Jinja2ChatFormatter(self.chat_template, eos_token=self.eos_token,
                                  bos_token=self.bos_token,
                                  add_generation_prompt=add_generation_prompt)
        text = fmt(messages=messages, **kwargs).prompt
        if not tokenize:
            return text
        # The template writes BOS itself when the model wants one.
        return self.encode(text, add_special_tokens=not text.startswith(self.bos_token or "\0"))


class LlamaCppTarget:
    """:class:`~qwen_apple_backend.bench.target.BenchTarget` over a llama.cpp context.

    Batch size 1, greedy. Prefill feeds the prompt in batches of ``n_batch``
    tokens, asking llama.cpp for the last token's logits only; decode feeds one
    token per step. :meth:`logits` asks for every row (teacher forcing), in
    batches small enough that a batch's logits stay under
    :data:`LOGITS_CHUNK_BYTES`. llama.cpp's CPU work is synchronous, so
    :meth:`synchronize` has nothing to wait for; device memory counters are not
    available (None).

    Args:
        path (Path): the GGUF file.
        label (str): report name.
        n_batch (int, optional): tokens per batch; default 512.
        n_ctx (int, optional): starting context; default 4096. It doubles (the context
            is rebuilt) until a prompt fits.
        n_threads (int, optional): decode threads; default ``QAB_LLAMACPP_THREADS``, else
            llama-cpp-python's (half the cores).
        n_threads_batch (int, optional): prefill threads; default ``QAB_LLAMACPP_THREADS``,
            else llama-cpp-python's (all cores).
        extra (dict, optional): more facts for :meth:`describe`.
    """

    kind = "llama.cpp"

    def __init__(self, path: Path, *, label: str = "llama.cpp", n_batch: Optional[int] = None,
                 n_ctx: Optional[int] = None, n_threads: Optional[int] = None,
                 n_threads_batch: Optional[int] = None, extra: Optional[dict] = None):
        import numpy as np

        self._np = np
        self.path = Path(path)
        self.label = label
        self.backend = "llama.cpp"
        self.prefill_step_size = int(n_batch or DEFAULT_N_BATCH)
        if self.prefill_step_size < 1:
            raise ValueError(f"n_batch must be >= 1, got {self.prefill_step_size}")
        env = _env_threads()
        self._threads = {k: v for k, v in {"n_threads": n_threads or env,
                                           "n_threads_batch": n_threads_batch or env}.items()
                         if v is not None}
        self.extra = dict(extra or {})
        self._llm = None
        self._open(int(n_ctx or DEFAULT_N_CTX))
        self.tokenizer = LlamaCppTokenizer(self._llm)
        self._n_past = 0
        self._next: Optional[int] = None

    # -- context -----------------------------------------------------------------------
    def _open(self, n_ctx: int) -> None:
        from llama_cpp import Llama

        if self._llm is not None:
            self._llm.close()
            self._llm = None
        self._llm = Llama(model_path=str(self.path), n_ctx=n_ctx,
                          n_batch=self.prefill_step_size, n_ubatch=self.prefill_step_size,
                          logits_all=False, verbose=False, **self._threads)
        self.n_ctx = int(self._llm.n_ctx())
        self._n_vocab = int(self._llm.n_vocab())
        if hasattr(self, "tokenizer"):
            self.tokenizer = LlamaCppTokenizer(self._llm)

    def _ensure_ctx(self, n_tokens: int) -> None:
        if n_tokens > self.n_ctx:
            size = self.n_ctx
            while size < n_tokens:
                size *= 2
            self._open(size)

    def _feed(self, tokens: Sequence[int], all_logits: bool):
        """Decode ``tokens`` at the current position; returns the logits rows asked for."""
        np = self._np
        llm = self._llm
        llm._batch.set_batch(batch=[int(t) for t in tokens], n_past=self._n_past,
                             logits_all=all_logits)
        llm._ctx.decode(llm._batch)
        self._n_past += len(tokens)
        rows = len(tokens) if all_logits else 1
        ptr = llm._ctx.get_logits() if all_logits else llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(ptr, shape=(rows, self._n_vocab))

    # -- state -------------------------------------------------------------------------
    def reset(self) -> None:
        self._llm._ctx.kv_cache_clear()
        self._n_past = 0
        self._next = None

    # -- measured calls ----------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> int:
        if len(ids) == 0:
            from qwen_apple_backend.errors import PromptError

            raise PromptError("the prompt is empty: give at least one token")
        self._ensure_ctx(len(ids) + 1)
        self.reset()
        step = self.prefill_step_size
        row = None
        for s in range(0, len(ids), step):
            row = self._feed(ids[s:s + step], all_logits=False)
        self._next = int(row[0].argmax())
        return self._next

    def decode(self, n: int) -> list[int]:
        if self._next is None:
            raise RuntimeError("decode() needs a primed state: call prefill() first")
        out: list[int] = []
        if n <= 0:
            return out
        if self._n_past + n > self.n_ctx:
            raise ValueError(f"decoding {n} tokens after {self._n_past} overruns the context "
                             f"of {self.n_ctx}; prefill a longer prompt first to grow it")
        y = self._next
        for _ in range(n):
            y = int(self._feed([y], all_logits=False)[0].argmax())
            out.append(y)
        self._next = y
        return out

    def logits(self, ids: Sequence[int]):
        np = self._np
        self._ensure_ctx(len(ids))
        self.reset()
        step = max(1, min(self.prefill_step_size, LOGITS_CHUNK_BYTES // (4 * self._n_vocab)))
        out = np.empty((len(ids), self._n_vocab), dtype=np.float32)
        for s in range(0, len(ids), step):
            chunk = ids[s:s + step]
            out[s:s + len(chunk)] = self._feed(chunk, all_logits=True)
        self.reset()
        return out

    # -- device ------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Nothing to wait for: llama.cpp's ``llama_decode`` returns when its CPU work is done."""

    def peak_memory(self) -> Optional[int]:
        return None

    def reset_peak_memory(self) -> None:
        pass

    def active_memory(self) -> Optional[int]:
        return None

    def decode_traffic(self) -> Optional[dict]:
        return None

    # -- model facts -------------------------------------------------------------------
    def vocab_size(self) -> int:
        return self._n_vocab

    def describe(self) -> dict:
        import llama_cpp

        meta = dict(self._llm.metadata or {})
        keep = ("general.architecture", "general.name", "general.file_type",
                "general.quantization_version", "tokenizer.ggml.model", "tokenizer.ggml.pre")
        system = llama_cpp.llama_print_system_info()
        return {
            "label": self.label,
            "kind": self.kind,
            "backend": self.backend,
            "gguf": str(self.path.resolve()),
            "gguf_bytes": self.path.stat().st_size,
            "metadata": {k: meta[k] for k in keep if k in meta},
            "model_type": meta.get("general.architecture"),
            "parameters": int(self._llm._model.n_params()),
            "parameter_bytes": int(self._llm._model.size()),
            "vocab_size": self._n_vocab,
            "n_ctx": self.n_ctx,
            "n_batch": self.prefill_step_size,
            "prefill_step_size": self.prefill_step_size,
            "threads": {"n_threads": self._llm.context_params.n_threads,
                        "n_threads_batch": self._llm.context_params.n_threads_batch},
            "llama_cpp_python": _version(),
            "system_info": system.decode() if isinstance(system, bytes) else str(system),
            **self.extra,
        }
