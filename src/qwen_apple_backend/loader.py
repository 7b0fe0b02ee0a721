"""``load()``: mlx-lm's ``load`` with the plugin registry in front of it.

The model is built and its weights loaded by mlx-lm itself
(``mlx_lm.utils.load_model`` through its ``get_model_classes`` seam); an
adapter then swaps in fused modules. Architectures no plugin claims load
exactly as ``mlx_lm.load`` loads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, Optional, Union

from . import envs
from .errors import CheckpointError, MissingCheckpointFileError, PromptError, UnknownBackendError
from .report import FuseReport

MLX_BACKENDS = envs.MLX_BACKENDS

#: Files of which at least one makes a directory hold a tokenizer that
#: ``transformers.AutoTokenizer`` (and so ``mlx_lm.load``) can load.
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                        "spiece.model", "tokenizer.tiktoken", "qwen.tiktoken")
# JSON files a tokenizer is read from; check_tokenizer_files() checks they parse.
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json")

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _resolve_path(path_or_hf_repo: Union[str, Path], revision: Optional[str]) -> Path:
    p = Path(path_or_hf_repo).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p}: expected a checkpoint directory, found a file")
        return p
    text = str(path_or_hf_repo)
    if _HF_REPO.match(text) and not text.startswith((".", "/", "~")):
        from mlx_lm.utils import _download

        try:
            return Path(_download(text, revision=revision))
        except Exception as exc:  # hub unreachable, repo missing, ...
            raise MissingCheckpointFileError(
                f"{text}: not a local checkpoint directory, and downloading it as a Hugging "
                f"Face repository failed ({type(exc).__name__}: {exc})") from exc
    raise MissingCheckpointFileError(f"{text}: checkpoint directory not found")


def _read_json_object(path: Path) -> dict:
    """A JSON file whose top level is an object; errors name the file.

    Raises:
        CheckpointError: if it is not UTF-8, not valid JSON or not an object.
    """
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON at line {exc.lineno} column "
                              f"{exc.colno}: {exc.msg}") from exc
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not a UTF-8 JSON file ({exc.reason})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return data


def _config_file(model_path: Path) -> Path:
    """``model_path / "config.json"``, which must exist.

    Raises:
        MissingCheckpointFileError: naming the file, if it is absent.
    """
    cfg = model_path / "config.json"
    if not cfg.is_file():
        raise MissingCheckpointFileError(f"{cfg}: config.json not found")
    return cfg


def read_config(model_path: Path) -> dict:
    """Parse ``config.json``.

    Raises:
        MissingCheckpointFileError: if the file is absent.
        CheckpointError: if it is not valid JSON or not an object.
    """
    cfg = _config_file(model_path)
    config = _read_json_object(cfg)
    if "model_type" not in config:
        raise CheckpointError(f"{cfg}: missing required field 'model_type'")
    return config


def check_quantization_config(config: dict, cfg_file: Union[str, Path] = "config.json") -> None:
    """Check ``config.json``'s ``quantization`` section before mlx-lm reads it.

    mlx-lm's loader indexes it without checks (a list gave ``AttributeError``, a
    section without ``group_size`` ``KeyError: 'group_size'``): it must be an object
    whose ``group_size`` and ``bits`` are positive integers, and each per-layer entry
    (any other key but ``mode``) ``false``/``true`` or an object whose ``group_size``
    and ``bits``, where given, are positive integers. An absent or null section is an
    unquantized checkpoint.

    Raises:
        CheckpointError: naming the file and the field.
    """
    q = config.get("quantization")
    if q is None:
        legacy = config.get("quantization_config")
        # mlx-lm reads a legacy (Hugging Face) section only when there is no
        # "quantization", and indexes its quant_method unchecked.
        if legacy and not (isinstance(legacy, dict)
                           and isinstance(legacy.get("quant_method"), str)):
            raise CheckpointError(
                f"{cfg_file}: quantization_config must be an object with a quant_method "
                "string (there is no quantization section, which an MLX-quantized "
                "checkpoint's config.json holds, with group_size and bits)")
        return
    where = f"{cfg_file}: quantization"
    if not isinstance(q, dict):
        raise CheckpointError(f"{where} must be an object with group_size and bits, "
                              f"got {type(q).__name__} {q!r}"[:300])

    def positive(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    for field in ("group_size", "bits"):
        if field not in q:
            raise CheckpointError(f"{where}.{field} is missing (an object with group_size and "
                                  "bits: mlx-lm quantizes the model's layers with them)")
        if not positive(q[field]):
            raise CheckpointError(f"{where}.{field} must be a positive integer, "
                                  f"got {q[field]!r}")
    if "mode" in q and not isinstance(q["mode"], str):
        raise CheckpointError(f"{where}.mode must be a string, got {q['mode']!r}")
    for key, entry in q.items():
        if key in ("group_size", "bits", "mode") or isinstance(entry, bool):
            continue
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}.{key} (a layer's entry) must be true, false or an "
                                  f"object with group_size and bits, got {entry!r}"[:300])
        for field in ("group_size", "bits"):
            if field in entry and not positive(entry[field]):
                raise CheckpointError(f"{where}.{key}.{field} must be a positive integer, "
                                      f"got {entry[field]!r}")


#: Bytes per element of each safetensors dtype MLX's loader reads (``mx.load``); it
#: refuses the others (``F64``, ``F8_E5M2``, ``F4``, ...) with "unsupported dtype".
SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1,
                        "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4,
                        "U64": 8, "I64": 8, "C64": 8}


def read_safetensors_header(path: Path) -> dict:
    """Read a safetensors header (tensor names, dtypes, shapes) without its data.

    Raises:
        CheckpointError: naming the file (and the tensor), if it is truncated or not
            safetensors, a tensor's dtype is one MLX cannot load, or its shape does not
            fill its data_offsets exactly (MLX raised a RuntimeError naming neither the
            file nor, for the dtype, the tensor).
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n <= 1 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a valid safetensors file (header is not an object)")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has no valid data_offsets") from exc
        if end > data_len or start > end:
            raise CheckpointError(
                f"{path}: tensor {name!r} lies past the end of the file (truncated? bytes "
                f"{start}..{end} of {data_len})")
        dtype, shape = info.get("dtype"), info.get("shape")
        if dtype not in SAFETENSORS_ITEMSIZE:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {dtype!r}, which MLX cannot load "
                f"(it reads {', '.join(SAFETENSORS_ITEMSIZE)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                and d >= 0 for d in shape)):
            raise CheckpointError(f"{path}: tensor {name!r} has no valid shape (a list of "
                                  f"sizes), got {shape!r}")
        need = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
        if end - start != need:
            raise CheckpointError(
                f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} needs {need:,} "
                f"bytes, but its data_offsets hold {end - start:,}")
    return header


