"""Which GPU backend is live, building kernels from their sources, and the self-check.

Every GPU kernel in this package is used only after it has computed the same
function as its portable MLX reference on random inputs of the shapes it is
about to see (the *self-check*). This matters most on Metal, whose kernels
cannot be run where the package is developed: a kernel that fails to compile,
raises, or disagrees with the reference beyond its tolerance is never used; a
warning says why and the portable path runs instead. The verdict is cached per
op, backend and shape class, so the check costs one extra call per shape class
per process.

This module imports only ``mlx.core``, the standard library, ``envs`` and
``ops._sources``.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .. import envs
from ._sources import KernelSource, compact, kernel_source

__all__ = [
    "KernelSelfCheckWarning",
    "SCALAR_PAD",
    "unpooled_length",
    "build_kernel",
    "f32_scalar",
    "padded_zeros",
    "gpu_backend",
    "self_checked",
    "self_check_passed",
    "self_check_results",
    "self_check_timings",
    "reset_self_checks",
]


class KernelSelfCheckWarning(RuntimeWarning):
    """A GPU kernel failed its self-check; the portable path is used instead."""


def gpu_backend() -> Optional[str]:
    """``"metal"`` or ``"cuda"`` when the default device is such a GPU, else None."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


@functools.lru_cache(maxsize=None)
def cuda_sm_count() -> int:
    """Streaming multiprocessors of CUDA device 0 (MLX's default GPU), or 0 when unknown.

    Read once from the CUDA driver (``cuDeviceGetAttribute``, attribute 16,
    ``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT``) through ``ctypes``: MLX's
    ``mx.device_info()`` does not report it. 0 without a CUDA driver (Metal,
    CPU) or when any call fails; callers then keep a size-independent launch.
    """
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    dev, count = ctypes.c_int(0), ctypes.c_int(0)
    try:
        if (lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), 0) != 0
                or lib.cuDeviceGetAttribute(ctypes.byref(count), 16, dev) != 0):
            return 0
    except AttributeError:
        return 0
    return max(0, int(count.value))


def build_kernel(op: str, backend: str, **options: Any) -> Optional[Callable[..., Any]]:
    """Compile-on-first-call kernel object for ``op`` on ``backend`` from its sources.

    The sources go to MLX compacted (:func:`._sources.compact`: MLX hashes a
    kernel's text at every launch it encodes).

    Args:
        op (str): manifest key (``kernels/MANIFEST.toml``).
        backend (str): ``"cuda"`` or ``"metal"``.
        **options: passed to ``mx.fast.cuda_kernel`` / ``mx.fast.metal_kernel``
            (``ensure_row_contiguous``, ``shared_memory``, ...).

    Returns:
        Callable | None: MLX's kernel object, or None when the manifest has no
        source for this backend, this MLX build lacks the backend's API or
        its device (the factory raises ``RuntimeError`` and
        ``mx.<backend>.is_available()`` is false: a CPU-only build, or a
        process that only pretends a GPU), or the kernel is a CUDA kernel not
        yet verified on a GPU (its manifest entry has no ``verified``) and
        ``QAB_UNVERIFIED_KERNELS`` is unset.
    """
    src: Optional[KernelSource] = kernel_source(op, backend)
    if src is None:
        return None
    if backend == "cuda" and not src.verified and not envs.unverified_kernels_allowed():
        return None
    factory = getattr(mx.fast, f"{backend}_kernel", None)
    if factory is None:
        return None
    header, body = compact(src.header), compact(src.body)
    if backend == "cuda" and envs.kernel_include():
        short = included_cuda_source(src.name, header, body, tuple(src.inputs))
        if short is not None:
            header, body = short
    try:
        return factory(name=src.name, input_names=list(src.inputs),
                       output_names=list(src.outputs), source=body, header=header, **options)
    except RuntimeError:
        # MLX's CPU build has the factories but no back-end behind them.
        probe = getattr(mx, backend, None)
        if probe is not None and not probe.is_available():
            return None
        raise


