"""The wheel builds without setuptools warnings and ships the kernels and the demo model."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the wheel from a copy of the tracked files (the checkout's build/ is left alone)."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    if not files or files == [""]:
        pytest.skip("not a git checkout")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                            "--no-build-isolation", "-v", "-w", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    (path,) = out.glob("qwen_apple_backend-*.whl")
    return path, build.stdout + build.stderr, src


def test_wheel_builds_without_setuptools_warnings(wheel):
    _, log, _ = wheel
    assert "SetuptoolsDeprecationWarning" not in log, log[-4000:]
    assert "is absent from the `packages` configuration" not in log, log[-4000:]


def test_wheel_ships_kernels_and_demo_model(wheel):
    path, _, src = wheel
    names = set(zipfile.ZipFile(path).namelist())
    expected = {"qwen_apple_backend/_kernels/MANIFEST.toml",
                "qwen_apple_backend/demo_model/config.json",
                "qwen_apple_backend/demo_model/model.safetensors"}
    for folder in ("cuda", "metal"):
        expected |= {f"qwen_apple_backend/_kernels/{folder}/{p.name}"
                     for p in (src / "kernels" / folder).iterdir() if p.is_file()}
    assert expected <= names, sorted(expected - names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(path).read(metadata).decode()
    assert "License-Expression: MIT" in text


def _make_dry_run(target, venv):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"],
                         capture_output=True, text=True, check=True)
    return out.stdout


def test_make_demo_installs_only_the_package(tmp_path):
    """A fresh `make demo` installs the package (with MLX's CPU backend), not the test tools,
    torch or llama-cpp-python; `make test` installs those, each with its own stamp file."""
    demo = _make_dry_run("demo", tmp_path / "venv")
    assert '-e ".[cpu]"' in demo and ".demo-installed" in demo and "qab demo" in demo
    for absent in (".[test]", "torch", "llama-cpp-python"):
        assert absent not in demo, absent
    # It reads make install's stamp (nothing to install after it) but never writes it.
    assert [line for line in demo.splitlines() if ".test-installed" in line] == [
        'if [ ! %s/.test-installed -nt pyproject.toml ]; then %s/bin/python -m pip install '
        '--quiet -e ".[cpu]"; fi' % (tmp_path / "venv", tmp_path / "venv")]
    test = _make_dry_run("test", tmp_path / "venv")
    for present in ('-e ".[test]"', "torch==", "llama-cpp-python==", ".test-installed",
                    "-m pytest"):
        assert present in test, present
    assert ".demo-installed" not in test
