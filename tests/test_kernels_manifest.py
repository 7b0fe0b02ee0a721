"""kernels/MANIFEST.toml and the kernel folders agree; sources carry what MLX needs."""

from __future__ import annotations

import re

import pytest

from qwen_apple_backend.ops._sources import BACKENDS, compact, kernel_dir, kernel_source, manifest


def test_every_listed_file_exists_and_every_file_is_listed():
    root = kernel_dir()
    listed = set()
    for op, entry in manifest().items():
        for backend in BACKENDS:
            files = entry.get(backend) or {}
            for rel in [files.get("body"), *files.get("header", [])]:
                if rel:
                    assert (root / rel).is_file(), f"{op}/{backend}: {rel} missing"
                    listed.add(rel)
    on_disk = {p.relative_to(root).as_posix() for b in BACKENDS
               for p in (root / b).glob("*") if p.is_file()}
    assert on_disk == listed, f"unlisted: {on_disk - listed}, missing: {listed - on_disk}"


@pytest.mark.parametrize("op", sorted(manifest()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bodies_use_their_declared_names(op, backend):
    src = kernel_source(op, backend)
    if src is None:
        pytest.skip(f"{op} has no {backend} source")
    code = src.header + src.body
    for name in (*src.inputs, *src.outputs, *src.template):
        assert re.search(rf"\b{re.escape(name)}\b", code), f"{op}/{backend}: {name} unused"
    assert src.name == f"qab_{op}"


def test_written_inputs_are_inputs():
    # `writes` names inputs a kernel writes in place (the emulator hands those
    # writes back); the packed MoE block's builds declare theirs.
    for op, entry in manifest().items():
        assert set(entry.get("writes", ())) <= set(entry["inputs"]), op
    assert kernel_source("moe_decode_block_gdn_pack", "cuda").writes == (
        "count", "gd_conv_state", "gd_state")
    assert kernel_source("moe_decode_block_pack", "cuda").writes == ("count",)
    assert kernel_source("moe_decode_block", "cuda").writes == ()


def test_kernel_sources_ship_in_the_wheel_config():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    setup = (root / "setup.py").read_text(encoding="utf-8")
    # setup.py maps the checkout's kernels/ into the package as _kernels.
    assert '"qwen_apple_backend._kernels": "kernels"' in setup
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    data = pyproject["tool"]["setuptools"]["package-data"]
    assert "qwen_apple_backend._kernels" in data


def test_unverified_cuda_kernels_are_opt_in(monkeypatch, tmp_path):
    import dataclasses

    import mlx.core as mx

    from qwen_apple_backend.ops import device

    built = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: built.append(kw["name"]) or "k",
                        raising=False)
    src = kernel_source("gated_delta_scan", "cuda")
    assert src.verified  # verified on a GPU: built without opting in
    monkeypatch.delenv("QAB_UNVERIFIED_KERNELS", raising=False)
    monkeypatch.setenv("QAB_CACHE_DIR", str(tmp_path))  # the include form's files
    assert device.build_kernel("gated_delta_scan", "cuda") == "k"
    unverified = dataclasses.replace(src, verified="")
    monkeypatch.setattr(device, "kernel_source", lambda op, backend: unverified)
    assert device.build_kernel("gated_delta_scan", "cuda") is None
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    assert device.build_kernel("gated_delta_scan", "cuda") == "k"
    assert built == ["qab_gated_delta_scan", "qab_gated_delta_scan"]


def test_metal_kernels_need_no_verification_stamp():
    # Metal kernels are gated by their on-device self-check alone.
    for op, entry in manifest().items():
        assert "verified" not in (entry.get("metal") or {}), op


def _launch(code: str) -> str:
    m = re.search(r"Launch: (grid \([^)]*\) threads, threadgroup \([^)]*\))", code)
    return m[1] if m else ""


@pytest.mark.parametrize("op", sorted(manifest()))
def test_metal_and_cuda_bodies_share_the_launch_contract(op):
    # The dispatchers pass one launch configuration to either backend, so a
    # Metal body must document the same grid and threadgroup as the CUDA one.
    cuda, metal = kernel_source(op, "cuda"), kernel_source(op, "metal")
    if cuda is None or metal is None:
        pytest.skip(f"{op} has no source for one backend")
    assert _launch(cuda.body) and _launch(cuda.body) == _launch(metal.body), op


CUDA_ONLY = ("__syncthreads", "__shared__", "threadIdx", "blockIdx", "blockDim", "__shfl",
             "asm volatile", "__nv_", "__device__")


@pytest.mark.parametrize("op", sorted(manifest()))
def test_metal_bodies_hold_no_cuda(op):
    src = kernel_source(op, "metal")
    if src is None:
        pytest.skip(f"{op} has no Metal source")
    code = src.header + src.body
    found = [tok for tok in CUDA_ONLY if tok in code]
    assert not found, f"{op}: CUDA-only constructs in the Metal source: {found}"


def test_metal_kernels_are_built_without_opt_in(monkeypatch):
    # Metal sources need no verification stamp: build_kernel hands every one
    # to mx.fast.metal_kernel (the self-check decides later), as listed.
    import mlx.core as mx

    from qwen_apple_backend.ops import device

    built = {}
    monkeypatch.setattr(mx.fast, "metal_kernel", lambda **kw: built.setdefault(kw["name"], kw),
                        raising=False)
    monkeypatch.delenv("QAB_UNVERIFIED_KERNELS", raising=False)
    ops = [op for op in sorted(manifest()) if kernel_source(op, "metal") is not None]
    assert "moe_grouped_gemm" in ops
    for op in ops:
        src = kernel_source(op, "metal")
        kw = device.build_kernel(op, "metal")
        assert kw is built[src.name]
        assert kw["source"] == compact(src.body) and kw["header"] == compact(src.header)
        assert kw["input_names"] == list(src.inputs) and kw["output_names"] == list(src.outputs)


def test_compact_drops_comments_and_indentation_only():
    code = ('// file comment\n'
            '#define N 4  // four\n'
            '  int a/**/b = 1; /* a block\n  over lines */ int c;\n'
            '\n'
            '    asm volatile("x // not a comment;\\n" ::);\n'
            "    char q = '\\'', s = '/';  \n")
    assert compact(code) == ('#define N 4\n'
                             'int a b = 1;   int c;\n'
                             'asm volatile("x // not a comment;\\n" ::);\n'
                             "char q = '\\'', s = '/';\n")
    assert compact("") == "" and compact("// only\n\n") == ""
    # Line splices join first, as in the C preprocessor (also inside a // comment);
    # a quote between digits is a separator, not a character literal.
    assert compact("#define F(x) \\\n  ((x) + 1)  \\\n// end\nint w = F(1);\n") == (
        "#define F(x)   ((x) + 1)\nint w = F(1);\n")
    assert compact("// note \\\nint hidden;\nint shown;\n") == "int shown;\n"
    assert compact("int x = 1'000; /* don't\n here */ int y = 0xFF'FF; char c = L'a';\n") == (
        "int x = 1'000;   int y = 0xFF'FF; char c = L'a';\n")
    with pytest.raises(ValueError, match="unterminated"):
        compact("int a; /* open")
