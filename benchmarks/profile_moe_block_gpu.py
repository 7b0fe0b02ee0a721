#!/usr/bin/env python3
"""GPU time of a decode token's MoE half: the one-launch block against the three launches.

``kernels/cuda/moe_decode_block.cu`` runs a decoder layer's MoE half (residual
add + RMSNorm + router + top-k, the experts' gate/up, their down projections +
the residual) as ticketed phases of one grid; ``moe_add_norm_route``,
``moe_gate_up_shared_gemv`` and ``moe_down_shared_gemv`` are the same work in
three launches. This script builds one MoE layer at Qwen3.6-35B-A3B's shape
(H = 2048, E = 256 experts, K = 8, I = 512, a shared expert, 8-bit router and
shared gate, 4-bit experts, random weights), checks that every build variant of
the block gives the three launches' output bit for bit, and then either

* (default) launches the three-launch path and every variant ``--reps`` times
  between ``cuProfilerStart`` and ``cuProfilerStop``, a small ``mx.sort``
  between candidates marking the log, for ``ncu --profile-from-start off``::

      ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \\
          --csv --log-file OUT/ncu-moe-block.csv python benchmarks/profile_moe_block_gpu.py OUT
      python benchmarks/profile_moe_block_gpu.py OUT --summarize OUT/ncu-moe-block.csv

  (ncu serializes the kernels and flushes the caches before each: the
  weights stream from HBM as in decode); or
* ``--timeline``: runs each variant built with the kernel's phase marks
  (``QAB_MARK`` in ``common.cuh``) recording the GPU's global timer per ticket:
  when the block took the ticket, finished waiting, finished its work, and its SM
  (the stamps also hold thread 0's sub-step marks, ``QAB_SUBMARK``, ``SUBMARKS``:
  an item's input staged, its dots done, its rows written, its count; this
  script does not summarize them, ``profile_layer_gpu.py --timeline`` does). The L2
  is flushed (a 256 MB write) before each launch. Prints, per phase, the first
  start, the median and last wait end, and the last work end, in us from the
  launch's first ticket, medians over ``--reps`` launches.

Variants are ``ops.moe.DECODE_BLOCK_OPTIONS`` settings, written
``CS=32+PREFETCH+PERSIST+GRID=264`` (flags alone mean true), plus six build
settings of the kernel text: ``SLEEP=ns`` (``QAB_WAIT_SLEEP_NS``, the wait's
sleep between polls), ``MINB=n`` (the kernel declared
``__launch_bounds__(BLOCK, n)``: at least n blocks per SM, registers capped to
fit), ``RELAXED`` (``QAB_WAIT_RELAXED``: relaxed polls and one acquire
fence instead of an acquire load per poll), ``PIN`` (``QAB_PIN_LOADS``:
the projection and route items use their loaded weights before they wait, so
that the compiler cannot move the loads past the wait), ``MANT``
(``QAB_NIBBLE_MANTISSA``: the experts' 4-bit and the router's 8-bit weights
become floats through a float's mantissa, ``common.cuh``'s ``qab_nibble`` /
``qab_byte``, instead of integer-to-float conversions; the same values;
measured no faster on an H100) and ``PS`` (``QAB_Q4_PRESCALE``: the 4-bit
dots' inputs prescaled by their weight's place in its word, so that each
weight is masked in place and made a float through a float's mantissa,
``common.cuh``'s ``qab_nibble_placed``; in this script's kernel the gate/up
and down dots, whose inputs are scaled in registers per chunk, in the layer
launch also the projections' staged inputs, ``gemv_q4.cuh``; the same bits);
``default`` is the shipped
setting. The timeline also records, per phase, how many blocks took their
ticket within 1 us of the first (``started_1us``: the blocks resident at the
start; the marks cost registers, so check it against the shipped build's
occupancy), the down items' end of waiting for the gate/up items
(``gu_wait_end_median``, with PREFETCH) and every ticket's marks of the last
launch (``tickets``). Writes ``profile-moe-block-gpu-<device>.json`` (the
summary) or ``profile-moe-block-gpu-timeline-<device>.json`` into OUT. Needs
MLX's CUDA backend, except ``--summarize``.

With ``--next`` each variant runs after an L2 flush and before the next decoder
layer's input projection (norm + GEMV at the Gated DeltaNet in_proj's shape),
once as is and once prefetching that projection's arrays into L2 (``PF``, the
``l2-prefetch`` build): under ``ncu --cache-control none`` the projection's time
shows what the prefetch saves the next launch, the block's what it costs.

Usage:
    python benchmarks/profile_moe_block_gpu.py OUT [--variants default,CS=32,...] [--reps 5]
    ncu --cache-control none ... python benchmarks/profile_moe_block_gpu.py OUT --next
    python benchmarks/profile_moe_block_gpu.py OUT --summarize CSV
    python benchmarks/profile_moe_block_gpu.py OUT --timeline [--variants ...] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import check_out, device_name, write_result  # noqa: E402
from profile_decode_gpu import (_profiler, kernel_group, marked_segments,  # noqa: E402
                                read_run_record)

DEFAULT_VARIANTS = "default,EARLY=0,STAGE=0+EARLY=0,CS=1+PREFETCH=0+STAGE=0+EARLY=0,PERSIST+GRID=264"
#: (N, E, H, I, K): one decode token of Qwen3.6-35B-A3B's MoE layer.
SHAPE = (1, 256, 2048, 512, 8)
PHASES = ("route", "gate/up", "down")
#: Variant keys that change the kernel's text (a header prefix), not its template.
BUILD_KEYS = ("SLEEP", "MINB", "RELAXED", "PIN", "MANT", "PS")
#: The build keys that are flags (0 or 1), as the options whose default is a bool.
BUILD_FLAGS = ("RELAXED", "PIN", "MANT", "PS")
#: Marks per ticket in the --timeline build: 0 start (its ticket taken), 1 its
#: wait's end, 2 its work's end, 3 a phase's own (the route's logits counted,
#: the down items' end of their wait for the gate/up items), 4 the SM, and
#: 5 .. STAMP_WIDTH - 1 the sub-step marks of SUBMARKS.
STAMP_WIDTH = 16
#: The sub-step marks a phase's items record (QAB_SUBMARK in the headers,
#: QAB_MARK(k >= 5) in moe_decode_block.cu): mark -> what thread 0 has done.
SUBMARKS = {
    "gdn": {5: "conv, gates", 6: "q, k normed", 7: "pass 1", 8: "pass 2", 9: "pass 3",
            10: "pass 4", 11: "counted"},
    "out-proj": {5: "staged", 6: "dots", 7: "written", 11: "counted"},
    "route": {5: "add, norm", 6: "logits written", 7: "logits fence", 8: "logits read (last)",
              11: "routed counted (last)"},
    "gate/up": {5: "x staged", 6: "dots", 7: "written", 11: "counted"},
    "down": {5: "loads issued", 6: "h staged", 7: "dots", 8: "written", 11: "counted"},
    "next-proj": {8: "norm", 5: "staged", 6: "dots", 7: "written"},
}
#: QAB_MARK as the --timeline build defines it: thread 0 stores the global
#: timer (ns) as mark k of its ticket (at mark 0 also the SM, and where its
#: row of marks is, in a shared variable of the block: QAB_SUBMARK, used in
#: the headers' helpers, which do not see the ticket, writes there).
MARK_DEFINE = ("__shared__ unsigned long long* qab_mark_row_;\n"
               "#define QAB_MARK(k) do { if (threadIdx.x == 0) { unsigned long long qab_t_; "
               "asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(qab_t_)); "
               f"if ((k) == 0) {{ qab_mark_row_ = stamps + (size_t)tk * {STAMP_WIDTH}; "
               "unsigned s_; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(s_)); "
               "qab_mark_row_[4] = s_; } "
               f"stamps[(size_t)tk * {STAMP_WIDTH} + (k)] = qab_t_; }} }} while (0)\n"
               "#define QAB_SUBMARK(k) do { if (threadIdx.x == 0) { unsigned long long qab_t_; "
               "asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(qab_t_)); "
               "qab_mark_row_[(k)] = qab_t_; } } while (0)\n")


def build_prefix(variant: dict) -> str:
    """The header text a variant's build keys put before the kernel's own header."""
    text = ""
    if "SLEEP" in variant:
        text += f"#define QAB_WAIT_SLEEP_NS {int(variant['SLEEP'])}\n"
    if "MINB" in variant:
        text += ("#undef __global__\n#define __global__ __location__(global) "
                 f"__launch_bounds__(256, {int(variant['MINB'])})\n")
    if variant.get("RELAXED"):
        text += "#define QAB_WAIT_RELAXED 1\n"
    if variant.get("PIN"):
        text += "#define QAB_PIN_LOADS 1\n"
    if variant.get("MANT"):
        text += "#define QAB_NIBBLE_MANTISSA 1\n"
    if variant.get("PS"):
        text += "#define QAB_Q4_PRESCALE 1\n"
    return text


_KERNELS: dict = {}


def variant_kernel(prefix: str, stamps: bool = False, shared_memory: int = 0):
    """moe_decode_block built with ``prefix`` before its header (and the phase marks
    recording into one more output, ``stamps``, when asked; ``shared_memory``
    the dynamic bytes a PSM build requests); one object per build."""
    import mlx.core as mx

    from qwen_apple_backend.ops._sources import compact, kernel_source

    key = (prefix, stamps, shared_memory)
    if key not in _KERNELS:
        src = kernel_source("moe_decode_block", "cuda")
        tag = f"_v{len(_KERNELS)}"
        _KERNELS[key] = mx.fast.cuda_kernel(
            name=src.name + tag, input_names=list(src.inputs),
            output_names=list(src.outputs) + (["stamps"] if stamps else []),
            source=compact(src.body),
            header=(MARK_DEFINE if stamps else "") + prefix + compact(src.header),
            shared_memory=shared_memory)
    return _KERNELS[key]


def parse_variant(text: str) -> dict:
    """``"CS=32+PREFETCH+GRID=264"`` -> ``{"CS": 32, "PREFETCH": True, "GRID": 264}``.

    Raises:
        ValueError: naming the unknown option or the bad value.

    >>> parse_variant("default")
    {}
    >>> parse_variant("CS=32+PERSIST+GRID=264")
    {'CS': 32, 'PERSIST': True, 'GRID': 264}
    """
    from qwen_apple_backend.ops.moe import DECODE_BLOCK_CHOICES, DECODE_BLOCK_OPTIONS

    if text == "default":
        return {}
    out = {}
    for part in text.split("+"):
        key, _, value = part.partition("=")
        if key not in DECODE_BLOCK_OPTIONS and key not in BUILD_KEYS:
            raise ValueError(f"variant {text!r}: unknown option {key!r}; known: "
                             f"{', '.join([*DECODE_BLOCK_OPTIONS, *BUILD_KEYS])}")
        if key in out:
            raise ValueError(f"variant {text!r}: {key} given twice")
        if not value:
            out[key] = True
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise ValueError(f"variant {text!r}: {key}={value!r} is not an integer") from None
        if isinstance(DECODE_BLOCK_OPTIONS.get(key), bool) or key in BUILD_FLAGS:
            if out[key] not in (0, 1):
                raise ValueError(f"variant {text!r}: {key} is a flag: 0 or 1, got {out[key]}")
            out[key] = bool(out[key])
            continue
        low = 0 if key in ("SLEEP", "NPS") else 1
        if out[key] < low:
            raise ValueError(f"variant {text!r}: {key} must be >= {low}, got {out[key]}")
        # What ops.moe accepts (it would refuse them at the first launch, after the build).
        allowed = DECODE_BLOCK_CHOICES.get(key)
        if allowed is not None and out[key] not in allowed:
            raise ValueError(f"variant {text!r}: {key} must be one of "
                             f"{', '.join(map(str, allowed))}, got {out[key]}")
    return out


def build_layer(dtype):
    """One MoE layer's decode inputs at :data:`SHAPE` (seeded random weights)."""
    import mlx.core as mx

    from qwen_apple_backend.ops import moe as moe_ops

    N, E, H, I, K = SHAPE
    k = mx.random.split(mx.random.key(7), 12)

    def q(shape, key, bits=4, group=64, scale=0.02):
        w = (scale * mx.random.normal(shape, key=key)).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=group, bits=bits)
        return moe_ops.ExpertWeights(weight=wq, scales=s, biases=b, group_size=group, bits=bits,
                                     mode="affine")

    x = (4.0 * mx.random.normal((N, 1, H), key=k[0])).astype(dtype)
    r = mx.random.normal((N, 1, H), key=k[1]).astype(dtype)
    nw = (1.0 + 0.2 * mx.random.normal((H,), key=k[2])).astype(dtype)
    gate = q((E, H), k[3], bits=8, scale=0.05)
    gate_up = q((E, 2 * I, H), k[4])
    down = q((E, H, I), k[5])
    shared = moe_ops.SharedExpertWeights(q((I, H), k[6]), q((I, H), k[7]), q((H, I), k[8]),
                                         q((1, H), k[9], bits=8))
    arrays = [x, r, nw]
    for w in (gate, gate_up, down, *shared):
        arrays += [w.weight, w.scales, w.biases]
    mx.eval(*arrays)
    return x, r, nw, gate, gate_up, down, shared


