"""gemv-kernel: the dense 4-bit decode GEMV dispatcher (ops/linear.py, layers/linear.py).

The CUDA kernel itself runs in tests/test_kernels_gpu_linear.py (GPU machine) and
tests/test_kernels_cuda_emulated.py (CPU emulation). Here: launch parameters,
the contract check, the self-check gate with fake kernels (a wrong one is
never used; a right one is used by lm_head), the exact
MLX fallback on the CPU, and the ablation switch.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from qwen_apple_backend import get_report, load
from qwen_apple_backend.layers.linear import DecodeQuantizedLinear, install_gemv_lm_head
from qwen_apple_backend.ops import device
from qwen_apple_backend.ops import linear as ql

from ._metrics import mx_rel_l2


def qlinear(N, K, group_size=64, bits=4, seed=0, dtype=mx.bfloat16):
    mx.random.seed(seed)
    lin = nn.Linear(K, N, bias=False)
    lin.weight = lin.weight.astype(dtype)
    q = nn.QuantizedLinear.from_linear(lin, group_size=group_size, bits=bits)
    mx.eval(q.parameters())
    return q


@pytest.mark.parametrize("K", [96, 512, 640, 2048, 4096])
@pytest.mark.parametrize("N", [100, 2048, 12352, 248320])
def test_launch_covers_every_row_with_lanes_that_divide_the_row(N, K):
    p = ql.gemv_launch(1, N, K)
    nc = K // 32
    assert p["LPR"] in (1, 2, 4, 8, 16, 32) and nc % p["LPR"] == 0
    # Largest such power of two: no lane idles when a wider split divides.
    assert p["LPR"] == 32 or nc % (2 * p["LPR"]) != 0
    rows_per_block = (p["threads"] // 32) * (32 // p["LPR"]) * p["RPW"]
    # Warps walk rows grid-stride: either every row has a first pass or the grid is capped.
    assert p["blocks"] * rows_per_block >= N or p["blocks"] == 1024
    assert p["RPW"] == (1 if N <= 4096 else 2 if N <= 32768 else 4)


@pytest.mark.parametrize("sms", [0, 1, 132])
@pytest.mark.parametrize("N", [100, 2048, 12352, 248320])
def test_pipelined_launch_aims_at_one_resident_wave(N, sms):
    p = ql.gemv_launch(1, N, 2048, pipe=True, sms=sms)
    assert p["PIPE"] and p["LPR"] == 32
    assert p["RPW"] == (1 if N <= 32768 else 2)
    needed = -(-N // (8 * p["RPW"]))
    cap = ql.PIPE_BLOCKS_PER_SM * sms if sms else 1024
    assert p["blocks"] == max(1, min(needed, cap, 1024))
    # Without pipe (and by default, GEMV_PIPE off) the one-pass grid, whatever the SMs.
    assert ql.gemv_launch(1, N, 2048, pipe=False, sms=sms) == ql.gemv_launch(1, N, 2048)
    assert not ql.gemv_launch(1, N, 2048)["PIPE"]


def test_sm_count_is_an_int():
    # 0 without a CUDA driver (this CPU machine), the device's SMs with one.
    from qwen_apple_backend.ops.device import cuda_sm_count

    n = cuda_sm_count()
    assert isinstance(n, int) and n >= 0


def test_contract_check(monkeypatch):
    q = qlinear(256, 2048)
    assert not ql.gemv_supported(1, q["weight"], q["scales"], q["biases"], 64, 4, "affine",
                                 mx.bfloat16)  # 256 KB: below GEMV_MIN_BYTES
    monkeypatch.setattr(ql, "GEMV_MIN_BYTES", 0)
    w, s, b = q["weight"], q["scales"], q["biases"]
    ok = dict(group_size=64, bits=4, mode="affine", dtype=mx.bfloat16)
    assert ql.gemv_supported(1, w, s, b, **ok)
    assert ql.gemv_supported(4, w, s, b, **ok)
    assert not ql.gemv_supported(5, w, s, b, **ok)  # more rows than GEMV_MAX_ROWS
    assert not ql.gemv_supported(0, w, s, b, **ok)
    assert not ql.gemv_supported(1, w, s, None, **ok)  # no biases
    assert not ql.gemv_supported(1, w, s, b, **{**ok, "dtype": mx.int32})
    assert not ql.gemv_supported(1, w, s, b, **{**ok, "mode": "mxfp4"})
    q8 = qlinear(256, 2048, bits=8)
    assert not ql.gemv_supported(1, q8["weight"], q8["scales"], q8["biases"],
                                 **{**ok, "bits": 8})
    # x staged as float in 32 KB of shared memory: 4 rows of 4096 do not fit.
    q4k = qlinear(64, 4096)
    assert ql.gemv_supported(2, q4k["weight"], q4k["scales"], q4k["biases"], **ok)
    assert not ql.gemv_supported(3, q4k["weight"], q4k["scales"], q4k["biases"], **ok)
    tiny = qlinear(8, 2048)  # N < 32: not worth a launch (shared_expert_gate is N = 1)
    assert not ql.gemv_supported(1, tiny["weight"], tiny["scales"], tiny["biases"], **ok)


def test_cpu_runs_mlx_unchanged():
    q = qlinear(256, 2048)
    x = mx.random.normal((1, 1, 2048), key=mx.random.key(1)).astype(mx.bfloat16)
    assert ql.gemv_ready(x, q["weight"], q["scales"], q["biases"], 64) is None
    assert mx.array_equal(ql.linear(q, x), q(x)).item()


def _reference_kernel(x, w, scales, biases, group_size, norm_weight=None, eps=0.0, pipe=None):
    # pipe: the kernel's double-buffered build, same output (not modelled).
    if norm_weight is not None:
        x = mx.fast.rms_norm(x, norm_weight, eps)
    wf = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                       group_size=group_size, bits=4)
    return (x.astype(mx.float32) @ wf.T).astype(x.dtype)


@pytest.fixture
def fake_cuda(monkeypatch):
    """ops.linear on a pretend CUDA device whose kernel is ``state['kernel']``."""
    state = {"calls": 0, "norm_calls": 0, "kernel": _reference_kernel, "pipes": []}

    def kernel(*a, **kw):
        state["calls"] += 1
        if kw.get("norm_weight") is not None:
            state["norm_calls"] += 1
        state["pipes"].append((kw.get("norm_weight") is not None, kw.get("pipe")))
        return state["kernel"](*a, **kw)

    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(ql, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(ql, "_gemv_object", lambda backend: object())
    monkeypatch.setattr(ql, "quantized_gemv_kernel", kernel)
    # The tiny models' lm_head is far below the real size rule.
    monkeypatch.setattr(ql, "GEMV_MIN_BYTES", 0)
    device.reset_self_checks()
    yield state
    device.reset_self_checks()


def test_a_kernel_that_passes_its_self_check_is_used(fake_cuda):
    q = qlinear(256, 2048)
    x = mx.random.normal((2, 2048), key=mx.random.key(2)).astype(mx.bfloat16)
    # Before the check, calls take MLX's path (safe inside mx.compile).
    assert mx.array_equal(ql.linear(q, x), q(x)).item() and fake_cuda["calls"] == 0
    ql.prepare(x, q)
    assert fake_cuda["calls"] == 1  # the self-check
    y = ql.linear(q, x)
    assert fake_cuda["calls"] == 2
    ref = _reference_kernel(x, q["weight"], q["scales"], q["biases"], 64)
    assert mx.array_equal(y, ref).item()
    # Another row count is another shape class: checked on its own.
    x1 = x[:1]
    assert mx.array_equal(ql.linear(q, x1), q(x1)).item() and fake_cuda["calls"] == 2


def test_a_wrong_kernel_is_never_used(fake_cuda):
    fake_cuda["kernel"] = lambda *a, **kw: _reference_kernel(*a, **kw) * 1.1
    q = qlinear(256, 2048)
    x = mx.random.normal((1, 2048), key=mx.random.key(3)).astype(mx.bfloat16)
    with pytest.warns(device.KernelSelfCheckWarning, match="quantized_gemv.*relative L2"):
        ql.prepare(x, q)
    calls = fake_cuda["calls"]
    assert mx.array_equal(ql.linear(q, x), q(x)).item()
    assert fake_cuda["calls"] == calls


def test_disable_kernels_env_wins(fake_cuda, monkeypatch):
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    q = qlinear(256, 2048)
    x = mx.random.normal((1, 2048), key=mx.random.key(4)).astype(mx.bfloat16)
    assert ql.gemv_ready(x, q["weight"], q["scales"], q["biases"], 64) is None
    assert fake_cuda["calls"] == 0


def test_lm_head_class_swap_keeps_parameters_and_outputs():
    class Text(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = qlinear(512, 256)

    text = Text()
    before = dict(tree_flatten(text.parameters()))
    x = mx.random.normal((1, 1, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    ref = text.lm_head(x)
    assert install_gemv_lm_head(text)
    assert type(text.lm_head) is DecodeQuantizedLinear
    assert isinstance(text.lm_head, nn.QuantizedLinear)
    after = dict(tree_flatten(text.parameters()))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert mx.array_equal(text.lm_head(x), ref).item()  # CPU: MLX's path
    assert not install_gemv_lm_head(text)  # already swapped: not exactly QuantizedLinear

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(16, 8)

    assert not install_gemv_lm_head(Tied())
    text8 = Text()
    text8.lm_head = qlinear(512, 256, bits=8)
    assert not install_gemv_lm_head(text8)


def _mixer_projection_rows(text) -> set:
    """Rows of each decoder layer's concatenated mixer projection."""
    rows = set()
    for layer in text.model.layers:
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        rows.add(sum(mixer._proj_cat.sizes))
    return rows


