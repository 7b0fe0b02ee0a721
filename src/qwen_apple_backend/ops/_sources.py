"""Kernel sources and their manifest (``kernels/MANIFEST.toml``).

Kernel bodies live outside the Python code, one file per op and backend:
``kernels/cuda/*.cu`` for ``mx.fast.cuda_kernel`` and ``kernels/metal/*.metal``
for ``mx.fast.metal_kernel``. An installed wheel carries them as
``qwen_apple_backend/_kernels``; a source checkout reads the repository's
``kernels/`` folder. Headers are concatenated in the order the manifest lists
them, never by glob. :func:`compact` strips the comments, indentation and
blank lines from the text handed to MLX (the files stay documented).

This module imports only the standard library.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["KernelSource", "compact", "kernel_dir", "kernel_source", "manifest"]

BACKENDS = ("cuda", "metal")


@dataclass(frozen=True)
class KernelSource:
    """One op's kernel for one backend, ready for ``mx.fast.*_kernel``.

    Attributes:
        op (str): manifest key, e.g. ``"gated_delta_scan"``.
        backend (str): ``"cuda"`` or ``"metal"``.
        inputs (tuple[str, ...]): input parameter names, in call order.
        outputs (tuple[str, ...]): output parameter names, in call order.
        template (tuple[str, ...]): template parameter names the body expects.
        header (str): concatenated header files.
        body (str): the kernel body.
        verified (str): where its GPU tests passed ("" if never run on a GPU).
        writes (tuple[str, ...]): the inputs it writes in place (the
            manifest's ``writes``; empty for most).
    """

    op: str
    backend: str
    inputs: tuple
    outputs: tuple
    template: tuple
    header: str
    body: str
    verified: str = ""
    writes: tuple = ()

    @property
    def name(self) -> str:
        """Kernel name given to MLX (unique per op and backend)."""
        return f"qab_{self.op}"


def kernel_dir() -> Path:
    """The folder holding ``MANIFEST.toml``, ``cuda/`` and ``metal/``.

    Returns:
        Path: ``qwen_apple_backend/_kernels`` in an installed wheel, else the
        checkout's ``kernels/``.

    Raises:
        FileNotFoundError: if neither exists (a broken install).
    """
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_kernels", here.parent.parent / "kernels"):
        if (candidate / "MANIFEST.toml").is_file():
            return candidate
    raise FileNotFoundError(
        f"kernel sources not found: neither {here / '_kernels'} nor "
        f"{here.parent.parent / 'kernels'} has a MANIFEST.toml")


def _in_number(code: str, i: int) -> bool:
    """Whether the ``'`` at ``code[i]`` separates digits (``1'000``, ``0xFF'FF``)."""
    j = i
    while j > 0 and (code[j - 1].isalnum() or code[j - 1] in "_'."):
        j -= 1
    return j < i and code[j].isdigit()


@functools.lru_cache(maxsize=None)
def compact(code: str) -> str:
    """C++ / CUDA / Metal source without comments, indentation or blank lines.

    MLX's CUDA backend hashes a custom kernel's whole source every time it
    encodes a launch (``std::hash`` of the text, in ``CustomKernel::eval_gpu``),
    about 0.2 us per KB on the H200's host (``benchmarks/profile_encode.py``),
    and a decode token launches ~230 of them: the compacted text is about
    half as long. As the C preprocessor does first, backslash-newline line
    splices are joined; then line structure is kept (directives end at a
    newline), so is every string and character literal (a ``'`` inside a
    number is a digit separator) and the spacing inside a line; a ``/* */``
    comment becomes one space (``a/**/b`` stays two tokens).

    Args:
        code (str): source text.

    Returns:
        str: the compacted text, ending in a newline (empty input: ``""``).

    Raises:
        ValueError: on an unterminated ``/*`` comment.
    """
    code = code.replace("\\\r\n", "").replace("\\\n", "")
    out = []
    i, n = 0, len(code)
    while i < n:
        c = code[i]
        if c == "'" and _in_number(code, i):
            out.append(c)
            i += 1
        elif c in "\"'":
            j = i + 1
            while j < n and code[j] != c and code[j] != "\n":
                j += 2 if code[j] == "\\" else 1
            out.append(code[i:j + 1])
            i = j + 1
        elif code.startswith("//", i):
            j = code.find("\n", i)
            i = n if j < 0 else j
        elif code.startswith("/*", i):
            j = code.find("*/", i + 2)
            if j < 0:
                raise ValueError("unterminated /* comment in kernel source")
            out.append(" ")
            i = j + 2
        else:
            out.append(c)
            i += 1
    lines = (line.strip() for line in "".join(out).splitlines())
    text = "\n".join(line for line in lines if line)
    return text + "\n" if text else ""


@functools.lru_cache(maxsize=None)
def manifest() -> dict:
    """The parsed ``MANIFEST.toml``: op name -> entry dict."""
    with open(kernel_dir() / "MANIFEST.toml", "rb") as f:
        return tomllib.load(f)


@functools.lru_cache(maxsize=None)
def kernel_source(op: str, backend: str) -> Optional[KernelSource]:
    """Read one op's kernel for ``backend``.

    Args:
        op (str): manifest key.
        backend (str): ``"cuda"`` or ``"metal"``.

    Returns:
        KernelSource | None: None when the manifest lists no file for this
        backend.

    Raises:
        KeyError: if ``op`` is not in the manifest.
        FileNotFoundError: if a listed file is missing.
    """
    entry = manifest()[op]
    files = entry.get(backend)
    if not files:
        return None
    root = kernel_dir()
    header = "".join((root / h).read_text(encoding="utf-8") + "\n"
                     for h in files.get("header", []))
    body = (root / files["body"]).read_text(encoding="utf-8")
    return KernelSource(op=op, backend=backend, inputs=tuple(entry["inputs"]),
                        outputs=tuple(entry["outputs"]),
                        template=tuple(entry.get("template", ())), header=header, body=body,
                        verified=str(files.get("verified", "")),
                        writes=tuple(entry.get("writes", ())))
