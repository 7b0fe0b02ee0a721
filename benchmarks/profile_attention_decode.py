#!/usr/bin/env python3
"""Decode attention at long context: where one full-attention layer's time goes.

One query token against S cached keys at the Qwen3.6-35B-A3B full-attention
shape (B = 1, Hq = 16, Hk = 2, D = 256, bf16 KV), by form:

* ``sdpa``: ``mx.fast.scaled_dot_product_attention`` as the fused layer calls
  it in eager decode (no mask, S exact);
* ``sdpa-mask``: the same with the boolean mask over a KV buffer 256
  positions longer, as the compiled decode step calls it;
* ``qk``, ``softmax``, ``pv``: the three MLX ops of the portable form alone
  (``q k^T`` with the 8 query heads of a KV head as rows, the float32 softmax,
  ``p v``);
* ``pv-split``: ``p v`` as a batched matmul over fixed blocks of 1,024 keys
  plus a sum over blocks (split-K in MLX ops);
* ``split-ops``: the whole split-K attention in MLX ops
  (``gqa_attention_split(..., use_kernel=False)``) over the masked buffer;
* ``split-kernel``: the same through the split-K kernel pair where this
  device has it (``split_kernel_ready``), else absent;
* ``split-kernel-lanes``: the same pair with the lane-group first pass
  (the opt-in ``attn-lanes``: ``gqa_decode_partial_lanes``) where it builds,
  else absent;
* ``step``: the whole attention core of the compiled decode step in one
  launch (``attn-step``: ``gqa_decode_step``: q/k norm and RoPE, the KV row
  written in place, the key pass (on tensor cores: ``attn-mma``), the merge
  and the gate) where this device has it, ``step-lanes`` the same with the
  lane-group key pass (``mma=False``), ``step-merge-split`` the same with its
  key blocks merged in two levels (``merge_split=True``: the opt-in
  ``attn-merge-split``), ``step-merge-spread`` the same with the merge in G
  more thread blocks per KV head (``merge_spread=True``: one query head
  each; the same bits), ``step-kv-prefetch`` and
  ``step-merge-split-kv-prefetch`` those two with each thread block's K and
  V rows asked of the L2 at its start (the profiling key
  ``QAB_STEP_KV_PREFETCH``), ``step-merge-spread-sleep1000`` and
  ``step-merge-spread-relaxed`` the spread merge with its merging blocks
  polling every ~1 us instead of ~32 ns (``QAB_WAIT_SLEEP_NS=1000``) or
  with relaxed loads and one acquire fence after (``QAB_WAIT_RELAXED``) (the
  forms of a profiling key are timed as the ``--timeline`` build, with its
  phase marks), and ``step-ctasN`` the step with the pass sized for about N
  thread blocks (``--step-ctas``, at most ``_LANES_CTAS``) instead of
  ``_LANES_CTAS`` (with ``--step-ctas``, ``step-merge-spread-ctasN`` and each
  profiling key's form too: ``step-kv-prefetch-ctasN``, ...);
* ``four-launches``: the launches ``step`` replaces (``qk_norm_rope``,
  ``kv_cache_write``, the lane-per-key pass and ``gqa_decode_combine`` with
  the gate), where this device has them;
* ``kv-update``: the compiled decode step's cache write alone: one
  ``mx.slice_update`` of a new key and value row into the K and V buffers
  at an array offset, compiled, each call's outputs replacing the buffers
  (as ``decode.py`` does): near zero when MLX updates the buffers in place,
  a copy of both buffers when it cannot;
* ``kv-update-kept``: the same with the previous buffers still referenced,
  which forces the copy (the reference point for ``kv-update``).

Median of ``--repeats`` synchronised runs after two warm-ups, in ms, and the
KV bytes read per ms (GB/s). Writes ``profile-attention-decode-<device>.json``
into OUT. Every form reads its offset as the compiled decode step hands it: a
0-d view of a ``[4]`` int32 array filled on the device (not MLX's small host
pool, where a 4-byte array would sit: ``ops.device.unpooled_length``).

``--timeline``: the ``step`` (and ``step-lanes``, ``step-merge-split``, the
profiling keys' forms) form again, built with phase marks (``QAB_MARK``,
empty in the shipped kernel: thread 0 stores the GPU's global timer, in ns)
and an L2 flush before each of ``--repeats`` launches: per launch, from its
first thread block's start, when the blocks had staged their query rows
(median, last), finished their pass and partial (median, last), counted
themselves done, and when the last block per KV head finished the merge,
with the merge's own steps (its warp 0: the fence passed, the max of the key
blocks' m known, the weights and denominator, the o rows summed; the gate and
the output are the rest); medians over the launches, in us. Writes
``profile-attention-decode-timeline-<device>.json``. ``--timeline-warm``: the
same without the flushes, so that each launch finds the kernel's code, the
KV rows and its inputs in the L2 where the launch before left them.

Usage:
    python benchmarks/profile_attention_decode.py OUT [--lengths 4096,32768,131072]
        [--repeats 20] [--forms step,four-launches] [--step-ctas 32,64]
        [--timeline [--timeline-warm]]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
HERE = Path(__file__).resolve().parent
for p in (SRC, HERE):
    if p.is_dir() and str(p) not in sys.path:
        sys.path.insert(0, str(p))

B, HQ, HK, D = 1, 16, 2, 256
SPLIT = 1024
#: Marks per thread block in the --timeline build (0 start, 1 query rows staged,
#: 2 pass and partial done, 3 counted, 4 merge done; in the merging block, warp 0
#: of its first query head: 8 its fence passed, 5 the max M known, 6 the weights
#: and the denominator, 7 the o rows summed) and the SM id.
MARKS = 9
#: QAB_MARK as the --timeline build defines it: thread 0 of each thread block
#: stores the global timer (ns) as mark k of its block, and the SM at mark 0.
MARK_DEFINE = ("#define QAB_MARK(k) do { if (threadIdx.x == 0) { unsigned long long qab_t_; "
               "const size_t qab_b_ = ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x"
               " + blockIdx.x; "
               "asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(qab_t_)); "
               f"stamps[qab_b_ * {MARKS + 1} + (k)] = qab_t_; if ((k) == 0) {{ unsigned s_; "
               "asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(s_)); "
               f"stamps[qab_b_ * {MARKS + 1} + {MARKS}] = s_; }} }} }} while (0)\n")


#: The timeline forms: name -> (mma, merge_split, profiling key, merge_spread) of
#: stamped_step.
TIMELINE_FORMS = {"step": (True, False, None, False), "step-lanes": (False, False, None, False),
                  "step-merge-split": (True, True, None, False),
                  "step-merge-spread": (True, False, None, True),
                  "step-merge-spread-sleep1000": (True, False, "QAB_WAIT_SLEEP_NS=1000", True),
                  "step-merge-spread-relaxed": (True, False, "QAB_WAIT_RELAXED", True),
                  "step-kv-prefetch": (True, False, "QAB_STEP_KV_PREFETCH", False),
                  "step-merge-split-kv-prefetch": (True, True, "QAB_STEP_KV_PREFETCH", False)}


def stamped_step(qkv, nw, k_buf, v_buf, offset, counter, rope, scale, mma=True,
                 merge_split=False, key=None, merge_spread=False, ctas=None):
    """One launch of the step's kernel built with the phase marks: ``(out, stamps)``,
    stamps ``[blocks, MARKS + 1]`` uint64 (0 where a mark does not apply); ``mma``
    and ``merge_split`` as ``gqa_decode_step``'s; ``key``: a profiling key of the
    kernel to define (``QAB_STEP_KV_PREFETCH``: each block's K and V rows asked
    of the L2 at its start; ``QAB_WAIT_RELAXED``: relaxed polls;
    ``NAME=VALUE``: a macro with a value, e.g. ``QAB_WAIT_SLEEP_NS=1000``), or
    None; ``merge_spread`` as ``gqa_decode_step``'s; ``ctas``: the pass sized
    for about that many thread blocks instead of ``_LANES_CTAS`` (at most it:
    ``counter`` is sized for it). The launch is ``gqa_decode_step``'s
    (``ops.attention._step_launch``) with the marks as a third output."""
    import mlx.core as mx

    from qwen_apple_backend.ops import attention as attn_ops
    from qwen_apple_backend.ops._sources import compact, kernel_source

    if key not in _STAMPED:
        src = kernel_source("gqa_decode_step", "cuda")
        name, _, value = (key or "").partition("=")
        prefix = f"#define {name} {value or 1}\n" if key else ""
        _STAMPED[key] = mx.fast.cuda_kernel(
            name=src.name + "_timeline" + (f"_{key.lower().replace('=', '_')}" if key else ""),
            input_names=list(src.inputs),
            output_names=list(src.outputs) + ["stamps"], source=compact(src.body),
            header=prefix + MARK_DEFINE + compact(src.header), ensure_row_contiguous=False)
    old = attn_ops._LANES_CTAS
    attn_ops._LANES_CTAS = ctas or old
    try:
        launch, blocks = attn_ops._step_launch(qkv, k_buf, HQ, rope, counter, mma,
                                               merge_split, merge_spread)
    finally:
        attn_ops._LANES_CTAS = old
    launch["output_shapes"].append((blocks * (MARKS + 1),))
    launch["output_dtypes"].append(mx.uint64)
    params = attn_ops._step_params(1e-6, 1e-6, float(rope.scale), float(rope.base), scale)
    out, _, stamps = _STAMPED[key](
        inputs=[qkv, nw, nw, params, offset, k_buf, v_buf, counter], init_value=0, **launch)
    return out, stamps.reshape(-1, MARKS + 1)


_STAMPED: dict = {}


def timeline_form(name: str):
    """``(mma, merge_split, key, merge_spread, ctas)`` of a form with a --timeline build: a
    :data:`TIMELINE_FORMS` name, optionally with ``-ctasN`` (the pass sized for
    about N thread blocks); None for other forms."""
    base, sep, c = name.rpartition("-ctas")
    if sep and c.isdigit() and base in TIMELINE_FORMS:
        return (*TIMELINE_FORMS[base], int(c))
    return (*TIMELINE_FORMS[name], None) if name in TIMELINE_FORMS else None


#: step_timeline's keys, and the mark each is the last block's of (``live``: of
#: the blocks that staged a query row; ``merging``: of the blocks that merged,
#: one per KV head, or G with the spread merge; in a two-level merge their marks
#: 5-7 are the final merge's).
TIMELINE_KEYS = (("start_last", "all", 0), ("staged_median", "live", 1),
                 ("staged_last", "live", 1), ("pass_median", "live", 2),
                 ("pass_last", "live", 2), ("counted_last", "live", 3),
                 ("fenced_last", "merging", 8), ("max_last", "merging", 5),
                 ("weights_last", "merging", 6), ("rows_last", "merging", 7),
                 ("merged_last", "merging", 4))


def launch_marks(rows: list) -> dict:
    """One launch's phase marks, us from its first thread block's start: each key
    of :data:`TIMELINE_KEYS` (``_median``: the median block's, ``_last``: the last
    block's), from ``rows``, a ``[MARKS + 1]`` row of global-timer ns per thread
    block (0 where a mark does not apply; the SM id last). Every block marks 1-3
    (the few past the token's key too: they stage nothing and pass no keys, so
    they pull the medians slightly early)."""
    import statistics

    t0 = min(r[0] for r in rows)
    sets = {"all": rows, "live": [r for r in rows if r[1]],
            "merging": [r for r in rows if r[4]]}
    res = {}
    for key, which, m in TIMELINE_KEYS:
        xs = [(r[m] - t0) / 1000.0 for r in sets[which]]
        res[key] = statistics.median(xs) if key.endswith("_median") else max(xs)
    return res


def step_timeline(launch, repeats: int, flush: bool = True) -> dict:
    """Medians over ``repeats`` launches (each after an L2 flush; ``flush`` False: none,
    so the launch before leaves its code and data in the L2) of :func:`launch_marks`,
    us; ``launch()`` returns ``(out, stamps)``."""
    import statistics

    import mlx.core as mx

    big = mx.zeros((64 * 1024 * 1024,), dtype=mx.float32)  # 256 MB: past the L2
    mx.eval(big)
    vals = {k: [] for k, _, _ in TIMELINE_KEYS}
    blocks = sms = 0
    for i in range(repeats + 2):
        if flush:
            mx.eval(big + 1.0)
        mx.synchronize()
        out, stamps = launch()
        mx.eval(out, stamps)
        if i < 2:
            continue  # the first launches build and warm
        rows = stamps.tolist()
        for k, v in launch_marks(rows).items():
            vals[k].append(v)
        blocks = len(rows)
        sms = len({r[MARKS] for r in rows})
    res = {k: round(statistics.median(v), 2) for k, v in vals.items()}
    # The last launch's marks per thread block, us from its first start (None:
    # not set), then the SM: where a median hides one late block.
    t0 = min(r[0] for r in rows)
    last = [[round((x - t0) / 1000.0, 2) if x else None for x in r[:MARKS]] + [r[MARKS]]
            for r in rows]
    res.update(blocks=blocks, sms=sms, last_launch=last)
    return res


def main(argv=None) -> int:
    from qwen_apple_backend.argtypes import positive_int, token_lengths

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--lengths", type=token_lengths, default="4096,32768,131072",
                   help="comma-separated cached keys S (K = 1024)")
    p.add_argument("--repeats", type=positive_int, default=20, help="timed runs per form")
    p.add_argument("--forms", default="",
                   help="comma-separated forms to time, of sdpa, sdpa-mask, qk, softmax, pv, "
                        "pv-split, split-ops, kv-update, kv-update-kept, split-kernel, "
                        "split-kernel-lanes, step, step-lanes, step-merge-split, step-merge-spread, "
                        "step-kv-prefetch, "
                        "step-merge-split-kv-prefetch, step-merge-spread-sleep1000, "
                        "step-merge-spread-relaxed, step-ctasN, "
                        "step-merge-spread-ctasN, "
                        "four-launches (the module docstring says what each times; default: "
                        "every form this device has)")
    def ctas_list(text: str) -> list:
        out = []
        for c in (c.strip() for c in text.split(",")):
            if not c:
                continue
            if not c.isdigit() or int(c) < 1:
                raise argparse.ArgumentTypeError(f"{c!r} is not a positive thread-block count")
            out.append(int(c))
        return out

    p.add_argument("--step-ctas", type=ctas_list, default=[],
                   help="comma-separated thread-block targets for extra step-ctasN forms")
    p.add_argument("--timeline", action="store_true",
                   help="also time the step's phases inside its launch (a marked build)")
    p.add_argument("--timeline-warm", action="store_true",
                   help="the --timeline launches without an L2 flush before each")
    args = p.parse_args(argv)
    if args.timeline_warm and not args.timeline:
        p.error("--timeline-warm goes with --timeline")
    wanted = {f for f in args.forms.split(",") if f}
    step_ctas = args.step_ctas
    from _common import check_out, write_result

    check_out(p, args.out)
    import mlx.core as mx
    from profile_modules import timeit

    scale = D ** -0.5
    G = HQ // HK
    rows, timelines = [], []
    for S in args.lengths:
        kq, kk, kv = mx.random.split(mx.random.key(S), 3)
        q = mx.random.normal((B, HQ, 1, D), key=kq).astype(mx.bfloat16)
        kbuf = mx.random.normal((B, HK, S + 256, D), key=kk).astype(mx.bfloat16)
        vbuf = mx.random.normal((B, HK, S + 256, D), key=kv).astype(mx.bfloat16)
        k, v = kbuf[:, :, :S], vbuf[:, :, :S]
        mask = (mx.arange(S + 256) < S).reshape(1, 1, 1, -1)
        qg = q.reshape(B, HK, G, D)
        scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32) * scale
        probs = mx.softmax(scores, axis=-1).astype(mx.bfloat16)
        mx.eval(q, kbuf, vbuf, k, v, mask, scores, probs)
        n = S // SPLIT * SPLIT

        def pv_split():
            pb = probs[..., :n].reshape(B, HK, G, n // SPLIT, SPLIT).swapaxes(2, 3)
            vb = v[:, :, :n].reshape(B, HK, n // SPLIT, SPLIT, D)
            out = (pb @ vb).astype(mx.float32).sum(axis=2)
            if n < S:
                out = out + (probs[..., n:] @ v[:, :, n:]).astype(mx.float32)
            return out

        from qwen_apple_backend.ops import attention as attn_ops

        upd_k = mx.random.normal((B, HK, 1, D), key=kq).astype(mx.bfloat16)
        write = mx.compile(lambda kb, vb, off: (
            mx.slice_update(kb, upd_k, off, axes=(2,)), mx.slice_update(vb, upd_k, off, axes=(2,))))
        live = {"k": mx.array(kbuf), "v": mx.array(vbuf)}
        kept = []
        # As the compiled decode step hands it: a [4] int32 filled on the device
        # (a [1] array would sit in MLX's small host pool), read as a 0-d view.
        offset = mx.full((4,), S - 1, dtype=mx.int32)[:1]
        mx.eval(live, offset)

        def kv_update(keep: bool):
            old = (live["k"], live["v"])
            live["k"], live["v"] = write(live["k"], live["v"], offset)
            if keep:
                kept[:] = [old]
            del old
            return live["k"], live["v"]

        forms = {
            "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
            "sdpa-mask": lambda: mx.fast.scaled_dot_product_attention(q, kbuf, vbuf, scale=scale,
                                                                      mask=mask),
            "qk": lambda: qg @ k.swapaxes(-1, -2),
            "softmax": lambda: mx.softmax(scores, axis=-1),
            "pv": lambda: probs @ v,
            "pv-split": pv_split,
            "split-ops": lambda: attn_ops.gqa_attention_split(q, kbuf, vbuf, scale, mask,
                                                              use_kernel=False),
            "kv-update": lambda: kv_update(False),
            "kv-update-kept": lambda: kv_update(True),
        }
        if attn_ops.split_kernel_ready(q, kbuf, vbuf, mask) is not None:
            forms["split-kernel"] = lambda: attn_ops.gqa_attention_split(q, kbuf, vbuf, scale,
                                                                         mask)
        if (attn_ops.split_kernel_ready(q, kbuf, vbuf, mask, lanes=True) is not None
                and attn_ops._lanes_usable("cuda", q, kbuf)):
            forms["split-kernel-lanes"] = lambda: attn_ops._split_kernel_call(
                "cuda", q, kbuf, vbuf, scale, mask, lanes=True)
        rope = attn_ops.RopeSpec(64, False, 1e7, 1.0)
        if attn_ops.step_kernel_ready(B, HQ, HK, D, mx.bfloat16, rope) is not None:
            qkv = mx.random.normal((B, 1, HQ * 2 * D + 2 * HK * D), key=kq).astype(mx.bfloat16)
            nw = mx.ones((D,), dtype=mx.bfloat16)
            sk, sv = kbuf * 1, vbuf * 1  # the step's own buffers (written in place)
            counter = attn_ops.step_counter(B, HK)
            mx.eval(qkv, nw, sk, sv)

            def step(ctas=None, mma=True, merge_split=False, merge_spread=False):
                old = attn_ops._LANES_CTAS
                attn_ops._LANES_CTAS = ctas or old
                try:
                    return attn_ops.gqa_decode_step(qkv, nw, nw, sk, sv, offset.reshape(()), counter,
                                                    heads=HQ, q_eps=1e-6, k_eps=1e-6, rope=rope,
                                                    scale=scale, mma=mma,
                                                    merge_split=merge_split,
                                                    merge_spread=merge_spread)
                finally:
                    attn_ops._LANES_CTAS = old

            forms["step"] = step
            forms["step-merge-split"] = lambda: step(merge_split=True)
            forms["step-merge-spread"] = lambda: step(merge_spread=True)
            for name in [f for f, v in TIMELINE_FORMS.items() if v[2]]:
                forms[name] = (lambda f: lambda: stamped_step(
                    qkv, nw, sk, sv, offset.reshape(()), counter, rope, scale, *f)[0])(
                        TIMELINE_FORMS[name])
            if attn_ops._step_mma(HQ // HK, D, mx.bfloat16):
                forms["step-lanes"] = lambda: step(mma=False)
            for c in step_ctas:
                forms[f"step-ctas{c}"] = lambda c=c: step(c)
                forms[f"step-merge-spread-ctas{c}"] = lambda c=c: step(c, merge_spread=True)
                for name in [f for f, v in TIMELINE_FORMS.items() if v[2]]:
                    forms[f"{name}-ctas{c}"] = (lambda f: lambda: stamped_step(
                        qkv, nw, sk, sv, offset.reshape(()), counter, rope, scale, *f)[0])(
                            timeline_form(f"{name}-ctas{c}"))
            fk, fv = kbuf * 1, vbuf * 1
            mx.eval(fk, fv)

            def four():
                qg, k_, v_ = mx.split(qkv, [HQ * 2 * D, HQ * 2 * D + HK * D], axis=-1)
                q_, gate = mx.split(qg.reshape(B, 1, HQ, 2 * D), 2, axis=-1)
                q4, k4 = attn_ops.prep_qk_decode(q_, k_.reshape(B, 1, HK, D), nw, nw,
                                                 q_eps=1e-6, k_eps=1e-6, rope=rope,
                                                 offset=offset.reshape(()))
                m_ = attn_ops.kv_cache_write("cuda", k4, v_.reshape(B, 1, HK, D).transpose(
                    0, 2, 1, 3), fk, fv, offset.reshape(()))
                return attn_ops.gqa_decode_attention_gated(q4, fk, fv, scale, m_, gate)

            forms["four-launches"] = four
        if wanted:
            unknown = sorted(wanted - set(forms))
            if unknown:
                p.error(f"--forms: {', '.join(unknown)} not available here (forms: "
                        f"{', '.join(forms)})")
            forms = {k: f for k, f in forms.items() if k in wanted}
        if args.timeline and "step" not in forms:
            p.error("--timeline times the step form, which this device does not have"
                    if not wanted else "--timeline needs the step form in --forms")
        kv_bytes = 2 * B * HK * S * D * 2
        row = dict(S=S, kv_bytes=kv_bytes)
        for name, fn in forms.items():
            row[name + "_ms"] = 1e3 * timeit(fn, args.repeats)
        if args.timeline:
            for name in [f for f in forms if timeline_form(f)]:
                tl = step_timeline(lambda: stamped_step(
                    qkv, nw, sk, sv, offset.reshape(()), counter, rope, scale,
                    *timeline_form(name)), args.repeats, flush=not args.timeline_warm)
                row[name.replace("-", "_") + "_timeline_us"] = {
                    k: v for k, v in tl.items() if k != "last_launch"}
                timelines.append(dict(S=S, form=name, l2_flush=not args.timeline_warm, **tl))
                print(f"S {S:7d} {name} timeline (us): "
                      + "  ".join(f"{k} {v}" for k, v in tl.items() if k != "last_launch"),
                      flush=True)
        for name in [f for f in forms if any((timeline_form(f) or (0, 0, None, False))[2:4])]:
            # A profiling key, or the spread merge, changes no value: its output
            # against the shipped build's.
            # (Each evaluated alone: MLX's CUDA graph may run two launches with
            # no data between them at once, and these two share a counter.)
            mma, merge_split, _, _, ctas = timeline_form(name)
            got = forms[name]()
            mx.eval(got)
            shipped = step(ctas, mma=mma, merge_split=merge_split)
            mx.eval(shipped)
            row[name.replace("-", "_") + "_same_as_shipped"] = bool(
                mx.array_equal(got, shipped).item())
            print(f"S {S:7d} {name}: same output as the shipped build: "
                  f"{row[name.replace('-', '_') + '_same_as_shipped']}", flush=True)
        if "pv-split" in forms:
            ref = (probs @ v).astype(mx.float32)
            row["pv_split_max_abs_diff"] = float(mx.abs(pv_split() - ref).max())
        rows.append(row)
        print(f"S {S:7d}: " + "  ".join(f"{k[:-3]} {row[k]:.3f}" for k in row if k.endswith("_ms"))
              + f" ms; KV {kv_bytes / 1e6:.1f} MB"
              + (f" -> sdpa {kv_bytes / row['sdpa_ms'] / 1e6:.1f} GB/s" if "sdpa_ms" in row else ""),
              flush=True)
    path = write_result(args.out, "profile-attention-decode",
                        dict(B=B, Hq=HQ, Hk=HK, D=D, split=SPLIT, repeats=args.repeats, rows=rows))
    print(f"wrote {path}")
    if timelines:
        path = write_result(args.out, "profile-attention-decode-timeline",
                            dict(B=B, Hq=HQ, Hk=HK, D=D, repeats=args.repeats, marks=[
                                "start", "query rows staged", "pass and partial done",
                                "counted", "merge done", "merge: max known",
                                "merge: weights and denominator", "merge: o rows summed",
                                "merge: fence passed"], rows=timelines))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
