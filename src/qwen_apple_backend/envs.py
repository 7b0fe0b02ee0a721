"""Every environment variable the package reads, in one place.

Read through the functions here (never ``os.environ`` elsewhere) so tests can
monkeypatch one module and users can find every switch.

Variables:
    QAB_BACKEND: default backend for ``load`` and the CLI when none is given
        (``auto``, ``fused`` or ``stock``). Default ``auto``.
    QAB_DISABLE: comma-separated fused module kinds to keep stock
        (``moe``, ``gdn``, ``attn``, ``all``) or single optimizations to
        switch off (``gdn-kernel``, ``moe-gemm``, ``moe-kernel``, ``moe-route``, ``moe-block``,
        ``attn-blocks``, ``attn-split``, ``attn-kernel``, ``qk-prep``, ``decode-compile``,
        ``decode-const``,
        ``proj-concat``, ``gemv-kernel``, ``embed-kernel``, ``proj-gemv``, ``add-norm``,
        ``norm-proj``,
        ``next-norm``, ``kv-in-place``, ``moe-block-stage``, ``gemv-pipe``,
        ``attn-lanes``, ``moe-block-early``, ``l2-prefetch``,
        ``moe-block-out-proj``, ``moe-block-next-proj``, ``moe-block-gdn``,
        ``moe-block-pack``, ``moe-block-unroll``, ``moe-block-npl``, ``moe-block-roll``,
        ``moe-block-npg``,
        ``attn-step``,
        ``attn-mma``, ``attn-merge-split``, ``attn-merge-spread``, ``moe-block-nps``,
        ``moe-block-rpl``, ``attn-step-long``),
        for ablations.
    QAB_DISABLE_KERNELS: ``1``/``true``/``yes``/``on`` forces the portable
        pure-MLX path of every op; ``0``/``false``/``no``/``off`` or empty
        leaves kernels on. Anything else is an error.
    QAB_ENABLE: comma-separated optimizations to switch on where they are
        off by default (``decode-compile``, the compiled one-token decode
        step: on by default on a GPU, off on the CPU, where it measured no
        faster; ``next-norm``, the fused MoE block's last decode kernel
        applying the next layer's input RMSNorm on CUDA: measured no faster
        on the H200; ``proj-gemv``, the concatenated input projections on
        the CUDA dense GEMV kernel: less GPU time, but decode at 4K measured
        slower on the H200; ``gemv-pipe``, those projections' GEMV with
        double-buffered passes, and ``attn-lanes``, the decode attention's
        lane-group first pass: each faster in one 4K run on the H200, slower
        in two later ones; ``l2-prefetch``, the one-launch MoE block asking
        the L2 for the next layer's input projection while its route runs:
        what the next launch gains, the block measured to lose on the H200;
        ``decode-const``, the compiled decode step's parameters as trace
        constants checked by identity instead of compile inputs: arrays
        changed in place are then not seen by decoding; ``attn-merge-split``,
        the one-launch attention step's key blocks merged in two levels:
        verified on the H200, no faster end to end at 4K in one run).
        ``QAB_DISABLE`` wins over it. ``next-norm`` needs
        ``moe-route``, which needs ``add-norm`` and ``moe-kernel``.
    QAB_UNVERIFIED_KERNELS: a boolean like ``QAB_DISABLE_KERNELS``; on, it also
        uses CUDA kernels whose GPU tests have not yet passed on a GPU
        (``verified`` missing in kernels/MANIFEST.toml); they still pass the
        self-check first. For developing kernels.
    QAB_KERNEL_INCLUDE: a boolean (the spellings of ``QAB_DISABLE_KERNELS``),
        but unset or empty means on:
        on CUDA, a kernel's header and body reach MLX as ``#include`` lines of
        content-addressed copies under ``QAB_CACHE_DIR``'s ``cuda-src``
        folder, so MLX hashes a line, not up to 34 KB of text, at every
        launch it encodes (the kernel compiled is the same). Off, MLX gets the
        whole text, as it also does when that folder cannot be written.
    QAB_PLUGINS: comma-separated allowlist of plugin (entry-point) names to
        load; unset loads all. The built-in plugin is named ``qwen``. A name
        no installed plugin has is an error (checked in ``plugins.py``, which
        knows the installed names).
    QAB_GDN_CHUNK: chunk size of the chunked Gated DeltaNet prefill (a positive
        integer). Default 64.
    QAB_CACHE_DIR: where ``make demo`` caches its checkpoint and CUDA kernel
        texts are written for ``QAB_KERNEL_INCLUDE``. Default
        ``~/.cache/qwen-apple-backend``. One that cannot be created or written
        is an error when the demo model is first copied there (``demo.py``).

A bad value raises :class:`~qwen_apple_backend.errors.EnvVarError` (a
``ValueError``) whose message starts with the variable's name; :func:`validate`
checks every variable at once (the ``qab`` command runs it at startup).
"""

