#!/usr/bin/env python3
"""Host time of the compiled decode step's call, and how much of it the model as a compile input takes.

The compiled one-token step (``decode.py``) captures the model as a compile
input, which MLX flattens and binds on every call, or, with
``QAB_ENABLE=decode-compile,decode-const`` (opt-in), holds the model's
parameters as trace constants checked by identity. On a fused preset model (real layer
count and widths; ``--experts`` fewer routed experts changes the experts'
sizes, not the number of arrays) this times, per call, median of
``--repeats``:

* ``step_build``: the whole step call (graph built, not evaluated): checks,
  cache bookkeeping, (without ``decode-const``) the model's flattening, and
  MLX's replay;
* ``model_as_input``: a compiled identity function with the model as its
  captured input tree (``mx.compile(f, inputs=model)``): the flattening and
  input handling alone;
* ``checks``: the step's validity checks (all passing): the parameter
  record's identities with ``decode-const``, else the concatenated
  projections';

and then ``--tokens`` tokens of mlx-lm's pipelined decode loop (token t+1
built and enqueued before token t is read), per token (medians):

* ``pipelined_build``: the step call, split into ``compiled_fn`` (MLX's
  compiled function: flattening the inputs and replaying the trace),
  ``bookkeeping`` (the step's own Python around it: cache layout, trace key,
  validity checks, cache updates) and ``outside`` (the model wrappers, the
  token's slicing and argmax);
* ``pipelined_encode``: ``mx.async_eval`` (MLX turning the graph into GPU work);
* ``pipelined_tok_s``: tokens per second of the loop.

The first decode token self-checks every kernel (JIT-compiling them on a
GPU the first time): allow a few minutes on a fresh machine.

Writes ``profile-decode-host-<device>.json`` into OUT.

Usage:
    python benchmarks/profile_decode_host.py OUT [--preset full] [--experts N]
        [--repeats 200] [--tokens 200] [--disable NAMES] [--const-ab ROUNDS]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import _common  # noqa: E402,F401  (puts src/ on the path)


def _median_ms(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main(argv=None) -> int:
    from qwen_apple_backend.argtypes import positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--preset", choices=["tiny", "small", "full"], default="full")
    p.add_argument("--experts", type=positive_int, default=None,
                   help="routed experts per layer instead of the preset's (at least its experts "
                        "per token; fewer build faster on a CPU)")
    p.add_argument("--repeats", type=positive_int, default=200, help="timed calls per form")
    p.add_argument("--tokens", type=positive_int, default=200,
                   help="tokens of the pipelined decode loop")
    p.add_argument("--const-ab", type=positive_int, default=None, metavar="ROUNDS",
                   help="instead: the step call with decode-const on and off, alternating in "
                        "one process for ROUNDS rounds of --repeats calls (the same model; "
                        "the step rebuilt before each round)")
    p.add_argument("--disable", default="",
                   help="comma-separated optimizations to switch off in the fused model "
                        "(QAB_DISABLE's names, e.g. moe-block-pack)")
    p.add_argument("--as-gpu", choices=["cuda", "metal"], default=None,
                   help="build that GPU's decode step on any machine (count_decode_ops.py's "
                        "stand-ins: the launches are markers) and time only its calls, not "
                        "the pipelined loop")
    args = p.parse_args(argv)
    from _common import check_out, variant_model, write_result

    check_out(p, args.out)
    os.environ.setdefault("QAB_ENABLE", "decode-compile")  # the CPU too
    from qwen_apple_backend import checkpoint
    from qwen_apple_backend.bench.target import build_preset

    shape = dict(checkpoint.PRESETS[args.preset])
    args.experts = args.experts or shape["num_experts"]
    if args.experts < shape["num_experts_per_tok"]:
        p.error(f"--experts {args.experts}: at least num_experts_per_tok "
                f"({shape['num_experts_per_tok']}) of preset {args.preset}")
    shape["num_experts"] = args.experts
    name = f"{args.preset}-x{args.experts}"
    checkpoint.PRESETS[name] = shape
    b = build_preset(name, seed=0, vocab_size=1024)
    stand_in = contextlib.ExitStack()
    if args.as_gpu:
        from count_decode_ops import GpuStandIn

        stand_in.enter_context(GpuStandIn(args.as_gpu))
    with stand_in:
        return _profile(args, b, variant_model, write_result)


def _profile(args, b, variant_model, write_result) -> int:
    """Time the step call (and, on a real device, the pipelined loop); write the result."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model = variant_model(b, "fused", disable=[d for d in args.disable.split(",") if d])
    text = model.language_model
    step = text.__dict__.get("_qab_decode")
    if step is None:
        raise SystemExit("profile_decode_host.py: the compiled decode step is not installed "
                         "(QAB_DISABLE=decode-compile?)")
    n_arrays = len(tree_flatten(text.parameters()))
    if args.const_ab:
        return _const_ab(args, model, step, n_arrays, write_result)
    const = bool(getattr(step, "const", False))
    # Traced first: tracing with the model as input re-wraps its arrays, which
    # makes the step rebuild once on its next call (in _primed, not timed).
    as_input = mx.compile(lambda x: x + 1, inputs=text)
    x = mx.array(1)
    mx.eval(as_input(x))
    cache, y = _primed(model)
    # Timed while every check passes (a stale one returns at its first mismatch).
    if not step._still_valid():
        raise RuntimeError("the step's checks do not pass after priming")
    checks_ms = _median_ms(step._still_valid, args.repeats)
    rows = dict(
        arrays=n_arrays,
        decode_const=const,
        # Built, never evaluated: each call appends one token's graph.
        step_build_ms=_median_ms(lambda: model(y, cache=cache), args.repeats),
        model_as_input_ms=_median_ms(lambda: as_input(x), args.repeats),
        checks_ms=checks_ms,
    )
    print(f"{n_arrays} arrays, decode-const {'on' if const else 'off'}: step call "
          f"{rows['step_build_ms']:.3f} ms; the model as a compile input alone "
          f"{rows['model_as_input_ms']:.3f} ms; the step's checks {rows['checks_ms']:.3f} ms",
          flush=True)
    if args.as_gpu:
        from _common import device_name

        path = write_result(args.out, "profile-decode-host",
                            dict(preset=args.preset, experts=args.experts, repeats=args.repeats,
                                 layers=len(text.model.layers), as_gpu=args.as_gpu, **rows),
                            device=f"{device_name()} as {args.as_gpu}")
        print(f"wrote {path}")
        os._exit(0)  # the built, unevaluated graphs are dropped, not evaluated
    mx.eval(y)
    cache, y = _primed(model)  # a fresh context: the timed calls above never ran
    rows.update(_pipelined(model, text, step, cache, y, args.tokens))
    print(f"pipelined decode: {rows['pipelined_tok_s']:.1f} tok/s; per token build "
          f"{rows['pipelined_build_ms']:.3f} ms (MLX's compiled function "
          f"{rows['compiled_fn_ms']:.3f}, the step's bookkeeping {rows['bookkeeping_ms']:.3f}, "
          f"outside the step {rows['outside_ms']:.3f}), encode {rows['pipelined_encode_ms']:.3f} "
          f"ms", flush=True)
    path = write_result(args.out, "profile-decode-host",
                        dict(preset=args.preset, experts=args.experts, repeats=args.repeats,
                             layers=len(text.model.layers), **rows))
    print(f"wrote {path}")
    os._exit(0)  # the built, unevaluated graphs are dropped, not evaluated