#: MLX passes an input's shape / strides / rank to a CUDA kernel when the body's
#: text contains ``<name>`` followed by one of these (a substring test).
_SHAPE_SUFFIXES = ("_shape", "_strides", "_ndim")


def _write_once(path: "os.PathLike[str]", text: str) -> None:
    """``text`` at ``path``, unless the file already holds exactly it (atomic replace).

    Raises:
        OSError: when the folder or file cannot be created or written.
    """
    from pathlib import Path

    path = Path(path)
    try:
        if path.read_text(encoding="utf-8") == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def included_cuda_source(name: str, header: str, body: str,
                         inputs: Tuple[str, ...]) -> Optional[Tuple[str, str]]:
    """A CUDA kernel's ``(header, body)`` as ``#include`` lines of files holding them.

    MLX's CUDA backend hashes a custom kernel's whole source (``std::hash``
    of the text) every time it encodes a launch, about 0.27 us per KB on the
    H200's host (``benchmarks/profile_encode.py``: 13.6 us per launch for a
    36 KB text, 3.8 us as includes); the one-launch MoE block
    is 34 KB compacted and a decode token launches it once per layer. The
    text itself is written once, content-addressed
    (``<cache dir>/cuda-src/<name>-<sha256 prefix>-{header,body}.cuh``; the
    cache dir is ``QAB_CACHE_DIR``'s), and MLX gets two short lines that
    NVRTC resolves when it compiles: the kernel it builds is the same text,
    and the digest in the file names changes the module name MLX caches the
    compiled kernel under whenever the text changes. A comment after the
    body's include names each input's ``_shape`` / ``_strides`` / ``_ndim``
    that the full body mentions, because MLX decides from the body's text
    (a substring search) which of those to pass. MLX compiles a kernel
    lazily, once per set of template arguments, so the files must outlive
    the process's kernels: deleting ``cuda-src`` while a process runs makes
    a later compile in it fail. Not cached: each call checks the files (the
    callers cache their kernel objects), so a changed ``QAB_CACHE_DIR`` is
    followed.

    Args:
        name (str): the kernel's name (``KernelSource.name``).
        header (str), body (str): the compacted texts handed to MLX otherwise.
        inputs (tuple[str, ...]): the kernel's input names.

    Returns:
        tuple[str, str] | None: the short header and body, or None when the
        files cannot be written, their path cannot be written inside an
        ``#include "..."`` (a quote, backslash or line break in it, or not
        UTF-8), or the path itself would change which shape parameters MLX
        passes (a folder named like ``x_shape``): the caller then hands MLX
        the full text.
    """
    import hashlib

    digest = hashlib.sha256(f"{header}\0{body}".encode()).hexdigest()[:20]
    try:
        folder = (envs.cache_dir() / "cuda-src").resolve()
    except (OSError, RuntimeError):
        return None
    paths = [folder / f"{name}-{digest}-{part}.cuh" for part in ("header", "body")]
    if any(c in str(p) for p in paths for c in '"\\\n\r'):
        return None
    try:
        str(folder).encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in the path (surrogate escapes)
        return None
    uses = sorted(n + suffix for n in inputs for suffix in _SHAPE_SUFFIXES if n + suffix in body)
    short_body = f'#include "{paths[1]}"\n' + (f"// {' '.join(uses)}\n" if uses else "")
    if any((n + suffix in short_body) != (n + suffix in body)
           for n in inputs for suffix in _SHAPE_SUFFIXES):
        return None
    try:
        if header:
            _write_once(paths[0], header)
        _write_once(paths[1], body)
    except OSError:
        return None
    return (f'#include "{paths[0]}"\n' if header else ""), short_body


#: Elements of a kernel's scalar-input array (see :func:`f32_scalar`): 16 bytes.
SCALAR_PAD = 4