from __future__ import annotations

import collections.abc
import os
from pathlib import Path
from typing import Iterable, Optional

from .errors import EnvVarError

FUSABLE_KINDS = ("moe", "gdn", "attn")
# Single optimizations inside a fused module kind, switchable for ablations.
OPTIMIZATIONS = {
    "gdn-kernel": "gdn",  # GPU gated delta scans (prefill) and one-launch decode step (else MLX ops)
    "moe-gemm": "moe",  # dequantize-then-grouped-GEMM experts for prefill
    # GPU MoE kernels: the router (softmax + top-k + renormalisation in one launch),
    # decode GEMVs (+ shared-expert fold), prefill grouped GEMM and combine
    "moe-kernel": "moe",
    # a decode token's residual add + post-attention RMSNorm + 8-bit router GEMV + route in
    # one CUDA launch (moe_add_norm_route), ahead of the expert kernels
    "moe-route": "moe",
    # that launch and the two expert kernels after it as one CUDA launch (moe_decode_block:
    # ticketed phases of one grid; same outputs; needs moe-route)
    "moe-block": "moe",
    # long prompts' attention in blocks of query rows (bounded score memory)
    "attn-blocks": "attn",
    # decode attention over >= 32K cached keys with p v split over key blocks (GPU)
    "attn-split": "attn",
    # one decode token's attention + output gate in the split-K CUDA kernel pair
    "attn-kernel": "attn",
    # a one-token call's q/k RMSNorm + RoPE in one CUDA or Metal launch (qk_norm_rope)
    "qk-prep": "attn",
    "decode-compile": "model",  # the compiled one-token decode step (decode.py)
    # opt-in: the compiled decode step holds the model's parameters as trace constants, checked
    # by identity before every call, instead of ~1,600 compile inputs bound per token
    # (decode.py; arrays changed in place are then not seen; CPU: 0.58 vs 0.78 ms per step call;
    # H100, 4K: 270.5 vs 265.3 tok/s, host build 0.83 vs 1.50 ms per token, GPU-bound there)
    "decode-const": "model",
    "proj-concat": "model",  # sibling input projections run as one matmul (layers/_concat.py)
    "gemv-kernel": "model",  # the CUDA dense 4-bit decode GEMV for lm_head (ops/linear.py)
    # a decode token's quantized embedding rows in one CUDA launch (embedding_dequantize: MLX's
    # affine dequantize arithmetic, the same values) instead of three gathers and a dequantize;
    # verified on the H200 (2026-12-05)
    "embed-kernel": "model",
    # the same GEMV for a decode token's concatenated input projections (GDN in_proj,
    # attention q/k/v; layers/_concat.py; needs proj-concat; opt-in with QAB_ENABLE: less
    # GPU time than MLX's qmv, but decode at 4K measured slower on the H200, host-bound)
    "proj-gemv": "model",
    "add-norm": "model",  # residual add + post-attention RMSNorm as one kernel (ops/norm.py)
    # a decode token's input RMSNorm inside the mixer's concatenated input projection's
    # GEMV launch (CUDA; ops/linear.py norm_gemv; needs add-norm and proj-concat); in the
    # compiled decode step also the final RMSNorm inside lm_head's GEMV launch (decode.py)
    "norm-proj": "model",
    # a decode token's MoE down kernel also applies the next layer's input RMSNorm (CUDA;
    # opt-in with QAB_ENABLE: measured no faster on the H200)
    "next-norm": "model",
    # the compiled decode step writes each token's K/V rows into the cache in place (decode.py)
    "kv-in-place": "model",
    # the one-launch MoE block's down items copy the token's gate/up activations into shared
    # memory once (CUDA; 34.3 vs 43 us per launch under ncu on the H200, two runs; 4K decode
    # 142.0 vs 133.5 tok/s, same run, same greedy ids)
    "moe-block-stage": "moe",
    # the decoder layers' concatenated input projections (norm-proj, proj-gemv) on the dense
    # GEMV kernel's double-buffered build (PIPE: each pass's loads issued before the
    # arithmetic of the pass before; a grid of about one resident wave; same output). H200,
    # ncu: 16.5 vs 19.4 us at the Gated DeltaNet's in_proj with its norm; opt-in with QAB_ENABLE
    # (4K decode faster in one run, slower in two later ones)
    "gemv-pipe": "model",
    # the split-K decode attention's first pass below 64K keys as the lane-group build
    # (gqa_decode_partial_lanes: several lanes per key, several warps per key block, their
    # partials merged in shared memory; CUDA; opt-in with QAB_ENABLE). H200, 4K decode: 333.6
    # vs 322.0 tok/s in one run, slower in two later ones
    "attn-lanes": "attn",
    # the one-launch MoE block's gate/up items stage the token's norm themselves (the route's
    # own add + norm code) and wait for the route only when they hold routed rows, so the
    # shared expert's rows run during it (EARLY; CUDA; same outputs). H200, ncu: 29.5 vs 34.6
    # us per launch
    "moe-block-early": "moe",
    # with moe-block-early, the one-launch MoE block's gate/up items that wait for nothing
    # ask the L2 to fetch the next decoder layer's concatenated input projection while the
    # route runs, so the next launch's GEMV reads it from L2 (PF; CUDA; same outputs;
    # opt-in with QAB_ENABLE). H200, ncu: the next GEMV 16.8 vs 19.2 us, the block 32.4 vs
    # 30.2; 4K decode 211.7 vs 206.0 tok/s (one run, ahead in 4 of 6 paired rounds); H100,
    # with the packed block: 253.9 vs 262.3 tok/s without it (one run)
    "l2-prefetch": "moe",
    # the one-launch MoE block computes the mixer's 4-bit output projection (attention's
    # o_proj, the Gated DeltaNet's out_proj) as its first phase (OP; CUDA; the projection's
    # arithmetic is the dense GEMV kernel's): one launch fewer per decoder layer and token
    "moe-block-out-proj": "moe",
    # the one-launch MoE block also computes the NEXT decoder layer's input RMSNorm and its
    # mixer's concatenated 4-bit input projection as its last phase (NP; CUDA; the norm
    # GEMV kernel's arithmetic), which that layer's mixer takes instead of its own launch:
    # one launch fewer per decoder layer but the first. H200, 4K decode: 195.0 vs 190.1 and
    # 155.4 vs 140.3 tok/s, 128K: 158.1 vs 145.0 (same runs, same greedy ids)
    "moe-block-next-proj": "moe",
    # the one-launch MoE block also runs the decoder layer's Gated DeltaNet decode step as its
    # first phase, ahead of the output projection (GD, op moe_decode_block_gdn; CUDA;
    # gated_delta_decode's per-head code: the same bits): one launch fewer per Gated DeltaNet
    # layer and token (verified on the H200, 2026-12-05: 287.4 vs 265.0 tok/s at 4K without it)
    "moe-block-gdn": "moe",
    # the one-launch MoE block reads the router's, the shared expert's and the routed
    # experts' 21 arrays from one uint32 array per layer, which the modules then hold views
    # of (ops moe_decode_block_pack / moe_decode_block_gdn_pack; CUDA; the same code and
    # bits): MLX's host cost per launch grows with every input array it binds (the builds
    # with the experts in the pack are not yet verified on a GPU)
    "moe-block-pack": "moe",
    # the one-launch MoE block's out- and next-projection phases stage their input row in loops
    # unrolled over the block size, so a thread's L2 reads go out together (UNROLL; CUDA; the
    # same bits). H100, profile_layer_gpu.py: 77.4 vs 83.1 us per Gated DeltaNet layer launch
    "moe-block-unroll": "moe",
    # the one-launch MoE block's next-projection blocks take the next tickets too (each while
    # the item before loads its weights) and reuse the input row they normed and staged, so
    # the phase's 772 items no longer start as 772 blocks (NPL; CUDA; the same bits). H200,
    # profile_layer_gpu.py: 73.7 vs 79.0 us per Gated DeltaNet layer launch
    "moe-block-npl": "moe",
    # the one-launch MoE block's dot loops (out- and next-projection, route, gate/up, down)
    # run one chunk's code in a loop, not unrolled: two thirds of the kernel's code, which
    # each phase's first block on an SM fetches through its instruction cache (ROLL; CUDA;
    # the same bits). H100, profile_layer_gpu.py --timeline --warm 4: the launch's last
    # phase ends at 56.6 vs 62.2 us; 4K decode 326.8 vs 305.0 tok/s
    "moe-block-roll": "moe",
    # the one-launch MoE block's grid holds as many next-projection blocks as the GPU keeps
    # resident (two per SM), which loop over the phase's items (NPL), instead of one block per
    # item, most of which would start only to take a ticket past the last and leave (NPG;
    # CUDA; the same bits). H100, profile_layer_gpu.py --timeline --warm 8: 60.99 vs 61.78 us
    # per Gated DeltaNet layer launch, the gap between launches 4.34 vs 5.06 us
    "moe-block-npg": "moe",
    # one decode token's full-attention core in one CUDA launch inside the compiled decode
    # step (gqa_decode_step: q/k RMSNorm + RoPE, the KV row written in place, the lane-group
    # split-K pass, the merge and the output gate; four launches before; needs attn-kernel,
    # qk-prep, proj-concat, kv-in-place and decode-compile; below 64K cached keys, and from
    # there too with attn-step-long where its key pass is on tensor cores)
    "attn-step": "attn",
    # with attn-step, its key pass on tensor cores (gqa_mma.cuh: mma.sync for q k and p v,
    # the probabilities as two 16-bit parts; bf16 / f16 caches with at most 8 query heads per
    # KV head) instead of the lane-group pass: the pass was issue-bound (H200, 4K keys:
    # 12-16 us of a ~30 us launch)
    "attn-mma": "attn",
    # opt-in (QAB_ENABLE): with attn-step, its key blocks merged in two levels (the last block
    # of each group of ceil(sqrt(NB)) key blocks merges the group, the last of those the
    # groups) instead of by the last block of each KV head alone, which read every key
    # block's partials through one SM (H200, 4K keys: 11 of a 23 us launch, session 24); one
    # 4K run on the H200: 307.5 tok/s with it against 310.3 without
    "attn-merge-split": "attn",
    # with attn-step (and not with attn-merge-split), its key blocks merged by G more thread
    # blocks per KV head (one query head each, a row's elements over the block's warps; every
    # block takes a ticket as it starts, the merging blocks the last G and wait for the key
    # blocks' count; their code out of line) instead of by the last key block alone; the
    # same bits. H100, the launch alone after an L2 flush (profile_attention_decode.py
    # --timeline): 20.46 / 20.06 vs 25.06 / 24.88 us at 4K keys (two runs) and 47.6 vs 50.69
    # at 32K (session 44); 4K decode 329.7 vs 325.6 tok/s without it
    "attn-merge-spread": "attn",
    # opt-in (QAB_ENABLE): the one-launch MoE block on a persistent grid of two blocks per SM
    # whose next-projection rows (48 per block) are copied into each block's shared memory
    # early, so that the phase after the down items is only its arithmetic (NPS; CUDA; the
    # same bits). H200, profile_layer_gpu.py: 74.0 vs 71.0 us per Gated DeltaNet layer launch
    # (slower: the phase's arithmetic, not its loads, sets its length)
    "moe-block-nps": "moe",
    # opt-in (QAB_ENABLE): the one-launch MoE block's route items (and the gate/up items that
    # stage the norm themselves) load the token's residual row, the norm weight and eps before
    # they wait for the out projection (RPL; CUDA; the same bits). H100, rolled build,
    # profile_layer_gpu.py --timeline --warm 4: the launch's last phase ends at 55.0 vs 56.6 us;
    # 4K decode 305.6 tok/s with and without it (bench-nvidia-h100-s40-rpl-4k.json)
    "moe-block-rpl": "moe",
    # with attn-step and attn-mma, the one-launch attention step also from 64K cached keys
    # (STEP_MAX_KEYS), where the layer otherwise keeps the four launches (the kernel pair's
    # lane-per-key pass), when its key pass runs on tensor cores. The limit was measured with
    # the step's lane-group pass (H200, 128K: 156.2 vs 168.3 tok/s). H100, same run: 64K
    # 230.1 vs 195.3 tok/s, 128K 225.9 vs 180.6, the same greedy ids
    "attn-step-long": "attn",
}


