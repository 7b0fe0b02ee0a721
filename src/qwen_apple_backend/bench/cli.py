"""``qab bench`` and ``qab compare``: argument parsing and printing.

:func:`add_parsers` adds both subcommands to ``qab``'s parser. Nothing heavy is
imported until a subcommand runs, so ``qab --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from ..argtypes import (file_name_part, nonempty_path, nonnegative_int, positive_float,
                        positive_int)

__all__ = ["add_parsers", "cmd_bench", "cmd_compare"]

_BENCH_DESCRIPTION = """\
Measure prefill and decode throughput of several backends side by side in one
process: the same prompt token ids for every backend, warm-ups excluded, the
device synchronised before every clock read, backends alternated within each
round and the order reversed every round, N rounds with raw samples kept, and
medians / 95th percentiles reported with ratios against `stock` (a ratio inside
the run-to-run spread is reported as "no difference"). Also recorded: time to
first token, peak memory per run, bytes read per decode step (weights touched,
KV cache, recurrent state) with the roofline % against the memory bandwidth,
and fidelity (teacher-forced top-1 agreement with `stock` and perplexity over
a built-in English text). Writes JSON and a PNG plot to --out and prints a
table.
"""

_BENCH_EPILOG = """\
examples:
  qab bench --preset tiny --vocab-size 1024 --quick
  qab bench --model path/to/Qwen3.6-35B-A3B-4bit --lengths 512,4K --rounds 3
  qab bench --preset full --lengths 2K,8K --ablate moe,gdn,attn --out results/
  qab bench --preset full --lengths 256,4K,128K --shared-prefill fused --no-fidelity
"""

_COMPARE_DESCRIPTION = """\
Run the same prompts through several backends and print them side by side:
time to first token, prefill and decode tokens/s, the greedy continuation, its
token agreement with the reference backend (`stock` when listed, else the
first) and the first position where the continuations diverge. Every backend
decodes exactly --max-tokens tokens.
"""

_COMPARE_EPILOG = """\
examples:
  qab compare --model path/to/checkpoint --backends stock,fused --prompt "Hello"
  qab compare --model path/to/checkpoint --prompts-file prompts.txt --json out.json
  qab compare --model path/to/mlx-checkpoint --backends stock,llama.cpp=model.gguf \\
      --chat-template --prompt "What is the capital of France?" --fidelity
"""


def _lengths(text: str) -> str:
    """``--lengths``: checked here (one argparse error line), parsed again by the harness."""
    from .harness import parse_lengths

    try:
        parse_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--lengths: ")) from None
    return text


def _add_source_args(p: argparse.ArgumentParser, seed_help: str) -> None:
    g = p.add_argument_group("model (one of --model / --preset; neither: the demo model, as "
                             "qab generate)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH", type=nonempty_path, default=None,
                     help="checkpoint directory, loaded once per backend")
    src.add_argument("--preset", choices=["tiny", "small", "full"], default=None,
                     help="random-weight model with the real layout, built in memory once per "
                          "backend from --seed (full = Qwen3.6-35B-A3B shapes, about 19 GB at "
                          "4 bits)")
    g.add_argument("--seed", type=nonnegative_int, default=0, help=seed_help)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="float dtype of a --preset model (default bfloat16)")
    g.add_argument("--vocab-size", type=positive_int, default=None,
                   help="vocabulary of a --preset model instead of 248,320 (small test models)")
    g.add_argument("--no-quantize", action="store_true",
                   help="keep a --preset model unquantized (default: 4-bit g64, routers 8-bit)")
    g.add_argument("--share-weights", action="store_true",
                   help="build a --preset once and let every backend share its weight arrays "
                        "(saves memory and build time; default builds once per backend)")
    b = p.add_argument_group("backends")
    b.add_argument("--backends", default="stock,fused",
                   help="comma-separated registered backends (default stock,fused; see "
                        "`qab backends`); NAME=PATH gives a backend its own model instead "
                        "of --model/--preset, e.g. stock,llama.cpp=model.gguf")
    from ..envs import FUSABLE_KINDS, OPT_IN, OPTIMIZATIONS

    # decode-compile is opt-in on the CPU only (on by default on a GPU).
    opt_in = [o for o in OPT_IN if o != "decode-compile"]
    b.add_argument("--ablate", default="", metavar="NAMES",
                   help=f"comma-separated fused module kinds ({', '.join(FUSABLE_KINDS)}) or "
                        f"optimizations ({', '.join(OPTIMIZATIONS)}): adds one "
                        "`fused-no-<name>` backend per name, the fused backend with that kind "
                        "kept stock or that optimization switched off (the opt-in ones, "
                        f"{', '.join(opt_in[:-1])} and {opt_in[-1]}, are "
                        "on in `fused` only with QAB_ENABLE=NAME)")
    b.add_argument("--prefill-step-size", type=positive_int, default=None,
                   help="prefill chunk in tokens (default: mlx-lm's, 2048)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class _NoteGiven(argparse.Action):
    """Mixin for an option's action: also adds its ``dest`` to ``namespace._given``
    when the command line gives the option (in any spelling: ``--flag=V``, an
    abbreviation), so :func:`_command_line` keeps options given at their default."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace._given = (*getattr(namespace, "_given", ()), self.dest)


