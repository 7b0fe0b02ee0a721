"""A compiled one-token decode step for the fused Qwen hybrid models.

mlx-lm builds the graph of every generated token in Python, layer by layer,
and its KV cache returns a view that grows by one position per token, so the
step cannot simply be ``mx.compile``-d: every token would be a new shape. Here
the step is traced with the cache as explicit inputs and outputs:

* each full-attention layer sees the whole preallocated KV buffer (mlx-lm
  grows it in blocks of 256 positions), writes the new key/value at an
  array-valued offset (``mx.slice_update``) and attends through a mask of the
  positions written so far; RoPE takes the same array offset;
* each Gated DeltaNet layer's conv and recurrent states go in and come out.

On a GPU whose ``kv_cache_write`` kernel passed its self-check, the new
key/value row is written into the buffers IN PLACE instead
(:func:`qwen_apple_backend.ops.attention.kv_cache_write`): ``slice_update``
copies a buffer MLX cannot donate, and with two tokens in flight the
previous token's attention still holds it, so every token copied every
full-attention layer's K and V (H200, 128K context: 19.6 vs 10.0 ms of GPU
per token; 59.5 -> 115.3 tokens/s with the in-place write, same run,
``decode-split-nvidia-h200-128k-ablation.json``). Each cache gets
private buffers (one copy) before the first in-place write, since an
array's memory may be shared (``copy.deepcopy`` of a cache shares it), and
the buffers then stay the cache's arrays from token to token. Views of a
cache's buffers taken earlier (``cache.state`` slices) cover only positions
already written, which are never written again, unless the cache is
trimmed and decoded again over them.

So one trace serves every token until the KV buffer grows (once per 256
tokens), and Python graph building leaves the per-token path. The model is
a compile input, read live; with ``QAB_ENABLE=decode-const`` its parameters
are trace constants instead, checked by identity before every call (see
:class:`_CompiledDecode`): per token MLX then binds only the token, the
offset and the caches. The adapter
installs the step on the text model by default on a GPU (``decode-compile``;
on the H200, full Qwen3.6-35B-A3B shape: 64.6 -> 128.2 tokens/s at a 4K
context, 92.1 -> 102.3 at 32K, ``benchmarks/decode_split.py``); on the CPU,
where it measured no faster, only with ``QAB_ENABLE=decode-compile``. Each new
trace, once per 256 tokens, costs a compile (a Python pass over every layer
plus MLX's graph compile; its cost over a long generation is not yet
measured on a GPU). ``QAB_DISABLE=decode-compile`` switches it off and
makes the ablation column of ``qab bench``. It runs only for one-token
calls whose caches are plain ``KVCache`` / ``ArraysCache`` objects with room
for one more position; everything else, and the first decode token of a model
(which runs the kernels' self-checks eagerly), takes the model's own path.
Results equal the eager path's (tests/test_decode.py), up to the order of the
final RMSNorm's float32 sum of squares where ``norm-proj`` runs it inside
``lm_head``'s GEMV launch (CUDA, heads of >= 32 MB).
"""

from __future__ import annotations

import copy
import operator
import weakref
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from .layers._watch import ParameterRecord
from .ops.attention import decode_kv_mask, kv_cache_write, kv_cache_write_ops, kv_write_ready
from .ops.moe import pack_check_pass, pack_checks_due, serial_decode_trace

__all__ = ["install_compiled_decode", "compiled_decode_installed"]

_REFRESHES = operator.attrgetter("refreshes")  # ConcatProjection.refreshes
#: Elements of the step's offset input (16 bytes: see :meth:`_CompiledDecode._device_offset`).
OFFSET_PAD = 4
#: Rows of the first table of positions (:meth:`_CompiledDecode._device_offset`).
_POSITION_ROWS = 4096


