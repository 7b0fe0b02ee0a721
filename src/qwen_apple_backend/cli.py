"""``qab``: mlx-lm's command-line tools with the Qwen backend switched on.

Subcommands (each imported lazily):

- ``qab generate|chat|serve ...``: ``mlx_lm.generate`` / ``mlx_lm.chat`` /
  ``mlx_lm.server`` with the same flags plus ``--backend auto|fused|stock``.
- ``qab backends``: discovered plugins, the architectures they claim, the backends they offer.
- ``qab make-checkpoint OUT``: a random-weight checkpoint with the real on-disk layout.
- ``qab demo``: build (once) and run the embedded default model on both backends.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

PASSTHROUGH = {
    "generate": ("mlx_lm.generate", "generate text (flags of mlx_lm.generate)"),
    "chat": ("mlx_lm.chat", "interactive chat (flags of mlx_lm.chat)"),
    "serve": ("mlx_lm.server", "OpenAI-compatible HTTP server (flags of mlx_lm.server)"),
}


def _backend_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, prog=f"qab {command}" if command else None)
    p.add_argument("--backend", default=None, choices=["auto", "fused", "stock"],
                   help="fused Qwen modules (fused), plain mlx-lm (stock), or fused where "
                        "supported (auto, default; env QAB_BACKEND)")
    p.add_argument("--qab-report", action="store_true",
                   help="print which modules were fused after loading")
    if command == "serve":
        from .server import DEFAULT_MAX_BODY_BYTES

        p.add_argument("--max-request-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body; larger ones get HTTP 413")
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _run_passthrough(command: str, argv: Sequence[str]) -> int:
    import importlib

    module_name, _ = PASSTHROUGH[command]
    ours, rest = _backend_parser(command).parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(f"qab {command}: {module_name} with the qwen-apple-backend registry enabled.\n"
              "Extra flags:\n"
              "  --backend {auto,fused,stock}  backend for the model (default auto)\n"
              "  --qab-report                  print which modules were fused\n"
              + ("  --max-request-bytes N         larger request bodies get HTTP 413 "
                 "(default 32 MiB)\n" if command == "serve" else "")
              + f"Flags of {module_name} follow.\n")
    if not any(a == "--model" or a.startswith("--model=") for a in rest) \
            and "-h" not in rest and "--help" not in rest:
        # Without --model, the shipped demo model rather than mlx-lm's hub default.
        from .demo import ensure_default_model

        rest = ["--model", str(ensure_default_model()), *rest]
        print(f"qab {command}: no --model given; using the demo model", file=sys.stderr)
    from . import loader

    loader.enable(ours.backend)
    if command == "serve":
        from . import server

        server.install(max_body_bytes=ours.max_request_bytes)
    if ours.qab_report:
        _print_reports_after_load()
    module = importlib.import_module(module_name)
    old_argv = sys.argv
    sys.argv = [f"qab {command}", *rest]
    from .errors import QABError

    try:
        result = module.main()
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    except QABError as exc:
        print(f"qab {command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        sys.argv = old_argv
    return int(result or 0)


def _print_reports_after_load() -> None:
    from . import loader

    original = loader.load

    def load_and_report(*args, **kwargs):
        out = original(*args, **kwargs)
        report = loader.get_report(out[0])
        if report is not None:
            print(report.summary(), file=sys.stderr)
        return out

    loader.load = load_and_report


def cmd_backends(args: argparse.Namespace) -> int:
    from .plugins import load_plugins

    state = load_plugins()
    if args.json:
        import json

        print(json.dumps({
            "plugins": {n: vars(p) for n, p in state.plugins.items()},
            "failed": state.failed,
            "architectures": [vars(e) for e in state.registry.iter_architectures()],
            "backends": [vars(e) for e in state.registry.iter_backends()],
        }, indent=2))
        return 0
    print("Plugins:")
    for name, info in sorted(state.plugins.items()):
        dist = f" [{info.distribution} {info.version}]" if info.distribution else ""
        print(f"  {name:<20} {info.source:<12} {info.module}{dist}")
    for name, why in sorted(state.failed.items()):
        print(f"  {name:<20} FAILED       {why}")
    print("\nArchitectures (winner first):")
    for name in sorted(state.registry.architectures):
        entries = sorted(state.registry.architectures[name], key=lambda e: (-e.priority, -e.order))
        for i, e in enumerate(entries):
            mark = "*" if i == 0 else " "
            print(f" {mark}{name:<38} plugin={e.plugin:<12} {e.target}")
    print("\nBackends:")
    from .registry import import_target

    for name in sorted(state.registry.backends):
        e = state.registry.backend(name)
        try:
            obj = import_target(e.target)
            ok, why = (obj() if isinstance(obj, type) else obj).available()
        except Exception as exc:  # noqa: BLE001
            ok, why = False, f"{type(exc).__name__}: {exc}"
        status = "available" if ok else f"unavailable ({why})"
        print(f"  {name:<12} plugin={e.plugin:<12} {status}  {e.description}")
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from .checkpoint import make_checkpoint

    out = make_checkpoint(args.out, preset=args.preset, layout=args.layout, seed=args.seed,
                          dtype=args.dtype, vocab_size=args.vocab_size,
                          overwrite=args.overwrite, progress=not args.quiet)
    print(f"wrote {args.layout} checkpoint ({args.preset}) to {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(prompt=args.prompt, max_tokens=args.max_tokens, model=args.model,
                    rebuild=args.rebuild)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qab",
        description="qwen-apple-backend: fused Qwen3.5/3.6 modules for mlx-lm.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"qwen-apple-backend {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)

    p = sub.add_parser("backends", help="list plugins, architectures and backends")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("make-checkpoint",
                       help="write a random-weight checkpoint with the real Qwen3.6 layout")
    p.add_argument("out", help="output directory")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "full"])
    p.add_argument("--layout", default="hf", choices=["hf", "mlx-q4"],
                   help="hf: published HF layout; mlx-q4: mlx-community 4-bit layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--vocab-size", type=int, default=None,
                   help="override the vocabulary size (small, fast test models)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("demo", help="generate with the embedded default model, fused vs stock")
    p.add_argument("--prompt", default="Write a haiku about fast inference.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="checkpoint to use instead of the default")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached default model")
    p.set_defaults(func=cmd_demo)

    from .bench.cli import add_parsers

    add_parsers(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:
        return _run_passthrough(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Optional[Callable[[argparse.Namespace], int]] = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from .errors import QABError

    try:
        return func(args)
    except (QABError, ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"qab {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