class _Store(_NoteGiven, argparse._StoreAction):
    pass


class _StoreTrue(_NoteGiven, argparse._StoreTrueAction):
    pass


class _Append(_NoteGiven, argparse._AppendAction):
    pass


def _note_given_options(p: argparse.ArgumentParser) -> None:
    """Make the options that ``p`` adds from now on record that they were given."""
    for name, action in ((None, _Store), ("store", _Store), ("store_true", _StoreTrue),
                         ("append", _Append)):
        p.register("action", name, action)
    p.set_defaults(_given=())


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Raw description and epilog; option help wrapped at spaces only, so that
    hyphenated names (``moe-block-early``) stay whole for copying."""

    def _split_lines(self, text, width):
        import textwrap

        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width,
                             break_on_hyphens=False)


def add_parsers(subparsers: Any) -> None:
    """Add the ``bench`` and ``compare`` subcommands to ``qab``'s subparsers.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.
    """
    fmt = _HelpFormatter
    p = subparsers.add_parser("bench", help="prefill/decode throughput sweep, backends side "
                              "by side (JSON + PNG + table)", description=_BENCH_DESCRIPTION,
                              epilog=_BENCH_EPILOG, formatter_class=fmt)
    _note_given_options(p)
    _add_source_args(p, "weights seed of --preset, seed of the prompt token ids and of "
                        "--synthetic-context's cache values (default 0)")
    s = p.add_argument_group("sweep")
    s.add_argument("--lengths", default=None, type=_lengths,
                   help="comma-separated prompt/context lengths, K = 1024 (default "
                        "256,512,1K,2K,4K,8K,16K,32K,64K,128K; --quick: 128,256,512)")
    s.add_argument("--quick", action="store_true",
                   help="smoke test: 3 short lengths, 1 round, 16 decode tokens")
    s.add_argument("--rounds", type=positive_int, default=None, help="measured rounds (default 5; "
                   "--quick 1)")
    s.add_argument("--warmup", type=nonnegative_int, default=1,
                   help="unrecorded warm-up runs per backend and length (default 1)")
    s.add_argument("--warmup-max-tokens", type=positive_int, default=4096,
                   help="cap on a warm-up prompt; longer ones are shortened keeping the "
                        "prefill chunk shapes (default 4096)")
    s.add_argument("--decode-tokens", type=positive_int, default=None,
                   help="tokens decoded per run (default 128; --quick 16)")
    s.add_argument("--shared-prefill", default=None, metavar="LABEL",
                   help="build each length's decode context once with LABEL's prefill (e.g. "
                        "fused) and decode every backend from a copy of it: decode-only "
                        "sweeps at long contexts where another backend's prefill takes "
                        "minutes. LABEL's prefill is timed once per length (recorded, not "
                        "compared); no prefill rows or panel. Every length's context stays "
                        "in memory for the whole sweep")
    s.add_argument("--synthetic-context", action="store_true",
                   help="with --shared-prefill LABEL: fill each length's context with seeded "
                        "random cache values (LABEL's model gives the shapes) instead of "
                        "prefilling it: decode speed only, without a prefill's minutes (a "
                        "fresh process compiling prefill kernels, or stock's per-token Gated "
                        "DeltaNet loop off Metal); the decoded tokens continue no prompt. "
                        "Add --no-fidelity: the fidelity pass still runs each backend's "
                        "prompt forward")
    s.add_argument("--max-seconds", type=positive_float, default=None,
                   help="time budget: start no further round when it would end past this "
                        "many seconds (rounds stay whole; the JSON records it), and with "
                        "--shared-prefill no shared prefill once it is spent")
    s.add_argument("--bandwidth-gbs", type=positive_float, default=None,
                   help="memory bandwidth in GB/s for the roofline (default: measured by a "
                        "device copy, recorded)")
    s.add_argument("--bandwidth-mib", type=positive_int, default=None,
                   help="array size of the bandwidth measurement (default 1024 on a GPU, 256 "
                        "on the CPU)")
    f = p.add_argument_group("fidelity")
    f.add_argument("--no-fidelity", action="store_true",
                   help="skip teacher-forced agreement and perplexity")
    f.add_argument("--fidelity-positions", type=positive_int, default=256,
                   help="teacher-forced positions scored (default 256; at least 192 counts)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench-results", metavar="DIR", type=nonempty_path,
                   help="folder for the JSON and PNG (default ./bench-results)")
    o.add_argument("--tag", default="", type=file_name_part,
                   help="file-name suffix instead of a timestamp (letters, digits, '.', '_', "
                        "'-')")
    o.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.set_defaults(func=cmd_bench, _parser=p)

    p = subparsers.add_parser("compare", help="same prompts through several backends, side "
                              "by side (speed, agreement, first divergence)",
                              description=_COMPARE_DESCRIPTION, epilog=_COMPARE_EPILOG,
                              formatter_class=fmt)
    _note_given_options(p)
    # compare tokenizes its text prompts and decodes greedily: the seed makes only a
    # --preset model's weights.
    _add_source_args(p, "weights seed of --preset (default 0); no effect with --model, "
                        "since the prompts are text and decoding is greedy")
    q = p.add_argument_group("prompts")
    q.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeatable)")
    q.add_argument("--prompts-file", default=None, metavar="FILE",
                   help="prompts: one per line, JSON Lines with a \"prompt\" field, or a JSON "
                        "list of strings")
    q.add_argument("--chat-template", action="store_true",
                   help="wrap each prompt in the tokenizer's chat template (default: raw text)")
    q.add_argument("--max-tokens", type=positive_int, default=32,
                   help="tokens generated per prompt and backend (default 32)")
    q.add_argument("--rounds", type=positive_int, default=1, help="repetitions of every prompt "
                   "(default 1)")
    q.add_argument("--warmup", type=nonnegative_int, default=1, help="unrecorded warm-up runs per backend "
                   "(default 1)")
    q.add_argument("--fidelity", action="store_true",
                   help="also score teacher-forced top-1 agreement with the reference and "
                        "perplexity on `qab bench`'s fidelity text")
    q.add_argument("--fidelity-positions", type=positive_int, default=256,
                   help="teacher-forced positions scored with --fidelity (default 256)")
    q.add_argument("--json", default=None, metavar="PATH", type=nonempty_path,
                   help="also write the result JSON (same format as `qab bench`)")
    p.set_defaults(func=cmd_compare, _parser=p)


def _command_line(args: argparse.Namespace, command: str) -> list[str]:
    """The effective command, to paste back: ``qab <command>`` plus every option the
    command line gave (also one given at its default, such as ``--backends
    stock,fused``) or that differs from its default, in the parser's order.

    A value starting with ``-`` is written ``--flag=VALUE``, as argparse needs it.
    """
    parser: Optional[argparse.ArgumentParser] = getattr(args, "_parser", None)
    out = ["qab", command]
    if parser is None:
        return out
    given = set(getattr(args, "_given", ()))
    for action in parser._actions:  # the parser's own option table
        if not action.option_strings or action.dest in ("help", "func", "_parser"):
            continue
        value = getattr(args, action.dest, None)
        if action.dest not in given and value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
            continue
        for v in value if isinstance(value, list) else [value]:
            out += [f"{flag}={v}"] if str(v).startswith("-") else [flag, str(v)]
    return out


def _split(text: str) -> list[str]:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def _default_to_demo(command: str, args: argparse.Namespace) -> None:
    """Neither ``--model`` nor ``--preset``: the shipped demo model, as ``qab
    generate`` / ``chat`` / ``serve`` use without ``--model`` (said on stderr)."""
    if args.model is None and args.preset is None:
        from ..demo import ensure_default_model

        args.model = str(ensure_default_model())
        _log(f"qab {command}: no --model or --preset given; using the demo model "
             f"({args.model})")


def _source_kwargs(args: argparse.Namespace) -> dict:
    return {"model": args.model, "preset": args.preset, "seed": args.seed, "dtype": args.dtype,
            "quantize": not args.no_quantize, "vocab_size": args.vocab_size,
            "share_weights": args.share_weights, "backends": _split(args.backends),
            "ablate": _split(args.ablate), "prefill_step_size": args.prefill_step_size,
            "progress": not args.no_progress}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _usage_problem(args: argparse.Namespace, prompts: Optional[list] = None) -> Optional[str]:
    """A bad ``--backends`` / ``--ablate`` / ``--shared-prefill`` / ``--synthetic-context`` /
    prompt, or a ``--preset --no-quantize`` dtype MLX's CPU cannot run, found before any
    model is built."""
    from ..errors import QABError
    from .harness import check_shared_prefill
    from .target import parse_backend_specs, resolve_backend

    try:
        specs = parse_backend_specs(args.backends, args.ablate)
        for spec in specs:
            resolve_backend(spec)  # registered, available here, benchmarkable
        check_shared_prefill(getattr(args, "shared_prefill", None), [s.label for s in specs])
    except (ValueError, QABError) as exc:
        return str(exc)
    for spec in specs:
        # A column's own model (NAME=PATH): named before any other column loads.
        if spec.model is not None and not Path(spec.model).exists():
            return f"--backends {spec.label}={spec.model}: no such file or folder"
    if (args.preset and args.no_quantize and args.dtype != "float32"
            and any(s.model is None for s in specs)):
        from ..checkpoint import gpu_available

        if not gpu_available():
            # Every run failed with MLX's "[GatherMM::eval] Currently only supports float32".
            return (f"--no-quantize with --dtype {args.dtype}"
                    + (" (the default)" if args.dtype == "bfloat16" else "")
                    + ": MLX's CPU backend runs unquantized MoE experts only in float32; add "
                    "--dtype float32, or leave --no-quantize out")
    if getattr(args, "synthetic_context", False) and not args.shared_prefill:
        return ("--synthetic-context needs --shared-prefill LABEL (the backend whose model "
                "shapes the contexts)")
    if prompts is not None and not prompts:
        return "give --prompt TEXT (repeatable) or --prompts-file FILE"
    if prompts is not None and any(not p.strip() for p in prompts):
        return "--prompt: empty prompt (give some text)"
    return None


def _output_problem(flag: str, path: str, folder: bool) -> Optional[str]:
    """Why ``path`` cannot take a command's output, found before any work, or None.

    ``folder``: ``path`` is a folder the command writes into (``qab bench --out``),
    created here if missing; else a file (``qab compare --json``) whose folder is
    created here. A path that cannot be created or written is named (the sweep's
    results were lost at the end before).
    """
    import tempfile

    target = Path(path) if folder else Path(path).parent
    if folder and Path(path).exists() and not Path(path).is_dir():
        return f"{flag} {path!r} exists and is not a folder"
    if not folder and Path(path).is_dir():
        return f"{flag} {path!r} is a folder, not a file"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return (f"{flag} {path!r}: cannot create the folder {str(target)!r}: "
                f"{exc.strerror or exc}")
    try:  # the only sure test of writing there (permissions, read-only or special mounts)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as exc:
        return (f"{flag} {path!r}: cannot write in the folder {str(target)!r}: "
                f"{exc.strerror or exc}")
    return None


def _usage_error(command: str, problem: str) -> int:
    print(f"qab {command}: error: {problem}", file=sys.stderr)
    return 2


def _warn_opt_in_ablations(args: argparse.Namespace) -> None:
    """Say on stderr when ``--ablate`` names an opt-in optimization that
    ``QAB_ENABLE`` does not switch on: ``fused`` runs without it too, so its
    ``fused-no-<name>`` column measures nothing."""
    from ..envs import OPT_IN, enabled_opt_in

    names = [n.strip().lower() for n in (args.ablate or "").split(",") if n.strip()]
    for name in names:
        if name in OPT_IN and name != "decode-compile" and name not in enabled_opt_in():
            print(f"warning: --ablate {name}: opt-in, so `fused` runs without it too unless "
                  f"QAB_ENABLE={name}: fused-no-{name} is the same model as fused",
                  file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> int:
    """``qab bench``: run the sweep, print the table, write JSON (+ PNG)."""
    from .harness import BenchConfig, parse_lengths, run_bench, write_outputs
    from .report import format_table

    problem = _usage_problem(args) or _output_problem("--out", args.out, folder=True)
    if problem:
        return _usage_error("bench", problem)
    _warn_opt_in_ablations(args)
    _default_to_demo("bench", args)

    cfg = BenchConfig(
        **_source_kwargs(args),
        lengths=parse_lengths(args.lengths) if args.lengths else None,
        rounds=args.rounds, warmup=args.warmup, warmup_max_tokens=args.warmup_max_tokens,
        decode_tokens=args.decode_tokens, bandwidth_gbs=args.bandwidth_gbs,
        bandwidth_mib=args.bandwidth_mib, fidelity=not args.no_fidelity,
        fidelity_positions=args.fidelity_positions, max_seconds=args.max_seconds,
        quick=args.quick, shared_prefill=args.shared_prefill,
        synthetic_context=args.synthetic_context,
        out_dir=args.out, tag=args.tag, plot=not args.no_plot,
        argv=_command_line(args, "bench"))
    result = run_bench(cfg, log=_log)
    files = write_outputs(result, Path(args.out), tag=args.tag, plot=not args.no_plot)
    print(_header(result))
    print(format_table(result["summary"]))
    _print_fidelity(result.get("fidelity"))
    for e in result.get("errors", []):
        print(f"error: {e['backend']} @ {e['length']}: {e['error']}", file=sys.stderr)
    print(f"\nwrote {files['json']}" + (f" and {files['png']}" if files.get("png") else ""))
    if result.get("errors") and not result.get("runs"):
        # Every run failed: an empty table is no result (it exited 0).
        print(f"qab bench: error: no run succeeded ({len(result['errors'])} failed, listed "
              f"above and in {files['json']})", file=sys.stderr)
        return 1
    return 0


def _print_fidelity(fid: Optional[dict]) -> None:
    if not fid:
        return
    print(f"\nfidelity over {fid['positions']} teacher-forced positions "
          f"(reference {fid['baseline']}):")
    width = max([16, *map(len, fid["backends"])])
    for label, r in fid["backends"].items():
        print(f"  {label:<{width}} top-1 agreement {100 * r['agreement_vs_stock']:6.2f}%  "
              f"perplexity {r['perplexity']:.4g} ({100 * r['perplexity_rel_vs_stock']:+.3f}%)"
              f"  self-agreement {100 * r.get('self_agreement', float('nan')):.1f}%")


def _header(result: dict) -> str:
    env = result["environment"]
    v = env["versions"]
    m = result["model"]
    what = (f"preset {m['preset']} seed {m['seed']}" if m.get("source") == "preset"
            else m.get("path"))
    bw = result.get("bandwidth") or {}
    shared = (result.get("settings") or {}).get("shared_prefill")
    kind = ("synthetic (random cache values)"
            if (result.get("settings") or {}).get("synthetic_context") else "prefilled")
    mode = (f"\ndecode only: every backend decoded from {shared}'s {kind} contexts "
            f"(peak MiB includes every stored context; working memory in the JSON)"
            if shared else "")
    return (f"device {result['device']} | mlx {v['mlx']} | mlx-lm {v['mlx_lm']} | "
            f"qwen-apple-backend {v['qwen_apple_backend']} | {what} | "
            f"bandwidth {bw.get('gbs', 0):.0f} GB/s ({bw.get('source')}){mode}\n")


def cmd_compare(args: argparse.Namespace) -> int:
    """``qab compare``: run the prompts through each backend and print them side by side."""
    from .compare import CompareConfig, format_compare, read_prompts, run_compare
    from .report import format_table, write_json

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts(Path(args.prompts_file))
    problem = _usage_problem(args, prompts) or (
        _output_problem("--json", args.json, folder=False) if args.json else None)
    if problem:
        return _usage_error("compare", problem)
    _warn_opt_in_ablations(args)
    _default_to_demo("compare", args)
    cfg = CompareConfig(**_source_kwargs(args), prompts=prompts, max_tokens=args.max_tokens,
                        rounds=args.rounds, warmup=args.warmup,
                        chat_template=args.chat_template, fidelity=args.fidelity,
                        fidelity_positions=args.fidelity_positions,
                        argv=_command_line(args, "compare"))
    result = run_compare(cfg, log=_log)
    print(format_compare(result))
    print(format_table(result["summary"], baseline=result["compare"]["reference"]))
    _print_fidelity(result.get("fidelity"))
    if args.json:
        path = write_json(result, Path(args.json))
        print(f"\nwrote {path}")
    return 0