@functools.lru_cache(maxsize=None)
def f32_scalar(value: float) -> mx.array:
    """A kernel's float32 scalar input (e.g. an epsilon): ``[4]`` copies of ``value``.

    Kernels read element 0. The array is one per value (cached), filled and
    evaluated on the default device when first asked for, so no call makes
    a new array or fill. It has :data:`SCALAR_PAD` elements (16 bytes), not
    one, because MLX's CUDA allocator places every buffer of at most 8 bytes
    in one small managed-memory pool that the host's own scalars (a sampled
    token read with ``.item()``, a host-written offset) share: a kernel
    reading a scalar from there waited on host memory. Measured on an H200
    with Nsight Compute (``benchmarks/profile_gemv_gpu.py``, the norm + GEMV
    launch, the only GEMV that reads its epsilon): 27-33 us per launch with
    a ``[1]`` epsilon, 8-20 us with a 16-byte one, at every projection shape.

    Safe inside ``mx.compile``: the array depends on no traced input, so it
    is evaluated then and becomes a constant of the traced graph.
    """
    a = mx.full((SCALAR_PAD,), value, dtype=mx.float32)
    mx.eval(a)
    return a


@functools.lru_cache(maxsize=None)
def padded_zeros(dtype: mx.Dtype) -> mx.array:
    """16 bytes of zeros of ``dtype``, evaluated, one array per dtype (cached).

    For a kernel input that a build does not read (a stand-in of the right
    dtype) or whose element 0 serves as a zero (the route counter's
    broadcast). 16 bytes, not one element, for the reason given in
    :func:`f32_scalar`: MLX's CUDA allocator pools buffers of <= 8 bytes in
    host-shared managed memory.
    """
    a = mx.zeros((unpooled_length(1, dtype),), dtype=dtype)
    mx.eval(a)
    return a