def _three_launches(layer, counter):
    from qwen_apple_backend.ops import moe as moe_ops

    x, r, nw, gate, gate_up, down, shared = layer
    h, y, _, inds, scores = moe_ops._add_norm_route_call("cuda", x, r, nw, 1e-6, gate, SHAPE[4],
                                                         True, counter)
    return moe_ops._moe_shared_decode_kernel_call("cuda", y, inds, scores, gate_up, down, shared,
                                                  residual=h)


def _block(layer, counter):
    from qwen_apple_backend.ops import moe as moe_ops

    x, r, nw, gate, gate_up, down, shared = layer
    return moe_ops._moe_decode_block_call("cuda", x, r, nw, 1e-6, gate, SHAPE[4], True, gate_up,
                                          down, shared, counter)


class _Options:
    """ops.moe.DECODE_BLOCK_OPTIONS set to a variant inside ``with``."""

    def __init__(self, variant: dict, stamps: int = 0):
        self.variant, self.stamps = variant, stamps

    def __enter__(self):
        from qwen_apple_backend.ops import moe as moe_ops

        self.saved = dict(moe_ops.DECODE_BLOCK_OPTIONS)
        self.real = moe_ops._decode_block_object
        moe_ops.DECODE_BLOCK_OPTIONS.update(
            {k: v for k, v in self.variant.items() if k not in BUILD_KEYS})
        prefix = build_prefix(self.variant)
        if prefix or self.stamps:
            def kernel(shared_memory=0):
                k = variant_kernel(prefix, self.stamps, shared_memory)
                return _StampedKernel(k, self.stamps) if self.stamps else k

            moe_ops._decode_block_object = lambda backend, shared_memory=0: kernel(shared_memory)

    def __exit__(self, *exc):
        from qwen_apple_backend.ops import moe as moe_ops

        moe_ops.DECODE_BLOCK_OPTIONS.clear()
        moe_ops.DECODE_BLOCK_OPTIONS.update(self.saved)
        moe_ops._decode_block_object = self.real


