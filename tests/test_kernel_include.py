"""CUDA kernel texts handed to MLX as ``#include`` lines (``ops.device.included_cuda_source``).

MLX hashes a custom kernel's whole text at every launch it encodes, so the
package writes each kernel's compacted header and body once, content-addressed,
under the cache dir and hands MLX two ``#include`` lines. These tests pin the
files' content, MLX's shape-parameter detection on the short body, the
fallbacks (no writable folder, a path an ``#include "..."`` cannot hold, the
switch off) and that ``build_kernel`` passes the short form. That NVRTC's
preprocessor makes the same kernel of it is checked with nvcc in
``test_kernels_compile.py`` (``test_included_source_is_the_same_code``).
"""

from __future__ import annotations

import pytest

from qwen_apple_backend.errors import EnvVarError
from qwen_apple_backend.ops import device
from qwen_apple_backend.ops._sources import compact, kernel_source, manifest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QAB_KERNEL_INCLUDE", raising=False)
    return tmp_path / "cache" / "cuda-src"


def _included_path(line: str):
    from pathlib import Path

    assert line.startswith('#include "'), line
    return Path(line[len('#include "'):line.index('"', len('#include "'))])


def test_texts_are_written_once_and_included_by_absolute_path(cache):
    header = "__device__ inline float qab_twice(float v) { return 2.f * v; }\n"
    body = "out[0] = qab_twice(x[0]) + float(x_shape[0]) + float(w_strides[0]);\n"
    short_header, short_body = device.included_cuda_source("qab_probe", header, body,
                                                           ("x", "w", "y"))
    h_path = _included_path(short_header)
    b_path = _included_path(short_body.splitlines()[0])
    assert h_path.is_absolute() and h_path.parent == cache.resolve()
    assert h_path.read_text(encoding="utf-8") == header
    assert b_path.read_text(encoding="utf-8") == body
    assert h_path.name.startswith("qab_probe-") and h_path.name.endswith("-header.cuh")
    # MLX passes x's shape and w's strides because the body names them; the
    # short body must name exactly those (MLX's test is a substring search).
    assert short_body.splitlines()[1] == "// w_strides x_shape"
    for name in ("x", "w", "y"):
        for suffix in ("_shape", "_strides", "_ndim"):
            assert (name + suffix in body) == (name + suffix in short_body), name + suffix
    # Another text: another file (the digest is in the name, so MLX compiles
    # and caches it as another module); the same text: the same file.
    other = device.included_cuda_source("qab_probe", header, body + "out[1] = 0.f;\n",
                                        ("x", "w", "y"))
    assert _included_path(other[1].splitlines()[0]) != b_path
    assert device.included_cuda_source("qab_probe", header, body,
                                       ("x", "w", "y")) == (short_header, short_body)


def test_another_cache_dir_is_followed(cache, tmp_path, monkeypatch):
    first = device.included_cuda_source("qab_probe", "", "out[0] = x[0];\n", ("x",))
    monkeypatch.setenv("QAB_CACHE_DIR", str(tmp_path / "elsewhere"))
    second = device.included_cuda_source("qab_probe", "", "out[0] = x[0];\n", ("x",))
    assert _included_path(second[1]).parent == (tmp_path / "elsewhere" / "cuda-src").resolve()
    assert _included_path(first[1]) != _included_path(second[1])


def test_a_changed_file_is_written_again(cache):
    short = device.included_cuda_source("qab_probe", "", "out[0] = x[0];\n", ("x",))
    assert short[0] == ""  # no header: no header line, no file
    path = _included_path(short[1])
    path.write_text("out[0] = 7.f;\n", encoding="utf-8")
    assert device.included_cuda_source("qab_probe", "", "out[0] = x[0];\n", ("x",)) == short
    assert path.read_text(encoding="utf-8") == "out[0] = x[0];\n"
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no temporary left


def test_an_unwritable_cache_dir_falls_back_to_the_full_text(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x", encoding="utf-8")
    monkeypatch.setenv("QAB_CACHE_DIR", str(blocker))
    assert device.included_cuda_source("qab_probe", "", "out[0] = x[0];\n", ("x",)) is None


@pytest.mark.parametrize("folder", ['say "hi"', "back\\slash", "x_shape", "not-utf8-\udcff"],
                         ids=["quote", "backslash", "shape-token", "not-utf8"])
def test_a_path_an_include_cannot_hold_falls_back(tmp_path, monkeypatch, folder):
    # A quote or backslash cannot sit in #include "..."; a folder named like an
    # input's shape parameter would make MLX pass it (its test is a substring
    # search of the body); a path that is not UTF-8 cannot reach MLX at all.
    monkeypatch.setenv("QAB_CACHE_DIR", str(tmp_path / folder))
    body = "out[0] = x[0];\n"
    assert device.included_cuda_source("qab_probe", "", body, ("x",)) is None
    assert not (tmp_path / folder).exists()  # nothing written


def _capture_builds(monkeypatch):
    import mlx.core as mx

    built = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: built.append(kw) or "k",
                        raising=False)
    monkeypatch.setattr(mx.fast, "metal_kernel", lambda **kw: built.append(kw) or "m",
                        raising=False)
    return built


@pytest.mark.parametrize("op", sorted(op for op, e in manifest().items() if e.get("cuda")))
def test_build_kernel_hands_mlx_the_include_form(op, cache, monkeypatch):
    built = _capture_builds(monkeypatch)
    # (Every op, the ones not yet verified on a GPU included.)
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    src = kernel_source(op, "cuda")
    assert device.build_kernel(op, "cuda") == "k"
    kw = built[-1]
    header, body = compact(src.header), compact(src.body)
    assert len(kw["source"]) < 400 and kw["source"].startswith('#include "')
    assert _included_path(kw["source"].splitlines()[0]).read_text(encoding="utf-8") == body
    if header:
        assert _included_path(kw["header"]).read_text(encoding="utf-8") == header
    else:
        assert kw["header"] == ""
    for name in src.inputs:
        for suffix in ("_shape", "_strides", "_ndim"):
            assert (name + suffix in body) == (name + suffix in kw["source"]), name + suffix
    assert kw["name"] == src.name and kw["input_names"] == list(src.inputs)


def test_switched_off_or_metal_hands_mlx_the_full_text(cache, monkeypatch):
    built = _capture_builds(monkeypatch)
    monkeypatch.setenv("QAB_KERNEL_INCLUDE", "0")
    src = kernel_source("gqa_decode_step", "cuda")
    device.build_kernel("gqa_decode_step", "cuda")
    assert built[-1]["source"] == compact(src.body)
    assert built[-1]["header"] == compact(src.header)
    assert not cache.exists()
    monkeypatch.setenv("QAB_KERNEL_INCLUDE", "1")
    metal = kernel_source("gated_delta_decode", "metal")
    assert device.build_kernel("gated_delta_decode", "metal") == "m"
    assert built[-1]["source"] == compact(metal.body)  # Metal: never the include form


def test_a_bad_switch_value_names_the_variable(monkeypatch):
    from qwen_apple_backend import envs

    monkeypatch.setenv("QAB_KERNEL_INCLUDE", "maybe")
    with pytest.raises(EnvVarError, match="^QAB_KERNEL_INCLUDE: expected one of"):
        envs.kernel_include()
    with pytest.raises(EnvVarError, match="QAB_KERNEL_INCLUDE"):
        envs.validate()
    for value, on in (("", True), ("off", False), ("No", False), ("yes", True)):
        monkeypatch.setenv("QAB_KERNEL_INCLUDE", value)
        assert envs.kernel_include() is on
