"""``qab``: mlx-lm's command-line tools with the Qwen backend switched on.

Subcommands (each imported lazily):

- ``qab generate|chat|serve ...``: ``mlx_lm.generate`` / ``mlx_lm.chat`` /
  ``mlx_lm.server`` with the same flags plus ``--backend`` (``auto``, ``fused``,
  ``stock`` or a plugin's MLX backend, checked against the registry).
- ``qab backends``: discovered plugins, the architectures they claim, the backends they offer.
- ``qab make-checkpoint OUT``: a random-weight checkpoint with the real on-disk layout.
- ``qab demo``: build (once) and run the embedded default model on both backends.
- ``qab bench`` / ``qab compare``: see :mod:`qwen_apple_backend.bench.cli`.

Bad input ends a command before any work with one ``error:`` line: the ``QAB_*``
environment variables and ``--backend`` (exit status 2), non-positive token counts
and the other flag values that mlx-lm would fail on only after loading (a ``--seed``,
``--top-k``, KV-cache quantization setting, chat-template JSON, prompt-cache file, batch
concurrency or cache size; argparse, exit status 2), a missing or broken checkpoint (exit
status 1); mlx-lm's own ValueError refusing its input (``--image`` for a text-only model)
is one ``error:`` line too (exit status 1). A
variable found unusable only at run time (a ``QAB_CACHE_DIR`` that cannot be
written) is the same one ``qab: error: VAR: ...`` line, exit status 2. Every
subcommand checks the environment at startup, except that ``--help`` (``-h``) and
``--version`` print without checking it, so help works whatever the variables hold.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence

from .argtypes import (byte_size, json_object, kv_bits, kv_group_size, nonempty_path,
                       nonnegative_float, port, positive_float, positive_int_up_to, prng_seed,
                       probability, safetensors_file)
from .argtypes import nonnegative_int, positive_int  # noqa: F401 - re-exported

PASSTHROUGH = {
    "generate": ("mlx_lm.generate", "generate text (flags of mlx_lm.generate)"),
    "chat": ("mlx_lm.chat", "interactive chat (flags of mlx_lm.chat)"),
    "serve": ("mlx_lm.server", "OpenAI-compatible HTTP server (flags of mlx_lm.server)"),
}


class UsageError(Exception):
    """A bad command line or environment: one ``error:`` line and exit status 2."""


def _usage(command: str) -> str:
    """The usage line of ``qab generate|chat|serve`` (both of its parsers print it)."""
    return (f"qab {command} [--backend NAME] [--qab-report]"
            + (" [--max-request-bytes N] [--request-timeout SECONDS]"
               if command == "serve" else "")
            + f" [flags of {PASSTHROUGH[command][0]}]")


def _backend_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, prog=f"qab {command}" if command else None,
                                usage=_usage(command) if command else None,
                                allow_abbrev=False)
    # Checked against the plugin registry at run time (_check_backend_arg), so
    # backends that plugins register are accepted too.
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="fused Qwen modules (fused), plain mlx-lm (stock), fused where "
                        "supported (auto, default; env QAB_BACKEND), or an MLX backend a "
                        "plugin registers")
    p.add_argument("--qab-report", action="store_true",
                   help="print which modules were fused after loading")
    if command == "serve":
        from .server import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT

        p.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                       metavar="N", help="largest request body; larger ones get HTTP 413")
        p.add_argument("--request-timeout", type=positive_float, default=DEFAULT_READ_TIMEOUT,
                       metavar="SECONDS",
                       help="a connection silent this long while its request is read is "
                            "closed (a cut-short body gets HTTP 408)")
    return p


_positive_int = positive_int  # the former private name, kept for importers

#: Flags of the mlx-lm commands that count tokens: checked here (a negative
#: --max-tokens makes mlx-lm generate forever) and left in place for mlx-lm.
_COUNT_FLAGS = {
    "generate": (("--max-tokens", "-m"), ("--max-kv-size",), ("--prefill-step-size",)),
    "chat": (("--max-tokens", "-m"), ("--max-kv-size",), ("--prefill-step-size",)),
    # serve's --max-tokens is capped too: in _VALUE_FLAGS.
    "serve": (("--prefill-step-size",), ("--prompt-cache-size",)),
}


#: Sampling flags of the mlx-lm commands, checked the same way (mlx-lm accepts a
#: negative --temp or a --top-p above 1 silently).
_SAMPLING_FLAGS = {
    "generate": (("--temp", nonnegative_float), ("--top-p", probability),
                 ("--min-p", probability), ("--xtc-probability", probability)),
    "chat": (("--temp", nonnegative_float), ("--top-p", probability),
             ("--xtc-probability", probability)),
    "serve": (("--temp", nonnegative_float), ("--top-p", probability),
              ("--min-p", probability)),
}


def _serve_max_tokens(text: str) -> int:
    """``qab serve --max-tokens``: a positive integer up to the server's cap on a request's
    ``max_tokens`` (the flag is the default of requests that give none, which the
    request check does not see)."""
    from .server import MAX_COMPLETION_TOKENS

    return positive_int_up_to(MAX_COMPLETION_TOKENS,
                              "the largest max_tokens qab serve accepts in a request")(text)


#: The ``__metadata__`` entries of a prompt cache that mlx-lm reads back: its
#: ``save_prompt_cache`` flattens [metadata, cache class names, scalar types], and
#: ``mlx_lm.generate`` reads the model and tokenizer_config that ``mlx_lm.cache_prompt``
#: stores in the first.
_PROMPT_CACHE_ENTRIES = ("0.model", "0.tokenizer_config", "1.0", "2.0")


def _prompt_cache_file(text: str) -> str:
    """``qab generate --prompt-cache-file``: a ``.safetensors`` file (:func:`safetensors_file`)
    whose header holds the metadata of a prompt cache mlx-lm wrote. Another file (a model's
    weights, a truncated or foreign one) failed in mlx-lm after loading with an unrelated
    traceback ("Unable to read 3 bytes", "not enough values to unpack")."""
    from pathlib import Path

    from .errors import CheckpointError
    from .loader import read_safetensors_header

    path = Path(safetensors_file(text))
    why = None
    try:
        meta = read_safetensors_header(path).get("__metadata__")
    except CheckpointError as exc:
        why = str(exc).removeprefix(f"{path}: ")
    else:
        meta = meta if isinstance(meta, dict) else {}
        missing = [k for k in _PROMPT_CACHE_ENTRIES if k not in meta]
        if missing:
            why = (f"its safetensors metadata has no {', '.join(missing)} "
                   f"entr{'ies' if len(missing) > 1 else 'y'}")
        else:
            try:  # mlx_lm.generate json.loads it
                json_object(meta["0.tokenizer_config"])
            except argparse.ArgumentTypeError:
                why = "its tokenizer_config metadata is not a JSON object"
    if why is not None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a prompt cache written by mlx-lm (mlx_lm.cache_prompt): {why}")
    return text


#: Other flags of the mlx-lm commands, checked the same way where the command has
#: them: mlx-lm accepts these bad values and fails only after loading the model
#: (a traceback; for --kv-group-size 0 a SIGFPE crash; for serve, every request
#: answered with an empty reply) or not at all (a negative --top-k).
_VALUE_FLAGS = {
    "generate": (("--seed", prng_seed),
                 ("--top-k", nonnegative_int),  # 0 (mlx-lm's default) switches top-k off
                 ("--num-draft-tokens", positive_int),  # 0 would draft nothing
                 ("--kv-bits", kv_bits), ("--kv-group-size", kv_group_size),
                 ("--quantized-kv-start", nonnegative_int),
                 ("--chat-template-config", json_object),
                 ("--prompt-cache-file", _prompt_cache_file),
                 # mlx-lm's min-p sampler raises for one below 1 (only with --min-p).
                 ("--min-tokens-to-keep", positive_int)),
    "chat": (("--seed", prng_seed),),
    "serve": (("--max-tokens", _serve_max_tokens), ("--top-k", nonnegative_int),
              ("--num-draft-tokens", positive_int), ("--kv-bits", kv_bits),
              ("--kv-group-size", kv_group_size), ("--quantized-kv-start", nonnegative_int),
              # mlx-lm parses it with json.loads, which takes any JSON (a list fails
              # every request): the same check as generate's --chat-template-config.
              ("--chat-template-args", json_object),
              # The batch sizes of mlx-lm's BatchGenerator: with 0 prompts it never
              # starts a batched request (which then waits forever).
              ("--decode-concurrency", positive_int), ("--prompt-concurrency", positive_int),
              # mlx-lm's own parser raises a decimal.InvalidOperation traceback for "-5".
              ("--prompt-cache-bytes", byte_size)),
}


def _check_count_flags(command: str, argv: Sequence[str]) -> None:
    """Exit with argparse's one-line error (status 2) for a token count that is not
    positive, a negative temperature, a probability (top-p, min-p) outside [0, 1], an
    empty ``--model``, (serve) a ``--port`` outside 0..65535 or (generate) an empty
    ``--prompt`` with ``--ignore-chat-template``, and for the flags of
    :data:`_VALUE_FLAGS`: a ``--seed`` outside 0..2**64-1, a negative ``--top-k``, a
    ``--num-draft-tokens`` below 1, a ``--kv-bits`` / ``--kv-group-size`` MLX cannot
    quantize with, a negative ``--quantized-kv-start``, a chat-template argument that
    is not a JSON object, a ``--prompt-cache-file`` that is not a prompt cache mlx-lm
    wrote, a ``--min-tokens-to-keep`` below 1, or (serve) a ``--max-tokens`` above the
    server's per-request cap, a ``--decode-concurrency`` / ``--prompt-concurrency``
    below 1 or a ``--prompt-cache-bytes`` that is not a size in bytes."""
    p = argparse.ArgumentParser(prog=f"qab {command}", add_help=False, allow_abbrev=False,
                                usage=_usage(command))
    for flags in _COUNT_FLAGS.get(command, ()):
        p.add_argument(*flags, type=positive_int, default=None)
    for flag, kind in (*_SAMPLING_FLAGS.get(command, ()), *_VALUE_FLAGS.get(command, ())):
        p.add_argument(flag, type=kind, default=None)
    p.add_argument("--model", type=nonempty_path, default=None)
    if command == "serve":
        p.add_argument("--port", type=port, default=None)
    if command == "generate":
        p.add_argument("--prompt", "-p", default=None)
        p.add_argument("--ignore-chat-template", action="store_true")
    ns, _ = p.parse_known_args(list(argv))
    if command == "generate" and ns.ignore_chat_template and ns.prompt == "":
        # No chat template to add tokens: mlx-lm would load the model, then
        # fail on an empty token list.
        p.error("argument --prompt/-p: empty with --ignore-chat-template: there is no token "
                "to generate from")


def _usable_backends() -> tuple[list[str], list[str]]:
    """(backends ``qab generate|chat|serve`` can use, other registered backends)."""
    from .loader import MLX_BACKENDS, plugin_mlx_backends
    from .plugins import get_registry

    usable = [*MLX_BACKENDS, *plugin_mlx_backends()]
    others = sorted(set(get_registry().backends) - set(usable))
    return usable, others


def _check_backend_arg(command: str, name: Optional[str]) -> Optional[str]:
    """``--backend`` against the registry; raises UsageError with the available names."""
    if name is None:
        return None
    usable, others = _usable_backends()
    value = name.strip().lower()
    if value in usable:
        return value
    if value in others:
        raise UsageError(
            f"--backend: backend {value!r} does not load mlx-lm models, so `qab {command}` "
            f"cannot use it (available here: {', '.join(usable)}); compare it with "
            f"`qab compare --backends stock,{value}=MODEL`")
    raise UsageError(
        f"--backend: unknown backend {value!r} (available: {', '.join(usable)}"
        + (f"; registered by plugins for qab compare/bench only: {', '.join(others)}"
           if others else "") + ")")


def _check_environment(command: str) -> None:
    """Validate every QAB_* variable before any work (one line, exit status 2)."""
    from . import envs
    from .errors import EnvVarError
    from .plugins import check_allowlist

    try:
        check_allowlist()
        backends = _usable_backends()[0] if command in PASSTHROUGH else None
        envs.validate(backends=backends)
    except EnvVarError as exc:
        raise UsageError(str(exc)) from None


#: How mlx-lm's ``speculative_generate_step`` starts its ValueError for a cache it
#: cannot rewind (a Gated DeltaNet layer's ``ArraysCache``).
_UNTRIMMABLE = "Speculative decoding requires a trimmable prompt cache"

#: ``--model``'s help in ``qab generate|chat --help``: mlx_lm.generate's names its
#: hub default, which qab never uses.
_MODEL_HELP = ("The path to the local model directory or Hugging Face repo. Without --model, "
               "qab uses its shipped demo model (not mlx-lm's hub default).")


def _explain(exc: BaseException) -> Optional[str]:
    """A one-line explanation for a known runtime failure, or None."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and "GatherMM" in text and "float32" in text:
        return (f"{text.strip().rstrip('.')} (MLX's CPU backend runs unquantized MoE "
                "experts only in float32): use a float32 checkpoint (`qab make-checkpoint OUT "
                "--dtype float32`), a quantized one (`--layout mlx-q4`), or a GPU")
    if isinstance(exc, ValueError) and text.startswith(_UNTRIMMABLE) and "ArraysCache" in text:
        # mlx-lm's speculative decoding rewinds the cache by the rejected draft tokens.
        return (f"{text.strip().rstrip('.')}: this model family's recurrent (Gated DeltaNet) "
                "layers keep a cache that cannot be trimmed, so --draft-model (speculative "
                "decoding) does not apply to it; leave --draft-model out")
    return None


