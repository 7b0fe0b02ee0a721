"""One GPU machine command's verification and measurements, in one Python process.

A fresh process on MLX's CUDA backend compiles every custom kernel it launches
(NVRTC, at the first launch of each kernel source and template instance; MLX
keeps those modules in the process only) and runs this package's kernel
self-checks once per shape class. On a fresh H100 that took longer than a
4-layer compiled-step test's 300 s, and the 4K bench's shared prefill took
another 190-230 s in a second process. Run in one process, the steps share the
compiled modules and the self-checks' verdicts: the bench's full-shape decode
compiles and checks what the GPU tests at Qwen3.6's widths (256 experts) then
reuse.

Steps (``--plan``, in the order given, each ``NAME:SECONDS``):

- ``bench``: stock vs fused at 4K, full shape, 3 rounds of 64 decode tokens,
  with ablation columns (``--ablate``, default ``moe-block-pack,decode-const``;
  an opt-in optimization named there, e.g. ``decode-const`` or
  ``attn-merge-split``, is switched on by ``QAB_ENABLE`` for this step only,
  so the fused column has it and its ablation column is the default build's);
  results under ``OUT/bench``.
- ``tests``: ``pytest -m gpu tests/test_kernels_gpu.py -k FILTER``
  (``--test-filter``).
- ``long``: stock vs fused at 128K (``--long-lengths``), 2 rounds of 32 decode
  tokens, with ablation columns of its own (``--long-ablate``, default none; an
  opt-in named there is switched on for this step as in ``bench``), e.g.
  ``--long-lengths 64K,128K --long-ablate attn-step-long`` (``OUT/long``).
- ``lengths``: stock vs fused at the ten lengths 256..128K, 3 rounds of 32
  decode tokens (``OUT/lengths``).
- ``layer``: ``benchmarks/profile_layer_gpu.py``: a Gated DeltaNet layer's one
  launch at Qwen3.6's shape, 40 chained launches over 8 distinct layers, us
  per launch and GB/s per variant (``--layer-variants``, default
  ``default,NPL=0,UNROLL=0``; ``OUT/layer``).
- ``timeline``: the same script's ``--timeline``: each phase's start, wait
  and end inside the launch, from the kernel's global-timer marks
  (``OUT/timeline``); with ``--timeline-warm N`` the last of N chained
  launches, and the chain's period, span and gap per launch on the GPU.

Bench steps decode only, from contexts of seeded random cache values shaped
by stock's model (``qab bench --shared-prefill stock --synthetic-context``: a
decode step's work does not depend on those values), or with
``--real-prefill`` from fused's prefilled contexts (the 4K prefill took
190-230 s in a fresh process).

Each step's output (Python's and the C level's) goes to ``OUT/<step>.txt``, a
line per step with its wall time and result to ``OUT/session.log``, and every
kernel self-check's seconds so far (mostly compilation: where a fresh process's
first calls spend their time) to ``OUT/self-checks.json``, slowest first. A step that
outlives its seconds gets its Python stack dumped into its file, and the
process ends there (exit 124): put the step that matters most first.

Usage (repository root, MLX with its CUDA backend importable; the kernels not
yet verified are allowed, ``QAB_UNVERIFIED_KERNELS=1``)::

    python benchmarks/gpu_session.py OUT --plan bench:330,tests:200
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("bench", "tests", "long", "lengths", "layer", "timeline")
TEN_LENGTHS = "256,512,1K,2K,4K,8K,16K,32K,64K,128K"


def parse_plan(text: str) -> list[tuple[str, float]]:
    """``"bench:330,tests:200"`` -> ``[("bench", 330.0), ("tests", 200.0)]``.

    Raises:
        ValueError: an unknown step, a missing or non-positive number of
            seconds, or a step named twice.
    """
    plan: list[tuple[str, float]] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, secs = (p.strip() for p in item.partition(":"))
        if name not in STEPS:
            raise ValueError(f"--plan: unknown step {name!r} (steps: {', '.join(STEPS)})")
        if not sep:
            raise ValueError(f"--plan: step {name!r} needs its seconds, as {name}:300")
        try:
            seconds = float(secs)
        except ValueError:
            raise ValueError(f"--plan: step {name!r}: {secs!r} is not a number of seconds")
        if not 0 < seconds < 1e6:  # also NaN and inf (a timer takes neither)
            raise ValueError(f"--plan: step {name!r}: seconds must be positive and finite, "
                             f"got {secs}")
        if any(n == name for n, _ in plan):
            raise ValueError(f"--plan: step {name!r} named twice")
        plan.append((name, seconds))
    if not plan:
        raise ValueError("--plan: no steps")
    return plan


def bench_argv(step: str, out: Path, ablate: str, real_prefill: bool = False,
               long_lengths: str = "128K") -> list[str]:
    """The ``qab bench`` arguments of a bench step: decode only, from stock's synthetic
    contexts (``--synthetic-context``), or from fused's prefilled ones (``real_prefill``).
    ``ablate``: the ``bench`` or ``long`` step's ablation columns (comma-separated, '' for
    none; the ``lengths`` step has none); ``long_lengths``: the ``long`` step's lengths."""
    context = (["--shared-prefill", "fused"] if real_prefill
               else ["--shared-prefill", "stock", "--synthetic-context"])
    common = ["bench", "--preset", "full", "--share-weights", *context,
              "--backends", "stock,fused", "--no-fidelity", "--out", str(out / step)]
    if step == "bench":
        argv = common + ["--lengths", "4K", "--rounds", "3", "--decode-tokens", "64"]
        return argv + (["--ablate", ablate] if ablate else [])
    if step == "long":
        argv = common + ["--lengths", long_lengths, "--rounds", "2", "--decode-tokens", "32"]
        return argv + (["--ablate", ablate] if ablate else [])
    if step == "lengths":
        return common + ["--lengths", TEN_LENGTHS, "--rounds", "3", "--decode-tokens", "32"]
    raise ValueError(f"not a bench step: {step!r}")