def _plain_checked() -> set:
    """(N, K) of every plain GEMV shape class self-checked so far."""
    return {(k[2][1], k[2][2]) for k in device.self_check_results()
            if k[0] == "quantized_gemv" and k[2][0] != "norm"}


def test_fused_decode_takes_the_kernel_for_lm_head_and_the_mixers_projections(
        tiny_q4, fake_cuda, monkeypatch):
    # The plain GEMV serves lm_head (gemv-kernel) and, with QAB_ENABLE, each
    # mixer's concatenated input projection (proj-gemv) where the input norm
    # is not in the launch (norm-proj, on by default, has its own test below).
    monkeypatch.setenv("QAB_ENABLE", "proj-gemv")
    monkeypatch.setenv("QAB_DISABLE", "norm-proj")
    fused, _ = load(tiny_q4, "fused")
    stock, _ = load(tiny_q4, "stock")
    text = fused.language_model
    assert type(text.lm_head) is DecodeQuantizedLinear
    prompt = mx.array([[(i * 37) % 900 for i in range(12)]])
    cf, cs = make_prompt_cache(fused), make_prompt_cache(stock)
    yf, ys = fused(prompt, cache=cf), stock(prompt, cache=cs)
    assert fake_cuda["calls"] == 0  # prefill rows > GEMV_MAX_ROWS: MLX's path
    assert mx.array_equal(yf, ys).item()
    tok = mx.array([[5]])
    yf, ys = fused(tok, cache=cf), stock(tok, cache=cs)
    vocab, hidden = text.lm_head["weight"].shape[0], text.lm_head["weight"].shape[1] * 8
    mixers = {(n, hidden) for n in _mixer_projection_rows(text)}
    assert _plain_checked() == {(vocab, hidden)} | mixers
    before = fake_cuda["calls"]
    yf2, ys2 = fused(tok, cache=cf), stock(tok, cache=cs)
    # lm_head and every Gated DeltaNet layer call it; the attention layers'
    # compiled projection step called it when traced and replays it since.
    linear = [layer.is_linear for layer in text.model.layers]
    assert fake_cuda["calls"] - before == 1 + sum(linear) and not all(linear)
    for layer in text.model.layers:
        if not layer.is_linear:
            assert any(key[4] == "cuda" for key in layer.self_attn._compiled)
    assert fake_cuda["norm_calls"] == 0
    # The fake kernel computes in float32: bf16 logits close to stock's.
    assert mx_rel_l2(yf2, ys2) <= 2e-2 and mx_rel_l2(yf, ys) <= 2e-2