def check_weight_files(model_path: Path) -> dict[str, tuple[str, list]]:
    """Validate the safetensors files and the index; return key -> (file, shape).

    Raises:
        MissingCheckpointFileError: no ``model*.safetensors``, or a shard named in
            ``model.safetensors.index.json`` is absent.
        CheckpointError: a corrupt shard (:func:`read_safetensors_header`), a key in
            two files, or a key the index lists that no file holds.
    """
    files = sorted(model_path.glob("model*.safetensors"))
    index_path = model_path / "model.safetensors.index.json"
    index = None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: invalid index (needs a 'weight_map' object): "
                                  f"{exc}") from exc
        for shard in sorted(set(index.values())):
            if not (model_path / shard).is_file():
                key = next(k for k, v in index.items() if v == shard)
                raise MissingCheckpointFileError(
                    f"{model_path / shard}: shard listed in {index_path.name} (e.g. for key "
                    f"{key!r}) is missing")
    if not files:
        raise MissingCheckpointFileError(f"{model_path}: no model*.safetensors weight files found")
    keys: dict[str, tuple[str, list]] = {}
    for f in files:
        for name, info in read_safetensors_header(f).items():
            if name == "__metadata__":
                continue
            if name in keys:
                # mlx-lm reads every file and keeps the last one's tensor, silently.
                raise CheckpointError(f"{f}: key {name!r} is also in {keys[name][0]} (a weight "
                                      "must be in one file only)")
            keys[name] = (f.name, info.get("shape"))
    if index is not None:
        for key, shard in index.items():
            got = keys.get(key)
            if got is None:
                raise CheckpointError(f"{model_path / shard}: key {key!r} listed in "
                                      f"{index_path.name} is not in the file")
    return keys


def _resolve_adapter(config: dict):
    from .plugins import resolve_architecture

    match = resolve_architecture(config)
    if match is None:
        return None
    name, entry = match
    obj = entry.load()
    adapter = obj() if isinstance(obj, type) else obj
    return name, entry, adapter


