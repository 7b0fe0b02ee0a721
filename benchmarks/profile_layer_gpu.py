#!/usr/bin/env python3
"""GPU time of a decode token's layer launch: the packed one-launch block of a Gated DeltaNet layer.

At batch 1 on an H100 a decode token of Qwen3.6-35B-A3B spends ~3.4 ms on the
GPU against ~1.8 ms on the host (``decode_split.py``, session 34): the GPU sets
the rate, and 30 of its 40 layers are one launch each, the packed block with
the Gated DeltaNet step (op ``moe_decode_block_gdn_pack``, phases one after the
other: the GDN step, the mixer's output projection, the route, the experts'
gate/up, their down projections, the next layer's norm + input projection).
This script builds such layers at Qwen3.6's shape (H = 2048, 256 experts of
512, K = 8, 8-bit router and shared gate, 4-bit everything else; 16 key and 32
value heads of 128, conv kernel 4; the next projection 12,352 rows; seeded
random weights, bfloat16) and measures them two ways:

* default (``--chain``): ``--layers`` distinct layers (default 8, ~3.6 GB, so
  the L2 does not keep one layer's weights for the next) run as a decode
  token runs them: layer i's output and next projection are layer i+1's
  residual input and Gated DeltaNet projection row, ``--chain`` launches
  (default 40) in one evaluated graph, the device synchronised around it.
  Per variant: the median over ``--reps`` chains of the time per launch (us)
  and the bytes a launch reads over that time (GB/s; weights of the 8 routed
  experts, the shared expert, the router, both projections, the recurrent
  state read and written);
* ``--timeline``: each variant built with the kernel's phase marks
  (``QAB_MARK``, recording the GPU's global timer by ticket) on one layer,
  after an L2 flush: per phase the first start, the median and last end of
  waiting, the median, 90th percentile and last end of work, and each
  sub-step mark's median over the phase's items (``QAB_SUBMARK``: input
  staged, dots done, rows written, counted; ``profile_moe_block_gpu.SUBMARKS``;
  each median on its own, so not one item's steps), in us from the launch's first
  ticket, medians over ``--reps`` launches, plus the blocks resident at the
  start (``started_1us``). With ``--warm N`` the marked launch is instead the
  last of N chained over N layers, no flush: the kernel's code in the L2 as
  in decode (after a flush it comes from DRAM, and the phases' straight-line
  code then costs microseconds of instruction fetch). Every launch of such a
  chain is marked and one evaluation runs them back to back (MLX's CUDA
  graphs of about two launches each, its 1,000 MB limit on a graph's
  inputs, as in a decode token), so the marks alone also time the chain on
  the GPU (``chain``: the launch period, a launch's span from its first
  ticket to its last mark, and the gap from there to the next launch's
  first ticket; :func:`chain_spans`). The marks cost registers: check
  ``started_1us`` against the shipped build's occupancy before reading
  phase overlaps.

The default chain timing is the host's clock around the chain's evaluation
(MLX's encode of the launches, ~14 us each in a decode token, included). It
did not separate builds whose GPU times differ by a few us: session 39's
rolled and unrolled builds measured 74.1 against 73.0 us per launch there,
session 40's GPU-timed chain 62.7 against 67.0 (another H100, another
run; why the two timings differ is not established). Compare builds with
``--timeline --warm N``.

Variants are ``ops.moe.DECODE_BLOCK_OPTIONS`` settings and the build keys of
``profile_moe_block_gpu.py`` (``SLEEP``, ``MINB``, ``RELAXED``, ``PIN``, ``MANT``, ``PS``), written
``PRW=4+MINB=2`` (``PRW``: the next projection's rows per warp, 2 shipped,
4 halving its 772 blocks; ``UNROLL=0``: the projection phases' input staging
as a loop, not unrolled as shipped (``moe-block-unroll`` off); ``NPL=0``:
each next-projection item its own block (``moe-block-npl`` off); ``PSM=48``:
next-projection items of 48 rows staged in shared memory; ``GDS=4``: four
GDN items per value head; ``RPL=1``: the route items load the residual row,
norm weight and eps before their wait; ``GSR=1``: the gate/up items route
their token themselves; ``PERSIST+GRID=264+PSM=48+NPS=1``: a persistent grid
whose blocks copy their next-projection rows into shared memory at their
start, ``NPS=2`` after their first item; ``MANT=1``: quantized weights made
floats through a float's mantissa; ``NPG=0``: the grid with a block per
next-projection item (772), most of which start only to take a ticket past
the last and leave, not as shipped the GPU's resident blocks (two per SM)
looping over them (``moe-block-npg`` off); ``PS=1``: the 4-bit dots' inputs
prescaled so that each weight is masked in place, one integer op fewer per
value in the projections' dots, and in gate/up and down also the mantissa in
place of the integer-to-float conversion; ``ROLL=0``: the items' dot loops unrolled,
not rolled as shipped (``moe-block-roll`` off)), plus ``PACK=0`` (the unpacked GD build,
``moe_decode_block_gdn``, 47 inputs instead of 27) and ``PF=1`` (the ``l2-prefetch``
build: the gate/up items that wait for nothing, resident from the launch's
start, ask the L2 for the next projection's weight, scales and biases that its
last phase reads); ``default`` is the
shipped build. Every variant's output, next projection and states are first
checked bit for bit against the first variant's. Writes
``profile-layer-gpu-<device>.json`` (or ``profile-layer-gpu-timeline-...``)
into OUT. Needs MLX's CUDA backend.

Usage:
    python benchmarks/profile_layer_gpu.py OUT [--variants default,PACK=0] [--layers 8]
        [--chain 40] [--reps 20]
    python benchmarks/profile_layer_gpu.py OUT --timeline [--variants default] [--reps 20]
        [--warm 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import check_out, device_name, write_result  # noqa: E402

#: Qwen3.6-35B-A3B's decode layer: H, E, I, K, (Hk, Hv, Dk, Dv), conv kernel.
H, E, I, K = 2048, 256, 512, 8
HEADS = (16, 32, 128, 128)
KC = 4
#: The next layer's concatenated input projection: q | k | v | z | b | a.
PN = 2 * HEADS[0] * HEADS[2] + 2 * HEADS[1] * HEADS[3] + 2 * HEADS[1]
PHASES = ("gdn", "out-proj", "route", "gate/up", "down", "next-proj")
DEFAULT_VARIANTS = "default,NPL=0,UNROLL=0"


class Layer(NamedTuple):
    """One Gated DeltaNet layer's decode arrays (weights, states and its block pack)."""

    nw: object
    gate: object
    gate_up: object
    down: object
    shared: object
    out_proj: object
    next_proj: object
    conv_w: object
    A_log: object
    dt_bias: object
    gnorm_w: object
    conv_state: object
    state: object
    pack: object