@pytest.mark.parametrize("enable, off", [
    ("proj-gemv", "gemv-kernel"), ("proj-gemv", "proj-gemv"), ("", ""),
    ("proj-gemv", "gemv-kernel,proj-gemv")])
def test_switches_turn_each_use_on_and_off(tiny_q4, fake_cuda, monkeypatch, enable, off):
    # proj-gemv is opt-in (QAB_ENABLE; QAB_DISABLE wins); gemv-kernel is on by
    # default. norm-proj is off here so the projections could take the plain GEMV.
    monkeypatch.setenv("QAB_ENABLE", enable)
    monkeypatch.setenv("QAB_DISABLE", ",".join(filter(None, [off, "norm-proj"])))
    fused, _ = load(tiny_q4, "fused")
    text = fused.language_model
    notes = " ".join(get_report(fused).notes)
    head_on = "gemv-kernel" not in off
    proj_on = "proj-gemv" in enable and "proj-gemv" not in off
    assert (type(text.lm_head) is DecodeQuantizedLinear) == head_on
    assert ("gemv-kernel in QAB_DISABLE" in notes) != head_on
    assert ("GEMV kernel (proj-gemv from QAB_ENABLE" in notes) == proj_on
    if proj_on:  # the fused model's device is this CPU, not the fake
        assert ("(proj-gemv from QAB_ENABLE; no effect on this device, which is not CUDA)"
                in notes)
    assert ("proj-gemv from QAB_ENABLE, but also in QAB_DISABLE" in notes) == (
        bool(enable) and not proj_on)
    cache = make_prompt_cache(fused)
    fused(mx.array([[1, 2, 3]]), cache=cache)
    fused(mx.array([[4]]), cache=cache)
    vocab, hidden = text.lm_head["weight"].shape[0], text.lm_head["weight"].shape[1] * 8
    mixers = {(n, hidden) for n in _mixer_projection_rows(text)}
    assert _plain_checked() == ({(vocab, hidden)} if head_on else set()) | (
        mixers if proj_on else set())
    assert fake_cuda["norm_calls"] == 0