def load_model(model_path: Union[str, Path], backend: Optional[str] = None, *, lazy: bool = False,
               strict: bool = True, model_config: Optional[dict] = None,
               trust_remote_code: bool = False, use_fallback: bool = True,
               disable: Optional[Union[frozenset, str]] = None):
    """Build and load a model from a local checkpoint directory.

    Args:
        model_path (str | Path): checkpoint directory.
        backend (str, optional): ``auto``, ``fused`` or ``stock``; default ``QAB_BACKEND``
            or ``auto``.
        lazy (bool): leave weights unevaluated. Default False.
        strict (bool): as in ``mlx_lm.utils.load_model``. Default True.
        model_config (dict, optional): config overrides, as in mlx-lm.
        trust_remote_code (bool): as in mlx-lm. Default False.
        use_fallback (bool): keep a module stock when it cannot be fused. Default True.
        disable (frozenset[str], optional): module kinds to keep stock and/or
            optimizations to switch off (the names ``QAB_DISABLE`` takes);
            default from ``QAB_DISABLE``.

    Returns:
        tuple[nn.Module, dict, FuseReport]: model, config, and what was replaced.

    Raises:
        MissingCheckpointFileError, CheckpointError, UnsupportedConfigError, FuseError,
        UnknownBackendError, EnvVarError (an unknown ``disable`` name).
    """
    checked = _check_config(model_path, backend, model_config, disable)
    return _load_checked(checked, lazy=lazy, strict=strict, model_config=model_config,
                         trust_remote_code=trust_remote_code, use_fallback=use_fallback)


@dataclasses.dataclass
class _Checked:
    """What :func:`_check_config` found: all :func:`load_model` needs besides weights."""

    model_path: Path
    backend: str
    config: dict
    report: FuseReport
    resolved: Optional[tuple]  # (architecture, registry entry, adapter), None: stock mlx-lm
    overrides: Optional[dict]  # the adapter's config overrides (model_config's included)
    kinds: Optional[frozenset]  # module kinds / optimizations to keep stock (fused, auto)


def _check_config(model_path: Union[str, Path], backend: Optional[str],
                  model_config: Optional[dict], disable) -> _Checked:
    """:func:`load_model`'s checks that need no weights: the backend, ``QAB_*``
    variables and ``disable``, ``config.json`` (its ``model_type`` and, where a plugin
    claims the architecture, every field the adapter needs). Milliseconds, so
    :func:`load` runs them before the tokenizer (seconds for a real one).

    Raises:
        as :func:`load_model`, except errors in the weight files.
    """
    backend = check_backend(backend)
    if backend not in MLX_BACKENDS:
        raise UnknownBackendError(f"load_model() builds MLX models with one of "
                                  f"{list(MLX_BACKENDS)}; use load() for backend {backend!r}")
    kinds = None
    if backend in ("auto", "fused"):
        envs.validate()  # a bad QAB_* variable fails here, not at the first forward pass
        kinds = envs.disabled_kinds() if disable is None else envs.check_disable(disable)
    model_path = Path(model_path)
    config = read_config(model_path)
    cfg_file = model_path / "config.json"
    check_quantization_config(config, cfg_file)
    report = FuseReport(backend=backend)
    resolved = _resolve_adapter(config)
    if resolved is None:
        check_model_type(config, cfg_file)
        return _Checked(model_path, backend, config, report, None, None, kinds)
    name, entry, adapter = resolved
    report.architecture, report.adapter, report.plugin = name, entry.target, entry.plugin
    merged = dict(config)
    if model_config:
        merged.update(model_config)
    try:
        overrides = adapter.prepare_config(merged, report)
    except CheckpointError as exc:
        # Adapters name the field as "config.json: ..."; give the full path.
        text = str(exc)
        if text.startswith("config.json"):
            raise type(exc)(f"{cfg_file}{text[len('config.json'):]}") from exc
        raise
    overrides = {**(model_config or {}), **overrides}
    return _Checked(model_path, backend, config, report, resolved, overrides, kinds)


def _load_checked(checked: _Checked, *, lazy: bool, strict: bool, model_config: Optional[dict],
                  trust_remote_code: bool, use_fallback: bool):
    """:func:`load_model` once :func:`_check_config` has passed: the weight files,
    the model, and its fused modules."""
    from mlx_lm import utils as mlx_utils

    model_path, report = checked.model_path, checked.report
    cfg_file = model_path / "config.json"
    weight_files = check_weight_files(model_path)
    if checked.resolved is None:
        with _config_errors(cfg_file, checked.config.get("model_type")):
            try:
                model, config = mlx_utils.load_model(model_path, lazy, strict=strict,
                                                     model_config=model_config,
                                                     trust_remote_code=trust_remote_code)
            except ValueError as exc:
                why = _activation_quantization_problem(str(exc), checked.config)
                if why is None:
                    raise
                raise CheckpointError(f"{model_path}: {why}") from exc
        why = f"no plugin claims architecture {config.get('model_type')!r}"
        report.notes.append(f"{why} (config.json model_type / architectures): stock mlx-lm "
                            "model")
        report.add_stock_modules(model, why)
        model.qab_report = report
        return model, config, report

    name, _, adapter = checked.resolved
    from .models._hybrid import load_context

    with load_context(model_path=model_path, config={**checked.config, **checked.overrides},
                      weight_files=weight_files), \
            _config_errors(cfg_file, name):
        try:
            model, config = mlx_utils.load_model(
                model_path, lazy, strict=strict, model_config=checked.overrides,
                get_model_classes=adapter.get_model_classes,
                trust_remote_code=trust_remote_code)
        except CheckpointError:
            raise
        except ValueError as exc:
            why = _activation_quantization_problem(str(exc), checked.config)
            if why is not None:
                raise CheckpointError(f"{model_path}: {why}") from exc
            # mlx-lm reports missing/unexpected/mis-shaped parameters as ValueError.
            raise CheckpointError(f"{model_path}: weights do not match the model built from "
                                  f"config.json: {_short_parameter_list(str(exc))}"
                                  + _quantization_hint(str(exc), checked.config)) from exc
    if checked.backend in ("auto", "fused"):
        adapter.fuse(model, config, disable=checked.kinds, use_fallback=use_fallback,
                     report=report)
    else:
        why = "backend=stock: stock mlx-lm modules (loader fixes only)"
        report.notes.append(why)
        report.add_stock_modules(model, "backend=stock")
    model.qab_report = report
    return model, config, report


