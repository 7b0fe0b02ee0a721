"""Write a plugin in a few lines: claim an architecture with ``hookimpl`` and watch it resolve.

A plugin is any module or object with ``hookimpl`` functions. Installed
plugins are found through the ``qwen_apple_backend`` entry-point group (see
``plugins/qab-example-plugin``); here the plugin lives in this script and is
registered at run time with ``register_plugin``. It makes two claims:

* ``my_toy_arch``, a name nobody else claims, with a plain ``Adapter``;
* the ``model_type`` of ``--model``: a third-party claim (default priority 0)
  beats the built-in one (priority -100), so loading the checkpoint goes
  through this plugin's adapter, which delegates to the adapter it displaced
  and notes that it ran.

    python examples/write_your_own_plugin.py --model path/to/checkpoint
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qwen_apple_backend import hookimpl
from qwen_apple_backend.models.base import Adapter

PLUGIN_NAME = "my-plugin"


class ToyAdapter(Adapter):
    """Stock mlx-lm model, nothing fused: the smallest valid adapter."""

    name = "toy"


class ObservingAdapter(Adapter):
    """Wraps the adapter that won before this plugin and records that ``fuse`` ran."""

    name = "observing"
    inner: Adapter = Adapter()  # set in main() to the displaced adapter
    fused_calls = 0

    def prepare_config(self, config, report):
        return self.inner.prepare_config(config, report)

    def get_model_classes(self, config):
        return self.inner.get_model_classes(config)

    def fuse(self, model, config, *, disable=frozenset(), use_fallback=True, report):
        self.inner.fuse(model, config, disable=disable, use_fallback=use_fallback,
                        report=report)
        ObservingAdapter.fused_calls += 1
        report.notes.append(f"{PLUGIN_NAME}: ObservingAdapter.fuse ran")


class MyPlugin:
    """The plugin: one hook implementation. ``claimed`` is filled in by main()."""

    claimed: list = []

    @staticmethod
    @hookimpl
    def qab_register_architectures(register):
        # Targets are "module:attr" strings, imported only when a model resolves to them;
        # "__main__" is this script.
        register("my_toy_arch", "__main__:ToyAdapter", description="example: stock model")
        for name in MyPlugin.claimed:
            register(name, "__main__:ObservingAdapter",
                     description="example: delegates to the displaced adapter")


def describe(match) -> str:
    if match is None:
        return "nobody (stock mlx-lm)"
    name, entry = match
    return f"{name} -> {entry.target} (plugin {entry.plugin})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the demo model, built once)")
    args = parser.parse_args()

    from qwen_apple_backend import get_report, load
    from qwen_apple_backend.loader import read_config
    from qwen_apple_backend.plugins import (register_plugin, resolve_architecture,
                                            unregister_plugin)

    if args.model is None:
        from qwen_apple_backend.demo import ensure_default_model

        args.model = str(ensure_default_model())
    if not Path(args.model).is_dir():
        from qwen_apple_backend.errors import MissingCheckpointFileError

        raise MissingCheckpointFileError(f"{args.model}: checkpoint directory not found")
    config = read_config(Path(args.model))  # config.json, with errors naming the file
    model_type = config["model_type"]

    before = resolve_architecture(config)
    print(f"before: {model_type} resolves to {describe(before)}")
    if before is not None:
        ObservingAdapter.inner = before[1].load()()
    MyPlugin.claimed = [model_type]

    name = register_plugin(MyPlugin(), name=PLUGIN_NAME)
    try:
        print(f"registered plugin: {name}")
        toy = resolve_architecture({"model_type": "my_toy_arch"})
        print(f"my_toy_arch resolves to {describe(toy)}")
        print(f"after: {model_type} resolves to {describe(resolve_architecture(config))}")
        model, _ = load(args.model, backend="fused")
        report = get_report(model)
        print(f"loaded with adapter {report.adapter} from plugin {report.plugin}")
        print(f"ObservingAdapter.fuse calls: {ObservingAdapter.fused_calls}")
        print(report.summary())
    finally:
        unregister_plugin(name)
    print(f"unregistered: {model_type} resolves to {describe(resolve_architecture(config))}")


if __name__ == "__main__":
    from qwen_apple_backend.errors import QABError

    try:
        main()
    except QABError as exc:  # a bad --model: missing, not a checkpoint, no tokenizer, ...
        sys.exit(f"{Path(sys.argv[0]).name}: error: {exc}")