def test_the_projection_gemv_matches_mlx_per_child(monkeypatch):
    # ConcatProjection.matmul on a GEMV backend: the same split outputs as
    # each child's own QuantizedLinear (CPU: the kernel's reference stands in).
    from qwen_apple_backend.layers._concat import ConcatProjection

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = qlinear(96, 256, dtype=mx.float32)
            self.b = qlinear(160, 256, seed=1, dtype=mx.float32)

    o = Owner()
    x = mx.random.normal((1, 1, 256), key=mx.random.key(9))
    refs = [o.a(x), o.b(x)]
    cat = ConcatProjection.build(o, ("a", "b"))
    assert cat.gemv is False and cat.gemv_backend(x) is None  # off until the fusing code sets it
    cat.gemv = True
    assert cat.gemv_backend(x) is None  # the CPU has no kernel
    monkeypatch.setattr(ql, "quantized_gemv_kernel", _reference_kernel)
    outs = cat(x, "cuda")
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert mx_rel_l2(out, ref) <= 1e-5  # float32: summation order only


def test_fused_decode_runs_the_input_norm_in_the_mixers_projection(tiny_q4, fake_cuda,
                                                                    monkeypatch):
    # norm-proj (on by default): a decode token's input RMSNorm and the mixer's
    # concatenated projection are one launch of the GEMV kernel (here the fake).
    monkeypatch.delenv("QAB_DISABLE", raising=False)
    monkeypatch.delenv("QAB_ENABLE", raising=False)
    fused, _ = load(tiny_q4, "fused")
    stock, _ = load(tiny_q4, "stock")
    text = fused.language_model
    prompt = mx.array([[(i * 37) % 900 for i in range(12)]])
    cf, cs = make_prompt_cache(fused), make_prompt_cache(stock)
    yf, ys = fused(prompt, cache=cf), stock(prompt, cache=cs)
    assert fake_cuda["norm_calls"] == 0  # prefill rows > GEMV_MAX_ROWS: the norm, then MLX
    assert mx.array_equal(yf, ys).item()
    tok = mx.array([[5]])
    yf, ys = fused(tok, cache=cf), stock(tok, cache=cs)
    keys = {k[2] for k in device.self_check_results()
            if k[0] == "quantized_gemv" and k[2][0] == "norm"}
    # ("norm", eps, M, N, K, ...): one self-check per mixer projection shape.
    assert {k[3] for k in keys} == _mixer_projection_rows(text)
    assert {k[2] for k in keys} == {1}
    before = fake_cuda["norm_calls"]
    yf2, ys2 = fused(tok, cache=cf), stock(tok, cache=cs)
    # Every Gated DeltaNet layer calls it; the attention layers' compiled
    # projection step called it when traced and replays it since.
    linear = [layer.is_linear for layer in text.model.layers]
    assert fake_cuda["norm_calls"] - before == sum(linear) and not all(linear)
    for layer in text.model.layers:
        if not layer.is_linear:
            assert any(key[2] == "cuda" for key in layer.self_attn._compiled)
    # The fake kernel computes in float32: bf16 logits close to stock's.
    assert mx_rel_l2(yf2, ys2) <= 2e-2 and mx_rel_l2(yf, ys) <= 2e-2