def _get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


#: Accepted spellings of a boolean variable (compared lower-case; empty = off).
TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off")

#: Backends ``QAB_BACKEND`` may name for MLX loading.
MLX_BACKENDS = ("auto", "fused", "stock")


def _names(names: Iterable[str]) -> dict[str, str]:
    """Names compared in any case: each lower-cased name -> its first spelling as given
    (stripped), so that an error quotes the value the user typed."""
    out: dict[str, str] = {}
    for name in names:
        name = str(name).strip()
        if name:
            out.setdefault(name.lower(), name)
    return out


def _unknown(var: str, what: str, unknown: Iterable[str], known: Iterable[str]) -> EnvVarError:
    unknown = sorted(set(unknown), key=lambda n: (n.lower(), n))
    names = ", ".join(repr(n) for n in unknown)
    plural = "s" if len(unknown) > 1 else ""
    return EnvVarError(f"{var}: unknown {what}{plural} {names} (known: {', '.join(known)})")


def _flag(name: str) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off (any case); unset or empty = off.

    Raises:
        EnvVarError: for any other value, naming the variable.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES or value == "":
        return False
    raise EnvVarError(f"{name}: expected one of {'/'.join(TRUE_VALUES)} (on) or "
                      f"{'/'.join(FALSE_VALUES)} (off), got {raw!r}")