def _run_passthrough(command: str, argv: Sequence[str]) -> int:
    import importlib

    module_name, _ = PASSTHROUGH[command]
    ours, rest = _backend_parser(command).parse_known_args(argv)
    wants_help = "-h" in rest or "--help" in rest
    if wants_help:
        try:
            usable = ", ".join(_usable_backends()[0])
        except Exception:  # noqa: BLE001 - help must print even with broken plugins
            usable = "auto, fused, stock"
        print(f"qab {command}: {module_name} with the qwen-apple-backend registry enabled.\n"
              "Extra flags:\n"
              f"  --backend NAME                backend for the model: {usable} "
              "(default auto, or env QAB_BACKEND)\n"
              "  --qab-report                  print which modules were fused, once after "
              "loading\n"
              + ("  --max-request-bytes N         larger request bodies get HTTP 413 "
                 "(default 32 MiB)\n"
                 "  --request-timeout SECONDS     close a connection silent this long while "
                 "its request is read; a cut-short body gets HTTP 408 (default 60)\n"
                 if command == "serve" else "")
              + f"Flags of {module_name} follow. Without --model, qab uses its shipped "
              "demo model, not mlx-lm's hub default.\n")
    else:
        _check_count_flags(command, rest)
        _check_environment(command)
        ours.backend = _check_backend_arg(command, ours.backend)
    if not (wants_help or _has_flag(rest, "--model") or _has_flag(rest, "--prompt-cache-file")):
        # Without --model, the shipped demo model rather than mlx-lm's hub default
        # (but with a prompt cache, mlx-lm's own choice: the model the cache records).
        from .demo import ensure_default_model

        rest = ["--model", str(ensure_default_model()), *rest]
        print(f"qab {command}: no --model given; using the demo model", file=sys.stderr)
    from . import loader

    loader.enable(ours.backend)
    if command == "serve":
        from . import server

        # Load the model before serving: a bad model fails here, not in a dead thread.
        server.install(max_body_bytes=ours.max_request_bytes, preload=not wants_help,
                       read_timeout=ours.request_timeout)
    if ours.qab_report:
        _print_reports_after_load()
    module = importlib.import_module(module_name)
    restore_help = _model_help_says_demo(module) if wants_help else (lambda: None)
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
    except EOFError:
        if command != "chat":
            raise
        print(file=sys.stderr)  # end of input (Ctrl-D, closed stdin): leave quietly
        return 0
    except (RuntimeError, ValueError) as exc:
        why = _explain(exc)  # the failures it knows
        if why is None and command != "serve" and _raised_by_mlx_lm(exc):
            # mlx_lm.generate / chat refusing its input ("The model ... does not take
            # images.", a --model other than the prompt cache's): its own message.
            why = " ".join(str(exc).split())
        if why is None:
            raise  # any other failure keeps its traceback
        print(f"qab {command}: error: {why}", file=sys.stderr)
        return 1
    finally:
        sys.argv = old_argv
        restore_help()
    return int(result or 0)