def _candidates(layer, variants):
    """[(name, fn)]: the three launches, then each variant (its own serial counter)."""
    from qwen_apple_backend.ops import moe as moe_ops

    route_counter = moe_ops.serial_counter()
    cands = [("three-launch", lambda: _three_launches(layer, route_counter))]
    for name, v in variants:
        with _Options(v):
            counter = moe_ops.serial_counter(moe_ops.decode_block_counter_length())

        def fn(v=v, counter=counter):
            with _Options(v):
                return _block(layer, counter)
        cands.append((name, fn))
    return cands


#: The next decoder layer's input projection of ``--next``: the Gated
#: DeltaNet's concatenated in_proj of Qwen3.6-35B-A3B, [N, K] 4-bit, group 64,
#: run with its input RMSNorm (the model's norm-proj launch).
NEXT_SHAPE = (12352, 2048)


def _next_candidates(layer, variants):
    """``--next``: per variant, the block then the next layer's input projection
    (``V>next``) and the block prefetching that projection into L2 then it
    (``V+PF>next``, the ``l2-prefetch`` build), each after an L2 flush (a
    256 MB write), for ncu with ``--cache-control none``: the projection's
    time shows whether it reads its weights from L2."""
    import mlx.core as mx

    from qwen_apple_backend.ops import linear as lin_ops
    from qwen_apple_backend.ops import moe as moe_ops

    x, r, nw, gate, gate_up, down, shared = layer
    N, K = NEXT_SHAPE
    k = mx.random.split(mx.random.key(11), 2)
    wq, sc, bi = mx.quantize((0.02 * mx.random.normal((N, K), key=k[0])).astype(mx.bfloat16),
                             group_size=64, bits=4)
    norm_w = (1.0 + 0.1 * mx.random.normal((K,), key=k[1])).astype(mx.bfloat16)
    flush = mx.zeros((64 * 1024 * 1024,), dtype=mx.float32)
    mx.eval(wq, sc, bi, norm_w, flush)
    backend = lin_ops.norm_gemv_ready(x, norm_w, 1e-6, wq, sc, bi, 64, bits=4)
    if backend != "cuda":
        raise SystemExit("--next: the norm GEMV kernel is not ready on this device")
    cands = []
    for name, v in variants:
        with _Options(v):
            if not moe_ops._decode_block_build(prefetch=True)["PF"]:
                raise SystemExit(f"--next: variant {name} has EARLY off; the prefetch needs it")
        for pf in ((), (wq, sc, bi)):
            with _Options(v):
                counter = moe_ops.serial_counter(moe_ops.decode_block_counter_length())

            def fn(v=v, counter=counter, pf=pf):
                mx.eval(flush + 1.0)
                with _Options(v):
                    out = moe_ops._moe_decode_block_call(
                        "cuda", x, r, nw, 1e-6, gate, SHAPE[4], True, gate_up, down, shared,
                        counter, prefetch=pf)
                return lin_ops.norm_gemv(out, norm_w, 1e-6, wq, sc, bi, group_size=64, bits=4,
                                         backend=backend)
            cands.append((f"{name}{'+PF' if pf else ''}>next", fn))
    return cands