class _StepKV:
    """``KVCache`` stand-in inside the traced step: whole buffer, array offset.

    With ``in_place`` (a GPU backend whose ``kv_cache_write`` kernel passed
    its self-check), :meth:`write_in_place` writes the token's row into the
    buffers without copying them and returns the mask the attention must
    read; otherwise attention layers call :meth:`update_and_fetch`, a
    ``slice_update`` that MLX turns into a copy of the whole buffer whenever
    the previous token still holds it (every pipelined token on CUDA).
    """

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array,
                 in_place: Optional[str] = None):
        self.keys, self.values, self.offset = keys, values, offset
        self.in_place = in_place
        self.written = False

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # The mask it also builds is unused here (make_mask serves it): not traced into the step.
        self.keys, self.values, _ = kv_cache_write_ops(keys, values, self.keys, self.values,
                                                       self.offset)
        return self.keys, self.values

    def write_in_place(self, keys: mx.array, values: mx.array):
        """``(keys buffer, values buffer, mask)`` after an in-place write, or None when off."""
        claimed = self.claim_in_place()
        if claimed is None:
            return None
        mask = kv_cache_write(self.in_place, keys.astype(self.keys.dtype),
                              values.astype(self.values.dtype), self.keys, self.values,
                              self.offset)
        return self.keys, self.values, mask

    def claim_in_place(self):
        """``(keys buffer, values buffer, offset)`` for a kernel that writes this
        token's row into the buffers in place (``kv_cache_write``, the attention
        step ``gqa_decode_step``), or None when off. Marks the buffers written:
        the step then keeps them instead of returning copies."""
        if self.in_place is None:
            return None
        self.written = True
        return self.keys, self.values, self.offset

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # The query is at position `offset`; keys 0..offset are written.
        return decode_kv_mask(self.keys.shape[2], self.offset)


def _layout(cache: Any) -> Optional[list]:
    """``["kv" | "ssm", ...]`` when every cache entry fits the compiled step, else None."""
    if not isinstance(cache, (list, tuple)) or not cache:
        return None
    kinds = []
    offset = None
    for c in cache:
        if type(c) is KVCache:
            if c.keys is None or c.offset >= c.keys.shape[2]:
                return None
            if offset is not None and c.offset != offset:
                return None
            offset = c.offset
            kinds.append("kv")
        elif type(c) is ArraysCache:
            if (len(c.cache) != 2 or c.lengths is not None or c.left_padding is not None
                    or c[0] is None or c[1] is None):
                return None
            kinds.append("ssm")
        else:
            return None
    return kinds if offset is not None else None


def _concats(model: Any) -> list:
    """Every ``(ConcatProjection, owner)`` of the model's layers (``proj-concat``), in order,
    and every MoE block's :class:`~qwen_apple_backend.layers.moe.BlockPack`
    (``moe-block-pack``), which the step treats alike."""
    out = []
    for layer in getattr(getattr(model, "model", model), "layers", ()):
        for name in ("linear_attn", "self_attn", "mlp"):
            m = getattr(layer, name, None)
            if m is None:
                continue
            for attr, owner in (("_proj_cat", m), ("_shared_cat", getattr(m, "shared_expert", None)),
                                ("_block_pack", m)):
                cat = getattr(m, attr, None)
                if cat is not None:
                    out.append((cat, owner))
    return out


class _NormedHead:
    """Stands in for ``lm_head`` while the step traces: the final RMSNorm in its GEMV launch.

    ``rms_norm(h, norm.weight, norm.eps) @ dequantize(head).T`` through
    :func:`qwen_apple_backend.ops.linear.norm_gemv` with the backend its
    readiness check returned (the ``norm-proj`` arithmetic the decoder
    layers' input projections use: ``mx.fast.rms_norm``'s rounding points),
    while the text model's final norm is :class:`_PassThrough`: one launch
    per token fewer. Shapes: x ``[B, T, H]``; returns ``[B, T, V]``.
    """

    def __init__(self, head: Any, norm: Any, backend: str):
        self.head, self.norm, self.backend = head, norm, backend

    def __call__(self, x: mx.array) -> mx.array:
        from .ops.linear import norm_gemv, norm_gemv_supported

        h, n = self.head, self.norm
        # The readiness check saw the norm weight's dtype: hidden states of
        # another dtype (or rows beyond the launch's contract) take the two
        # modules as they are.
        if x.dtype != n.weight.dtype or not norm_gemv_supported(
                x.size // x.shape[-1], n.weight, h.weight, h.scales, h.biases, h.group_size,
                h.bits, h.mode, x.dtype):
            return h(n(x))
        return norm_gemv(x, n.weight, n.eps, h.weight, h.scales, h.biases,
                         group_size=h.group_size, bits=h.bits, mode=h.mode, backend=self.backend)