def split_variant(text: str) -> tuple[dict, bool]:
    """``"PACK=0+GRPW=4"`` -> (``{"GRPW": 4}``, False): the block options of
    ``profile_moe_block_gpu.parse_variant`` and whether the build is packed.

    Raises:
        ValueError: naming an unknown option or a bad value.

    >>> split_variant("default")
    ({}, True)
    >>> split_variant("PACK=0+GRPW=4")
    ({'GRPW': 4}, False)
    >>> split_variant("PF=1")
    ({'PF': True}, True)
    """
    from profile_moe_block_gpu import parse_variant

    # The launch's own flags (not block options): their value as given, or None.
    flags = {}
    for name in ("PACK", "PF"):
        given = [p for p in text.split("+") if p.startswith(name + "=")]
        if len(given) > 1 or (given and given[0] not in (f"{name}=0", f"{name}=1")):
            raise ValueError(f"variant {text!r}: {name} is a flag: {name}=0 or {name}=1")
        flags[name] = given[0].endswith("=1") if given else None
    parts = [p for p in text.split("+") if not p.startswith(("PACK=", "PF="))]
    opts = parse_variant("+".join(parts)) if parts else {}
    if flags["PF"]:
        if opts.get("EARLY") is False:
            raise ValueError(f"variant {text!r}: PF needs EARLY (its items that wait for "
                             f"nothing issue the prefetch)")
        opts["PF"] = True
    return opts, flags["PACK"] is not False