def check_model_type(config: dict, cfg_file: Union[str, Path] = "config.json") -> None:
    """An architecture no plugin claims must be one mlx-lm itself can build.

    Raises:
        CheckpointError: naming the file and ``model_type`` (and the claimed names)
            when mlx-lm has no model of that type either.
    """
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except ValueError as exc:
        from .plugins import get_registry

        claimed = ", ".join(sorted(get_registry().architectures)) or "none"
        model_type = config.get("model_type")
        raise CheckpointError(
            f"{cfg_file}: unsupported model_type {model_type!r}: no installed plugin claims it "
            f"(claimed: {claimed}) and mlx-lm has no model of that type ({exc})") from exc


_MISSING_ARG = re.compile(r"missing \d+ required (?:positional|keyword-only) arguments?: (.*)$")


def _short_parameter_list(text: str, most: int = 4) -> str:
    """MLX's "Received N parameters not in model: a,\\nb,\\n..." (one line per name) with
    its first ``most`` names and a count of the rest, on one line."""
    head, sep, names = text.partition(": \n")
    if not sep:
        return text
    items = [n.strip().rstrip(",.") for n in names.split("\n") if n.strip()]
    if len(items) <= most:
        return f"{head}: {', '.join(items)}"
    return f"{head}: {', '.join(items[:most])}, ... ({len(items) - most} more)"


def _quantization_hint(text: str, config: dict) -> str:
    """A hint for weights that hold quantization scales where config.json says nothing of
    quantization (mlx-lm then builds unquantized layers)."""
    if (config.get("quantization") is None and not config.get("quantization_config")
            and "not in model" in text and ".scales" in text):
        return (" (the weights are quantized, .scales and .biases, but config.json has no "
                "quantization section with their group_size and bits)")
    return ""


#: The quantization modes whose layers mlx-lm's ``load_model`` can swap for
#: activation-quantized ones (``quantize_activations``, ``mlx_lm.generate
#: --quantize-activations``); it raises a ValueError for any other.
_ACTIVATION_QUANTIZATION_MODES = ("nvfp4", "mxfp8")


def _activation_quantization_problem(text: str, config: dict) -> Optional[str]:
    """What mlx-lm's "... does not support activation quantization" ValueError means
    for this checkpoint, or None for another error. (Its message for a mode comes with an
    unfilled ``{m.mode}``; the mode is read from config.json here.)"""
    if "does not support activation quantization" not in text:
        return None
    what = "activation quantization (--quantize-activations; quantize_activations in model_config)"
    if "bias" in text:
        return (f"{what} does not apply to this checkpoint: mlx-lm cannot quantize the "
                "activations of its quantized linear layers that have a bias")
    quant = config.get("quantization") or config.get("quantization_config")
    mode = None
    if isinstance(quant, dict):
        mode = quant.get("mode") or quant.get("quant_method") or "affine"
    modes = " or ".join(_ACTIVATION_QUANTIZATION_MODES)
    return (f"{what} is supported only for checkpoints quantized in mode {modes}; this one "
            + (f"is quantized in mode {mode!r} (config.json)" if mode
               else "has layers quantized in another mode"))


@contextlib.contextmanager
def _config_errors(cfg_file: Path, architecture: Any):
    """Turn mlx-lm's ``ModelArgs(...)`` TypeError for a missing config field into a
    CheckpointError naming the file and the field."""
    try:
        yield
    except TypeError as exc:
        m = _MISSING_ARG.search(str(exc))
        if m is None:
            raise
        fields = re.findall(r"'([^']+)'", m.group(1))
        which = ", ".join(repr(f) for f in fields) or m.group(1)
        raise CheckpointError(
            f"{cfg_file}: missing required field{'s' if len(fields) > 1 else ''} {which} "
            f"(needed to build the {architecture} model)") from exc