class _PassThrough:
    """Stands in for the text model's final norm while :class:`_NormedHead` applies it."""

    def __call__(self, x: mx.array) -> mx.array:
        return x


def _final_norm_backend(text: Any, tokens: mx.array) -> Optional[str]:
    """The backend that runs ``text``'s final RMSNorm inside ``lm_head``'s launch, or None.

    Only for mlx-lm's layout (``text.model.norm`` a plain ``nn.RMSNorm``
    applied last, then ``text.lm_head``, untied, unsharded) with ``lm_head``
    on the decode GEMV (:class:`~qwen_apple_backend.layers.linear.DecodeQuantizedLinear`,
    no ``bias``: the norm + GEMV launch adds none) within
    :func:`~qwen_apple_backend.ops.linear.gemv_supported` (4-bit affine, at
    least ``GEMV_MIN_BYTES``: the very test by which its eager calls take the
    GEMV kernel, so the head's arithmetic is that kernel's either way) and
    :func:`~qwen_apple_backend.ops.linear.norm_gemv_ready` passing for this
    shape class (its self-check runs here, outside the trace). Call outside
    ``mx.compile``.
    """
    from .layers.linear import DecodeQuantizedLinear
    from .ops import linear as qlinear

    inner = text.get("model") if isinstance(text, dict) else None
    head = text.get("lm_head") if isinstance(text, dict) else None
    norm = inner.get("norm") if isinstance(inner, dict) else None
    args = getattr(text, "args", None)
    if (type(head) is not DecodeQuantizedLinear or type(norm) is not nn.RMSNorm
            or getattr(args, "tie_word_embeddings", False)
            or getattr(text, "sharding_group", None) is not None
            or not qlinear.is_plain_quantized_linear(head) or "bias" in head):
        return None
    x = mx.zeros((tokens.shape[0], tokens.shape[1], norm.weight.shape[0]), norm.weight.dtype)
    if not qlinear.gemv_supported(tokens.size, head.weight, head.scales, head.biases,
                                  head.group_size, head.bits, head.mode, x.dtype):
        return None
    return qlinear.norm_gemv_ready(x, norm.weight, norm.eps, head.weight, head.scales,
                                   head.biases, head.group_size)