def unpooled_length(n: int, dtype: mx.Dtype) -> int:
    """Elements to allocate for a kernel output of ``n`` elements of ``dtype``.

    ``n``, or more where ``n`` elements would take under 16 bytes: such a
    buffer would sit in MLX's small managed pool (see :func:`f32_scalar`),
    and the kernels writing and reading it would wait on host memory.
    Kernels read only the first ``n`` (the writer may zero the rest).
    Measured on an H200 with Nsight Compute (``benchmarks/profile_decode_gpu.py``,
    8 layers at 4K context): with the MoE decode fold's shared-gate logit a
    ``[1]`` float32, the fold's down kernel, which reads it, took 20.3 us per
    launch; with a ``[4]`` one, 8.1 us.
    """
    return max(int(n), -(-16 // dtype.size))


# (op, backend, shape key) -> (passed, message)
_RESULTS: Dict[Tuple[str, str, Hashable], Tuple[bool, str]] = {}
_LOCK = threading.Lock()
#: (op, backend, key, passed, reference seconds, kernel seconds), in the order
#: the checks ended (see :func:`self_check_timings`).
_TIMINGS: list = []


def self_check_results() -> Dict[Tuple[str, str, Hashable], Tuple[bool, str]]:
    """A copy of every verdict so far: ``(op, backend, key) -> (passed, message)``."""
    with _LOCK:
        return dict(_RESULTS)


def self_check_passed(op: str, backend: str, key: Hashable) -> bool:
    """Whether ``(op, backend, key)`` was self-checked and passed (never runs a check)."""
    hit = _RESULTS.get((op, backend, key))
    return bool(hit and hit[0])


def self_check_known(op: str, backend: str, key: Hashable) -> bool:
    """Whether ``(op, backend, key)`` has a verdict, passed or failed (never runs a check)."""
    with _LOCK:
        return (op, backend, key) in _RESULTS


def reset_self_checks() -> None:
    """Forget every verdict and timing (tests; after changing kernel sources)."""
    with _LOCK:
        _RESULTS.clear()
        _TIMINGS.clear()


def self_check_timings() -> list:
    """Wall time of every self-check run so far, in the order they ended.

    The first launch of a CUDA kernel source and template instance compiles it
    (NVRTC; MLX keeps the module in the process), so on a fresh process these
    times are mostly compilation: where a first call's seconds go.

    Returns:
        list[dict]: ``op``, ``backend``, ``key`` (its ``repr``), ``passed``,
        ``reference_s`` (the inputs, the reference built and evaluated: checks
        that the reference's construction runs, such as a part's own check,
        included) and ``kernel_s`` (the kernel built and evaluated), in seconds.
    """
    with _LOCK:
        return [{"op": op, "backend": backend, "key": repr(key), "passed": passed,
                 "reference_s": ref_s, "kernel_s": kern_s}
                for op, backend, key, passed, ref_s, kern_s in _TIMINGS]


def _max_rel_err(out: mx.array, ref: mx.array) -> float:
    out32, ref32 = out.astype(mx.float32), ref.astype(mx.float32)
    num = mx.sqrt(mx.sum(mx.square(out32 - ref32)))
    den = mx.maximum(mx.sqrt(mx.sum(mx.square(ref32))), mx.array(1e-30))
    return float((num / den).item())


def self_checked(
    op: str,
    backend: str,
    key: Hashable,
    kernel: Callable[..., Sequence[mx.array]],
    reference: Callable[..., Sequence[mx.array]],
    make_inputs: Callable[[], Sequence[Any]],
    *,
    rtol: Union[float, Sequence[float]],
) -> bool:
    """Whether ``kernel`` may be used for shape class ``key`` (checking it on first use).

    On the first call for ``(op, backend, key)`` both functions run on
    ``make_inputs()`` (seeded random inputs of the real shapes). The kernel
    passes when it returns as many arrays as the reference, each of the same
    shape and dtype, all finite, with relative L2 error ``||out - ref|| /
    ||ref||`` at most ``rtol``. An exception while compiling or running the
    kernel is a failure too. On failure a :class:`KernelSelfCheckWarning`
    names the op, backend, shapes and reason. The verdict is cached. The
    reference is evaluated before the kernel is built, and each part's wall
    time is kept (:func:`self_check_timings`).

    Args:
        op (str): op name (for messages and the cache).
        backend (str): ``"cuda"`` / ``"metal"`` (or a test's fake name).
        key (Hashable): shape class (dims and dtypes the kernel is specialised on).
        kernel (Callable): the GPU path, returning a sequence of arrays.
        reference (Callable): the portable path, same signature and results.
        make_inputs (Callable): returns the positional arguments for both.
        rtol (float | Sequence[float]): largest accepted relative L2 error,
            for every output or (a sequence) for each output in order.

    Returns:
        bool: True when the kernel passed (now or earlier).
    """
    cache_key = (op, backend, key)
    with _LOCK:
        hit = _RESULTS.get(cache_key)
    if hit is not None:
        return hit[0]
    t0 = time.perf_counter()
    t1 = None
    try:
        args = make_inputs()
        ref = list(reference(*args))
        mx.eval(ref)
        t1 = time.perf_counter()
        out = list(kernel(*args))
        mx.eval(out)
        reason = ""
        if len(out) != len(ref):
            reason = f"returned {len(out)} arrays, the reference {len(ref)}"
        for i, (o, r) in enumerate(zip(out, ref)):
            if reason:
                break
            if o.shape != r.shape or o.dtype != r.dtype:
                reason = (f"output {i} is {o.dtype}{list(o.shape)}, the reference "
                          f"{r.dtype}{list(r.shape)}")
            elif not bool(mx.all(mx.isfinite(o.astype(mx.float32))).item()):
                reason = f"output {i} has non-finite values"
            else:
                tol = rtol if isinstance(rtol, (int, float)) else rtol[i]
                err = _max_rel_err(o, r)
                if not err <= tol:
                    reason = f"output {i} relative L2 error {err:.3g} > {tol:.3g}"
    except Exception as exc:  # noqa: BLE001 - any failure means "do not use"
        reason = f"{type(exc).__name__}: {exc}"
    passed = not reason
    message = "passed" if passed else reason
    t2 = time.perf_counter()
    if t1 is None:  # the inputs or the reference failed
        t1 = t2
    with _LOCK:
        _RESULTS[cache_key] = (passed, message)
        _TIMINGS.append((op, backend, key, passed, t1 - t0, t2 - t1))
    if not passed:
        warnings.warn(
            f"qwen_apple_backend: the {backend} kernel for {op} failed its self-check "
            f"for {key} ({message}); using the portable MLX path instead",
            KernelSelfCheckWarning, stacklevel=3)
    return passed