@pytest.mark.parametrize("on", [False, True], ids=["default", "gemv-pipe"])
def test_gemv_pipe_switch_reaches_the_mixers_projection_launches(tiny_q4, fake_cuda,
                                                                monkeypatch, on):
    # gemv-pipe (opt-in): with QAB_ENABLE=gemv-pipe the mixers' norm + projection
    # launches (and their self-checks) ask for the double-buffered build and the
    # report says so; by default the one-pass build; lm_head keeps GEMV_PIPE's default.
    monkeypatch.delenv("QAB_DISABLE", raising=False)
    monkeypatch.setenv("QAB_ENABLE", "gemv-pipe" if on else "")
    fused, _ = load(tiny_q4, "fused")
    notes = get_report(fused).notes
    assert any("(gemv-pipe from QAB_ENABLE" in n for n in notes) == on
    off = not on
    cats = [getattr(layer.linear_attn if layer.is_linear else layer.self_attn, "_proj_cat")
            for layer in fused.language_model.model.layers]
    assert cats and all(c is not None and c.gemv_pipe is (not off) for c in cats)
    cache = make_prompt_cache(fused)
    fused(mx.array([[1, 2, 3]]), cache=cache)
    fused(mx.array([[4]]), cache=cache)
    fused(mx.array([[4]]), cache=cache)
    norm = {p for is_norm, p in fake_cuda["pipes"] if is_norm}
    assert norm == {not off}
    assert {p for is_norm, p in fake_cuda["pipes"] if not is_norm} <= {None, ql.GEMV_PIPE}
    keys = {k[2] for k in device.self_check_results() if k[0] == "quantized_gemv"}
    assert {k[-1] for k in keys if k[0] == "norm"} == {not off}


def test_norm_proj_switched_off(tiny_q4, fake_cuda, monkeypatch):
    # On by default (test above); QAB_DISABLE=norm-proj runs the norm as its
    # own operation and says so; QAB_ENABLE does not name it (on by default).
    monkeypatch.delenv("QAB_ENABLE", raising=False)
    monkeypatch.setenv("QAB_DISABLE", "norm-proj")
    fused, _ = load(tiny_q4, "fused")
    assert any("norm-proj in QAB_DISABLE" in n for n in get_report(fused).notes)
    cache = make_prompt_cache(fused)
    fused(mx.array([[1, 2, 3]]), cache=cache)
    fused(mx.array([[4]]), cache=cache)
    fused(mx.array([[4]]), cache=cache)
    assert fake_cuda["norm_calls"] == 0
    monkeypatch.setenv("QAB_ENABLE", "norm-proj")
    with pytest.raises(ValueError, match="'norm-proj' is on by default"):
        load(tiny_q4, "fused")