def run_bench(argv: list[str], enable: Optional[str]) -> int:
    from qwen_apple_backend.cli import main

    before = os.environ.get("QAB_ENABLE")
    if enable:
        os.environ["QAB_ENABLE"] = ",".join(p for p in (before, enable) if p)
    try:
        return int(main(argv) or 0)
    finally:
        if before is None:
            os.environ.pop("QAB_ENABLE", None)
        else:
            os.environ["QAB_ENABLE"] = before


def layer_profiler():
    """benchmarks/profile_layer_gpu.py as a module (its folder and src on sys.path)."""
    for folder in (ROOT / "src", ROOT / "benchmarks"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    import profile_layer_gpu

    return profile_layer_gpu


def run_layer(out: Path, variants: str, timeline: bool, warm: int = 0) -> int:
    """``profile_layer_gpu.py`` in this process: the ``layer`` step (chained
    launches) or the ``timeline`` step (``warm``: its ``--warm``); its exit status."""
    profile_layer_gpu = layer_profiler()
    argv = [str(out / ("timeline" if timeline else "layer")), "--variants", variants]
    if timeline:
        argv += ["--timeline", "--warm", str(warm)]
    try:
        return int(profile_layer_gpu.main(argv) or 0)
    except SystemExit as e:  # its usage errors and failed checks
        if e.code not in (None, 0):
            print(e.code if isinstance(e.code, str) else f"exit {e.code}", file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def run_tests(filter_: str) -> int:
    import pytest

    return int(pytest.main(["-v", "-m", "gpu", "-p", "no:cacheprovider", "-rs",
                            str(ROOT / "tests" / "test_kernels_gpu.py"), "-k", filter_]))


def write_check_timings(out: Path) -> int:
    """``OUT/self-checks.json``: every kernel self-check's seconds so far
    (:func:`qwen_apple_backend.ops.device.self_check_timings`, mostly NVRTC
    compilation in a fresh process), slowest first; returns how many."""
    import json

    from qwen_apple_backend.ops.device import self_check_timings

    rows = sorted(self_check_timings(), key=lambda r: -(r["reference_s"] + r["kernel_s"]))
    (out / "self-checks.json").write_text(json.dumps(rows, indent=1) + "\n")
    return len(rows)


class Session:
    """Runs steps with their output in files and a deadline each."""

    def __init__(self, out: Path):
        self.out = out
        self.log = out / "session.log"
        self.console = os.dup(1)  # the terminal, kept while fds 1/2 go to a step's file

    def say(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S', time.gmtime())} {text}\n"
        with open(self.log, "a") as f:
            f.write(line)
        os.write(self.console, line.encode())

    def step(self, name: str, seconds: float, fn: Callable[[], int]) -> int:
        path = self.out / f"{name}.txt"
        self.say(f"{name}: start ({seconds:.0f} s)")
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(path, "ab", buffering=0) as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            t0 = time.perf_counter()

            def over():
                sys.stderr.flush()
                os.write(2, f"\n{name}: over its {seconds:.0f} s, stacks:\n".encode())
                faulthandler.dump_traceback(file=f, all_threads=True)
                try:
                    write_check_timings(self.out)
                except Exception:  # noqa: BLE001 - the stop matters more
                    pass
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                self.say(f"{name}: over its {seconds:.0f} s; stopped (stacks in {path.name})")
                os._exit(124)

            timer = threading.Timer(seconds, over)
            timer.daemon = True
            timer.start()
            try:
                rc = fn()
            except BaseException as e:  # noqa: BLE001 - reported, then the next step runs
                import traceback

                traceback.print_exc()
                rc = 1 if not isinstance(e, SystemExit) else int(e.code or 0)
            finally:
                timer.cancel()
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
        checks = write_check_timings(self.out)
        last = "" if rc == 0 else last_line(path)
        self.say(f"{name}: rc {rc} in {time.perf_counter() - t0:.1f} s ({checks} self-checks "
                 "so far, OUT/self-checks.json)" + (f"; last output: {last}" if last else ""))
        return rc


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a step's file (its error, for a failed step's
    log line), at most ``limit`` characters; "" when there is none."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    return lines[-1][:limit] if lines else ""


def gpu_available() -> bool:
    """Whether MLX's CUDA backend has a GPU (every step needs one)."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        description="A GPU machine command's verification and measurements in one process "
                    "(compiled kernels and self-check verdicts shared between steps).")
    ap.add_argument("out", type=Path, help="folder for the session log and each step's output")
    ap.add_argument("--plan", default="bench:330,tests:200",
                    help=f"steps in order, NAME:SECONDS each (steps: {', '.join(STEPS)}; "
                         "default bench:330,tests:200)")
    ap.add_argument("--test-filter", default="one_pack",
                    help="pytest -k of the tests step (default one_pack)")
    ap.add_argument("--real-prefill", action="store_true",
                    help="bench steps decode from fused's prefilled contexts (default: stock's "
                         "synthetic ones, random cache values: no prefill's minutes)")
    ap.add_argument("--ablate", default="moe-block-pack,decode-const",
                    help="the 4K bench's ablation columns (default moe-block-pack,decode-const; "
                         "'' for none)")
    ap.add_argument("--long-ablate", default="",
                    help="the long step's ablation columns (default none), e.g. attn-step-long")
    ap.add_argument("--long-lengths", default="128K",
                    help="the long step's context lengths (qab bench --lengths; default 128K)")
    ap.add_argument("--layer-variants", default="default,NPL=0,UNROLL=0",
                    help="variants of the layer and timeline steps (profile_layer_gpu.py's "
                         "--variants; default default,NPL=0,UNROLL=0)")
    ap.add_argument("--timeline-warm", type=int, default=0, metavar="N",
                    help="the timeline step's --warm: phases of the last of N chained "
                         "launches, no L2 flush, and the chain's GPU period, span and gap per "
                         "launch, 3 <= N <= profile_layer_gpu.MAX_WARM (default 0: one "
                         "launch after a flush)")
    args = ap.parse_args(argv)
    try:
        plan = parse_plan(args.plan)
    except ValueError as e:
        ap.error(str(e))
    if args.timeline_warm and not any(name == "timeline" for name, _ in plan):
        ap.error("--timeline-warm goes with a timeline step in --plan")
    most = layer_profiler().MAX_WARM
    if args.timeline_warm and not 3 <= args.timeline_warm <= most:
        ap.error(f"--timeline-warm takes 0 or N from 3 to {most}, got {args.timeline_warm}")
    if any(name in ("layer", "timeline") for name, _ in plan):
        try:
            for v in (v for v in args.layer_variants.split(",") if v):
                layer_profiler().split_variant(v)
        except ValueError as e:
            ap.error(f"--layer-variants: {e}")
    if not gpu_available():
        # (On a CPU the bench step would build the full model, ~35B parameters.)
        ap.error("its steps need MLX's CUDA backend and a CUDA GPU, and none is available")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"cannot make the output folder {str(args.out)!r}: {e.strerror or e}")
    sys.path.insert(0, str(ROOT / "src"))
    from qwen_apple_backend.envs import OPT_IN

    os.environ.setdefault("QAB_UNVERIFIED_KERNELS", "1")
    session = Session(args.out)
    session.say(f"plan {args.plan}")
    worst = 0
    for name, seconds in plan:
        if name == "tests":
            fn = lambda: run_tests(args.test_filter)  # noqa: E731
        elif name in ("layer", "timeline"):
            fn = (lambda t: lambda: run_layer(args.out, args.layer_variants, t,
                                               args.timeline_warm))(name == "timeline")
        else:
            # Opt-in ablations (envs.OPT_IN; decode-compile is on by default on
            # a GPU): on for the step, so the fused column has them.
            step_ablate = {"bench": args.ablate, "long": args.long_ablate}.get(name, "")
            enable = ",".join(a.strip() for a in step_ablate.split(",")
                              if a.strip() in OPT_IN and a.strip() != "decode-compile") or None
            argv_ = bench_argv(name, args.out, step_ablate, args.real_prefill,
                               args.long_lengths)
            fn = (lambda a, e: lambda: run_bench(a, e))(argv_, enable)
        worst = max(worst, session.step(name, seconds, fn))
    return worst


if __name__ == "__main__":
    sys.exit(main())