def check_variants(cands) -> None:
    """Every candidate's output equals the three launches' bit for bit (twice each).

    Raises:
        SystemExit: naming the variant that differs.
    """
    import mlx.core as mx

    ref = cands[0][1]()
    mx.eval(ref)
    for name, fn in cands[1:]:
        for _ in range(2):
            out = fn()
            mx.eval(out)
            if not mx.array_equal(out, ref).item():
                raise SystemExit(f"variant {name}: output differs from the three launches")


def summarize(csv_path: Path, run: dict) -> list[dict]:
    """Per candidate of ``run["order"]``: launches and GPU us per call, by kernel group.

    Raises:
        SystemExit: naming the file when the log does not split into one
            marked segment per candidate, or a segment is not a multiple of reps.
    """
    order, reps = run["order"], int(run["reps"])
    segments = marked_segments(csv_path, order, reps)
    out = []
    for cand, seg in zip(order, segments):
        groups: dict[str, float] = {}
        for name, us in seg:
            g = kernel_group(name)
            groups[g] = groups.get(g, 0.0) + us / reps
        out.append({"candidate": cand, "launches": len(seg) // reps,
                    "us": round(sum(groups.values()), 2),
                    "kernels_us": {g: round(u, 2) for g, u in groups.items()}})
    return out