@pytest.mark.parametrize("enable, off, need", [("proj-gemv", "proj-concat", "proj-concat"),
                                               ("next-norm", "add-norm", "add-norm")])
def test_an_enabled_switch_whose_prerequisite_is_off_says_so(tiny_q4, monkeypatch, enable, off,
                                                             need):
    monkeypatch.setenv("QAB_ENABLE", enable)
    monkeypatch.setenv("QAB_DISABLE", off)
    fused, _ = load(tiny_q4, "fused")
    notes = get_report(fused).notes
    assert f"{enable} from QAB_ENABLE is not used: it needs {need} (in QAB_DISABLE / disable=)" \
        in notes


def _fake_one_launch_block(monkeypatch, calls):
    """The fused MoE blocks take the one-launch path on the pretend CUDA device:
    ``_add_norm_route_forward`` computes ``h + block(rms_norm(h))`` with the
    block's own MLX path and, with an NP phase, the next layer's norm +
    projection with the GEMV kernel's reference arithmetic (what the mixer's
    own norm-proj launch computes on the fake device). ``calls`` gets the
    NP phase's projection rows per call (0 without it)."""
    from qwen_apple_backend.layers import moe as moe_layer
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    def choice(self, x, decode, norm=None, next_norm=None, out_proj=None, next_proj=None):
        if norm is None:  # the block's own __call__: its MLX path
            return (None, None, None, None, None)
        return (None, "fake", "fake", None, "fake")

    def forward(self, x, r, norm_weight, *extra, eps, proj_group=0, proj_eps=0.0,
                out_group=0, **kw):
        assert not out_group  # (the tiny mixers' outputs are too narrow for OP)
        h = x + r
        out = h + self(mx.fast.rms_norm(h, norm_weight, eps))
        calls.append(extra[1].shape[0] if proj_group else 0)
        if not proj_group:
            return out
        nw, pw, ps, pb = extra
        return out, _reference_kernel(out, pw, ps, pb, proj_group, norm_weight=nw, eps=proj_eps)

    monkeypatch.setattr(FusedSparseMoeBlock, "_kernel_choice", choice)
    monkeypatch.setattr(FusedSparseMoeBlock, "_add_norm_route_forward", forward)
    # (at H = 64 below the kernel's 1,024-multiple rule)
    monkeypatch.setattr(moe_layer, "next_projection_supported", lambda x, np_: True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "decode-compile"])