def plugin_mlx_backends() -> dict[str, str]:
    """Backends registered by plugins that load mlx-lm models (besides ``fused`` / ``stock``).

    A backend qualifies when its registered class has an ``mlx_backend`` attribute
    naming one of :data:`MLX_BACKENDS` (as subclasses of
    ``qwen_apple_backend.backends.base.MLXBackend`` do); its own ``load`` is used.

    Returns:
        dict[str, str]: backend name -> the MLX backend it builds on.
    """
    from .plugins import get_registry
    from .registry import import_target

    out: dict[str, str] = {}
    registry = get_registry()
    for name in sorted(registry.backends):
        if name in MLX_BACKENDS:
            continue
        try:
            obj = import_target(registry.backend(name).target)
        except Exception:  # noqa: BLE001 - a broken plugin backend is simply not usable
            continue
        if getattr(obj, "mlx_backend", None) in MLX_BACKENDS:
            out[name] = obj.mlx_backend
    return out


def check_backend(backend: Optional[str]) -> str:
    """Normalise a backend name for MLX loading.

    Args:
        backend (str, optional): a backend name; None reads ``QAB_BACKEND`` (default
            ``auto``).

    Returns:
        str: the lower-cased name: one of :data:`MLX_BACKENDS`, or a plugin backend
        that loads mlx-lm models (:func:`plugin_mlx_backends`).

    Raises:
        TypeError: for a backend that is neither a str nor None (``backend=3`` was an
            ``AttributeError`` from ``.strip()``).
        UnknownBackendError: for a name that is not an MLX backend; names other
            plugins register (e.g. ``llama.cpp``) are pointed to ``qab compare``.
            The message names ``QAB_BACKEND`` when the name came from it.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (a str) or None, got "
                        f"{type(backend).__name__} {backend!r}")
    source = "" if backend else "QAB_BACKEND: "
    backend = (backend or envs.backend()).strip().lower()
    if backend in MLX_BACKENDS:
        return backend
    plugin_mlx = plugin_mlx_backends()
    if backend in plugin_mlx:
        return backend
    from .plugins import get_registry

    known = set(get_registry().backends)
    usable = [*MLX_BACKENDS, *plugin_mlx]
    if backend in known:
        raise UnknownBackendError(
            f"{source}backend {backend!r} is not an MLX backend and cannot return an mlx-lm "
            f"model (MLX backends: {', '.join(usable)}); use it through "
            f"qwen_apple_backend.backends or `qab compare --backends stock,{backend}=MODEL`")
    raise UnknownBackendError(
        f"{source}unknown backend {backend!r}; expected one of {usable}"
        + (f" (registered: {sorted(known)})" if known else ""))


def check_tokenizer_files(model_path: Path) -> None:
    """A checkpoint directory must hold a tokenizer to generate text.

    Raises:
        MissingCheckpointFileError: naming ``tokenizer.json`` (and the other file
            names a tokenizer may come in) when the directory has none of them.
        CheckpointError: naming the file, line and column when ``tokenizer.json`` or
            ``tokenizer_config.json`` is not valid JSON.
    """
    model_path = Path(model_path)
    for name in TOKENIZER_JSON_FILES:
        path = model_path / name
        if not path.is_file():
            continue
        _read_json_object(path)
    check_tokenizer_present(model_path)


def check_tokenizer_present(model_path: Path) -> None:
    """:func:`check_tokenizer_files` without parsing the JSON files: a look at names only.

    Raises:
        MissingCheckpointFileError: as :func:`check_tokenizer_files`.
    """
    if any((model_path / n).is_file() for n in TOKENIZER_FILE_NAMES):
        return
    if any(model_path.glob("*.tiktoken")):
        return
    raise MissingCheckpointFileError(
        f"{model_path / 'tokenizer.json'}: tokenizer.json not found (nor "
        f"{', '.join(TOKENIZER_FILE_NAMES[1:])}): this checkpoint has no tokenizer, which "
        "generating text needs. Copy the tokenizer files of the original model into the "
        "directory (for a Qwen3.5/3.6 checkpoint, "
        "qwen_apple_backend.tokenizer.write_tokenizer(path) writes the real one).")


def _load_tokenizer(model_path: Path, tokenizer_config: Optional[dict],
                    eos_token_ids: Any) -> tuple[Any, Optional[CheckpointError]]:
    """``mlx_lm.utils.load_tokenizer``, and the error to raise if it failed.

    The tokenizer's JSON files are parsed by the tokenizer itself; only when it fails
    are they parsed again (:func:`check_tokenizer_files`), so that a corrupt file's
    error names its line and column (a real Qwen ``tokenizer.json`` is 15 MB: a parse
    saved on every load). A failure with valid JSON files is returned, not raised:
    transformers also reads ``config.json``, whose own errors the model's loader names
    by field, so the caller raises it only once the model has loaded.

    Returns:
        ``(tokenizer, None)``, or ``(None, error)``: a :class:`CheckpointError` naming
        the file, for the caller to raise.

    Raises:
        CheckpointError: naming the file, line and column of a JSON file that does not
            parse.
    """
    from mlx_lm import utils as mlx_utils

    try:
        return mlx_utils.load_tokenizer(model_path, tokenizer_config,
                                        eos_token_ids=eos_token_ids), None
    except Exception as exc:  # noqa: BLE001 - corrupt tokenizer files raise anything
        check_tokenizer_files(model_path)
        files = [n for n in TOKENIZER_FILE_NAMES + TOKENIZER_JSON_FILES[1:]
                 if (model_path / n).is_file()]
        error = CheckpointError(
            f"{model_path / files[0] if files else model_path}: the tokenizer could not be "
            f"loaded from {', '.join(files) or 'this directory'}: "
            f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return None, error


def load(path_or_hf_repo: Union[str, Path], backend: Optional[str] = None, *,
         tokenizer_config: Optional[dict] = None, model_config: Optional[dict] = None,
         adapter_path: Optional[str] = None, lazy: bool = False, return_config: bool = False,
         revision: Optional[str] = None, trust_remote_code: bool = False,
         use_fallback: bool = True, disable=None):
    """Load a model and tokenizer like ``mlx_lm.load``, with fused Qwen modules.

    Args:
        path_or_hf_repo (str | Path): checkpoint directory (or a Hugging Face repo id,
            downloaded by mlx-lm when the network allows).
        backend (str, optional): ``"auto"`` (fused where a plugin claims the
            architecture, stock otherwise), ``"fused"`` or ``"stock"``. Default
            ``QAB_BACKEND`` or ``"auto"``.
        tokenizer_config, model_config, adapter_path, lazy, return_config, revision,
            trust_remote_code: as in ``mlx_lm.load``.
        use_fallback (bool): keep a module stock when it cannot be fused (True), or
            raise ``FuseError`` naming the layer and reason (False). Default True.
        disable (Iterable[str] | str, optional): module kinds to keep stock
            (``moe``, ``gdn``, ``attn``, ``all``) and/or optimizations to
            switch off (the names ``QAB_DISABLE`` takes), or one
            comma-separated string of them; default from ``QAB_DISABLE``.

    Returns:
        ``(model, tokenizer)`` or ``(model, tokenizer, config)``; what was replaced
        is in :func:`get_report` (``model.qab_report``).

    Raises:
        MissingCheckpointFileError: missing directory, config, weight or tokenizer file.
        CheckpointError: corrupt file, mismatching keys/shapes/quantization, an
            unsupported ``model_type`` or a missing required config field.
        UnsupportedConfigError: a config the model cannot be built from.
        UnknownBackendError: an unknown backend name.
        EnvVarError: a bad ``QAB_*`` environment variable or an unknown
            ``disable`` name.

    Example:
        >>> from qwen_apple_backend import load, get_report
        >>> from mlx_lm import generate
        >>> model, tokenizer = load("path/to/Qwen3.6-35B-A3B-4bit", backend="fused")
        >>> print(get_report(model).summary())
        >>> print(generate(model, tokenizer, prompt="Hello", max_tokens=32))
    """
    backend = check_backend(backend)
    if backend not in MLX_BACKENDS:
        # A plugin backend that builds mlx-lm models: its own load() (which comes back here
        # with one of MLX_BACKENDS).
        from .backends import get_backend

        return get_backend(backend).load(
            path_or_hf_repo, tokenizer_config=tokenizer_config, model_config=model_config,
            adapter_path=adapter_path, lazy=lazy, return_config=return_config,
            revision=revision, trust_remote_code=trust_remote_code,
            use_fallback=use_fallback, disable=disable)
    # config.json's checks (milliseconds), then the tokenizer (seconds for a real one),
    # then the weights: each error as early as it can be found.
    checked = _check_before_weights(path_or_hf_repo, backend, revision, model_config,
                                    None if disable is None else envs.check_disable(disable))
    model_path = checked.model_path
    # The end-of-sequence ids as mlx-lm's load() takes them: config.json, then
    # generation_config.json, then model_config.
    from mlx_lm import utils as mlx_utils

    eos_token_ids = {**mlx_utils.load_config(model_path),
                     **(model_config or {})}.get("eos_token_id")
    tokenizer, tokenizer_error = _load_tokenizer(model_path, tokenizer_config, eos_token_ids)
    model, config, _ = _load_checked(checked, lazy=lazy, strict=True,
                                     model_config=model_config,
                                     trust_remote_code=trust_remote_code,
                                     use_fallback=use_fallback)
    if tokenizer_error is not None:
        raise tokenizer_error
    if adapter_path is not None:
        model = mlx_utils.load_adapters(model, adapter_path)
        model.eval()
    if return_config:
        return model, tokenizer, config
    return model, tokenizer


def check_checkpoint(path_or_hf_repo: Union[str, Path], backend: Optional[str] = None, *,
                     revision: Optional[str] = None) -> Path:
    """The checks :func:`load` makes before it reads a weight: the directory,
    ``config.json`` and its fields, a tokenizer file, the weight files' headers and
    index. Milliseconds; nothing is loaded. ``qab serve`` runs them before mlx-lm's
    server drops the model it serves for a request's ``model``.

    Args:
        path_or_hf_repo (str | Path): as :func:`load`.
        backend (str, optional): as :func:`load`; a plugin backend that does not build
            MLX models gets only the directory check.
        revision (str, optional): as :func:`load`.

    Returns:
        Path: the checkpoint directory.

    Raises:
        MissingCheckpointFileError, CheckpointError, UnsupportedConfigError,
        UnknownBackendError, EnvVarError: as :func:`load`.
    """
    backend = check_backend(backend)
    if backend not in MLX_BACKENDS:
        return _resolve_path(path_or_hf_repo, revision)
    checked = _check_before_weights(path_or_hf_repo, backend, revision, None, None)
    check_weight_files(checked.model_path)
    return checked.model_path


def _check_before_weights(path_or_hf_repo: Union[str, Path], backend: str,
                          revision: Optional[str], model_config: Optional[dict],
                          disable) -> _Checked:
    """The checkpoint directory, then its own files (a folder with neither is named by
    its config.json, then the tokenizer's), then :func:`_check_config`: what
    :func:`load` and :func:`check_checkpoint` check before any weight."""
    model_path = _resolve_path(path_or_hf_repo, revision)
    _config_file(model_path)
    check_tokenizer_present(model_path)
    return _check_config(model_path, backend, model_config, disable)


def get_report(model: Any) -> Optional[FuseReport]:
    """What was fused in ``model``, and why the rest stayed stock.

    Args:
        model: a model from :func:`load` (or any mlx-lm model).

    Returns:
        FuseReport | None: the report :func:`load` stored on the model. A model
        with none (e.g. from plain ``mlx_lm.load``) gets one listing every layer's
        modules as stock, saying it was not loaded through this package. None
        only for an object that is not an MLX model (e.g. a llama.cpp model).
    """
    report = getattr(model, "qab_report", None)
    if report is not None:
        return report
    try:
        import mlx.nn as nn
    except ImportError:  # pragma: no cover - mlx is a dependency
        return None
    if not isinstance(model, nn.Module):
        return None
    why = "not loaded through qwen_apple_backend (e.g. plain mlx_lm.load): stock mlx-lm model"
    report = FuseReport(backend="stock", notes=[why])
    report.add_stock_modules(model, "not loaded through qwen_apple_backend")
    return report


def _text_config_int(model: Any, name: str) -> Optional[int]:
    """The integer field ``name`` of a loaded model's text config (its ``language_model``'s
    args for a multimodal wrapper, else its own), or None."""
    for obj in (getattr(model, "language_model", None), model):
        value = getattr(getattr(obj, "args", None), name, None)
        if isinstance(value, int):
            return value
    return None


def max_positions(model: Any) -> Optional[int]:
    """``max_position_embeddings`` of a loaded model's text config, if known."""
    return _text_config_int(model, "max_position_embeddings")