def layer_bytes(layer: Layer) -> int:
    """Bytes one launch of ``layer`` reads from memory: the router, K = 8 routed
    experts' gate/up and down rows, the shared expert and its gate, the output
    and next projections, the GDN weights, conv state (read and written) and
    float32 recurrent state (read and written)."""
    def nbytes(w, rows_of=None):
        arrays = [w.weight, w.scales] + ([w.biases] if w.biases is not None else [])
        total = sum(a.nbytes for a in arrays)
        return total if rows_of is None else total * rows_of // w.weight.shape[0]

    experts = (nbytes(layer.gate_up) + nbytes(layer.down)) * K // E
    shared = sum(nbytes(w) for w in layer.shared)
    arrays = (layer.nw, layer.conv_w, layer.A_log, layer.dt_bias, layer.gnorm_w,
              layer.next_proj.norm_weight)
    return (nbytes(layer.gate) + experts + shared + nbytes(layer.out_proj.weights)
            + nbytes(layer.next_proj.weights) + sum(a.nbytes for a in arrays)
            + 2 * layer.conv_state.nbytes + 2 * layer.state.nbytes)


def build_layer(seed: int) -> Layer:
    """One layer's arrays at Qwen3.6's shape, seeded, evaluated."""
    import mlx.core as mx

    from qwen_apple_backend.ops import moe as moe_ops

    dt = mx.bfloat16
    k = iter(mx.random.split(mx.random.key(seed), 20))

    def q(shape, bits=4, scale=None):
        w = (mx.random.normal(shape, key=next(k)) * (scale or shape[-1] ** -0.5)).astype(dt)
        wq, s, b = mx.quantize(w, group_size=64, bits=bits)
        return moe_ops.ExpertWeights(wq, s, b, group_size=64, bits=bits)

    Hk, Hv, Dk, Dv = HEADS
    C = 2 * Hk * Dk + Hv * Dv
    nw = (1.0 + 0.2 * mx.random.normal((H,), key=next(k))).astype(dt)
    gate = q((E, H), bits=8)
    gate_up, down = q((E, 2 * I, H)), q((E, H, I))
    shared = moe_ops.SharedExpertWeights(q((I, H)), q((I, H)), q((H, I)), q((1, H), bits=8))
    out_proj = moe_ops.OutProjection(None, q((H, Hv * Dv)))
    pnw = (1.0 + 0.2 * mx.random.normal((H,), key=next(k))).astype(dt)
    next_proj = moe_ops.NextProjection(pnw, 1e-6, q((PN, H)))
    conv_w = (0.5 * mx.random.normal((C, KC, 1), key=next(k))).astype(dt)
    A_log = mx.log(mx.random.uniform(0.05, 2.0, (Hv,), key=next(k)))
    dt_bias = (1.0 + 0.5 * mx.random.normal((Hv,), key=next(k))).astype(dt)
    gnorm_w = (1.0 + 0.1 * mx.random.normal((Dv,), key=next(k))).astype(dt)
    conv_state = mx.random.normal((1, KC - 1, C), key=next(k)).astype(dt)
    state = 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=next(k))
    pack = moe_ops.decode_block_pack(gate, gate_up, down, shared)
    layer = Layer(nw, gate, gate_up, down, shared, out_proj, next_proj, conv_w, A_log, dt_bias,
                  gnorm_w, conv_state, state, pack)
    mx.eval(arrays_of(layer))
    return layer