def test_next_proj_hands_the_next_mixer_its_projection(tiny_q4, fake_cuda, monkeypatch,
                                                       compiled):
    # moe-block-next-proj (on by default): each MoE block's one launch ends with the
    # next layer's input RMSNorm and its mixer's concatenated 4-bit input
    # projection; that mixer then takes it (projected=) and runs no norm +
    # projection launch of its own. Here on a pretend CUDA device with the
    # block's launch faked (_fake_one_launch_block): the same logits, token
    # for token, as the model with the switch off, whose mixers run those
    # projections themselves, and one norm-proj launch per token (the first
    # layer's) instead of one per layer.
    monkeypatch.delenv("QAB_DISABLE", raising=False)
    calls = []
    _fake_one_launch_block(monkeypatch, calls)
    monkeypatch.setenv("QAB_ENABLE", "decode-compile" if compiled else "")
    on, _ = load(tiny_q4, "fused")
    monkeypatch.setenv("QAB_DISABLE", "moe-block-next-proj")
    off, _ = load(tiny_q4, "fused")
    assert not any("moe-block-next-proj" in n for n in get_report(on).notes)
    assert any("(moe-block-next-proj in QAB_DISABLE" in n for n in get_report(off).notes)
    layers = on.language_model.model.layers
    assert all(layer.mlp.next_proj_phase for layer in layers)
    assert not any(layer.mlp.next_proj_phase for layer in off.language_model.model.layers)
    rows_of_next = [(layer.linear_attn if layer.is_linear else layer.self_attn)
                    ._proj_cat.cat["weight"].shape[0] for layer in layers[1:]]
    prompt = mx.array([[(i * 37) % 900 for i in range(12)]])
    co, cf = make_prompt_cache(on), make_prompt_cache(off)
    assert mx.array_equal(on(prompt, cache=co), off(prompt, cache=cf)).item()
    linear = [layer.is_linear for layer in layers]
    assert linear[0] and not all(linear)
    for t in range(4):
        tok = mx.array([[(t * 53 + 7) % 900]])
        calls.clear()
        before = fake_cuda["norm_calls"]
        yo = on(tok, cache=co)
        mx.eval(yo)
        launches_on = fake_cuda["norm_calls"] - before
        np_rows = list(calls)
        calls.clear()
        before = fake_cuda["norm_calls"]
        yf = off(tok, cache=cf)
        mx.eval(yf)
        launches_off = fake_cuda["norm_calls"] - before
        assert mx.array_equal(yo, yf).item(), f"token {t}: rel-L2 {mx_rel_l2(yo, yf):.3g}"
        if t == 0 and not compiled:
            # The blocks' compiled calls trace here: every block but the
            # last ran the next mixer's projection (NP), the model without
            # the switch none.
            assert np_rows[:-1] == rows_of_next and np_rows[-1] == 0, np_rows
            assert calls == [0] * len(layers)
        if t >= 1 and not compiled:
            # Replays: the Gated DeltaNet mixers' own norm + projection calls
            # (eager; attention's compiled projection replays): only the first
            # layer's with the switch, every one without.
            assert launches_on == 1 and launches_off == sum(linear)
    # The attention layers split the handed projection (their compiled
    # projection step keyed pre=True), those of the model without the switch not.
    for model, want in ((on, True), (off, False)):
        for layer in model.language_model.model.layers:
            if not layer.is_linear:
                assert any(k[-1] for k in layer.self_attn._compiled) == want


def test_a_wrong_projected_input_is_refused_and_the_mixer_keeps_working(tiny_q4, monkeypatch):
    # projected= (moe-block-next-proj's handoff) of the wrong width, token
    # count or dtype is a ValueError naming it, before any compiled call (an
    # error inside a trace would leave the module's arrays replaced by the
    # trace's placeholders); the right one gives the output of input_norm=.
    monkeypatch.delenv("QAB_DISABLE", raising=False)
    monkeypatch.delenv("QAB_ENABLE", raising=False)
    fused, _ = load(tiny_q4, "fused")
    layers = fused.language_model.model.layers
    for layer in (layers[0], layers[3]):
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        norm, cat = layer.input_layernorm, mixer._proj_cat
        x = mx.random.normal((1, 1, norm.weight.shape[0]), key=mx.random.key(3))
        x = x.astype(mx.bfloat16)
        good = cat.matmul(norm(x))
        n = good.shape[-1]
        bad = [good[..., :-1], mx.concatenate([good, good], axis=1), good.astype(mx.float32),
               good.reshape(n)]
        for p in bad:
            with pytest.raises(ValueError, match=r"^projected: expected the concatenated input "
                                                 rf"projection's output of shape \(1, 1, {n}\) "
                                                 r"and dtype mlx.core.bfloat16, got shape"):
                mixer(x, None, make_prompt_cache(fused)[layers.index(layer)],
                      input_norm=norm, projected=p)
        want = mixer(x, None, make_prompt_cache(fused)[layers.index(layer)], input_norm=norm)
        got = mixer(x, None, make_prompt_cache(fused)[layers.index(layer)], input_norm=norm,
                    projected=good)
        assert mx.array_equal(got, want).item(), type(mixer).__name__