def _raised_by_mlx_lm(exc: BaseException) -> bool:
    """Whether ``exc`` is a ValueError raised in mlx-lm's own code (its innermost
    frame is in the ``mlx_lm`` package), not one from this package or a library."""
    if not isinstance(exc, ValueError) or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    return module == "mlx_lm" or module.startswith("mlx_lm.")


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    """Whether ``argv`` gives ``flag``, as ``FLAG VALUE`` or ``FLAG=VALUE``."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _model_help_says_demo(module) -> Callable[[], None]:
    """Make ``module``'s help give :data:`_MODEL_HELP` for ``--model``; returns the undo.

    mlx_lm.generate's help says its hub default model is used without ``--model``,
    but ``qab`` passes its demo model then. The ``--model`` action of the parser that
    ``setup_arg_parser()`` builds gets qab's text (whatever mlx-lm's wording or line
    wrapping); a module without that function (mlx_lm.server, whose ``--model`` help
    names no default) is left alone, and the header line printed before says it too.
    """
    setup = getattr(module, "setup_arg_parser", None)
    if not callable(setup):
        return lambda: None

    def setup_arg_parser(*args, **kwargs):
        parser = setup(*args, **kwargs)
        for action in parser._actions:
            if "--model" in action.option_strings:
                action.help = _MODEL_HELP
        return parser

    module.setup_arg_parser = setup_arg_parser

    def restore() -> None:
        module.setup_arg_parser = setup

    return restore


def _print_reports_after_load() -> None:
    from . import loader

    original = loader.load
    printed: set[int] = set()

    def load_and_report(*args, **kwargs):
        out = original(*args, **kwargs)
        report = loader.get_report(out[0])
        # Once per loaded model (a plugin backend's load() calls load() again).
        if report is not None and id(report) not in printed:
            printed.add(id(report))
            print(report.summary(), file=sys.stderr, flush=True)
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
    from .checkpoint import default_dtype, layouts_for, make_checkpoint

    layouts = layouts_for(args.preset)
    if args.layout not in layouts:
        raise UsageError(f"--preset {args.preset} is written only with --layout "
                         f"{' or '.join(layouts)}: its "
                         f"{args.layout} layout would materialise every parameter unquantized")
    dtype = default_dtype(args.layout) if args.dtype == "auto" else args.dtype
    out = make_checkpoint(args.out, preset=args.preset, layout=args.layout, seed=args.seed,
                          dtype=dtype, vocab_size=args.vocab_size,
                          overwrite=args.overwrite, progress=not args.quiet)
    print(f"wrote {args.layout} checkpoint ({args.preset}, {dtype}) to {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(prompt=args.prompt, max_tokens=args.max_tokens, model=args.model,
                    rebuild=args.rebuild)


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, except where the default is None:
    those help strings say in words what leaving the option out does."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


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

    p = sub.add_parser(
        "make-checkpoint", formatter_class=_DefaultsHelpFormatter,
        help="write a random-weight checkpoint with the real Qwen3.6 layout",
        description="Write a random-weight checkpoint with the exact Qwen3.6-35B-A3B on-disk "
                    "layout (config, safetensors shards, the real tokenizer).")
    p.add_argument("out", type=nonempty_path, help="output directory")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "full"],
                   help="model size: tiny and small for tests, full = Qwen3.6-35B-A3B "
                        "shapes (mlx-q4 layout only)")
    p.add_argument("--layout", default="hf", choices=["hf", "mlx-q4"],
                   help="hf: published HF layout; mlx-q4: mlx-community 4-bit layout")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random seed of the weights")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="stored float dtype; auto = bfloat16 when MLX has a GPU (or for "
                        "--layout mlx-q4), float32 on a CPU-only MLX, whose unquantized "
                        "MoE expert GEMM runs only in float32")
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="embedding rows instead of the real 248,320 (small, fast test "
                        "models; default: the real vocabulary)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser(
        "demo", formatter_class=_DefaultsHelpFormatter,
        help="generate with the embedded default model, fused vs stock",
        description="Load a model on the fused and on the stock backend, generate the same "
                    "greedy continuation of a chat prompt on each, and print the fused "
                    "backend's text, whether stock produced the same text, and both "
                    "backends' prefill and decode tokens per second. Without --model it "
                    "uses the small trained demo model shipped in the package (copied once "
                    "into the cache directory, QAB_CACHE_DIR, with its tokenizer).")
    p.add_argument("--prompt", default="Write a haiku about fast inference.",
                   help="user message, wrapped in the model's chat template")
    p.add_argument("--max-tokens", type=positive_int, default=32,
                   help="tokens to generate on each backend (greedy)")
    p.add_argument("--model", type=nonempty_path, default=None, metavar="PATH",
                   help="checkpoint directory to use instead of the demo model (default: "
                        "the demo model)")
    p.add_argument("--rebuild", action="store_true",
                   help="write the cached copy of the demo model again")
    p.set_defaults(func=cmd_demo)

    from .bench.cli import add_parsers

    add_parsers(sub)
    parser.qab_commands = sub.choices  # name -> its parser, for _main's usage errors
    return parser


def _main(argv: Sequence[str]) -> int:
    from .errors import EnvVarError, QABError

    if argv and argv[0] in PASSTHROUGH:
        try:
            return _run_passthrough(argv[0], argv[1:])
        except UsageError as exc:
            print(f"qab {argv[0]}: error: {exc}" if str(exc).startswith("--")
                  else f"qab: error: {exc}", file=sys.stderr)
            return 2
        except EnvVarError as exc:  # found at run time, e.g. an unusable QAB_CACHE_DIR
            print(f"qab: error: {exc}", file=sys.stderr)
            return 2
        except (QABError, FileNotFoundError) as exc:
            print(f"qab {argv[0]}: error: {exc}", file=sys.stderr)
            return 1
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse reports a subcommand's unknown flags with the top-level usage;
        # the subcommand's own usage says which flags it takes.
        command = parser.qab_commands.get(getattr(args, "command", None), parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    func: Optional[Callable[[argparse.Namespace], int]] = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    # Every subcommand, also those that read no QAB_* variable (backends,
    # make-checkpoint): a misspelt one is reported by the first command run.
    try:
        _check_environment(args.command)
    except UsageError as exc:
        print(f"qab: error: {exc}", file=sys.stderr)
        return 2
    try:
        return func(args)
    except UsageError as exc:  # a combination of flags the command cannot do
        print(f"qab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except EnvVarError as exc:  # found at run time: QAB_PLUGINS, QAB_CACHE_DIR
        print(f"qab: error: {exc}", file=sys.stderr)
        return 2
    except (QABError, ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"qab {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        why = _explain(exc)
        if why is None:
            raise
        print(f"qab {args.command}: error: {why}", file=sys.stderr)
        return 1


def _quiet_stdout() -> None:
    """Point stdout at the null device, so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``qab`` command; returns the exit status.

    A reader that closes the pipe early (``qab backends --json | head -1``) ends
    the command quietly with status 141, like a program killed by SIGPIPE; Ctrl-C
    ends it with status 130, without a traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except KeyboardInterrupt:
        try:
            print(file=sys.stderr)
        except (OSError, ValueError):
            pass
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