def arrays_of(layer: Layer) -> list:
    """Every array of ``layer`` (its weights' named tuples unpacked)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [a for _, a in tree_flatten(list(layer)) if isinstance(a, mx.array)]


class Variant:
    """A variant's block options set (and, with a build prefix or marks, its own
    kernel object in place of the shipped one) inside ``with``."""

    _kernels: dict = {}

    def __init__(self, opts: dict, packed: bool, stamps: int = 0):
        self.opts, self.packed, self.stamps = opts, packed, stamps

    def kernel(self, prefix: str, shared_memory: int = 0):
        import mlx.core as mx

        from profile_moe_block_gpu import MARK_DEFINE

        from qwen_apple_backend.ops._sources import compact, kernel_source

        op = "moe_decode_block_gdn_pack" if self.packed else "moe_decode_block_gdn"
        key = (op, prefix, bool(self.stamps), shared_memory)
        if key not in Variant._kernels:
            src = kernel_source(op, "cuda")
            # The marks index by the block's absolute ticket: the GDN items'
            # relative one (tk) is negative.
            marks = MARK_DEFINE.replace("(size_t)tk", "(size_t)ticket") if self.stamps else ""
            Variant._kernels[key] = mx.fast.cuda_kernel(
                name=f"{src.name}_v{len(Variant._kernels)}", input_names=list(src.inputs),
                output_names=list(src.outputs) + (["stamps"] if self.stamps else []),
                source=compact(src.body), header=marks + prefix + compact(src.header),
                shared_memory=shared_memory)
        return Variant._kernels[key]

    def __enter__(self):
        from profile_moe_block_gpu import BUILD_KEYS, _StampedKernel, build_prefix

        from qwen_apple_backend.ops import moe as moe_ops

        self.saved = dict(moe_ops.DECODE_BLOCK_OPTIONS)
        self.real = (moe_ops._decode_block_pack_object, moe_ops._decode_block_gdn_object)
        moe_ops.DECODE_BLOCK_OPTIONS.update(
            {k: v for k, v in self.opts.items() if k not in BUILD_KEYS and k != "PF"})
        prefix = build_prefix(self.opts)
        if prefix or self.stamps:
            # One kernel object per dynamic shared memory size (PSM's), as ops.moe's.
            def kernel(shared_memory=0):
                k = self.kernel(prefix, shared_memory)
                return _StampedKernel(k, self.stamps) if self.stamps else k

            if self.packed:
                moe_ops._decode_block_pack_object = (
                    lambda backend, gdn=False, shared_memory=0: kernel(shared_memory))
            else:
                moe_ops._decode_block_gdn_object = (
                    lambda backend, shared_memory=0: kernel(shared_memory))
        return self

    def __exit__(self, *exc):
        from qwen_apple_backend.ops import moe as moe_ops

        moe_ops.DECODE_BLOCK_OPTIONS.clear()
        moe_ops.DECODE_BLOCK_OPTIONS.update(self.saved)
        moe_ops._decode_block_pack_object, moe_ops._decode_block_gdn_object = self.real

    def counter(self, layer: Layer, proj):
        """A zero serial counter long enough for this build's launch."""
        from qwen_apple_backend.ops import moe as moe_ops

        if not self.packed:
            return moe_ops.serial_counter(moe_ops.decode_block_counter_length())
        return moe_ops.serial_counter(moe_ops.decode_block_pack_counter_length(
            1, H, E, K, I, proj.dtype, True, step(layer, proj)))


def step(layer: Layer, proj):
    """The layer's GatedDeltaStep on the projection row ``proj`` ``[1, 1, PN]``."""
    from qwen_apple_backend.ops import moe as moe_ops

    return moe_ops.GatedDeltaStep(proj, layer.conv_state, layer.conv_w, None, layer.A_log,
                                  layer.dt_bias, layer.gnorm_w, 1e-6, layer.state, HEADS)