def backend(known: Optional[Iterable[str]] = None) -> str:
    """``QAB_BACKEND`` lower-cased, default ``auto``.

    Args:
        known (Iterable[str], optional): backend names accepted here; when given,
            any other value raises.

    Raises:
        EnvVarError: if ``known`` is given and the value is not in it.
    """
    raw = (_get("QAB_BACKEND", "auto") or "auto").strip() or "auto"
    value = raw.lower()
    if known is not None:
        known = list(known)
        if value not in known:
            raise _unknown("QAB_BACKEND", "backend", [raw], known)
    return value


def disabled_kinds() -> frozenset[str]:
    """Module kinds forced to stock, and optimizations switched off, by ``QAB_DISABLE``.

    Names match in any case; an error quotes them as given.

    Raises:
        EnvVarError: if a name is not one of ``moe``, ``gdn``, ``attn``,
            ``all`` or an optimization name (a key of :data:`OPTIMIZATIONS`).
    """
    given = _names((_get("QAB_DISABLE", "") or "").split(","))
    names = set(given)
    unknown = names - set(FUSABLE_KINDS) - set(OPTIMIZATIONS) - {"all"}
    if unknown:
        raise _unknown("QAB_DISABLE", "optimization", [given[n] for n in unknown],
                       [*FUSABLE_KINDS, "all", *OPTIMIZATIONS])
    if "all" in names:
        return frozenset(FUSABLE_KINDS)
    return frozenset(names)