def test_report_says_when_a_switch_takes_the_blocks_phases_away(tiny_q4, monkeypatch):
    # moe-block-out-proj, moe-block-next-proj, moe-block-gdn, moe-block-pack,
    # moe-block-unroll, moe-block-npl, moe-block-roll and moe-block-npg (on by default) live in
    # the one-launch
    # MoE block: the
    # report says when another switch takes it away (or, for next-proj, the
    # concatenated projections or norm-proj; for gdn, also the out-projection
    # phase or the GDN kernels), and says nothing by default or when they are
    # switched off themselves (their own note).
    monkeypatch.delenv("QAB_DISABLE", raising=False)
    monkeypatch.delenv("QAB_ENABLE", raising=False)

    def notes(**kw):
        return [n for n in get_report(load(tiny_q4, "fused", **kw)[0]).notes
                if "is not used" in n and "moe-block-" in n]

    assert notes() == []
    # Nor where a module kind they need stays stock (the module table says so).
    assert notes(disable=["moe", "gdn"]) == [] and notes(disable=["gdn"]) == []
    assert notes(disable=["moe-block"]) == [
        f"{n} is not used: it needs moe-block, which QAB_DISABLE / disable= switches off"
        for n in ("moe-block-out-proj", "moe-block-next-proj", "moe-block-gdn",
                  "moe-block-pack", "moe-block-unroll", "moe-block-npl", "moe-block-roll",
                  "moe-block-npg")]
    assert notes(disable=["proj-concat", "moe-block-out-proj"]) == [
        "moe-block-next-proj is not used: it needs proj-concat, which QAB_DISABLE / disable= "
        "switches off",
        "moe-block-gdn is not used: it needs moe-block-out-proj and proj-concat, which "
        "QAB_DISABLE / disable= switches off",
        "moe-block-npl is not used: it needs proj-concat, which QAB_DISABLE / disable= "
        "switches off",
        "moe-block-npg is not used: it needs proj-concat, which QAB_DISABLE / disable= "
        "switches off"]
    # moe-block-npg's items loop only with moe-block-npl.
    assert notes(disable=["moe-block-npl"]) == [
        "moe-block-npg is not used: it needs moe-block-npl, which QAB_DISABLE / disable= "
        "switches off"]
    assert notes(disable=["gdn-kernel"]) == [
        "moe-block-gdn is not used: it needs gdn-kernel, which QAB_DISABLE / disable= "
        "switches off"]
    monkeypatch.setenv("QAB_ENABLE", "next-norm")
    assert notes() == [f"{n} is not used: next-norm from QAB_ENABLE replaces the one-launch "
                       "MoE block" for n in ("moe-block-out-proj", "moe-block-next-proj",
                                             "moe-block-gdn", "moe-block-pack",
                                             "moe-block-unroll", "moe-block-npl",
                                             "moe-block-roll", "moe-block-npg")]


def test_deferred_gated_delta_runs_its_step_once_and_stores_the_states():
    # moe-block-gdn: a mixer's deferred decode step. commit() stores states
    # computed elsewhere (the MoE block's launch) in the mixer's cache;
    # deferred() runs the step itself once, stores its states and returns its
    # output with the projection still to apply; apply() projects it. A layer
    # that gives up on the block after deferred() and then calls apply() does
    # not run the step twice.
    from mlx_lm.models.cache import ArraysCache

    from qwen_apple_backend.layers.linear import DEFERRED, DeferredGatedDelta, DeferredProjection

    runs = []
    out, conv, state = mx.ones((1, 1, 8)), mx.full((1, 3, 4), 2.0), mx.full((1, 2, 4, 4), 3.0)
    proj = nn.Linear(8, 6, bias=False)
    cache = ArraysCache(size=2)
    d = DeferredGatedDelta("step", proj, cache, lambda: runs.append(1) or (out, conv, state))
    assert isinstance(d, DEFERRED) and not runs
    d.commit(conv + 1, state + 1)
    assert mx.array_equal(cache[0], conv + 1).item() and mx.array_equal(cache[1], state + 1).item()
    dp = d.deferred()
    assert isinstance(dp, DeferredProjection) and dp.x is out and dp.proj is proj
    assert cache[0] is conv and cache[1] is state and runs == [1]
    assert d.deferred() is dp and runs == [1]
    assert mx.allclose(d.apply(), proj(out)).item() and runs == [1]
    # No cache (a call without one): nothing to store.
    assert DeferredGatedDelta("step", proj, None, lambda: (out, conv, state)).deferred().x is out