def med_s(s, lo: int, hi: int, t0=None):
    """Median of mark 3 (a down item's end of waiting for the gate/up items) over
    tickets [lo, hi) of one launch's stamps, in ns from its first ticket (``t0``
    when the caller has it); None when the build sets no mark 3 (no PREFETCH)."""
    t0 = min(row[0] for row in s) if t0 is None else t0
    ends = sorted(row[3] - t0 for row in s[lo:hi] if row[3])
    return ends[len(ends) // 2] if ends else None


def timeline(layer, variants, reps: int, spin: int = 0) -> list[dict]:
    """Per variant and phase: us from the first ticket (medians over ``reps`` launches).

    ``spin``: 4096 x 4096 bfloat16 matmuls run before each launch's L2 flush
    (the GPU busy, as in decode, before the timed launch: its clocks up).
    """
    import mlx.core as mx

    from qwen_apple_backend.ops import moe as moe_ops

    flush = mx.zeros((64 * 1024 * 1024,), dtype=mx.float32)
    busy = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
    mx.eval(flush, busy)
    N, E, H, I, K = SHAPE
    results = []
    for name, v in variants:
        with _Options(v):  # GRPW sets the gate/up phase's block count
            rblk, gblk, dblk = moe_ops._decode_block_phase_blocks(E, H, I, K)
        blocks = rblk + gblk + dblk
        bounds = [0, rblk * N, (rblk + gblk) * N, blocks * N]
        with _Options(v, stamps=blocks * N):
            counter = moe_ops.serial_counter(moe_ops.decode_block_counter_length())
            samples = []
            for _ in range(reps + 2):
                acc = busy
                for _ in range(spin):
                    acc = (acc @ busy) * 1e-3
                mx.eval(acc, flush + 1.0)
                mx.synchronize()
                _block(layer, counter)
                stamps = _StampedKernel.last
                mx.eval(stamps)
                samples.append(stamps.reshape(-1, STAMP_WIDTH).tolist())
        samples = samples[2:]  # the first launches compile and warm
        phases = {}
        for p, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            keys = ("start_first", "start_median", "wait_end_median", "wait_end_last",
                    "work_end_last")
            vals = {k: [] for k in keys}
            started, gu_waits = [], []
            for s in samples:
                t0 = min(row[0] for row in s)
                rows = s[lo:hi]
                # Blocks that took their ticket within 1 us of the first (resident
                # from the launch's start); with PREFETCH, the down items' mark 3.
                started.append(sum(1 for row in rows if row[0] - t0 < 1000))
                if p == 2:
                    gu_waits.append(med_s(s, lo, hi, t0))
                waits = sorted(row[1 if p else 0] - t0 for row in rows)
                starts = sorted(row[0] - t0 for row in rows)
                vals["start_first"].append(starts[0])
                vals["start_median"].append(starts[len(starts) // 2])
                vals["wait_end_median"].append(waits[len(waits) // 2])
                vals["wait_end_last"].append(waits[-1])
                vals["work_end_last"].append(max(row[2] for row in rows) - t0)
            phases[PHASES[p]] = {k: round(statistics.median(x) / 1000.0, 2)
                                 for k, x in vals.items()}
            # Blocks of this phase per SM (a phase's tickets spread over how many SMs).
            per_sm = {}
            for row in samples[-1][lo:hi]:
                per_sm[row[4]] = per_sm.get(row[4], 0) + 1
            phases[PHASES[p]]["sms"] = len(per_sm)
            phases[PHASES[p]]["max_per_sm"] = max(per_sm.values())
            phases[PHASES[p]]["started_1us"] = int(statistics.median(started))
            ends = [e for e in gu_waits if e is not None]
            if ends:
                phases[PHASES[p]]["gu_wait_end_median"] = round(
                    statistics.median(ends) / 1000.0, 2)
        # The last launch per ticket: [start, wait end, prefetch wait end, work end] in us
        # from its first ticket (0 where a mark does not apply), and the SM.
        last = samples[-1]
        t0 = min(row[0] for row in last)
        tickets = [[round((row[k] - t0) / 1000.0, 2) if row[k] else 0 for k in (0, 1, 3, 2)]
                   + [int(row[4])] for row in last]
        results.append({"variant": name, "phases": phases, "tickets": tickets})
        print(f"{name}:")
        for ph, d in phases.items():
            print(f"  {ph:>8}: " + "  ".join(f"{k} {u:7.2f}" if isinstance(u, float)
                                                 else f"{k} {u}" for k, u in d.items()))
    return results


class _StampedKernel:
    """Calls the timeline kernel with one more output (the stamps) and keeps it
    (``last``; and in ``calls``, when that is a list, every launch's in order)."""

    last = None
    calls = None

    def __init__(self, kernel, items: int):
        self.kernel, self.items = kernel, items

    def __call__(self, **kw):
        import mlx.core as mx

        outs = self.kernel(**{**kw, "output_shapes": kw["output_shapes"] + [(self.items * STAMP_WIDTH,)],
                              "output_dtypes": kw["output_dtypes"] + [mx.uint64]},
                           init_value=0)
        _StampedKernel.last = outs[-1]
        if _StampedKernel.calls is not None:
            _StampedKernel.calls.append(outs[-1])
        return outs[:-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma list of block variants (default {DEFAULT_VARIANTS})")
    p.add_argument("--reps", type=int, default=5, help="profiled launches per candidate")
    p.add_argument("--timeline", action="store_true",
                   help="record each ticket's phase times instead of running for ncu")
    p.add_argument("--spin", type=int, default=0,
                   help="--timeline: 4096^2 bf16 matmuls before each launch (GPU clocks up)")
    p.add_argument("--next", action="store_true",
                   help="profile each variant followed by the next layer's input projection, "
                        "without and with the block prefetching it into L2 (run ncu with "
                        "--cache-control none)")
    p.add_argument("--summarize", type=Path, default=None, metavar="CSV",
                   help="summarize an ncu --csv log of an earlier run instead of running")
    args = p.parse_args(argv)
    check_out(p, args.out)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.spin < 0:
        p.error("--spin must be >= 0")
    if args.next and args.timeline:
        p.error("--next profiles under ncu; it does not go with --timeline")
    try:
        variants = [(v, parse_variant(v)) for v in args.variants.split(",") if v]
    except ValueError as exc:
        p.error(str(exc))
    names = [v for v, _ in variants]
    if not names or len(set(names)) != len(names):
        p.error(f"--variants: give one or more distinct variants, got {args.variants!r}")
    if args.summarize is None:
        import mlx.core as mx

        if not mx.cuda.is_available():
            p.error("profiling needs MLX's CUDA backend and a CUDA GPU (--summarize runs anywhere)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = out / "profile-moe-block-gpu-run.json"
    if args.summarize is not None:
        run = read_run_record(record)
        result = {**run, "rows": summarize(args.summarize, run)}
        dest = write_result(out, "profile-moe-block-gpu", result,
                            device=str(run.get("device", "unknown")))
        for row in result["rows"]:
            parts = ", ".join(f"{g} {u:.2f}" for g, u in row["kernels_us"].items())
            print(f"{row['candidate']:>40}: {row['launches']} launch(es) {row['us']:8.2f} us "
                  f"({parts})")
        print(f"wrote {dest}")
        return 0

    import mlx.core as mx

    layer = build_layer(mx.bfloat16)
    cands = _candidates(layer, variants)
    check_variants(cands)
    print(f"{len(cands) - 1} variant(s) equal the three launches bit for bit")
    if args.next:
        cands = _next_candidates(layer, variants)
        a, b = cands[0][1](), cands[1][1]()
        mx.eval(a, b)
        if not mx.array_equal(a, b).item():
            raise SystemExit("--next: the prefetching block changed the output")
    typed = list(argv if argv is not None else sys.argv[1:])
    command = "python benchmarks/profile_moe_block_gpu.py " + " ".join(
        "OUT" if a == args.out else a for a in typed)
    if args.timeline:
        rows = timeline(layer, variants, args.reps, args.spin)
        dest = write_result(out, "profile-moe-block-gpu-timeline",
                            {"reps": args.reps, "shape": SHAPE, "spin": args.spin,
                             "command": command, "rows": rows})
        print(f"wrote {dest}")
        return 0
    for _, fn in cands:  # warm every kernel outside the profiled range
        mx.eval(fn())
    mx.synchronize()
    marker = mx.array([3.0, 1.0, 2.0, 5.0, 4.0])
    mx.eval(mx.sort(marker))
    mx.synchronize()
    on = _profiler("cuProfilerStart")
    mx.eval(mx.sort(marker))
    for _, fn in cands:
        for _ in range(args.reps):
            mx.eval(fn())
        mx.eval(mx.sort(marker))
    mx.synchronize()
    _profiler("cuProfilerStop")
    run = {"device": device_name(), "reps": args.reps, "shape": SHAPE, "profiler": on,
           "order": [name for name, _ in cands], "command": command}
    record.write_text(json.dumps(run, indent=1) + "\n")
    print(f"profiled {len(cands)} candidates x {args.reps} reps (profiler "
          f"{'on' if on else 'unavailable'}); wrote {record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
