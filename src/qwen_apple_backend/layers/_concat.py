"""One matmul for several projections of the same input.

Decode runs each projection of a layer as its own (quantized) matrix-vector
product; on a GPU every one is a kernel launch whose fixed cost is larger than
its arithmetic. :class:`ConcatProjection` stacks the output rows of sibling
projections (a Gated DeltaNet's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``; a shared expert's ``gate_proj`` and ``up_proj``) into one
matrix at fuse time and runs them as one matmul, then splits the result.

No weight is stored twice: after the rows are concatenated, each stock
child's arrays are replaced by row slices of the concatenation (views of the
same buffer), so parameter names, ``parameters()``, saving and ``to_stock``
are unchanged. The concatenated path is taken only while every child still
holds exactly those views and is still of the type it had: once a child's
arrays are replaced (``load_weights``, ``update``, ``shard()``) or the child
itself is (LoRA wrappers), calls go back to the separate projections. An
array changed in place (``w *= c``, ``w[...] = v``: MLX swaps the array inside
the same Python object) is not seen, since validity is checked by identity:
the one matmul keeps the old rows.
(Owners that run compiled graphs with ``inputs=module`` call :meth:`refresh`
after such a call, since tracing re-wraps the same arrays in new objects.
The compiled decode step passes :attr:`cat` among its compile inputs and sets
:attr:`tracing` while it traces, so a trace takes the one-matmul path too.)

Row-stacking is exact for quantized weights too: quantization groups run
along the input axis, so each output row keeps its own packed words, scales
and biases.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..ops import linear as qlinear
from ..ops.linear import norm_gemv, norm_gemv_ready

__all__ = ["ConcatProjection"]

_ARRAYS = ("weight", "scales", "biases", "bias")


def _arrays(m: nn.Module) -> dict:
    return {n: m[n] for n in _ARRAYS if n in m}


def _kind(m: nn.Module) -> Optional[tuple]:
    """What must agree between children to stack them (None: not stackable)."""
    if type(m) is nn.QuantizedLinear:
        if getattr(m, "global_scale", None) is not None:
            return None
        return ("q", m.group_size, m.bits, m.mode, tuple(sorted(_arrays(m))),
                m["weight"].dtype, m["scales"].dtype)
    if type(m) is nn.Linear:
        return ("f", tuple(sorted(_arrays(m))), m["weight"].dtype)
    return None


class ConcatProjection:
    """Several ``Linear`` / ``QuantizedLinear`` children of one module, run as one matmul.

    Build with :meth:`build`; call with the shared input to get the list of
    the children's outputs, in order. Not an ``nn.Module``: it holds no
    parameters of its own (the concatenated arrays are referenced, not
    registered), so the owning module's parameter tree is unchanged.

    Shapes:
        x: ``[..., H]``; returns ``[[..., N_0], [..., N_1], ...]`` for children
        of output sizes ``N_i``.
    """

    def __init__(self, names: Sequence[str], children: Sequence[nn.Module], cat: dict,
                 sizes: list, kind: tuple):
        self.names = list(names)
        self.children = list(children)
        self.cat = cat
        self.sizes = sizes
        self.kind = kind
        self.views = [_arrays(c) for c in children]
        self.types = [type(c) for c in children]
        #: How many times :meth:`refresh` re-recorded :attr:`views`: a copy of
        #: :meth:`identity_checks` taken at another count may be stale.
        self.refreshes = 0
        #: Set by a compiled step around a tracing call that found this
        #: concatenation valid just before and passes :attr:`cat` as a compile
        #: input: the children's arrays are tracers then, not the views.
        self.tracing = False
        #: Whether one-token calls may take the CUDA dense GEMV kernel
        #: (``proj-gemv``; see :meth:`gemv_backend`). Set by the fusing code.
        self.gemv = False
        #: Whether the GEMV kernel runs its double-buffered build
        #: (the opt-in ``gemv-pipe``; see
        #: :func:`~qwen_apple_backend.ops.linear.gemv_launch`). Set by the fusing code.
        self.gemv_pipe = False
        offs, total = [], 0
        for n in sizes[:-1]:
            total += n
            offs.append(total)
        self.split_at = offs

    @classmethod
    def build(cls, owner: nn.Module, names: Sequence[str]) -> Optional["ConcatProjection"]:
        """Stack ``owner``'s children ``names`` (same input size and quantization), or None.

        Replaces each child's arrays with views of the concatenation (after
        evaluating it), so the separate arrays are freed once nothing else
        holds them.

        Args:
            owner (nn.Module): the module whose children these are.
            names (Sequence[str]): two or more children, each ``nn.Linear`` or
                ``nn.QuantizedLinear``, of the same input size.

        Returns:
            ConcatProjection | None: None when the children differ in type,
            quantization (bits, group size, mode), dtype, input size or
            bias presence, or are of another type.
        """
        children = [getattr(owner, n, None) for n in names]
        if len(children) < 2 or any(c is None for c in children):
            return None
        kinds = {_kind(c) for c in children}
        if len(kinds) != 1 or None in kinds:
            return None
        (kind,) = kinds
        arrs = [_arrays(c) for c in children]
        if len({a["weight"].shape[1:] for a in arrs}) != 1:
            return None
        sizes = [int(a["weight"].shape[0]) for a in arrs]
        cat = {n: mx.concatenate([a[n] for a in arrs], axis=0) for n in arrs[0]}
        mx.eval(cat)
        lo = 0
        for c, n in zip(children, sizes):
            views = {name: arr[lo:lo + n] for name, arr in cat.items()}
            mx.eval(views)
            c.update(views)
            lo += n
        return cls(names, children, cat, sizes, kind)

    def valid(self, owner: nn.Module) -> bool:
        """True while ``owner`` still has these children, of their type, holding their views."""
        # Plain dict lookups (modules are dicts): eager calls and the compiled
        # decode step run this before every call of every layer.
        for child_name, c, t, views in zip(self.names, self.children, self.types, self.views):
            if dict.get(owner, child_name) is not c or type(c) is not t:
                return False
            if self.tracing:
                continue
            for name, v in views.items():
                if dict.get(c, name) is not v:
                    return False
        return True

    def identity_checks(self, owner: nn.Module) -> tuple:
        """What :meth:`valid` checks, flattened for a C-level pass over many concatenations.

        Returns:
            tuple: ``(containers, keys, expected, children, types)``: :meth:`valid`
            (not tracing) is true exactly when ``dict.get(containers[i], keys[i])
            is expected[i]`` for every i and ``type(children[j]) is types[j]``
            for every j. Stale after :meth:`refresh` (see :attr:`refreshes`).
        """
        containers, keys, expected = [], [], []
        for child_name, c, views in zip(self.names, self.children, self.views):
            containers.append(owner)
            keys.append(child_name)
            expected.append(c)
            for name, v in views.items():
                containers.append(c)
                keys.append(name)
                expected.append(v)
        return containers, keys, expected, list(self.children), list(self.types)

    def refresh(self) -> None:
        """Re-record the children's arrays after a call that was valid when it started.

        ``mx.compile(..., inputs=module)`` swaps a module's arrays for tracers
        while tracing and puts back new Python objects for the same arrays;
        the owner calls this right after such a call, which started with
        :meth:`valid` true, so no user change can have happened in between.
        """
        self.views = [_arrays(c) for c in self.children]
        self.refreshes += 1

    def __call__(self, x: mx.array, gemv_backend: Optional[str] = None) -> list:
        """Outputs of every child for input ``x``, from one matmul (see :meth:`matmul`)."""
        return mx.split(self.matmul(x, gemv_backend), self.split_at, axis=-1)

    def check_projected(self, x: mx.array, projected: mx.array) -> None:
        """Check a precomputed output of :meth:`matmul` for input ``x``
        (``projected=`` of the fused mixers, ``moe-block-next-proj``).

        Raises:
            ValueError: naming ``projected`` when its shape is not
                ``[*x.shape[:-1], N]`` (N: the concatenation's output rows) or
                its dtype is not ``x``'s.
        """
        n = self.cat["weight"].shape[0]
        if (not isinstance(projected, mx.array) or projected.shape != (*x.shape[:-1], n)
                or projected.dtype != x.dtype):
            got = (f"shape {tuple(projected.shape)} {projected.dtype}"
                   if isinstance(projected, mx.array) else type(projected).__name__)
            raise ValueError(f"projected: expected the concatenated input projection's output "
                             f"of shape {(*x.shape[:-1], n)} and dtype {x.dtype}, got {got}")

    def gemv_backend(self, x: mx.array) -> Optional[str]:
        """The backend whose dense GEMV kernel may run :meth:`matmul` for this call, or None.

        With :attr:`gemv` on (``proj-gemv``) and children quantized with
        biases and no bias term: see
        :func:`~qwen_apple_backend.ops.linear.gemv_ready` (4-bit affine, at most
        :data:`~qwen_apple_backend.ops.linear.GEMV_MAX_ROWS` token rows, at any weight size;
        a self-check on its first call per shape class: call it outside
        ``mx.compile`` first). On the H200 the kernel took less GPU time than
        MLX's ``qmv`` at every decode projection shape of Qwen3.6-35B-A3B
        (Nsight Compute, ``benchmarks/profile_gemv_gpu.py``: 14.4 vs 17.8 us
        for the Gated DeltaNet's 12352 x 2048 in_proj, 13.0 vs 14.7 for the
        attention's 9216 x 2048 q/k/v).
        """
        if not (self.gemv and self._quantized_with_biases()):
            return None
        c = self.cat
        return qlinear.gemv_ready(x, c["weight"], c["scales"], c["biases"], self.kind[1],
                                  self.kind[2], self.kind[3], min_bytes=0, pipe=self.gemv_pipe)

    def _quantized_with_biases(self) -> bool:
        # The kernels' layout: quantized children with affine biases, no bias term.
        return self.kind[0] == "q" and "bias" not in self.cat and "biases" in self.cat

    def norm_backend(self, x: mx.array, norm: nn.Module) -> Optional[str]:
        """The backend whose one launch may run ``matmul(norm(x))`` for this call, or None.

        ``norm`` must be exactly an ``nn.RMSNorm`` and the children 4-bit
        affine quantized without a bias term; see
        :func:`~qwen_apple_backend.ops.linear.norm_gemv_ready` (a self-check
        on its first call per shape class: call it outside ``mx.compile``
        first).
        """
        if not self._quantized_with_biases() or type(norm) is not nn.RMSNorm:
            return None
        c = self.cat
        return norm_gemv_ready(x, norm["weight"], norm.eps, c["weight"], c["scales"],
                               c["biases"], self.kind[1], bits=self.kind[2], mode=self.kind[3],
                               pipe=self.gemv_pipe)

    def norm_matmul(self, x: mx.array, weight: mx.array, eps: float, backend: str) -> mx.array:
        """``matmul(mx.fast.rms_norm(x, weight, eps))`` as one launch (``backend`` from
        :meth:`norm_backend`), unsplit: ``[..., sum of the children's outputs]``."""
        c = self.cat
        return norm_gemv(x, weight, eps, c["weight"], c["scales"], c["biases"],
                         group_size=self.kind[1], bits=self.kind[2], mode=self.kind[3],
                         backend=backend, pipe=self.gemv_pipe)

    def matmul(self, x: mx.array, gemv_backend: Optional[str] = None) -> mx.array:
        """The one matmul's output, ``[..., sum of the children's outputs]``, not split.

        ``gemv_backend``: what :meth:`gemv_backend` returned for this call's
        shape class: the dense GEMV kernel (no self-check here, so safe inside
        ``mx.compile``); None: MLX's matmul.
        """
        c = self.cat
        if gemv_backend is not None:
            return qlinear.quantized_gemv_kernel(x, c["weight"], c["scales"], c["biases"],
                                                 self.kind[1], pipe=self.gemv_pipe)
        if self.kind[0] == "q":
            y = mx.quantized_matmul(x, c["weight"], c["scales"], c.get("biases"), transpose=True,
                                    group_size=self.kind[1], bits=self.kind[2],
                                    mode=self.kind[3])
        else:
            y = x @ c["weight"].T
        if "bias" in c:
            y = y + c["bias"]
        return y