def vocab_rows(model: Any) -> Optional[int]:
    """Rows of a loaded model's token embedding (its text config's ``vocab_size``), if known."""
    value = _text_config_int(model, "vocab_size")
    return value if value is not None and not isinstance(value, bool) and value > 0 else None


def check_token_ids(model: Any, ids: Any) -> None:
    """Reject token ids outside the model's embedding rows.

    MLX gathers embedding rows without a bounds check: on the CPU an id past the last
    row crashed the process (segmentation fault), on a GPU it reads other memory. Such
    ids come from a tokenizer that does not match the weights, e.g. a
    ``qab make-checkpoint --vocab-size`` checkpoint, which keeps Qwen's full tokenizer
    (``qab bench`` / ``qab compare`` fold their prompt ids into its range).

    Args:
        model: a loaded model.
        ids: token ids (a list of ints or an integer ``mx.array``; empty: nothing to check).

    Raises:
        PromptError: naming the id and the model's ``vocab_size``.
    """
    import mlx.core as mx

    rows = vocab_rows(model)
    if rows is None:
        return
    if isinstance(ids, mx.array):
        if ids.size == 0 or not mx.issubdtype(ids.dtype, mx.integer):
            return
        low, high = int(mx.min(ids).item()), int(mx.max(ids).item())
    else:
        try:
            values = [int(i) for i in ids]
        except (TypeError, ValueError):
            return
        if not values:
            return
        low, high = min(values), max(values)
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise PromptError(
            f"the prompt holds token id {bad}, outside the model's {rows} embedding rows "
            f"(config.json vocab_size = {rows}): its tokenizer does not match its weights "
            "(a `qab make-checkpoint --vocab-size` checkpoint keeps the full tokenizer; "
            "`qab bench` and `qab compare` fold their prompt ids into its range)")