def launch(variant: Variant, layer: Layer, x, proj, counter):
    """One launch of ``layer``: (out, next projection row, conv state, state)."""
    from qwen_apple_backend.ops import moe as moe_ops

    pw = layer.next_proj.weights
    return moe_ops._moe_decode_block_call(
        "cuda", x, None, layer.nw, 1e-6, layer.gate, K, True, layer.gate_up, layer.down,
        layer.shared, counter, out_proj=layer.out_proj, next_proj=layer.next_proj,
        gdn_step=step(layer, proj), pack=layer.pack if variant.packed else None,
        prefetch=(pw.weight, pw.scales, pw.biases) if variant.opts.get("PF") else ())


def private_states(layers: list) -> list:
    """The layers with copies of their states (the packed build writes them in place)."""
    import mlx.core as mx

    out = [lay._replace(conv_state=mx.contiguous(lay.conv_state * 1),
                        state=mx.contiguous(lay.state * 1)) for lay in layers]
    mx.eval([(lay.conv_state, lay.state) for lay in out])
    return out


def check_variants(variants, layer: Layer, x, proj) -> None:
    """Every variant's four outputs equal the first variant's bit for bit.

    Raises:
        SystemExit: naming the variant and the output that differs, or the
            variant and ops.moe's error for a build option it refuses.
    """
    import mlx.core as mx

    ref = None
    for name, v in variants:
        (lay,) = private_states([layer])
        try:
            with v:
                got = launch(v, lay, x, proj, v.counter(lay, proj))
                mx.eval(got)
        except ValueError as exc:  # a build option ops.moe refuses
            raise SystemExit(f"variant {name}: {exc}") from None
        if ref is None:
            ref = got
            continue
        for what, a, b in zip(("output", "next projection", "conv state", "state"), got, ref):
            if not mx.array_equal(a, b).item():
                raise SystemExit(f"variant {name}: its {what} differs from {variants[0][0]}'s")


def chain_times(variants, layers: list, x, proj, chain: int, reps: int) -> list[dict]:
    """Per variant: us per launch over ``chain`` chained launches, medians of ``reps``."""
    import mlx.core as mx

    rows = []
    nbytes = layer_bytes(layers[0])
    for name, v in variants:
        own = private_states(layers)
        with v:
            counters = [v.counter(lay, proj) for lay in own]
            mx.eval(counters)
            samples = []
            for r in range(reps + 2):
                h, p = x, proj
                for i in range(chain):
                    h, p, *_ = launch(v, own[i % len(own)], h, p, counters[i % len(own)])
                mx.synchronize()
                t0 = time.perf_counter()
                mx.eval(h, p)
                mx.synchronize()
                if r >= 2:  # (the first chains compile and warm)
                    samples.append((time.perf_counter() - t0) / chain)
        us = statistics.median(samples) * 1e6
        rows.append({"variant": name, "us_per_launch": round(us, 2),
                     "us_min": round(min(samples) * 1e6, 2),
                     "us_max": round(max(samples) * 1e6, 2),
                     "gb_per_s": round(nbytes / (us * 1e-6) / 1e9, 1)})
        print(f"{name:>24}: {us:8.2f} us per launch (min {rows[-1]['us_min']:.2f}, max "
              f"{rows[-1]['us_max']:.2f}), {rows[-1]['gb_per_s']:.0f} GB/s")
    return rows


def phase_bounds(opts: dict) -> list[int]:
    """Ticket bounds of the six phases of one token row's launch, under ``opts``."""
    from qwen_apple_backend.ops import moe as moe_ops

    rblk, gblk, dblk = moe_ops._decode_block_phase_blocks(E, H, I, K, opts.get("GRPW"))
    prw = opts.get("PRW", moe_ops.DECODE_BLOCK_OPTIONS["PRW"])
    psm = opts.get("PSM", moe_ops.DECODE_BLOCK_OPTIONS["PSM"])
    gds = opts.get("GDS", moe_ops.DECODE_BLOCK_OPTIONS["GDS"])
    sizes = [HEADS[1] * gds, moe_ops._proj_phase_blocks(H), rblk, gblk, dblk,
             moe_ops._proj_phase_blocks(PN, prw, psm)]
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return bounds