class _CompiledDecode:
    """The traced step of one text model (held weakly; with ``const`` the
    parameter record holds the model's tree, so model and step form a cycle
    that Python's garbage collector frees, as the compile input's did).

    With ``const`` (``decode-const``, opt-in) the model's arrays, and
    the concatenated input projections' and MoE blocks' packs valid when
    the step is built, are trace CONSTANTS: MLX binds only the token, the
    offset and the caches per call, not ~1,600 parameter arrays (a compile
    input costs MLX host time per array on every call: Qwen3.6's text model
    as a compile input took 0.28 ms per call on the H200's host,
    ``profile-decode-host-nvidia-h200-pipelined.json``). A
    :class:`~qwen_apple_backend.layers._watch.ParameterRecord` of the model
    is checked before every call: an array or module replaced since
    (``load_weights``, ``update``, an assignment) rebuilds the step. The
    fused layers' own compiled functions re-wrap their arrays when they
    trace; they keep the record current
    (:func:`~qwen_apple_backend.layers._watch.compile_watched`), and after
    a call of the step that traced, the record is taken anew (the call
    started valid). An array changed IN PLACE (``w *= c``, ``w[...] = v``)
    is not seen: decoding keeps the old values (as the concatenations and
    packs always do), which is why it is opt-in (``QAB_ENABLE=decode-const``).

    Without ``const`` the model is a compile input (``inputs=[model,
    ...]``): its tree is flattened on every call and parameters are read
    live. The concatenations (``proj-concat``) and packs valid when the step
    is built are compile inputs too (their arrays live outside the module
    tree), so the trace runs one matmul per concatenation, as eager calls
    do; every call first checks (:meth:`ConcatProjection.valid`) that each
    still holds: a child replaced or given new arrays since rebuilds the
    compiled function without that concatenation.
    """

    def __init__(self, model: Any, call, in_place: bool = True, final_norm: bool = True,
                 const: bool = False):
        self._model = weakref.ref(model)
        self.allow_in_place = in_place
        self.allow_final_norm = final_norm
        self.const = const
        self._record: Optional[ParameterRecord] = None
        self._final_norm: Optional[str] = None  # the trace being built: norm-in-lm_head backend
        self._call = call
        self._fn = None
        self._uses: list = []
        self._checks: list = [[], [], [], [], []]
        self._checks_at: list = []
        self._owners: list = []
        self._traced: dict = {}  # trace key -> indices of the KV caches returned copied
        self._copied: list = []
        self._in_place: dict = {}  # K/V shapes and dtypes -> backend or None
        self._owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._packs_write_states = False  # a used pack may write the GDN states in place
        self._pack_check_due = False  # next call: a check pass on scratch caches, then a trace
        self._positions: Optional[mx.array] = None  # [n * OFFSET_PAD] int32: row p all p
        self.eager_calls = 0
        self.compiled_calls = 0
        self.check_passes = 0  # eager forwards on scratch caches, for the packs' self-checks
        self.builds = 0

    def _build(self) -> None:
        """Compile the step with the concatenations that are valid now as inputs
        (each MoE block's :class:`~qwen_apple_backend.layers.moe.BlockPack`
        built or rebuilt first, outside the trace)."""
        model = self._model()
        for layer in getattr(getattr(model, "model", model), "layers", ()):
            mlp = getattr(layer, "mlp", None)
            prepare = getattr(mlp, "prepare_block_pack", None)
            if prepare is not None:
                before = mlp.__dict__.get("_block_pack")
                pack = prepare()
                if pack is not None and pack is not before:
                    # A new pack: its self-check runs in an eager call first
                    # (none can run inside the trace).
                    self._pack_check_due = True
        pairs = [(c, owner) for c, owner in _concats(model) if c.valid(owner)]
        self._uses = [c for c, _ in pairs]
        self._owners = [owner for _, owner in pairs]
        # A pack's GD build writes the Gated DeltaNet states in place: the
        # caches' state buffers must then be private (_own_states).
        self._packs_write_states = any(getattr(c, "writes_states", False) for c in self._uses)
        if self.const:
            self._fn = mx.compile(self._step)
            self._take_record(model)
        else:
            self._record_checks()
            self._fn = mx.compile(self._step, inputs=[model, [c.cat for c in self._uses]])
        self._traced = {}
        self.builds += 1

    def release_if_stale(self) -> None:
        """Drop the compiled function (and with ``const`` its record; else the
        concatenations and packs it reads, with their checks) once the model no
        longer holds what they were traced with, so replaced weights, and the
        stale packs holding the old experts (``moe-block-pack``), are freed
        before the next decode token (called by the text model's other calls:
        a prefill after ``load_weights`` would otherwise hold both copies)."""
        if self._fn is not None and not self._still_valid():
            self._fn = self._record = None
            self._traced = {}
            self._uses, self._owners = [], []
            self._packs_write_states = False
            self._checks, self._checks_at = [[], [], [], [], []], []

    def _take_record(self, model: Any) -> None:
        """Record the model's parameter tree (``const``) and let its modules keep it current."""
        self._record = ParameterRecord(model)
        self._record.watch()

    def _record_checks(self) -> None:
        """Flatten every used concatenation's :meth:`ConcatProjection.valid` test."""
        checks = [[], [], [], [], []]
        for c, owner in zip(self._uses, self._owners):
            for into, part in zip(checks, c.identity_checks(owner)):
                into.extend(part)
        self._checks = checks
        self._checks_at = list(map(_REFRESHES, self._uses))

    def _still_valid(self) -> bool:
        """Whether the built step still applies (``benchmarks/profile_decode_host.py``
        times it as ``checks_ms``).

        With ``const``: the model still holds every recorded array and module
        (:meth:`ParameterRecord.valid`, C-level passes over ~4,000 entries for
        Qwen3.6), which implies that every used concatenation and pack is
        still valid (their modules and arrays are in the tree). Otherwise:
        every used concatenation still :meth:`~ConcatProjection.valid`, in
        two C-level passes over ~900 identities; re-recorded first if a
        concatenation was refreshed since (an eager compiled layer that
        traced re-wraps its arrays)."""
        if self.const:
            return self._record is not None and self._record.valid()
        if list(map(_REFRESHES, self._uses)) != self._checks_at:
            self._record_checks()
        containers, keys, expected, children, types = self._checks
        return (all(map(operator.is_, map(dict.get, containers, keys), expected))
                and all(map(operator.is_, map(type, children), types)))

    def _device_offset(self, position: int) -> mx.array:
        """The step's offset input for a cache at ``position``: ``[OFFSET_PAD]`` int32.

        A view of row ``position`` of a table of positions kept on the
        device (``n`` rows of ``OFFSET_PAD`` elements, row p all p, flat;
        built on the device, twice as long as needed whenever a position
        passes its end), so no launch per token advances it (the step
        returned ``offset + 1`` before: one more kernel per token, and one
        more output). Never a host-written scalar: MLX's CUDA allocator
        keeps buffers of <= 8 bytes in a small managed-memory pool that the
        host's own scalars share (a sampled token read with ``.item()``), so
        every kernel reading the offset (RoPE, the KV write, the mask)
        waited on host memory (see
        :func:`qwen_apple_backend.ops.device.f32_scalar`); the view's
        buffer is the table's.
        """
        table = self._positions
        at = position * OFFSET_PAD
        if table is None or table.shape[0] <= at:
            rows = max(_POSITION_ROWS, 2 * (position + 1))
            table = mx.repeat(mx.arange(rows, dtype=mx.int32), OFFSET_PAD)
            mx.async_eval(table)  # no wait for the tokens in flight
            self._positions = table
        # A slice (a view: no launch); an integer index would be a Gather.
        return table[at:at + OFFSET_PAD]

    def _step(self, tokens, offset, kv, ssm, layout, in_place):
        caches, ik, iss = [], 0, 0
        # Element 0 of the padded offset as a 0-d view (offset[0] would be a
        # Gather launch: measured in the H200 profile of a decode token).
        position = offset[:1].reshape(())
        for kind in layout:
            if kind == "kv":
                caches.append(_StepKV(kv[ik][0], kv[ik][1], position, in_place))
                ik += 1
            else:
                c = ArraysCache(size=2)
                c[0], c[1] = ssm[iss]
                caches.append(c)
                iss += 1
        model = self._model()
        backend = self._final_norm
        if backend is None:
            logits = self._call(model, tokens, cache=caches)
        else:
            # The final norm and lm_head as one launch: stand-ins while
            # tracing, the very modules put back after (the trace is what
            # replays).
            inner, head = model["model"], model["lm_head"]
            norm = inner["norm"]
            inner["norm"], model["lm_head"] = _PassThrough(), _NormedHead(head, norm, backend)
            try:
                logits = self._call(model, tokens, cache=caches)
            finally:
                inner["norm"], model["lm_head"] = norm, head
        steps = [c for c in caches if isinstance(c, _StepKV)]
        # Buffers written in place are not outputs (the cache keeps them);
        # which ones were is known only while tracing: kept per trace.
        self._copied = [i for i, c in enumerate(steps) if not c.written]
        kv_out = [(steps[i].keys, steps[i].values) for i in self._copied]
        ssm_out = [(c[0], c[1]) for c in caches if isinstance(c, ArraysCache)]
        if self._packs_write_states and ssm_out:
            # States a packed block wrote in place are its inputs, arrays MLX
            # holds as evaluated: a host read of them (np.array, saving the
            # cache) would not wait for the step. Handed back through a
            # Depends on the logits each (views of the same memory, no
            # launch), they are this step's outputs again. One Depends per
            # array: MLX's cost of a primitive grows with the square of its
            # outputs (each holds the others as siblings; CPU, compiled: one
            # Depends over 60 arrays 253 us per call, 60 of one array 24 us,
            # the arrays passed through 10 us).
            ssm_out = [(mx.depends(a, logits), mx.depends(b, logits)) for a, b in ssm_out]
        return logits, kv_out, ssm_out

    def _in_place_backend(self, kvs: list, kv_sig: tuple) -> Optional[str]:
        """The backend writing this call's KV rows in place, or None.

        Decided once per ``kv_sig`` (every K/V buffer's shape and dtype, as in
        the trace key): every buffer of one ``(B, Hk, D, dtype)``, each cache's
        keys and values of one shape, the kernel self-checked for it.
        """
        if not self.allow_in_place:
            return None
        hit = self._in_place.get(kv_sig, False)
        if hit is False:
            k = kvs[0].keys
            cls = (k.shape[:2], k.shape[3], k.dtype)
            uniform = (all((s[:2], s[3], d) == cls for s, d in kv_sig)
                       and all(k_[0] == v_[0] for k_, v_ in zip(kv_sig[0::2], kv_sig[1::2])))
            probe = mx.zeros((k.shape[0], k.shape[1], 1, k.shape[3]), dtype=k.dtype)
            hit = self._in_place[kv_sig] = kv_write_ready(probe, k) if uniform else None
        return hit

    def _own(self, kvs: list) -> None:
        """Give each cache private K/V buffers before the first in-place write to them.

        An array's memory may be shared (``copy.deepcopy`` of a cache, as
        mlx-lm's server does with prompt caches, shares it; so do views), and
        writing in place must not change another array. A cache whose arrays
        are the ones recorded here after a copy keeps them (only this step
        writes them while they stay the cache's); any other array, a grown
        buffer or a copied cache's, is copied once first.
        """
        for c in kvs:
            owned = self._owned.get(c)
            if owned is None or owned[0] is not c.keys or owned[1] is not c.values:
                c.keys, c.values = c.keys * 1, c.values * 1
                self._owned[c] = (c.keys, c.values)

    def _own_states(self, states: list) -> None:
        """Give each Gated DeltaNet cache private state buffers before the packed
        MoE block writes them in place (``moe-block-pack``'s GD build).

        As :meth:`_own` for the KV caches: an array not known private (a
        prefill's, an eager token's, a copied cache's, which may share its
        memory) is copied once, row-major. The step's own outputs are private
        (fresh launch outputs, or these buffers written in place), so
        :meth:`__call__` records them after each call (:data:`_OWNED_STATES`);
        a deep copy of the cache drops it from that record
        (:func:`_arrays_cache_deepcopy`). An array taken from the cache
        between tokens (``cache[1]``) still sees later tokens' values.
        """
        for c in states:
            owned = _OWNED_STATES.get(c)
            if owned is None or owned[0] is not c[0] or owned[1] is not c[1]:
                # Row-major copies: MLX hands a kernel a row-major temporary
                # of any other layout (the ops path's prefill state is
                # column-major in its last two axes), whose writes are lost.
                c[0], c[1] = mx.contiguous(c[0] * 1), mx.contiguous(c[1] * 1)
                _OWNED_STATES[c] = (c[0], c[1])
                _guard_arrays_cache_deepcopy()

    def __call__(self, tokens, cache, layout):
        if self._fn is None or not self._still_valid():
            self._build()
        # A check pass is always followed by a new trace in the same call (it
        # follows a build, which forgets the traced shapes).
        checked = self._pack_check_due
        if checked:
            # New packs, or a trace that left one out for want of its
            # self-check: first an eager forward of this token on scratch
            # copies of the caches, which checks the packed builds for its
            # shape class and is then dropped; the token itself then runs
            # through the trace below, with their verdicts known. So the
            # step's tokens follow the same eager / compiled sequence with
            # packs as without them (a compiled and an eager token may round
            # a bf16 intermediate differently).
            self._pack_check_due = False
            self.check_passes += 1
            with pack_check_pass():
                mx.eval(self._call(self._model(), tokens, _scratch_caches(cache)))
        kvs = [c for c in cache if type(c) is KVCache]
        kv_sig = tuple((a.shape, a.dtype) for c in kvs for a in (c.keys, c.values))
        in_place = self._in_place_backend(kvs, kv_sig)
        if in_place is not None:
            self._own(kvs)  # same shapes and dtypes: kv_sig still holds
        kv = [(c.keys, c.values) for c in kvs]
        offset = self._device_offset(kvs[0].offset)
        states = [c for c in cache if type(c) is ArraysCache]
        writes_states = self._packs_write_states
        if writes_states:
            self._own_states(states)
        ssm = [(c[0], c[1]) for c in states]
        # While tracing, the model's arrays are tracers: the concatenations the
        # step reads are marked so their owners still take the one-matmul path
        # (their arrays are compile inputs, so replays read the current ones).
        # Tracing also re-wraps the model's arrays in new objects (a replay
        # does not): re-record the children's views after a call that traces
        # (new input shapes).
        key = (tokens.shape, tokens.dtype, tuple(layout), in_place, kv_sig,
               tuple((a.shape, a.dtype) for pair in ssm for a in pair))
        tracing = key not in self._traced
        self._final_norm = (_final_norm_backend(self._model(), tokens)
                            if tracing and self.allow_final_norm else None)
        for c in self._uses:
            c.tracing = tracing
        due = pack_checks_due()
        try:
            # One call per module, each depending on the one before: the MoE
            # blocks' counting kernels read their own counters in place.
            with serial_decode_trace(compiled=True):
                logits, kv_out, ssm_out = self._fn(tokens, offset, kv, ssm, tuple(layout),
                                                   in_place)
        finally:
            for c in self._uses:
                c.tracing = False
        if tracing:
            self._traced[key] = self._copied
            for c in self._uses:
                c.refresh()
            if self.const:
                # The layers' compiled functions traced inside re-wrapped
                # their arrays; the call started valid: record them anew.
                self._take_record(self._model())
            if pack_checks_due() != due and not checked:
                # The trace left a pack out (its shape class unchecked): the
                # next call checks it in a check pass and traces again (once:
                # a trace right after a check pass that did not help is kept).
                self._pack_check_due = True
                self._fn = None
        for i, pair in zip(self._traced[key], kv_out):
            kvs[i].keys, kvs[i].values = pair
        for c in kvs:
            c.offset += tokens.shape[1]
        for c, pair in zip(states, ssm_out):
            c[0], c[1] = pair
            if writes_states:
                _OWNED_STATES[c] = pair
        self.compiled_calls += 1
        return logits