def check_prompt(model: Any, prompt: Any) -> None:
    """Reject an empty prompt, one longer than ``max_position_embeddings``, and token ids
    outside the model's embedding (:func:`check_token_ids`).

    Args:
        model: a loaded model.
        prompt: token ids (list / mx.array) or text.

    Raises:
        PromptError: naming the length and the limit, or the token id.
    """
    try:
        n = len(prompt) if not hasattr(prompt, "size") else int(prompt.size)
    except TypeError:
        return
    if n == 0:
        raise PromptError("the prompt is empty: give at least one token")
    limit = max_positions(model)
    if limit is not None and not isinstance(prompt, str) and n > limit:
        raise PromptError(f"the prompt has {n} tokens, more than the model's "
                          f"max_position_embeddings = {limit} (config.json)")
    if not isinstance(prompt, str):
        check_token_ids(model, prompt)


# ---- enable(): route mlx-lm's own entry points through load() ----------------------------

_PATCHED: dict[tuple[str, str], Any] = {}
_LOAD_USERS = ("mlx_lm.utils", "mlx_lm", "mlx_lm.generate", "mlx_lm.chat", "mlx_lm.server",
               "mlx_lm.benchmark", "mlx_lm.evaluate")


def enable(backend: Optional[str] = None) -> None:
    """Make mlx-lm's own ``load`` (and so ``mlx_lm.generate``/``chat``/``server``) use
    the registry.

    Idempotent; :func:`disable` undoes it. ``backend`` (default ``QAB_BACKEND`` or
    ``auto``) applies to every load while enabled.

    Example:
        >>> import qwen_apple_backend, mlx_lm
        >>> qwen_apple_backend.enable("fused")
        >>> model, tokenizer = mlx_lm.load("path/to/checkpoint")  # fused modules inside
    """
    import importlib

    chosen = check_backend(backend)

    def patched_load(path_or_hf_repo, tokenizer_config=None, model_config=None,
                     adapter_path=None, lazy=False, return_config=False, revision=None,
                     trust_remote_code=False, **kwargs):
        return load(path_or_hf_repo, kwargs.pop("backend", chosen),
                    tokenizer_config=tokenizer_config, model_config=model_config,
                    adapter_path=adapter_path, lazy=lazy, return_config=return_config,
                    revision=revision, trust_remote_code=trust_remote_code, **kwargs)

    patched_load.__qab_patched__ = True
    patched_load.qab_backend = chosen  # for check_checkpoint() before a served model is dropped
    for modname in _LOAD_USERS:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        if hasattr(mod, "load"):
            _PATCHED.setdefault((modname, "load"), _original(mod, "load"))
            setattr(mod, "load", patched_load)

    gen = importlib.import_module("mlx_lm.generate")
    original_stream = _PATCHED.setdefault(("mlx_lm.generate", "stream_generate"),
                                          _original(gen, "stream_generate"))

    def checked_stream_generate(model, tokenizer, prompt, *args, **kwargs):
        if not isinstance(prompt, str):
            check_prompt(model, prompt)
        elif prompt == "":
            raise PromptError("the prompt is empty: give at least one token")
        return original_stream(model, tokenizer, prompt, *args, **kwargs)

    checked_stream_generate.__qab_patched__ = True
    gen.stream_generate = checked_stream_generate


def _original(mod, name):
    """The unpatched ``mod.name``; a module that imported an already patched
    function by name gets the original of its source (mlx_lm.utils / mlx_lm.generate)."""
    fn = getattr(mod, name)
    if not getattr(fn, "__qab_patched__", False):
        return fn
    if (mod.__name__, name) in _PATCHED:
        return _PATCHED[(mod.__name__, name)]
    source = "mlx_lm.utils" if name == "load" else "mlx_lm.generate"
    return _PATCHED[(source, name)]


def disable() -> None:
    """Undo :func:`enable`: mlx-lm's entry points load stock models again."""
    import importlib

    for (modname, attr), fn in list(_PATCHED.items()):
        setattr(importlib.import_module(modname), attr, fn)
    _PATCHED.clear()


def is_enabled() -> bool:
    import sys

    mod = sys.modules.get("mlx_lm.utils")
    return bool(mod is not None and getattr(getattr(mod, "load", None), "__qab_patched__", False))