def check_disable(names: Iterable[str]) -> frozenset[str]:
    """Validate a ``disable=`` argument as ``QAB_DISABLE`` is validated.

    Args:
        names (Iterable[str] | str): module kinds (``moe``, ``gdn``,
            ``attn``, ``all``) and/or optimization names (any case), or one
            comma-separated string of them (as ``QAB_DISABLE``).

    Returns:
        frozenset[str]: the lower-cased names, ``all`` expanded to every kind.

    Raises:
        EnvVarError: (a ``ValueError``) naming ``disable=``, the unknown names
            as given and the accepted ones.
        TypeError: naming ``disable=`` for a value that is neither a string nor an
            iterable of strings (``disable=3``).
    """
    if isinstance(names, str):
        names = names.split(",")
    elif not isinstance(names, collections.abc.Iterable):
        raise TypeError(f"disable=: expected names (a str or an iterable of str), got "
                        f"{type(names).__name__} {names!r}")
    names = list(names)
    odd = [n for n in names if not isinstance(n, str)]
    if odd:
        raise TypeError(f"disable=: expected names (a str or an iterable of str), got "
                        f"{type(odd[0]).__name__} {odd[0]!r} among them")
    given = _names(names)
    got = set(given)
    unknown = got - set(FUSABLE_KINDS) - set(OPTIMIZATIONS) - {"all"}
    if unknown:
        raise _unknown("disable=", "optimization", [given[n] for n in unknown],
                       [*FUSABLE_KINDS, "all", *OPTIMIZATIONS])
    if "all" in got:
        got = (got - {"all"}) | set(FUSABLE_KINDS)
    return frozenset(got)


