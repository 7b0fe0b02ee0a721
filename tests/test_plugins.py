"""Plugin discovery, registry precedence, failure handling and `qab backends`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qwen_apple_backend import hookimpl, plugins
from qwen_apple_backend.errors import PluginLoadError, UnknownArchitectureError, UnknownBackendError
from qwen_apple_backend.registry import BUILTIN_PRIORITY, Registry, candidate_architectures

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_PLUGIN = REPO / "plugins" / "qab-example-plugin"


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    monkeypatch.delenv("QAB_PLUGINS", raising=False)
    plugins.reset()
    yield
    plugins.reset()


def test_builtin_is_discovered_through_the_entry_point():
    state = plugins.load_plugins()
    info = state.plugins["qwen"]
    assert info.source == "entry point"
    assert info.distribution == "qwen-apple-backend"
    for arch in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_next",
                 "Qwen3_5MoeForConditionalGeneration"):
        assert state.registry.architecture(arch).plugin == "qwen"
    assert {"stock", "fused"} <= set(state.registry.backends)


def test_load_plugins_is_idempotent():
    assert plugins.load_plugins() is plugins.load_plugins()
    assert plugins.load_plugins(force=True) is not None


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"},
      "architectures": ["Qwen3_5MoeForConditionalGeneration"]},
     ["qwen3_5_moe", "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration"]),
    ({"model_type": "llama", "architectures": "LlamaForCausalLM"}, ["llama", "LlamaForCausalLM"]),
    ({"model_type": "x", "text_config": {"model_type": "x"}}, ["x"]),
])
def test_candidate_architecture_order(config, expected):
    assert candidate_architectures(config) == expected


def test_resolution_by_text_config_and_architectures():
    # text_config.model_type alone, and architectures[] alone, are enough.
    name, entry = plugins.resolve_architecture({"model_type": "unknown_wrapper",
                                                "text_config": {"model_type": "qwen3_5_moe_text"}})
    assert (name, entry.target) == ("qwen3_5_moe_text", "qwen_apple_backend.models.qwen3_5_moe:Adapter")
    name, entry = plugins.resolve_architecture({"model_type": "nope",
                                                "architectures": ["Qwen3NextForCausalLM"]})
    assert entry.target.endswith("qwen3_next:Adapter")
    assert plugins.resolve_architecture({"model_type": "llama"}) is None


class _ThirdParty:
    @hookimpl
    def qab_register_architectures(self, register):
        register("qwen3_5_moe", "tests_fake:Adapter", description="third party")
        register("brand_new_arch", "tests_fake:Other")

    @hookimpl
    def qab_register_backends(self, register):
        register("fake-backend", "tests_fake:Backend")


def test_third_party_registration_wins_over_builtin():
    plugins.register_plugin(_ThirdParty(), name="thirdparty")
    reg = plugins.get_registry()
    assert reg.architecture("qwen3_5_moe").plugin == "thirdparty"
    assert reg.architecture("brand_new_arch").target == "tests_fake:Other"
    # Both claims are kept and listed, the built-in one last.
    assert [e.plugin for e in reg.iter_architectures() if e.name == "qwen3_5_moe"] == \
        ["thirdparty", "qwen"]
    assert reg.backend("fake-backend").plugin == "thirdparty"
    plugins.unregister_plugin("thirdparty")
    assert plugins.get_registry().architecture("qwen3_5_moe").plugin == "qwen"


class _Dynamic:
    @hookimpl
    def qab_get_builder(self, architecture):
        return "dyn_mod:Adapter" if architecture == "qwen3_5" else None


def test_get_builder_hook_answers_first():
    plugins.register_plugin(_Dynamic(), name="dynamic")
    name, entry = plugins.resolve_architecture({"model_type": "qwen3_5"})
    assert entry.target == "dyn_mod:Adapter"
    _, entry = plugins.resolve_architecture({"model_type": "qwen3_next"})
    assert entry.plugin == "qwen"


class _Broken:
    @hookimpl
    def qab_register_architectures(self, register):
        raise RuntimeError("boom in register")


def test_plugin_whose_hook_raises_is_reported_and_skipped():
    plugins.register_plugin(_Broken(), name="broken")
    state = plugins.load_plugins()
    assert "broken" in state.failed and "boom in register" in state.failed["broken"]
    assert state.registry.architecture("qwen3_5_moe").plugin == "qwen"


def test_registry_errors_are_clear():
    reg = Registry()
    with pytest.raises(ValueError, match="module:attr"):
        reg.add_architecture("a", "no_colon", "p")
    with pytest.raises(UnknownArchitectureError, match="no plugin claims architecture 'zzz'"):
        reg.require_architecture("zzz")
    with pytest.raises(UnknownBackendError, match="unknown backend 'nope'") as info:
        reg.backend("nope")
    assert "optional plugin" not in str(info.value)
    # The optional plugin's backend, not installed: what to install is named.
    with pytest.raises(UnknownBackendError,
                       match=r"unknown backend 'llama.cpp'; registered backends: none "
                             r"\('llama.cpp' comes from an optional plugin: pip install "
                             r"plugins/qab-llamacpp"):
        reg.backend("llama.cpp")
    reg.add_architecture("a", "m:builtin", "qwen", priority=BUILTIN_PRIORITY)
    reg.add_architecture("a", "m:other", "other")
    assert reg.architecture("a").target == "m:other"


def _install_example(target: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--no-build-isolation", "--target", str(target), str(EXAMPLE_PLUGIN)],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"pip install of the example plugin failed:\n{out.stderr}"


def _run(code: str, env_extra: dict, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("example_site")
    _install_example(site)
    return site


def test_installed_third_party_plugin_is_discovered_and_wins(example_site, tmp_path):
    env = {"PYTHONPATH": str(example_site)}
    code = """
        import json
        from qwen_apple_backend import plugins
        s = plugins.load_plugins()
        print(json.dumps({"plugins": {k: v.source for k, v in s.plugins.items()},
                          "llama": s.registry.architecture("llama").plugin,
                          "failed": s.failed}))
    """
    out = _run(code, env, tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    # Other installed plugins (e.g. qab-llamacpp) may be listed too.
    assert {k: data["plugins"].get(k) for k in ("example", "qwen")} == \
        {"example": "entry point", "qwen": "entry point"}
    assert data["llama"] == "example"
    assert "example" not in data["failed"] and "qwen" not in data["failed"]
    # `qab backends` lists it with the architecture it claims.
    cli = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "backends"],
                         capture_output=True, text=True, env=dict(os.environ, **env), cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert "example" in cli.stdout and "qab_example_plugin.adapter:CountingLlamaAdapter" in cli.stdout


def test_allowlist_and_broken_entry_point(tmp_path, example_site):
    # A distribution whose entry point cannot be imported.
    broken = tmp_path / "broken_site"
    dist = broken / "qab_broken-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qab-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[qwen_apple_backend]\nbroken = qab_missing_module_xyz\n")
    env = {"PYTHONPATH": os.pathsep.join([str(broken), str(example_site)])}
    code = """
        import json
        from qwen_apple_backend import plugins
        s = plugins.load_plugins()
        print(json.dumps({"plugins": sorted(s.plugins), "failed": s.failed}))
    """
    out = _run(code, env, tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    # Other installed plugins (e.g. qab-llamacpp) may be listed too.
    assert {"example", "qwen"} <= set(data["plugins"]) and "broken" not in data["plugins"]
    assert "qab_missing_module_xyz" in data["failed"]["broken"]
    assert "failed to load and was skipped" in out.stderr
    # Asked for by name: it raises, naming the plugin.
    out = _run(code, {**env, "QAB_PLUGINS": "qwen,broken"}, tmp_path)
    assert out.returncode != 0
    assert "PluginLoadError" in out.stderr and "'broken'" in out.stderr
    # The allowlist keeps the others out.
    out = _run(code, {**env, "QAB_PLUGINS": "qwen"}, tmp_path)
    assert json.loads(out.stdout.strip().splitlines()[-1])["plugins"] == ["qwen"]


def test_allowlist_naming_a_missing_plugin_raises(monkeypatch):
    from importlib.metadata import entry_points

    from qwen_apple_backend.errors import EnvVarError

    available = sorted({ep.name for ep in entry_points(group=plugins.ENTRY_POINT_GROUP)}
                       | {"qwen"})
    monkeypatch.setenv("QAB_PLUGINS", "qwen,not_installed_anywhere")
    with pytest.raises(PluginLoadError) as info:
        plugins.load_plugins(force=True)
    # Also an EnvVarError: the message names the variable, the unknown name and the
    # available plugins.
    assert isinstance(info.value, EnvVarError)
    assert str(info.value) == ("QAB_PLUGINS: unknown plugin 'not_installed_anywhere' "
                               f"(available: {', '.join(available)})")
    with pytest.raises(EnvVarError):
        plugins.check_allowlist()
    monkeypatch.setenv("QAB_PLUGINS", "qwen")
    assert plugins.check_allowlist() == frozenset({"qwen"})


class _PluginBackends:
    """A plugin MLX backend (the fused backend under another name) and a non-MLX one."""

    @hookimpl
    def qab_register_backends(self, register):
        register("fused-too", "qwen_apple_backend.backends.fused:FusedBackend",
                 description="the fused backend, registered by a plugin")
        register("remote-thing", "tests.test_plugins:_NotMLX")


class _NotMLX:
    name = "remote-thing"

    def available(self):
        return True, ""


def test_cli_backend_choices_come_from_the_registry(tiny_hf_f32):
    from qwen_apple_backend import cli, load

    plugins.register_plugin(_PluginBackends(), name="more-backends")
    usable, others = cli._usable_backends()
    # Other installed plugins (e.g. qab-llamacpp's "llama.cpp") may add
    # compare/bench-only backends; ours must be among them.
    assert usable == ["auto", "fused", "stock", "fused-too"] and "remote-thing" in others
    only = re.escape(", ".join(others))
    assert cli._check_backend_arg("generate", "Fused-Too") == "fused-too"
    with pytest.raises(cli.UsageError, match=r"--backend: backend 'remote-thing' does not load "
                                             r"mlx-lm models, so `qab generate` cannot use it "
                                             r"\(available here: auto, fused, stock, "
                                             r"fused-too\)"):
        cli._check_backend_arg("generate", "remote-thing")
    with pytest.raises(cli.UsageError, match=r"unknown backend 'nope' \(available: auto, fused, "
                                             r"stock, fused-too; registered by plugins for qab "
                                             r"compare/bench only: " + only + r"\)"):
        cli._check_backend_arg("chat", "nope")
    # The plugin's MLX backend loads through its own load().
    model, _ = load(tiny_hf_f32, "fused-too")
    assert model.qab_report.backend == "fused" and model.qab_report.counts()["moe"] == (4, 4)