def summarize_phases(samples: list, bounds: list[int]) -> dict:
    """Per phase, medians over launches of its marks in us from each launch's first ticket.

    ``samples``: per launch, rows ``[start, wait end, work end, mark 3, SM,
    sub-step marks ...]`` per ticket (0 where a mark does not apply). Mark 3
    is the route items' logits written and counted (the last of them then
    routes the row) and the down items' end of their wait for the gate/up
    items; a phase with it gets ``mark3_median`` and ``mark3_last`` too.
    Work ends: the median and 90th percentile (nearest rank) item's and the
    last. Sub-step marks (5 on, ``profile_moe_block_gpu.SUBMARKS``: what
    thread 0 of an item had done then): ``sub``, per mark its name and its
    median over the phase's items that set it. Each mark's median is taken on
    its own, so two marks' medians may come from different items: their
    difference is not one item's step time.
    """
    from profile_moe_block_gpu import SUBMARKS

    phases = {}
    for p, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        vals: dict[str, list] = {k: [] for k in ("start_first", "start_median",
                                                 "wait_end_median", "wait_end_last",
                                                 "work_end_median", "work_end_p90",
                                                 "work_end_last")}
        started = []
        sub: dict[int, list] = {}
        for s in samples:
            t0 = min(row[0] for row in s)
            rows = s[lo:hi]
            started.append(sum(1 for row in rows if row[0] - t0 < 1000))
            starts = sorted(row[0] - t0 for row in rows)
            waits = sorted((row[1] or row[0]) - t0 for row in rows)
            ends = sorted(row[2] - t0 for row in rows)
            vals["start_first"].append(starts[0])
            vals["start_median"].append(starts[len(starts) // 2])
            vals["wait_end_median"].append(waits[len(waits) // 2])
            vals["wait_end_last"].append(waits[-1])
            vals["work_end_median"].append(ends[len(ends) // 2])
            vals["work_end_p90"].append(ends[-(-9 * len(ends) // 10) - 1])
            vals["work_end_last"].append(ends[-1])
            marks = sorted(row[3] - t0 for row in rows if row[3])
            if marks:
                vals.setdefault("mark3_median", []).append(marks[len(marks) // 2])
                vals.setdefault("mark3_last", []).append(marks[-1])
            for k in range(5, len(rows[0]) if rows else 5):
                got = sorted(row[k] - t0 for row in rows if row[k])
                if got:
                    sub.setdefault(k, []).append(got[len(got) // 2])
        phases[PHASES[p]] = {k: round(statistics.median(x) / 1000.0, 2) for k, x in vals.items()
                             if x}
        phases[PHASES[p]]["blocks"] = hi - lo
        phases[PHASES[p]]["started_1us"] = int(statistics.median(started))
        if sub:
            names = SUBMARKS.get(PHASES[p], {})
            phases[PHASES[p]]["sub"] = {
                f"{k} {names.get(k, '?')}": round(statistics.median(x) / 1000.0, 2)
                for k, x in sorted(sub.items(), key=lambda kv: statistics.median(kv[1]))}
    return phases


#: The most chained launches (distinct layers, ~450 MB each) a --warm timeline takes.
MAX_WARM = 16


def launch_spans(launches: list) -> tuple[list[int], list[int]]:
    """(first mark, last mark) in ns of each launch's stamps, in launch order.

    ``launches``: per launch, the rows of :func:`summarize_phases`'s samples
    (the global timer's ns per mark, 0 where unset, the SM at index 4). The
    first mark is the launch's first ticket; the last is the latest mark of
    any kind (work ends, counts, sub-step marks), so a launch's span leaves
    out only its blocks' exits after their last mark.
    """
    firsts, lasts = [], []
    for rows in launches:
        marks = [m for row in rows for k, m in enumerate(row) if m and k != 4]
        firsts.append(min(row[0] for row in rows if row[0]))
        lasts.append(max(marks))
    return firsts, lasts


def chain_spans(reps: list) -> dict:
    """GPU-only timing of the warm timeline's chains, from their marks alone.

    ``reps``: per chain, :func:`launch_spans`'s input for its N launches,
    run back to back by one evaluation (no host time between them while the
    host's encode keeps ahead of the GPU, as it does here). Medians over
    the chains, in us: ``period`` (first ticket of the last launch minus the
    first's, over N - 1: the GPU's time per launch, launch overhead
    included), ``span`` (a launch's first to last mark, the median launch's)
    and ``gap`` (a launch's last mark to the next one's first ticket: the
    last blocks' exits, the kernel's completion, the next launch's start and
    its first block's ticket; the median gap of a chain).
    """
    periods, spans, gaps = [], [], []
    for launches in reps:
        firsts, lasts = launch_spans(launches)
        n = len(firsts)
        periods.append((firsts[-1] - firsts[0]) / (n - 1))
        spans.append(statistics.median(b - a for a, b in zip(firsts, lasts)))
        gaps.append(statistics.median(firsts[k + 1] - lasts[k] for k in range(n - 1)))
    us = lambda xs: round(statistics.median(xs) / 1000.0, 2)  # noqa: E731
    return {"period": us(periods), "span": us(spans), "gap": us(gaps), "chains": len(reps)}


def timeline(variants, layers: list, x, proj, reps: int, warm: int = 0) -> list[dict]:
    """Per variant: :func:`summarize_phases` of ``reps`` marked launches.

    ``warm`` 0: each launch of ``layers[0]`` alone, after an L2 flush (its
    weights, and the kernel's code, from DRAM). ``warm`` n >= 3 (at most
    :data:`MAX_WARM`): each the last of n chained launches over
    ``layers[:n]`` (as :func:`chain_times` runs them, no flush), as in a
    decode token: the kernel's code and the counters in the L2, the layer's
    weights not (the layers before it, ~40 MB of reads each, pass through the
    50 MB L2 first).
    """
    import mlx.core as mx

    from profile_moe_block_gpu import STAMP_WIDTH, _StampedKernel

    flush = None if warm else mx.zeros((64 * 1024 * 1024,), dtype=mx.float32)  # 256 MB
    if flush is not None:
        mx.eval(flush)
    results = []
    for name, v in variants:
        bounds = phase_bounds(v.opts)
        marked = Variant(v.opts, v.packed, stamps=bounds[-1])
        own = private_states(layers[:max(1, warm)])
        samples, chains = [], []
        with marked:
            counters = [marked.counter(lay, proj) for lay in own]
            mx.eval(counters)
            for _ in range(reps + 2):
                if warm:
                    h, p = x, proj
                    mx.synchronize()
                    _StampedKernel.calls = []
                    try:
                        for i, lay in enumerate(own):
                            h, p, *_ = launch(marked, lay, h, p, counters[i])
                        mx.eval(h, p, *_StampedKernel.calls)
                        chains.append([c.reshape(-1, STAMP_WIDTH).tolist()
                                       for c in _StampedKernel.calls])
                    finally:
                        _StampedKernel.calls = None
                    samples.append(chains[-1][-1])  # the last launch's
                else:
                    mx.eval(flush + 1.0)
                    mx.synchronize()
                    mx.eval(launch(marked, own[0], x, proj, counters[0]))
                    samples.append(_StampedKernel.last.reshape(-1, STAMP_WIDTH).tolist())
        phases = summarize_phases(samples[2:], bounds)
        results.append({"variant": name, "phases": phases})
        print(f"{name}:")
        for ph, d in phases.items():
            print(f"  {ph:>9}: " + "  ".join(f"{k} {u}" for k, u in d.items()))
        if warm:
            results[-1]["chain"] = chain = chain_spans(chains[2:])
            print(f"  {'chain':>9}: " + "  ".join(f"{k} {u}" for k, u in chain.items()))
    return results


def main(argv=None) -> int:
    from qwen_apple_backend.argtypes import positive_int

    p = argparse.ArgumentParser(prog="profile_layer_gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma list of layer launch variants (default {DEFAULT_VARIANTS})")
    p.add_argument("--layers", type=positive_int, default=8,
                   help="distinct layers the chain cycles through (~450 MB each)")
    p.add_argument("--chain", type=positive_int, default=40,
                   help="chained launches per timed graph (a token's 40 layers)")
    p.add_argument("--reps", type=positive_int, default=20,
                   help="timed chains (or marked launches with --timeline) per variant")
    p.add_argument("--timeline", action="store_true",
                   help="record each ticket's phase times (one launch after an L2 flush, or "
                        "with --warm the last of N chained) instead of timing chains")
    p.add_argument("--warm", type=int, default=0, metavar="N",
                   help=f"--timeline: the phases of the last of N chained launches over N "
                        f"layers, no L2 flush (the code and counters warm, as in decode), and "
                        f"the chain's GPU period, span and gap per launch, 3 <= N <= "
                        f"{MAX_WARM}; 0 (default): one launch after an L2 flush")
    args = p.parse_args(argv)
    check_out(p, args.out)
    if args.warm and not args.timeline:
        p.error("--warm goes with --timeline")
    if args.warm and not 3 <= args.warm <= MAX_WARM:
        p.error(f"--warm takes 0 or N from 3 to {MAX_WARM} (fewer layers leave the marked "
                f"one's weights in the L2 from the launch before), got {args.warm}")
    try:
        variants = [(v, Variant(*split_variant(v))) for v in args.variants.split(",") if v]
    except ValueError as exc:
        p.error(str(exc))
    names = [v for v, _ in variants]
    if not names or len(set(names)) != len(names):
        p.error(f"--variants: give one or more distinct variants, got {args.variants!r}")
    import mlx.core as mx

    if not mx.cuda.is_available():
        p.error("profiling needs MLX's CUDA backend and a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = [build_layer(100 + i)
              for i in range(max(1, args.warm) if args.timeline else args.layers)]
    kx, kp = mx.random.split(mx.random.key(3))
    x = (4.0 * mx.random.normal((1, 1, H), key=kx)).astype(mx.bfloat16)
    proj = mx.random.normal((1, 1, PN), key=kp).astype(mx.bfloat16)
    mx.eval(x, proj)
    check_variants(variants, layers[0], x, proj)
    print(f"{len(variants) - 1} variant(s) equal {names[0]} bit for bit "
          f"(output, next projection, both states)")
    typed = list(argv if argv is not None else sys.argv[1:])
    command = "python benchmarks/profile_layer_gpu.py " + " ".join(
        "OUT" if a == args.out else a for a in typed)
    result = {"command": command, "device": device_name(),
              "shape": {"H": H, "E": E, "I": I, "K": K, "heads": list(HEADS), "Kc": KC,
                        "next_rows": PN, "dtype": "bfloat16"},
              "bytes_per_launch": layer_bytes(layers[0]), "reps": args.reps}
    if args.timeline:
        result["warm"] = args.warm
        result["variants"] = timeline(variants, layers, x, proj, args.reps, args.warm)
        stem = "profile-layer-gpu-timeline"
    else:
        result.update(layers=args.layers, chain=args.chain,
                      rows=chain_times(variants, layers, x, proj, args.chain, args.reps))
        stem = "profile-layer-gpu"
    dest = write_result(out, stem, result, device=result["device"])
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