def _const_ab(args, model, step, n_arrays, write_result) -> int:
    """The step call with ``decode-const`` on and off, alternating (``--const-ab``)."""
    from _common import device_name

    per = {True: [], False: []}
    for rnd in range(args.const_ab):
        for const in (True, False):
            step.const, step._fn = const, None  # rebuilt by the next call
            cache, y = _primed(model)
            if not step._still_valid():
                raise RuntimeError("the step's checks do not pass after priming")
            per[const].append(_median_ms(lambda: model(y, cache=cache), args.repeats))
            print(f"round {rnd}: decode-const {'on ' if const else 'off'} step call "
                  f"{per[const][-1]:.3f} ms", flush=True)
    on, off = (statistics.median(per[c]) for c in (True, False))
    print(f"median of {args.const_ab} rounds: {on:.3f} ms with decode-const, {off:.3f} without "
          f"({off - on:+.3f} ms per call)", flush=True)
    device = device_name() + (f" as {args.as_gpu}" if args.as_gpu else "")
    path = write_result(args.out, "profile-decode-host-const",
                        dict(preset=args.preset, experts=args.experts, repeats=args.repeats,
                             rounds=args.const_ab, layers=len(model.language_model.model.layers),
                             arrays=n_arrays, step_build_ms_const=on, step_build_ms_inputs=off,
                             rounds_const=per[True], rounds_inputs=per[False]),
                        device=device)
    print(f"wrote {path}")
    os._exit(0)  # the built, unevaluated graphs are dropped, not evaluated