#: ArraysCache -> its (conv, recurrent) states known private: the compiled
#: step's own (see _CompiledDecode._own_states).
_OWNED_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _arrays_cache_deepcopy(self, memo):
    """``ArraysCache.__deepcopy__`` (installed with the compiled step): Python's
    default deep copy, after dropping ``self`` from :data:`_OWNED_STATES`.

    A deep copy of an MLX array shares its memory (so does ``mx.array(a)``),
    so a copy of a cache whose state buffers the compiled step writes in
    place would see the original's later tokens: a snapshot taken to fork or
    restore a conversation would change under it. Dropped from the record,
    the original's next compiled call copies its states to new buffers first
    (:meth:`_CompiledDecode._own_states`), and the copy keeps its values.
    """
    _OWNED_STATES.pop(self, None)
    return copy._reconstruct(self, memo, *self.__reduce_ex__(4))


def _scratch_caches(cache: list) -> list:
    """Copies of a decode step's ``cache`` (:class:`KVCache` and
    :class:`ArraysCache` entries) that one eager forward may update without
    touching the originals: each KV buffer is a new array sharing the old
    one's memory (``mx.stop_gradient``), so the forward's row write cannot
    donate that memory and copies it (transient: the KV cache's size once);
    the states' list is a new one (an eager forward replaces its entries).
    """
    out = []
    for c in cache:
        s = copy.copy(c)
        if type(c) is KVCache:
            s.keys, s.values = mx.stop_gradient(c.keys), mx.stop_gradient(c.values)
        else:
            s.cache = list(c.cache)
        out.append(s)
    return out