def kernels_disabled() -> bool:
    """``QAB_DISABLE_KERNELS``: force the portable path of every op.

    Raises:
        EnvVarError: for a value that is not a boolean spelling.
    """
    return _flag("QAB_DISABLE_KERNELS")


# Optimizations that are not on everywhere by default and that QAB_ENABLE can
# switch on: decode-compile is on by default on a GPU only (host-bound decode:
# measured on the H200) and off on the CPU (measured no faster there).
OPT_IN = ("decode-compile", "next-norm", "proj-gemv", "gemv-pipe", "attn-lanes",
          "l2-prefetch", "decode-const", "attn-merge-split", "moe-block-nps", "moe-block-rpl")


def enabled_opt_in() -> frozenset[str]:
    """Optimizations switched on by ``QAB_ENABLE`` (comma-separated) where they are off by default.

    Names match in any case; an error quotes them as given.

    Raises:
        EnvVarError: for a name that is not in :data:`OPT_IN` (one that is on
            by default says so).
    """
    return check_enable((_get("QAB_ENABLE", "") or "").split(","))


def check_enable(names: Iterable[str], var: str = "QAB_ENABLE") -> frozenset[str]:
    """Validate opt-in optimization names as ``QAB_ENABLE`` is validated.

    Args:
        names (Iterable[str]): names from :data:`OPT_IN` (any case).
        var (str): what the error messages name (``QAB_ENABLE``, or a flag).

    Returns:
        frozenset[str]: the lower-cased names.

    Raises:
        EnvVarError: (a ``ValueError``) naming ``var``: for a name that is on by
            default, or one that is no optimization, quoted as given.
    """
    given = _names(names)
    got = set(given)
    unknown = got - set(OPT_IN)
    on_already = sorted(unknown & set(OPTIMIZATIONS))
    if on_already:
        raise EnvVarError(
            f"{var}: {given[on_already[0]]!r} is on by default ({var} names only "
            f"{', '.join(OPT_IN)}; switch others off with QAB_DISABLE)")
    if unknown:
        raise _unknown(var, "optimization", [given[n] for n in unknown], OPT_IN)
    return frozenset(got)


def unverified_kernels_allowed() -> bool:
    """``QAB_UNVERIFIED_KERNELS``: also build CUDA kernels not yet verified on a GPU.

    Raises:
        EnvVarError: for a value that is not a boolean spelling.
    """
    return _flag("QAB_UNVERIFIED_KERNELS")


def kernel_include() -> bool:
    """``QAB_KERNEL_INCLUDE``: hand MLX a CUDA kernel's text as ``#include`` lines (default on).

    Off (``0``/``false``/``no``/``off``), MLX gets the whole compacted text of
    every kernel, as before (``ops.device.included_cuda_source`` says why the
    short form is faster). Unset or empty means on.

    Raises:
        EnvVarError: for a value that is not a boolean spelling.
    """
    if not (_get("QAB_KERNEL_INCLUDE") or "").strip():
        return True
    return _flag("QAB_KERNEL_INCLUDE")


def plugin_allowlist() -> frozenset[str] | None:
    raw = _get("QAB_PLUGINS")
    if raw is None:
        return None
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def gdn_chunk_size() -> int:
    """``QAB_GDN_CHUNK``, default 64.

    Raises:
        EnvVarError: if it is not a positive integer.
    """
    raw = _get("QAB_GDN_CHUNK", "64")
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise EnvVarError(f"QAB_GDN_CHUNK: expected a positive integer, got {raw!r}")
    return value


def validate(backends: Optional[Iterable[str]] = None) -> None:
    """Check every ``QAB_*`` variable now, rather than at first use.

    Args:
        backends (Iterable[str], optional): names ``QAB_BACKEND`` may take; None
            leaves ``QAB_BACKEND`` unchecked (commands that do not read it).

    Raises:
        EnvVarError: for the first variable with a bad value, naming it.
    """
    disabled_kinds()
    enabled_opt_in()
    kernels_disabled()
    unverified_kernels_allowed()
    kernel_include()
    gdn_chunk_size()
    if backends is not None:
        backend(backends)


def cache_dir() -> Path:
    raw = _get("QAB_CACHE_DIR")
    if raw:
        return Path(raw).expanduser()
    xdg = _get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "qwen-apple-backend"