def _primed(model):
    """A fresh 8-token context past the eager first token, a trace (after the
    packs' check pass where the step builds packs) and a replay:
    ``(cache, next token [1, 1])``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    step = model.language_model.__dict__.get("_qab_decode")
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]), cache=cache)
    y = mx.array([[9]])
    for _ in range(8):
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
        if step is None or step.compiled_calls >= 2:
            break
    return cache, y


class _TimedStep:
    """Stands in for the model's compiled step, timing its calls and its compiled function."""

    def __init__(self, step):
        self.step, self.calls, self.fn = step, [], []
        fn = step._fn

        def timed_fn(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            self.fn.append(time.perf_counter() - t0)
            return out

        step._fn = timed_fn
        self._restore = lambda: setattr(step, "_fn", fn)

    def __getattr__(self, name):
        return getattr(self.step, name)

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self.step(*args)
        self.calls.append(time.perf_counter() - t0)
        return out


def _pipelined(model, text, step, cache, y, tokens: int) -> dict:
    """Per-token host phases of mlx-lm's pipelined decode loop (see the module doc)."""
    import mlx.core as mx

    timed = _TimedStep(step)
    text.__dict__["_qab_decode"] = timed
    builds = step.builds
    # Per token after the first: (build, encode, step call, compiled function);
    # a token the step did not take (the eager one after the KV buffer grows,
    # every 256 positions) is left out of the split.
    rows = []
    try:
        mx.synchronize()
        t0 = time.perf_counter()
        nxt = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.async_eval(nxt)
        for _ in range(tokens - 1):
            cur = nxt
            calls = len(timed.calls)
            a = time.perf_counter()
            nxt = mx.argmax(model(cur, cache=cache)[:, -1:], axis=-1)
            b = time.perf_counter()
            mx.async_eval(nxt)
            c = time.perf_counter()
            if len(timed.calls) == calls + 1 == len(timed.fn):
                rows.append((b - a, c - b, timed.calls[-1], timed.fn[-1]))
            cur.item()
        nxt.item()
        seconds = time.perf_counter() - t0
    finally:
        text.__dict__["_qab_decode"] = step
        timed._restore()
    if step.builds != builds or not rows:
        raise RuntimeError("the step was rebuilt or never taken while timing the loop")
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return dict(tokens=tokens, split_tokens=len(rows), pipelined_tok_s=tokens / seconds,
                pipelined_build_ms=med([r[0] for r in rows]),
                pipelined_encode_ms=med([r[1] for r in rows]),
                compiled_fn_ms=med([r[3] for r in rows]),
                bookkeeping_ms=med([r[2] - r[3] for r in rows]),
                outside_ms=med([r[0] - r[2] for r in rows]))


if __name__ == "__main__":
    sys.exit(main())