def _guard_arrays_cache_deepcopy() -> None:
    if ArraysCache.__dict__.get("__deepcopy__") is not _arrays_cache_deepcopy:
        if "__deepcopy__" in ArraysCache.__dict__:
            return  # mlx-lm's own: leave it (the record then misses deep copies)
        ArraysCache.__deepcopy__ = _arrays_cache_deepcopy


def _decode_class(base: type) -> type:
    """A subclass of the text model's class whose one-token calls take the compiled step."""

    def __call__(self, inputs, cache=None, **kwargs):
        step = self.__dict__.get("_qab_decode")
        if (step is not None and not any(v is not None for v in kwargs.values())
                and not self.training and inputs.ndim == 2 and inputs.shape[1] == 1):
            layout = _layout(cache)
            if layout is not None:
                if step.eager_calls == 0:
                    # First decode token: eager, so kernel self-checks run
                    # outside the trace.
                    step.eager_calls += 1
                    return base.__call__(self, inputs, cache)
                return step(inputs, cache, layout)
        if step is not None:
            step.release_if_stale()
        return base.__call__(self, inputs, cache, **kwargs)

    return type(base.__name__, (base,), {"__call__": __call__,
                                        "__module__": base.__module__,
                                        "_qab_compiled_decode": True})


def install_compiled_decode(text_model: Any, in_place: bool = True,
                            final_norm: bool = True, const: bool = False) -> bool:
    """Route ``text_model``'s one-token calls through a compiled decode step.

    The instance's class is swapped for a subclass that adds the compiled
    path (parameters, names and every other call are unchanged).

    Args:
        text_model (nn.Module): an mlx-lm Qwen3.5 / Qwen3-Next text model (the
            module with ``model`` and ``lm_head``, called as
            ``text_model(inputs, cache)``).
        in_place (bool): let the step write K/V rows into the cache in place
            where the ``kv_cache_write`` kernel is ready (``kv-in-place``;
            False: ``slice_update``, which copies the buffers). Default True.
        final_norm (bool): run the text model's final RMSNorm inside
            ``lm_head``'s GEMV launch where that kernel is ready
            (``norm-proj``; see :func:`_final_norm_backend`). Default True.
        const (bool): trace the parameters as constants, checked by identity
            before every call (``decode-const``; arrays changed in place
            are not seen; False: the model is a compile input, read live
            on every call). See :class:`_CompiledDecode`. Default False.

    Returns:
        bool: True when installed (False if it already was).
    """
    if compiled_decode_installed(text_model):
        return False
    base = type(text_model)
    text_model.__class__ = _decode_class(base)
    object.__setattr__(text_model, "_qab_decode",
                       _CompiledDecode(text_model, base.__call__, in_place, final_norm, const))
    return True


def compiled_decode_installed(text_model: Any) -> bool:
    """Whether :func:`install_compiled_decode` was applied to ``text_model``."""
    return bool(getattr(type(text_model), "_qab_compiled_decode", False))
