"""What the benchmark harness drives: a :class:`BenchTarget` per backend.

The harness never touches a model directly. Each backend hands it a target
with a handful of methods (prefill, greedy decode, teacher-forced logits,
synchronisation and memory counters), so a non-MLX backend such as the
llama.cpp plugin plugs in by returning its own target from a
``bench_target(path_or_model, **kwargs)`` method on its backend class. The
MLX backends (``stock``, ``fused``) share :class:`MLXTarget`.

This module also builds the models of the ``--preset`` sources in memory
(:func:`build_preset`) and fuses an in-memory model the way the loader fuses
a checkpoint (:func:`fuse_in_memory`).

MLX and mlx-lm are imported inside functions only, so importing this module
stays cheap.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol, Sequence, Union, runtime_checkable

from ..errors import QABError

__all__ = [
    "BackendSpec",
    "BackendUnavailableError",
    "BenchTarget",
    "ContextTarget",
    "MLXContext",
    "MLXTarget",
    "build_preset",
    "clone_model_structure",
    "default_prefill_step_size",
    "fuse_in_memory",
    "make_bench_target",
    "parse_backend_specs",
    "resolve_backend",
]


class BackendUnavailableError(QABError, RuntimeError):
    """A backend that cannot run here, or offers no ``bench_target``."""


@runtime_checkable
class BenchTarget(Protocol):
    """One backend, ready to be measured. Batch size is 1 throughout.

    Timing is the harness's job: it reads its clock around :meth:`prefill` and
    :meth:`decode` and calls :meth:`synchronize` before every clock read, so an
    implementation must not return while work it queued is still running
    unless :meth:`synchronize` waits for it.

    Optional: ``export_context()`` and ``load_context(ctx)`` (:class:`ContextTarget`)
    let a target hand its prefilled state to others (``qab bench --shared-prefill``);
    they are not members of this protocol, so a target without them is still a
    :class:`BenchTarget`.

    Attributes:
        label (str): name in reports (``"stock"``, ``"fused"``, ``"fused-no-moe"`` ...).
        kind (str): implementation family (``"mlx"``, ``"llama.cpp"`` ...).
        tokenizer: an object with ``encode(text) -> list[int]`` and
            ``decode(ids) -> str``, or None when the target has none.
    """

    label: str
    kind: str
    tokenizer: Any

    def reset(self) -> None:
        """Drop every cache and recurrent state; the next call starts from an empty context."""
        ...

    def prefill(self, ids: Sequence[int]) -> int:
        """Process a prompt from an empty context and choose the first token greedily.

        Args:
            ids (Sequence[int]): prompt token ids, length T >= 1.

        Returns:
            int: the first generated token (time to first token = duration of this call).
            It is not yet fed back: :meth:`decode` starts by feeding it.
        """
        ...

    def decode(self, n: int) -> list[int]:
        """Generate ``n`` further tokens greedily from the state :meth:`prefill` left.

        Returns:
            list[int]: ``n`` token ids (n model steps).
        """
        ...

    def logits(self, ids: Sequence[int]) -> Any:
        """Teacher-forced next-token logits from an empty context.

        Shapes:
            ids: [T]; returns a ``numpy.ndarray`` of shape [T, V], float32, where row t
            scores the token after ``ids[t]``.
        """
        ...

    def synchronize(self) -> None:
        """Block until all work queued on the device has finished."""
        ...

    def peak_memory(self) -> Optional[int]:
        """Peak device memory in bytes since :meth:`reset_peak_memory` (None if unknown)."""
        ...

    def reset_peak_memory(self) -> None:
        """Restart the peak-memory counter."""
        ...

    def active_memory(self) -> Optional[int]:
        """Device memory in use now, in bytes (None if unknown)."""
        ...

    def decode_traffic(self) -> Optional[dict]:
        """Bytes one decode step reads at the current context (after :meth:`prefill`).

        Returns:
            dict | None: byte counts by component with a ``"total"`` key, or None when
            the target cannot tell.
        """
        ...

    def vocab_size(self) -> int:
        """Number of logits per position (V)."""
        ...

    def describe(self) -> dict:
        """JSON-serialisable facts for the report: backend, flags, dtype, quantization ..."""
        ...


@runtime_checkable
class ContextTarget(Protocol):
    """The optional half of :class:`BenchTarget`: decoding from another target's prefill.

    ``qab bench --shared-prefill LABEL`` prefills each length once on LABEL's
    target, keeps :meth:`export_context`'s object for the whole sweep and has
    every target :meth:`load_context` it before each decode.
    """

    def export_context(self) -> Any:
        """A copy of the state :meth:`BenchTarget.prefill` left, unaffected by later calls.

        Returns:
            an object with at least ``label`` (str, this target's) and
            ``first_token`` (int, the token decode feeds first: prefill's choice).

        Raises:
            RuntimeError: when there is no prefilled state.
        """
        ...

    def load_context(self, ctx: Any) -> None:
        """Replace this target's state by a private copy of ``ctx``, so that
        :meth:`BenchTarget.decode` continues from it; ``ctx`` itself is never changed.

        Raises:
            ValueError: when this target cannot use ``ctx`` (another kind of state,
                another cache layout); the message names both labels.
        """
        ...


@dataclass(frozen=True)
class BackendSpec:
    """One column of a benchmark: a registered backend, possibly with kinds switched off.

    Attributes:
        label (str): unique name in reports, e.g. ``"fused-no-moe"``.
        backend (str): registry name of the backend (``"stock"``, ``"fused"``, ...).
        disable (frozenset[str]): fused module kinds kept stock (``moe``, ``gdn``, ``attn``).
        ablation (str | None): the kind this column ablates, if it is an ablation.
        model (str | None): this column's own model path (``--backends NAME=PATH``),
            used instead of ``--model`` / ``--preset``, e.g. a GGUF file for a
            backend that cannot read the MLX checkpoint.
    """

    label: str
    backend: str
    disable: frozenset = field(default_factory=frozenset)
    ablation: Optional[str] = None
    model: Optional[str] = None

    def to_dict(self) -> dict:
        return {"label": self.label, "backend": self.backend,
                "disable": sorted(self.disable), "ablation": self.ablation,
                "model": self.model}


def parse_backend_specs(backends: Union[str, Iterable[str]],
                        ablate: Union[str, Iterable[str], None] = None) -> list[BackendSpec]:
    """Turn ``--backends`` and ``--ablate`` into the list of measured columns.

    Args:
        backends (str | Iterable[str]): comma-separated or listed backend names; a
            name may carry its own model path as ``NAME=PATH``
            (``stock,llama.cpp=model.gguf``).
        ablate (str | Iterable[str], optional): fused module kinds (``moe``, ``gdn``,
            ``attn``) or optimizations (the keys of ``envs.OPTIMIZATIONS``, e.g.
            ``gdn-kernel``, ``moe-route``); each adds a ``fused-no-<name>`` column
            (the ``fused`` backend with that one switched off; an opt-in one such as
            ``next-norm`` is on in ``fused`` only with ``QAB_ENABLE``). What
            ``QAB_DISABLE`` switches off stays off in that column too (a
            ``disable=`` list replaces the variable when a model is loaded).

    Returns:
        list[BackendSpec]: in the given order, ablations last.

    Raises:
        ValueError: for an empty list, a ``NAME=`` entry without its path, a repeated
            name, an unknown ablation kind or one that ``QAB_DISABLE`` already switches
            off.
    """
    from ..envs import FUSABLE_KINDS, OPTIMIZATIONS, disabled_kinds

    entries = _split(backends)
    items = [(n.partition("=")[0].strip(), n.partition("=")[2].strip() or None)
             for n in entries]
    names = [n for n, _ in items]
    if not names:
        raise ValueError("--backends: give at least one backend name")
    if not all(names):
        raise ValueError("--backends: a NAME=PATH entry has no name")
    # "fused=" (e.g. an unset "fused=$GGUF") would measure --model / --preset instead.
    pathless = [n for n, (_, path) in zip(entries, items) if "=" in n and path is None]
    if pathless:
        raise ValueError(f"--backends: {pathless[0]!r} has no path after '=' (NAME=PATH gives "
                         "a backend its own model; NAME alone uses --model / --preset)")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"--backends: {dupes} listed more than once")
    specs = [BackendSpec(n, n, model=path) for n, path in items]
    for kind in (k.lower() for k in _split(ablate or ())):  # any case, as QAB_DISABLE
        if kind not in FUSABLE_KINDS and kind not in OPTIMIZATIONS:
            raise ValueError(f"--ablate: unknown module kind or optimization {kind!r}; expected a "
                             f"comma-separated subset of {list(FUSABLE_KINDS)} or "
                             f"optimizations {list(OPTIMIZATIONS)}")
        label = f"fused-no-{kind}"
        if any(s.label == label for s in specs):
            raise ValueError(f"--ablate: {kind!r} listed more than once")
        if kind in disabled_kinds():
            raise ValueError(f"--ablate: {kind!r} is already switched off by QAB_DISABLE, so "
                             f"{label} would measure fused again")
        fused_model = next((s.model for s in specs if s.backend == "fused"), None)
        specs.append(BackendSpec(label, "fused", disabled_kinds() | {kind}, kind,
                                 model=fused_model))
    return specs


def _split(value: Union[str, Iterable[str]]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return [s.strip() for s in items if s and s.strip()]


def default_prefill_step_size() -> int:
    """mlx-lm's own prefill chunk (``generate_step(prefill_step_size=...)``, 2048 in 0.32)."""
    import inspect

    from mlx_lm.generate import generate_step

    return int(inspect.signature(generate_step).parameters["prefill_step_size"].default)


# ----------------------------------------------------------------------------- models


def _text_args(model: Any) -> Any:
    for obj in (getattr(model, "language_model", None), model):
        args = getattr(obj, "args", None)
        if args is not None:
            return args
    return None


def model_dtype(model: Any) -> str:
    """The floating dtype holding most parameter bytes (``"bfloat16"``, ``"float32"`` ...)."""
    from mlx.utils import tree_flatten

    sizes: dict[str, int] = {}
    for _, p in tree_flatten(model.parameters()):
        name = str(p.dtype).rsplit(".", 1)[-1]
        if name.startswith(("float", "bfloat")):
            sizes[name] = sizes.get(name, 0) + p.nbytes
    return max(sizes, key=sizes.get) if sizes else "unknown"


def model_quantization(model: Any) -> Optional[dict]:
    """Quantization of a model's layers: bits, group sizes and modes in use, with counts.

    Returns:
        dict | None: ``{"bits": {"4": n, "8": m}, "group_size": {...}, "mode": {...},
        "layers": n}``, or None if no layer is quantized.
    """
    bits: dict[str, int] = {}
    groups: dict[str, int] = {}
    modes: dict[str, int] = {}
    n = 0
    for _, m in model.named_modules():
        b = getattr(m, "bits", None)
        if not isinstance(b, int) or not hasattr(m, "group_size"):
            continue
        n += 1
        bits[str(b)] = bits.get(str(b), 0) + 1
        g = str(getattr(m, "group_size", None))
        groups[g] = groups.get(g, 0) + 1
        mode = str(getattr(m, "mode", "affine"))
        modes[mode] = modes.get(mode, 0) + 1
    if not n:
        return None
    return {"layers": n, "bits": bits, "group_size": groups, "mode": modes}


def weight_read_bytes(model: Any) -> dict:
    """Weight bytes one decode step reads, from the model's parameters.

    Every parameter is read once per token except: the token embedding (one row),
    and the routed experts (``top_k / num_experts`` of each expert tensor, the
    expected share for one token). The lm_head is read in full (every row).

    Returns:
        dict[str, int]: bytes by component: ``embedding_row``, ``experts_active``,
        ``shared_expert``, ``router``, ``attention``, ``gdn``, ``lm_head``, ``other``,
        plus ``experts_total`` and ``parameters_total`` (for reference, not read).
    """
    from mlx.utils import tree_flatten

    args = _text_args(model)
    num_experts = getattr(args, "num_experts", None)
    top_k = getattr(args, "num_experts_per_tok", None)
    tied = bool(getattr(args, "tie_word_embeddings", False))
    out = {k: 0 for k in ("embedding_row", "experts_active", "shared_expert", "router",
                          "attention", "gdn", "lm_head", "other", "experts_total",
                          "parameters_total")}
    embed_full = 0
    for name, p in tree_flatten(model.parameters()):
        nbytes = int(p.nbytes)
        out["parameters_total"] += nbytes
        parts = name.split(".")
        if "embed_tokens" in parts:
            embed_full += nbytes
            out["embedding_row"] += nbytes // max(1, int(p.shape[0]))
        elif ("switch_mlp" in parts or "experts" in parts) and p.ndim >= 3:
            e = int(p.shape[0])
            share = min(top_k, e) / e if top_k else 1.0
            out["experts_total"] += nbytes
            out["experts_active"] += int(round(nbytes * share))
        elif "lm_head" in parts:
            out["lm_head"] += nbytes
        elif "shared_expert" in parts or "shared_expert_gate" in parts:
            out["shared_expert"] += nbytes
        elif "mlp" in parts and "gate" in parts and num_experts:
            out["router"] += nbytes
        elif "self_attn" in parts:
            out["attention"] += nbytes
        elif "linear_attn" in parts:
            out["gdn"] += nbytes
        else:
            out["other"] += nbytes
    if tied:
        # A tied head multiplies by the whole embedding matrix.
        out["lm_head"] += embed_full
    return out


def cache_read_bytes(cache: Sequence[Any]) -> dict:
    """KV-cache and recurrent-state bytes one decode step reads, from a primed cache.

    Returns:
        dict[str, int]: ``kv_cache`` (keys and values of the filled positions of every
        attention layer) and ``recurrent_state`` (every GDN conv and delta state).
    """
    kv = state = 0
    for c in cache or ():
        keys = getattr(c, "keys", None)
        if keys is not None and hasattr(c, "offset"):
            values = c.values
            filled = min(int(c.offset), int(keys.shape[2]))
            # Buffers grow in steps; only the filled rows are read.
            kv += (int(keys.nbytes) + int(values.nbytes)) * filled // max(1, int(keys.shape[2]))
        elif hasattr(c, "cache") and isinstance(c.cache, list):
            state += sum(int(a.nbytes) for a in c.cache if a is not None)
        else:
            try:
                kv += int(c.nbytes)
            except Exception:  # noqa: BLE001 - unknown cache type: not counted
                pass
    return {"kv_cache": kv, "recurrent_state": state}


def clone_model_structure(model: Any) -> Any:
    """A copy of a module tree that shares every weight array with the original.

    Fusing replaces submodules in place; fusing the clone leaves the original's
    modules untouched while no weight is duplicated (``--share-weights``).
    """
    import mlx.core as mx
    import mlx.nn as nn

    def clone(value):
        if isinstance(value, nn.Module):
            new = copy.copy(value)
            for k, v in value.items():
                new[k] = clone(v)
            return new
        if isinstance(value, list):
            return [clone(v) for v in value]
        if isinstance(value, tuple):
            return tuple(clone(v) for v in value)
        if isinstance(value, dict) and not isinstance(value, mx.array):
            return {k: clone(v) for k, v in value.items()}
        return value

    return clone(model)


def fuse_in_memory(model: Any, backend: str = "fused", *, config: Optional[dict] = None,
                   disable: Optional[Iterable[str]] = None, use_fallback: bool = True):
    """Fuse an already built mlx-lm model in place, as :func:`qwen_apple_backend.load` does.

    The adapter is found through the plugin registry from ``config`` (the model's
    ``config.json`` contents), so the same plugin that would claim the checkpoint
    fuses the in-memory model.

    Args:
        model (nn.Module): an mlx-lm model (e.g. from ``checkpoint.build_random_model``).
        backend (str): ``"fused"``/``"auto"`` to fuse, ``"stock"`` to leave it. Default ``"fused"``.
        config (dict, optional): the model's config; default ``{"model_type": ...}`` from
            the model's args.
        disable (Iterable[str], optional): module kinds to keep stock (``moe``, ``gdn``,
            ``attn``). Default: none.
        use_fallback (bool): keep a module stock when it cannot be fused. Default True.

    Returns:
        FuseReport: what was replaced; also stored as ``model.qab_report``.

    Raises:
        FuseError: when ``use_fallback`` is False and a module cannot be fused.
        EnvVarError: (a ``ValueError``) for an unknown ``disable`` name.

    Example:
        >>> from qwen_apple_backend.checkpoint import build_random_model, hf_config
        >>> model = build_random_model("tiny", vocab_size=1024)
        >>> report = fuse_in_memory(model, "fused", config=hf_config("tiny", 1024))
        >>> report.counts()["moe"]
        (4, 4)
    """
    from ..plugins import resolve_architecture
    from ..report import FuseReport

    report = FuseReport(backend=backend)
    if config is None:
        args = _text_args(model)
        config = {"model_type": getattr(getattr(model, "args", None), "model_type", None)
                  or getattr(args, "model_type", None)}
    if backend == "stock":
        report.notes.append("backend=stock: stock mlx-lm modules (built in memory)")
        report.add_stock_modules(model, "backend=stock")
    else:
        match = resolve_architecture(config)
        if match is None:
            why = f"no plugin claims architecture {config.get('model_type')!r}"
            report.notes.append(f"{why}: stock mlx-lm model")
            report.add_stock_modules(model, why)
        else:
            name, entry = match
            obj = entry.load()
            adapter = obj() if isinstance(obj, type) else obj
            report.architecture, report.adapter, report.plugin = name, entry.target, entry.plugin
            from ..envs import check_disable

            adapter.fuse(model, config, disable=check_disable(disable or ()),
                         use_fallback=use_fallback, report=report)
    model.qab_report = report
    return report


@dataclass
class PresetBuild:
    """A model built in memory from a preset, and what it took."""

    model: Any
    config: dict
    build_s: float
    preset: str
    seed: int
    dtype: str
    quantized: bool
    vocab_size: Optional[int]


def build_preset(preset: str, *, seed: int = 0, dtype: str = "bfloat16", quantize: bool = True,
                 vocab_size: Optional[int] = None, progress: bool = False) -> PresetBuild:
    """Build a random-weight model of a checkpoint preset in device memory.

    Args:
        preset (str): ``"tiny"``, ``"small"`` or ``"full"`` (Qwen3.6-35B-A3B shapes).
        seed (int): weights are a pure function of the seed. Default 0.
        dtype (str): float dtype of weights and scales. Default ``"bfloat16"``.
        quantize (bool): 4-bit affine g64, routers 8-bit. Default True.
        vocab_size (int, optional): embedding rows instead of 248,320.
        progress (bool): progress bar while building. Default False.

    Returns:
        PresetBuild: the evaluated model, its ``config.json`` dict and the build time.
    """
    import mlx.core as mx

    from ..checkpoint import build_random_model, hf_config

    config = hf_config(preset, vocab_size)
    t0 = time.perf_counter()
    model = build_random_model(preset, quantize=quantize, seed=seed, dtype=dtype,
                               vocab_size=vocab_size, progress=progress)
    mx.eval(model.parameters())
    mx.synchronize()
    return PresetBuild(model, config, time.perf_counter() - t0, preset, seed, dtype, quantize,
                       vocab_size)


# ------------------------------------------------------------------------- MLX target


@dataclass(frozen=True)
class MLXContext:
    """A prefilled mlx-lm prompt cache and the next token, exported by :class:`MLXTarget`.

    Held for reuse: targets load private copies of :attr:`cache`
    (:meth:`MLXTarget.load_context`), never the object itself.

    Attributes:
        label (str): the target whose prefill built it.
        first_token (int): the token prefill chose; decode feeds it first.
        cache (list): the mlx-lm cache objects, one per layer (preallocated KV
            buffers keep their size).
        next_token (mx.array): ``first_token`` as the [1] int array decode feeds.
    """

    label: str
    first_token: int
    cache: list
    next_token: Any


class MLXTarget:
    """:class:`BenchTarget` over an mlx-lm model (stock or fused).

    Prefill follows ``mlx_lm.generate.generate_step``: all prompt tokens but the
    last in chunks of ``prefill_step_size`` (cache state evaluated after each
    chunk), then the last token, whose logits choose the first token. Decode
    overlaps building step t+1 with running step t (``mx.async_eval``), as
    mlx-lm does. Greedy (argmax) throughout. Also a :class:`ContextTarget`:
    the prefilled cache can be exported and loaded into another MLX target
    with the same cache layout.

    Args:
        model (nn.Module): the model.
        label (str): report name.
        backend (str): registry backend name. Default ``"stock"``.
        prefill_step_size (int, optional): default mlx-lm's (2048).
        tokenizer: optional tokenizer (``encode``/``decode``).
        disable (Iterable[str]): kinds kept stock (recorded only).
        extra (dict, optional): more facts for :meth:`describe` (build time, source).
    """

    kind = "mlx"

    def __init__(self, model: Any, *, label: str, backend: str = "stock",
                 prefill_step_size: Optional[int] = None, tokenizer: Any = None,
                 disable: Iterable[str] = (), extra: Optional[dict] = None):
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        self.model = model
        self.label = label
        self.backend = backend
        self.tokenizer = tokenizer
        self.disable = frozenset(disable)
        self.prefill_step_size = int(prefill_step_size or default_prefill_step_size())
        if self.prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {self.prefill_step_size}")
        self.extra = dict(extra or {})
        self._stream = generation_stream
        self._mx = mx
        self._cache: Optional[list] = None
        self._next = None
        self._weights: Optional[dict] = None

    # -- state -------------------------------------------------------------------------
    def reset(self) -> None:
        self._cache = None
        self._next = None
        self._mx.clear_cache()

    def _new_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def _step_logits(self, tokens, cache):
        return self.model(tokens[None], cache=cache)

    def export_context(self) -> MLXContext:
        """A deep copy of the prefilled cache and the next token.

        The copy keeps every preallocated KV buffer's size, so a decode from it
        runs at the same buffer shapes as one after :meth:`prefill`.

        Returns:
            MLXContext: the context.

        Raises:
            RuntimeError: when there is no prefilled state.
        """
        mx = self._mx
        if self._next is None or self._cache is None:
            raise RuntimeError("export_context() needs a primed state: call prefill() first")
        mx.eval([c.state for c in self._cache])
        return MLXContext(label=self.label, first_token=int(self._next.item()),
                          cache=copy.deepcopy(self._cache), next_token=self._next)

    def synthetic_context(self, ids: Sequence[int], seed: int = 0) -> MLXContext:
        """A context of ``len(ids)`` tokens whose cache holds seeded random values, built
        without running the prompt: for decode-speed sweeps (``qab bench
        --synthetic-context``), where a real prefill costs minutes (a fresh process
        compiling the prefill kernels, or stock's per-token Gated DeltaNet loop off
        Metal) and a decode step's work does not depend on the cached values (the
        same KV rows read, K experts per token, the same state sizes).

        A one-token prefill of ``ids[-1]`` gives each cache entry's shapes and
        dtypes and the next token (its greedy choice). Each KV cache is then
        written in this target's prefill chunk pattern (``len(ids) - 1`` rows in
        ``prefill_step_size`` chunks, then one) through mlx-lm's own
        ``KVCache.update_and_fetch``, so its buffer has the capacity a real
        prefill of ``ids`` leaves; keys and values are N(0, 1) in the cache dtype.
        Each other cache entry (mlx-lm's ``ArraysCache``: the Gated DeltaNet conv
        and recurrent states) gets N(0, 1) values of its shape and dtype, scaled
        by 0.1 for a float32 entry (the recurrent state; the conv state too in a
        float32 model) to keep the recurrence bounded.

        Args:
            ids (Sequence[int]): the context's token ids (only their number and the
                last one are used).
            seed (int): seed of the random values (``mx.random.key``).

        Returns:
            MLXContext: the context, with ``label`` this target's.

        Raises:
            ValueError: an empty ``ids``, or a cache entry of a type other than
                mlx-lm's ``KVCache`` and ``ArraysCache`` (named).
        """
        from mlx_lm.models.cache import ArraysCache, KVCache

        mx = self._mx
        n = len(ids)
        if n == 0:
            raise ValueError("synthetic_context needs at least one token id")
        self.prefill([ids[-1]])
        probe, nxt = self._cache, self._next
        cache = self._new_cache()
        key = mx.random.key(int(seed) % (1 << 64))  # mx.random.key takes a uint64

        def normal(shape, dtype, scale=1.0):
            nonlocal key
            key, sub = mx.random.split(key)
            return (mx.random.normal(shape, key=sub) * scale).astype(dtype)

        chunks = [self.prefill_step_size] * ((n - 1) // self.prefill_step_size)
        chunks += [(n - 1) % self.prefill_step_size] if (n - 1) % self.prefill_step_size else []
        chunks += [1]
        with mx.stream(self._stream):
            for i, (c, p) in enumerate(zip(cache, probe)):
                if type(c) is KVCache and type(p) is KVCache:
                    B, Hk, _, Dk = p.keys.shape
                    Dv = p.values.shape[-1]
                    for t in chunks:
                        c.update_and_fetch(normal((B, Hk, t, Dk), p.keys.dtype),
                                           normal((B, Hk, t, Dv), p.values.dtype))
                        mx.eval(c.keys, c.values)
                elif type(c) is ArraysCache and type(p) is ArraysCache:
                    for j, a in enumerate(p.cache):
                        if a is not None:
                            c[j] = normal(a.shape, a.dtype,
                                          0.1 if a.dtype == mx.float32 else 1.0)
                    mx.eval([a for a in c.cache if a is not None])
                else:
                    raise ValueError(f"{self.label}: synthetic_context cannot fill cache "
                                     f"entry {i} ({type(c).__name__}); it fills mlx-lm's "
                                     "KVCache and ArraysCache")
        self.reset()
        return MLXContext(label=self.label, first_token=int(nxt.item()), cache=cache,
                          next_token=nxt)

    def load_context(self, ctx: MLXContext) -> None:
        """Install a fresh deep copy of ``ctx``'s cache and its next token.

        MLX arrays are values: decoding replaces the copy's arrays (the compiled
        decode step copies a buffer before its first in-place write), so ``ctx``
        stays as exported.

        Raises:
            ValueError: when ``ctx`` is not an :class:`MLXContext`, or its cache has
                another number of entries or another cache type at some entry
                than this model's ``make_prompt_cache``, or a KV cache entry whose
                keys are of another dtype than this model's (:func:`model_dtype`:
                a float32 model's context would make a bfloat16 model decode in
                float32, silently).
        """
        if not isinstance(ctx, MLXContext):
            raise ValueError(f"{self.label} cannot decode from a {type(ctx).__name__} "
                             f"context (from {getattr(ctx, 'label', '?')}): it takes the "
                             "contexts of MLX targets")
        own = [type(c) for c in self._new_cache()]
        theirs = [type(c) for c in ctx.cache]
        if len(own) != len(theirs):
            raise ValueError(f"{self.label} cannot decode from {ctx.label}'s context: "
                             f"{ctx.label}'s cache has {len(theirs)} entries, "
                             f"{self.label}'s {len(own)}")
        for i, (a, b) in enumerate(zip(theirs, own)):
            if a is not b:
                raise ValueError(f"{self.label} cannot decode from {ctx.label}'s context: "
                                 f"cache entry {i} is {a.__name__} in {ctx.label}'s, "
                                 f"{b.__name__} in {self.label}'s")
        own_dtype = model_dtype(self.model)
        for i, c in enumerate(ctx.cache):
            keys = getattr(c, "keys", None)
            name = str(getattr(keys, "dtype", "")).rsplit(".", 1)[-1]
            if name and own_dtype != "unknown" and name != own_dtype:
                raise ValueError(f"{self.label} cannot decode from {ctx.label}'s context: "
                                 f"cache entry {i} holds {name} keys, {self.label}'s model "
                                 f"runs in {own_dtype}")
        self._cache = copy.deepcopy(ctx.cache)
        self._next = ctx.next_token

    # -- measured calls ----------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> int:
        mx = self._mx
        if len(ids) == 0:
            from ..errors import PromptError

            raise PromptError("the prompt is empty: give at least one token")
        self._cache = cache = self._new_cache()
        prompt = mx.array(list(ids), dtype=mx.int32)
        with mx.stream(self._stream):
            while prompt.size > 1:
                n = min(self.prefill_step_size, prompt.size - 1)
                self._step_logits(prompt[:n], cache)
                mx.eval([c.state for c in cache])
                prompt = prompt[n:]
                mx.clear_cache()
            logits = self._step_logits(prompt, cache)[:, -1, :]
            y = mx.argmax(logits, axis=-1)
            mx.eval(y)
        self._next = y
        return int(y.item())

    def decode(self, n: int) -> list[int]:
        mx = self._mx
        if self._next is None or self._cache is None:
            raise RuntimeError("decode() needs a primed state: call prefill() first")
        out: list[int] = []
        if n <= 0:
            return out
        cache = self._cache

        def step(y):
            return mx.argmax(self._step_logits(y, cache)[:, -1, :], axis=-1)

        with mx.stream(self._stream):
            y = step(self._next)
            mx.async_eval(y)
            for i in range(n):
                if i + 1 < n:
                    nxt = step(y)
                    mx.async_eval(nxt)
                out.append(int(y.item()))
                if i + 1 < n:
                    y = nxt
                if i % 256 == 255:
                    mx.clear_cache()
        self._next = y
        return out

    def logits(self, ids: Sequence[int]):
        import numpy as np

        mx = self._mx
        cache = self._new_cache()
        prompt = mx.array(list(ids), dtype=mx.int32)
        rows = []
        with mx.stream(self._stream):
            for s in range(0, prompt.size, self.prefill_step_size):
                out = self._step_logits(prompt[s:s + self.prefill_step_size], cache)[0]
                out = out.astype(mx.float32)
                mx.eval(out)
                rows.append(np.array(out))
        return np.concatenate(rows, axis=0)

    # -- device ------------------------------------------------------------------------
    def synchronize(self) -> None:
        self._mx.synchronize(self._stream)
        self._mx.synchronize()

    def peak_memory(self) -> Optional[int]:
        return int(self._mx.get_peak_memory())

    def reset_peak_memory(self) -> None:
        self._mx.reset_peak_memory()

    def active_memory(self) -> Optional[int]:
        return int(self._mx.get_active_memory())

    # -- model facts -------------------------------------------------------------------
    def weight_traffic(self) -> dict:
        if self._weights is None:
            self._weights = weight_read_bytes(self.model)
        return self._weights

    def decode_traffic(self) -> Optional[dict]:
        w = self.weight_traffic()
        parts = {k: v for k, v in w.items() if k not in ("experts_total", "parameters_total")}
        parts.update(cache_read_bytes(self._cache or ()))
        parts["total"] = sum(parts.values())
        return parts

    def vocab_size(self) -> int:
        args = _text_args(self.model)
        v = getattr(args, "vocab_size", None)
        if isinstance(v, int):
            return v
        return int(self.logits([0]).shape[-1])

    def max_context(self) -> Optional[int]:
        """The model's ``max_position_embeddings`` (its config), or None where it has none."""
        v = getattr(_text_args(self.model), "max_position_embeddings", None)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    def describe(self) -> dict:
        from ..loader import get_report

        report = get_report(self.model)
        args = _text_args(self.model)
        w = self.weight_traffic()
        return {
            "label": self.label,
            "kind": self.kind,
            "backend": self.backend,
            "disable": sorted(self.disable),
            "prefill_step_size": self.prefill_step_size,
            "model_type": getattr(args, "model_type", None),
            "vocab_size": self.vocab_size(),
            "dtype": model_dtype(self.model),
            "quantization": model_quantization(self.model),
            "parameter_bytes": w["parameters_total"],
            "fuse_report": report.to_dict() if report is not None else None,
            "fused_counts": ({k: list(v) for k, v in report.counts().items()}
                             if report is not None else None),
            **self.extra,
        }


# ------------------------------------------------------------------- backend hook glue


def resolve_backend(spec: BackendSpec) -> Any:
    """The backend instance behind a column, checked to be usable for benchmarking.

    Raises:
        UnknownBackendError: if no plugin registered ``spec.backend``.
        BackendUnavailableError: if it is unavailable here or offers no ``bench_target``.
    """
    from ..backends import get_backend

    backend = get_backend(spec.backend)
    ok, why = backend.available()
    if not ok:
        raise BackendUnavailableError(
            f"backend {spec.backend!r} is not available here: {why}")
    if getattr(backend, "bench_target", None) is None:
        raise BackendUnavailableError(f"backend {spec.backend!r} offers no bench_target(); "
                                      "it cannot be benchmarked")
    return backend


def make_bench_target(spec: BackendSpec, *, model_path: Optional[Union[str, Path]] = None,
                      model: Any = None, config: Optional[dict] = None,
                      prefill_step_size: Optional[int] = None, tokenizer: Any = None,
                      extra: Optional[dict] = None) -> BenchTarget:
    """Ask a registered backend for a :class:`BenchTarget`.

    The backend class must offer ``bench_target(path_or_model, **kwargs)``; the
    MLX backends inherit one from ``MLXBackend``. A plugin backend that only
    loads checkpoints may raise when given an in-memory model.

    Args:
        spec (BackendSpec): backend name, report label and disabled kinds.
        model_path (str | Path, optional): checkpoint directory (``--model``).
        model (nn.Module, optional): in-memory model (``--preset``); used in place.
        config (dict, optional): ``config.json`` of the in-memory model.
        prefill_step_size (int, optional): prefill chunk; default mlx-lm's.
        tokenizer: tokenizer to attach (in-memory models).
        extra (dict, optional): more facts for ``describe()``.

    Returns:
        BenchTarget: the target.

    Raises:
        UnknownBackendError: if no plugin registered ``spec.backend``.
        BackendUnavailableError: if the backend is unavailable here or offers no
            ``bench_target``.
    """
    if (model_path is None) == (model is None):
        raise ValueError("give exactly one of model_path and model")
    backend = resolve_backend(spec)
    kwargs: dict[str, Any] = {"label": spec.label, "prefill_step_size": prefill_step_size,
                              "extra": extra}
    if spec.disable:
        kwargs["disable"] = spec.disable
    if model is not None:
        kwargs["config"] = config
        kwargs["tokenizer"] = tokenizer
    return backend.bench_target(model_path if model is None else model, **kwargs)


