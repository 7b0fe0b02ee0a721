"""The compiled one-token decode step (decode-compile: default on a GPU, QAB_ENABLE on the CPU) against the eager path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from qwen_apple_backend import load
from qwen_apple_backend.decode import compiled_decode_installed


def _greedy(model, prompt, n):
    cache = make_prompt_cache(model)
    toks, lps = [], []
    for (y, lp), _ in zip(generate_step(prompt, model, max_tokens=n, prompt_cache=cache), range(n)):
        toks.append(int(y))
        lps.append(lp)
    return toks, mx.stack(lps), cache


def _assert_same_decoding(comp, eager, prompt, n=8):
    """The compiled and the eager model decode the same greedy tokens (float32 logprobs within 1e-5)."""
    t_comp, lp_comp, _ = _greedy(comp, prompt, n)
    t_eager, lp_eager, _ = _greedy(eager, prompt, n)
    assert t_comp == t_eager
    assert float(mx.abs(lp_comp - lp_eager).max()) <= 1e-5


def test_compiled_step_equals_eager_for_64_tokens_across_a_kv_block(tiny_hf_f32, monkeypatch):
    # 230 prompt tokens + 64 decoded: the KV buffer grows at 256 mid-way, so
    # the step is traced twice and the grow itself runs eagerly.
    prompt = mx.array([(i * 37) % 1000 for i in range(230)])
    monkeypatch.setenv("QAB_DISABLE", "decode-compile")  # eager on any device
    eager, _ = load(tiny_hf_f32, "fused")
    assert not compiled_decode_installed(eager.language_model)
    monkeypatch.delenv("QAB_DISABLE")
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    comp, _ = load(tiny_hf_f32, "fused")
    assert compiled_decode_installed(comp.language_model)
    assert "compiled step" in " ".join(comp.qab_report.notes)

    t_eager, lp_eager, c_eager = _greedy(eager, prompt, 64)
    t_comp, lp_comp, c_comp = _greedy(comp, prompt, 64)
    assert t_comp == t_eager
    # float32: the same ops on the same values, masked slots contribute exp(-inf) = 0.
    assert float(mx.abs(lp_comp - lp_eager).max()) <= 1e-5
    step = comp.language_model.__dict__["_qab_decode"]
    assert step.eager_calls == 1 and step.compiled_calls >= 60
    # Caches come out identical: KV offsets, written KV rows, recurrent states.
    for a, b in zip(c_comp, c_eager):
        if hasattr(a, "offset"):
            assert a.offset == b.offset
            n = a.offset
            assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-6).item()
        else:
            assert mx.allclose(a[1], b[1], atol=1e-6).item()


def test_non_plain_caches_and_prefill_take_the_eager_path(tiny_hf_f32, monkeypatch):
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    step = m.language_model.__dict__["_qab_decode"]
    cache = make_prompt_cache(m)
    m(mx.array([[1, 2, 3, 4]]), cache=cache)  # prefill: eager
    m(mx.array([[5]]), cache=cache)  # first decode token: eager (self-checks)
    m(mx.array([[6]]), cache=cache)
    assert (step.eager_calls, step.compiled_calls) == (1, 1)
    m(mx.array([[7], [8]]), cache=None)  # no cache: eager
    assert step.compiled_calls == 1


def test_decode_const_without_the_compiled_step_says_so(tiny_hf_f32, monkeypatch):
    # decode-const lives in the compiled step: on the CPU without
    # decode-compile (or with it disabled) the report says it is not used.
    note = ("decode-const from QAB_ENABLE is not used: it needs the compiled decode step "
            "(decode-compile), which is off here")
    monkeypatch.setenv("QAB_ENABLE", "decode-const")
    m, _ = load(tiny_hf_f32, "fused")
    # (On a GPU decode-compile is on by default: then it is used.)
    assert (note in m.qab_report.notes) is not compiled_decode_installed(m.language_model)
    monkeypatch.setenv("QAB_ENABLE", "decode-const,decode-compile")
    monkeypatch.setenv("QAB_DISABLE", "decode-compile")
    assert note in load(tiny_hf_f32, "fused")[0].qab_report.notes
    monkeypatch.delenv("QAB_DISABLE")
    m, _ = load(tiny_hf_f32, "fused")
    assert note not in m.qab_report.notes
    assert m.language_model.__dict__["_qab_decode"].const is True


def test_disable_and_bad_enable(tiny_hf_f32, monkeypatch):
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    monkeypatch.setenv("QAB_DISABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    assert not compiled_decode_installed(m.language_model)
    monkeypatch.delenv("QAB_DISABLE")
    monkeypatch.setenv("QAB_ENABLE", "warp-drive")
    with pytest.raises(ValueError, match="QAB_ENABLE: unknown optimization"):
        load(tiny_hf_f32, "fused")
    # An optimization that is on by default is named as such.
    monkeypatch.setenv("QAB_ENABLE", "moe-route")
    with pytest.raises(ValueError, match=r"^QAB_ENABLE: 'moe-route' is on by default \(QAB_ENABLE "
                                         r"names only decode-compile, next-norm, proj-gemv, gemv-pipe, attn-lanes, "
                                         r"l2-prefetch, decode-const, attn-merge-split, "
                                         r"moe-block-nps, "
                                         r"moe-block-rpl; "
                                         r"switch others "
                                         r"off with QAB_DISABLE\)$"):
        load(tiny_hf_f32, "fused")


@pytest.mark.slow
def test_compiled_step_is_the_default_on_a_gpu_only(tiny_hf_f32, monkeypatch):
    import qwen_apple_backend.models._hybrid as hybrid

    monkeypatch.delenv("QAB_ENABLE", raising=False)
    # The load where the default device is the CPU (also on a GPU machine).
    monkeypatch.setattr(hybrid, "gpu_backend", lambda: None)
    cpu, _ = load(tiny_hf_f32, "fused")
    assert not compiled_decode_installed(cpu.language_model)
    assert any("eagerly on the CPU" in n for n in cpu.qab_report.notes)
    # The same load where the default device is a GPU backend.
    monkeypatch.setattr(hybrid, "gpu_backend", lambda: "cuda")
    gpu, _ = load(tiny_hf_f32, "fused")
    assert compiled_decode_installed(gpu.language_model)
    assert any("compiled step" in n for n in gpu.qab_report.notes)
    monkeypatch.setenv("QAB_DISABLE", "decode-compile")
    off, _ = load(tiny_hf_f32, "fused")
    assert not compiled_decode_installed(off.language_model)
    assert any("compiled decode step off" in n for n in off.qab_report.notes)
    stock, _ = load(tiny_hf_f32, "stock")
    assert not compiled_decode_installed(getattr(stock, "language_model", stock))


def _host_loop(model, prompt, n):
    """Plain loop: one forward, argmax, the id read on the host and fed back."""
    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)
    toks = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())  # host round trip every token
        toks.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return toks


@pytest.mark.parametrize("enable", ["", "decode-compile"])
def test_gpu_resident_handoff_matches_the_host_loop(tiny_hf_f32, monkeypatch, enable):
    # mlx-lm's generate_step keeps the sampled id on the device and enqueues
    # step t+1 before the host reads token t (two steps in flight); with the
    # fused backend (eager or compiled step) that path gives the same tokens
    # as a loop that reads every id on the host.
    if enable:
        monkeypatch.setenv("QAB_ENABLE", enable)
    else:
        monkeypatch.delenv("QAB_ENABLE", raising=False)
    model, _ = load(tiny_hf_f32, "fused")
    prompt = mx.array([(i * 53) % 997 for i in range(40)])
    handoff, _, _ = _greedy(model, prompt, 48)
    assert handoff == _host_loop(model, prompt, 48)
    # And the tokens are stock mlx-lm's, run on the CPU: its float32 is the
    # reference. (On the H200, stock's own GPU tokens differed from the CPU's
    # from the first token on, with TF32 off too, where fused GPU tokens did
    # not: stock's gathered expert matmuls on CUDA.)
    with mx.stream(mx.cpu):
        stock, _ = load(tiny_hf_f32, "stock")
        assert handoff == _host_loop(stock, prompt, 48)


def test_compiled_step_sees_replaced_projection_weights(tiny_hf_f32, monkeypatch):
    # With proj-concat on, replacing a projection's weights after the step was
    # traced must not leave decoding on stale concatenated rows.
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    comp, _ = load(tiny_hf_f32, "fused")
    monkeypatch.delenv("QAB_ENABLE")
    eager, _ = load(tiny_hf_f32, "fused")
    prompt = mx.array([(i * 41) % 900 for i in range(20)])
    _greedy(comp, prompt, 4)  # traces the step
    step = comp.language_model.__dict__["_qab_decode"]
    assert step._fn is not None and step._uses
    for m in (comp, eager):
        gdn = m.language_model.model.layers[0].linear_attn
        gdn.in_proj_z.weight = gdn.in_proj_z.weight * 3.0
    # The next eager call (a prefill) lets go of the stale trace and of the
    # concatenations (and, on CUDA, packs) it read, before any decode token.
    comp(prompt[None], cache=make_prompt_cache(comp))
    assert step._fn is None and not step._uses and not any(step._checks)
    _assert_same_decoding(comp, eager, prompt)


@pytest.mark.parametrize("const", [True, False], ids=["decode-const", "inputs"])
def test_compiled_step_reads_replaced_parameters(tiny_hf_f32, monkeypatch, const):
    # Parameters replaced after tracing (the final norm's weight, an expert
    # weight, a whole new norm module) are what the next tokens use, as in
    # eager decoding: with decode-const (parameters as trace constants) the
    # identity check rebuilds the step; without it the model is a compile
    # input, read live, and so are arrays changed in place (`w *= c`,
    # `w[...] = v`: MLX swaps the array inside the same Python object, which
    # the identity check does not see: decode-const's documented limit).
    import mlx.nn as nn

    monkeypatch.setenv("QAB_ENABLE", "decode-compile,decode-const" if const else "decode-compile")
    comp, _ = load(tiny_hf_f32, "fused")
    monkeypatch.delenv("QAB_ENABLE")
    monkeypatch.setenv("QAB_DISABLE", "decode-compile")
    eager, _ = load(tiny_hf_f32, "fused")
    step = comp.language_model.__dict__["_qab_decode"]
    assert step.const is const
    assert any("(decode-const from QAB_ENABLE)" in n for n in comp.qab_report.notes) is const
    prompt = mx.array([(i * 29) % 900 for i in range(20)])
    _greedy(comp, prompt, 12)
    builds = step.builds
    for m in (comp, eager):
        lm = m.language_model.model
        lm.norm.weight = lm.norm.weight * 0.5 + 0.3
        mlp = lm.layers[0].mlp
        mlp.switch_mlp.down_proj.weight = mlp.switch_mlp.down_proj.weight * -1.0
    # The next eager call (a prefill) lets go of the stale trace and its
    # constants (the replaced weights), before any decode token.
    comp(prompt[None], cache=make_prompt_cache(comp))
    assert (step._fn is None) is const
    _assert_same_decoding(comp, eager, prompt)
    assert step.builds == builds + const  # constants: rebuilt once; inputs: read live
    for m in (comp, eager):
        lm = m.language_model.model
        old = lm.norm
        lm.norm = nn.RMSNorm(old.weight.shape[0], eps=old.eps)
        lm.norm.weight = old.weight * 2.0
    _assert_same_decoding(comp, eager, prompt)
    if const:
        return
    for m in (comp, eager):
        lm = m.language_model.model
        lm.norm.weight *= -1.0
        lm.layers[0].mlp.switch_mlp.down_proj.weight[...] = 0
    _assert_same_decoding(comp, eager, prompt)


@pytest.mark.parametrize("const", [True, False], ids=["decode-const", "inputs"])
def test_new_short_prompts_do_not_rebuild_the_step(tiny_hf_f32, monkeypatch, const):
    # Short prompts of new lengths trace the layers' own compiled functions,
    # which re-wraps their arrays in new Python objects; the step must not
    # take that for replaced parameters (a rebuild retraces the whole step).
    # With decode-const the layers' watched calls keep its record current.
    monkeypatch.setenv("QAB_ENABLE", "decode-compile,decode-const" if const else "decode-compile")
    comp, _ = load(tiny_hf_f32, "fused")
    step = comp.language_model.__dict__["_qab_decode"]
    assert step.const is const
    for n in (5, 3, 2, 4):
        _greedy(comp, mx.array([(i * 31 + n) % 900 for i in range(n)]), 6)
    assert step.builds == 1 and step.compiled_calls >= 16


def test_replays_skip_the_concatenation_walk_and_prefill_keeps_it(tiny_hf_f32, monkeypatch):
    # Only a call that traces re-wraps the model's arrays; replays must not
    # pay the walk over every concatenated projection, and after decoding
    # the eager prefill still runs its one-matmul projections.
    import qwen_apple_backend.decode as dec
    from qwen_apple_backend.decode import _concats

    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    walks = []
    monkeypatch.setattr(dec, "_concats", lambda model: walks.append(1) or _concats(model))
    cache = make_prompt_cache(m)
    m(mx.array([[1, 2, 3, 4]]), cache=cache)
    for t in range(5, 15):  # first token eager, then one trace and 8 replays
        mx.eval(m(mx.array([[t]]), cache=cache))
    step = m.language_model.__dict__["_qab_decode"]
    assert step.compiled_calls == 9
    assert len(walks) == 1 and step.builds == 1  # when the step was built, not per replay
    cats = _concats(m.language_model)
    assert cats and all(c.valid(owner) for c, owner in cats)


def test_compiled_step_runs_the_concatenated_projections(tiny_hf_f32, monkeypatch):
    # Inside the trace each module takes its one-matmul path (proj-concat), so
    # the compiled step has no more projection matmuls than an eager token.
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    if "count_decode_ops" in sys.modules:
        monkeypatch.delitem(sys.modules, "count_decode_ops")
    from count_decode_ops import decode_step_ops

    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    comp, _ = load(tiny_hf_f32, "fused")
    monkeypatch.delenv("QAB_ENABLE")
    eager, _ = load(tiny_hf_f32, "fused")
    oc, oe = decode_step_ops(comp, 8), decode_step_ops(eager, 8)
    matmuls = ("Matmul", "QuantizedMatmul", "AddMM")
    assert sum(oc[k] for k in matmuls) == sum(oe[k] for k in matmuls) > 0, (oc, oe)
    step = comp.language_model.__dict__["_qab_decode"]
    assert step._uses and all(not c.tracing for c in step._uses)


def test_op_counter_counts_the_compiled_step(tiny_hf_f32, monkeypatch):
    # benchmarks/count_decode_ops.py counts the third decode token, so with
    # decode-compile on it sees the compiled step's graph (the KV written at an
    # array offset: DynamicSliceUpdate) in its steady state (after the first
    # compiled call, which copies the caches' buffers once), not the eager
    # first token.
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    monkeypatch.syspath_prepend(bench)
    if "count_decode_ops" in sys.modules:
        monkeypatch.delitem(sys.modules, "count_decode_ops")
    from count_decode_ops import decode_step_ops

    monkeypatch.setenv("QAB_DISABLE", "decode-compile")  # eager on any device
    eager, _ = load(tiny_hf_f32, "fused")
    monkeypatch.delenv("QAB_DISABLE")
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    comp, _ = load(tiny_hf_f32, "fused")
    ops_eager, ops_comp = decode_step_ops(eager, 8), decode_step_ops(comp, 8)
    step = comp.language_model.__dict__["_qab_decode"]
    in_place = any(v is not None for v in step._in_place.values())  # GPU kv_cache_write
    assert (ops_comp["DynamicSliceUpdate"] > 0) != in_place
    assert ops_eager["DynamicSliceUpdate"] == 0
    assert (step.eager_calls, step.compiled_calls) == (1, 2)  # the counted token was compiled


def test_in_place_kv_writes_own_private_buffers(tiny_hf_f32, monkeypatch):
    # With an in-place KV write backend (faked here: the CPU has none; the
    # real kernels are tested on a GPU in tests/test_kernels_gpu.py), the
    # compiled step first gives each cache private K/V buffers (a copy), then
    # keeps writing those same arrays; a deep copy of the cache, whose arrays
    # share memory with the original's, gets its own copy before any write.
    import copy

    from qwen_apple_backend import decode
    from qwen_apple_backend.ops import attention as attn_ops

    writes = []

    def fake_write(backend, k_new, v_new, k_buf, v_buf, offset):
        writes.append((backend, k_buf.shape))
        return attn_ops.kv_cache_write_ops(k_new, v_new, k_buf, v_buf, offset)[2]

    monkeypatch.setattr(decode, "kv_write_ready", lambda probe, k: "fake")
    monkeypatch.setattr(decode, "kv_cache_write", fake_write)
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    step = m.language_model.__dict__["_qab_decode"]
    cache = make_prompt_cache(m)
    m(mx.array([[1, 2, 3, 4]]), cache=cache)
    m(mx.array([[5]]), cache=cache)  # eager first token
    kv = [c for c in cache if hasattr(c, "offset")]
    before = [(c.keys, c.values) for c in kv]
    m(mx.array([[6]]), cache=cache)
    assert step.compiled_calls == 1 and writes and all(b == "fake" for b, _ in writes)
    owned = [(c.keys, c.values) for c in kv]
    for (k0, v0), (k1, v1) in zip(before, owned):
        assert k1 is not k0 and v1 is not v0  # privatized once
        assert mx.array_equal(k1, k0).item()  # a copy (nothing written by the fake)
    m(mx.array([[7]]), cache=cache)
    assert all(c.keys is k and c.values is v for c, (k, v) in zip(kv, owned))
    assert [c.offset for c in kv] == [7] * len(kv)
    dup = copy.deepcopy(cache)
    m(mx.array([[8]]), cache=dup)
    dkv = [c for c in dup if hasattr(c, "offset")]
    assert all(d.keys is not k for d, (k, _) in zip(dkv, owned))
    assert all(c.keys is k for c, (k, _) in zip(kv, owned))
    assert [c.offset for c in kv] == [7] * len(kv) and [d.offset for d in dkv] == [8] * len(dkv)


def test_in_place_state_writes_own_private_buffers(tiny_hf_f32, monkeypatch):
    # While the step uses a pack whose build writes the Gated DeltaNet states
    # in place (moe-block-pack's GD build; faked here: the CPU has no packs),
    # it first gives each such cache private state buffers (one copy of an
    # array it does not know, e.g. a prefill's or a deep copy's, whose memory
    # may be shared), and takes its own outputs as private: no copy per token.
    import copy

    from qwen_apple_backend import decode

    real_build, real_own = decode._CompiledDecode._build, decode._CompiledDecode._own_states
    copied = []

    def build(self):
        real_build(self)
        self._packs_write_states = True

    def own(self, states):
        before = [(c[0], c[1]) for c in states]
        real_own(self, states)
        copied.append(sum(c[1] is not b[1] for c, b in zip(states, before)))
        for c, (conv, st) in zip(states, before):
            if c[1] is not st:  # a copy: equal values, its own buffer
                assert mx.array_equal(c[0], conv).item() and mx.array_equal(c[1], st).item()

    monkeypatch.setattr(decode._CompiledDecode, "_build", build)
    monkeypatch.setattr(decode._CompiledDecode, "_own_states", own)
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    step = m.language_model.__dict__["_qab_decode"]
    cache = make_prompt_cache(m)
    n_gdn = sum(type(c).__name__ == "ArraysCache" for c in cache)
    assert n_gdn > 0
    m(mx.array([[1, 2, 3, 4]]), cache=cache)
    m(mx.array([[5]]), cache=cache)  # eager first token
    for t in (6, 7, 8):
        mx.eval(m(mx.array([[t]]), cache=cache))
    assert step.compiled_calls == 3
    assert copied == [n_gdn, 0, 0], copied
    dup = copy.deepcopy(cache)
    mx.eval(m(mx.array([[9]]), cache=dup))
    assert copied[-1] == n_gdn
    # A deep copy shares the original's memory: the original's next token
    # first copies its states (the snapshot keeps its values), then none.
    snap = copy.deepcopy(cache)
    for t in (10, 11):
        mx.eval(m(mx.array([[t]]), cache=cache))
    assert copied[-2:] == [n_gdn, 0], copied
    assert all(s[1] is not c[1] for s, c in zip(snap, cache) if type(c).__name__ == "ArraysCache")
    # (The guard is ArraysCache's own deep copy: pickling and copies as before.)
    import pickle

    assert all(type(a) is type(b) and a is not b for a, b in zip(snap, cache))
    assert pickle.loads(pickle.dumps(cache[0])).state is not None
    # A state in another layout than row-major (the ops path's prefill state is
    # column-major in its last two axes) is copied row-major: a kernel is handed
    # a row-major temporary of any other, whose writes in place would be lost.
    gdn = next(c for c in cache if type(c).__name__ == "ArraysCache")
    col = mx.contiguous(gdn[1].swapaxes(-1, -2)).swapaxes(-1, -2)
    mx.eval(col)
    assert not np.asarray(col).flags["C_CONTIGUOUS"]
    gdn[1] = col
    real_own(step, [gdn])
    mx.eval(gdn[1])
    assert np.asarray(gdn[1]).flags["C_CONTIGUOUS"] and mx.array_equal(gdn[1], col).item()


def test_in_place_kv_write_reference():
    # kv_cache_write_ops, the portable contract of the in-place kernel: row
    # `offset` replaced in both buffers, the mask s <= offset.
    from qwen_apple_backend.ops import attention as attn_ops

    k_buf = mx.arange(2 * 3 * 6 * 4, dtype=mx.float32).reshape(2, 3, 6, 4)
    v_buf = -k_buf
    k_new = mx.full((2, 3, 1, 4), 0.5)
    v_new = mx.full((2, 3, 1, 4), -0.5)
    kb, vb, mask = attn_ops.kv_cache_write_ops(k_new, v_new, k_buf, v_buf,
                                               mx.array([4], dtype=mx.int32))
    assert mx.array_equal(kb[:, :, 4], k_new[:, :, 0]).item()
    assert mx.array_equal(vb[:, :, 4], v_new[:, :, 0]).item()
    assert mx.array_equal(kb[:, :, :4], k_buf[:, :, :4]).item()
    assert mx.array_equal(kb[:, :, 5:], k_buf[:, :, 5:]).item()
    assert mask.tolist() == [[[[True] * 5 + [False]]]]
    if attn_ops.gpu_backend() is None:
        assert attn_ops.kv_write_ready(k_new, k_buf) is None  # no kernel on the CPU


def test_kv_in_place_switch(tiny_hf_f32, monkeypatch):
    # QAB_DISABLE=kv-in-place keeps the compiled step on slice_update even where
    # the in-place kernel is ready (faked here), and says so in the report.
    from qwen_apple_backend import decode

    writes = []
    monkeypatch.setattr(decode, "kv_write_ready", lambda probe, k: "fake")
    monkeypatch.setattr(decode, "kv_cache_write", lambda *a: writes.append(a) or None)
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    monkeypatch.setenv("QAB_DISABLE", "kv-in-place")
    m, _ = load(tiny_hf_f32, "fused")
    assert any("kv-in-place in QAB_DISABLE" in n for n in m.qab_report.notes)
    step = m.language_model.__dict__["_qab_decode"]
    assert step.allow_in_place is False
    cache = make_prompt_cache(m)
    m(mx.array([[1, 2, 3, 4]]), cache=cache)
    m(mx.array([[5]]), cache=cache)
    before = [c.keys for c in cache if hasattr(c, "offset")]
    m(mx.array([[6]]), cache=cache)
    assert step.compiled_calls == 1 and writes == []
    after = [c.keys for c in cache if hasattr(c, "offset")]
    assert all(a is not b for a, b in zip(after, before))  # new slice_update outputs
    monkeypatch.delenv("QAB_DISABLE")
    m2, _ = load(tiny_hf_f32, "fused")
    assert m2.language_model.__dict__["_qab_decode"].allow_in_place is True
    assert not any("kv-in-place" in n for n in m2.qab_report.notes)


def test_another_models_eager_calls_do_not_make_the_step_recheck(tiny_hf_f32, monkeypatch):
    # Without decode-const (the parameters as compile inputs: the default),
    # the step re-records its flattened concatenation checks only when one of ITS
    # concatenations was refreshed (an eager compiled layer that traced),
    # not when another fused model in the process runs prefills in between.
    import qwen_apple_backend.decode as dec

    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    other, _ = load(tiny_hf_f32, "fused")
    cache = make_prompt_cache(m)
    m(mx.array([[1, 2, 3, 4]]), cache=cache)
    for t in (5, 6, 7):  # eager first token, the trace, a replay
        mx.eval(m(mx.array([[t]]), cache=cache))
    records = []
    original = dec._CompiledDecode._record_checks
    monkeypatch.setattr(dec._CompiledDecode, "_record_checks",
                        lambda self: records.append(1) or original(self))
    for n, t in enumerate(range(8, 14)):
        # New prompt lengths: the other model's compiled layers trace and refresh.
        mx.eval(other(mx.array([[(i * 7 + n) % 900 for i in range(3 + n)]]),
                      cache=make_prompt_cache(other)))
        mx.eval(m(mx.array([[t]]), cache=cache))
    step = m.language_model.__dict__["_qab_decode"]
    assert step.builds == 1 and step.compiled_calls == 8
    assert sum(c.refreshes for c, _ in dec._concats(other.language_model)) > 0  # it did refresh
    assert records == []
    # One of its own concatenations refreshed: the next call re-records once.
    step._uses[0].refresh()
    mx.eval(m(mx.array([[20]]), cache=cache))
    mx.eval(m(mx.array([[21]]), cache=cache))
    assert records == [1] and step.builds == 1


def test_the_offset_is_a_view_of_a_device_table_of_positions(tiny_hf_f32, monkeypatch):
    # The step's offset input is a slice of a table of positions on the
    # device ([4] int32, its buffer the table's: out of MLX's small managed
    # pool), not a host-written scalar and not an output of the previous
    # step (one launch per token less); a cache at another position (a new
    # prompt, a trim) gets its own row, and a position past the table's end
    # a longer table.
    from qwen_apple_backend.decode import OFFSET_PAD

    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    step = m.language_model.__dict__["_qab_decode"]
    seen = []
    tables = []
    real = step._device_offset

    def spy(position):
        off = real(position)
        seen.append((position, off))
        tables.append(step._positions)
        return off

    monkeypatch.setattr(step, "_device_offset", spy)
    cache = make_prompt_cache(m)
    m(mx.array([[1, 2, 3, 4]]), cache=cache)
    for t in range(5, 10):  # first eager, then 4 compiled tokens
        mx.eval(m(mx.array([[t]]), cache=cache))
    assert [p for p, _ in seen] == [5, 6, 7, 8]
    assert all(t is tables[0] for t in tables)  # one table for every token
    assert tables[0].dtype == mx.int32 and tables[0].nbytes > 8
    base = np.asarray(tables[0]).__array_interface__["data"][0]
    for position, off in seen:
        assert off.shape == (OFFSET_PAD,) and off.dtype == mx.int32
        assert off.tolist() == [position] * OFFSET_PAD
        # A view into the table's memory (no new buffer, no launch).
        row = np.asarray(off).__array_interface__["data"][0]
        assert row == base + position * OFFSET_PAD * 4
    # Another cache at another position: that position's row.
    other = make_prompt_cache(m)
    m(mx.array([[1, 2]]), cache=other)
    mx.eval(m(mx.array([[3]]), cache=other))
    mx.eval(m(mx.array([[4]]), cache=other))
    assert seen[-1][0] == 3 and seen[-1][1].tolist() == [3] * OFFSET_PAD
    # Past the table's end: a table twice as long as needed.
    rows = tables[0].size // OFFSET_PAD
    assert real(rows - 1).tolist() == [rows - 1] * OFFSET_PAD and step._positions is tables[0]
    assert real(rows).tolist() == [rows] * OFFSET_PAD  # the first row past the end
    assert step._positions.size == 2 * (rows + 1) * OFFSET_PAD
    rows = step._positions.size // OFFSET_PAD
    assert real(rows + 3).tolist() == [rows + 3] * OFFSET_PAD
    assert step._positions.size == 2 * (rows + 4) * OFFSET_PAD
    assert real(6).tolist() == [6] * OFFSET_PAD
    # And back to the first cache: its logits still equal the eager model's.
    monkeypatch.setenv("QAB_DISABLE", "decode-compile")
    eager, _ = load(tiny_hf_f32, "fused")
    ec = make_prompt_cache(eager)
    eager(mx.array([[1, 2, 3, 4]]), cache=ec)
    for t in range(5, 10):
        eager(mx.array([[t]]), cache=ec)
    a = m(mx.array([[10]]), cache=cache)
    b = eager(mx.array([[10]]), cache=ec)
    assert seen[-1][0] == 9
    assert float(mx.abs(a - b).max()) <= 1e-5


def test_kernel_scalar_inputs_are_not_small_buffers():
    # MLX's CUDA allocator pools buffers of <= 8 bytes in host-shared managed
    # memory: kernel scalars are 16-byte arrays, one per value, element 0 read.
    from qwen_apple_backend.ops.device import SCALAR_PAD, f32_scalar, padded_zeros
    from qwen_apple_backend.ops.moe import fold_norm_counter

    e = f32_scalar(1e-6)
    assert e is f32_scalar(1e-6) and e is not f32_scalar(1e-5)
    assert e.shape == (SCALAR_PAD,) and e.dtype == mx.float32 and e.nbytes == 16
    assert mx.all(e == mx.array(1e-6, dtype=mx.float32)).item()
    for dt in (mx.bool_, mx.bfloat16, mx.float32, mx.uint32):
        z = padded_zeros(dt)
        assert z is padded_zeros(dt) and z.nbytes == 16 and z.dtype == dt
        assert not mx.any(z).item()
    c = fold_norm_counter(3)
    assert c.shape == (3,) and c.dtype == mx.uint32 and c.tolist() == [0, 0, 0]


def test_small_kernel_outputs_are_not_small_buffers():
    # A kernel output of under 16 bytes is allocated longer (its kernels index
    # only the first n): the MoE fold's shared-gate logit of one token row.
    from qwen_apple_backend.ops import moe as moe_ops
    from qwen_apple_backend.ops.device import unpooled_length

    assert [unpooled_length(n, mx.float32) for n in (0, 1, 3, 4, 5)] == [4, 4, 4, 4, 5]
    assert unpooled_length(1, mx.bfloat16) == 8 and unpooled_length(1, mx.bool_) == 16
    assert unpooled_length(9, mx.bfloat16) == 9

    from .test_kernels_gpu import _fold_case

    for rows in (1, 2, 7):
        x, inds, _, gu, _, sw = _fold_case((rows, 8, 1024, 64, 2, 4), mx.float32)
        seen = {}

        def kernel(**kw):
            seen.update(kw)
            return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"],
                                                          kw["output_dtypes"])]

        I = gu.weight.shape[1] // 2
        h, logit = moe_ops._fold_gate_up_launch(kernel, x, inds.reshape(-1, 2), gu, sw,
                                                rows, 1024, I, 2)
        assert h.shape == (rows, 3, I)
        assert logit.dtype == mx.float32 and logit.size >= rows and logit.nbytes >= 16


def test_the_step_traces_under_the_serial_marker(tiny_hf_f32, monkeypatch):
    # The MoE blocks see ops.moe.serial_decode_tracing() while the compiled
    # step traces them (their counting kernels may then read their own
    # counters in place), and not in eager calls (prefill, the first token).
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock
    from qwen_apple_backend.ops.moe import serial_decode_tracing

    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    marks = []
    real = FusedSparseMoeBlock.__call__

    def spy(self, x, *a, **k):
        marks.append((x.shape[1], serial_decode_tracing()))
        return real(self, x, *a, **k)

    monkeypatch.setattr(FusedSparseMoeBlock, "__call__", spy)
    cache = make_prompt_cache(m)
    mx.eval(m(mx.array([[1, 2, 3]]), cache=cache))
    for t in (4, 5, 6):
        mx.eval(m(mx.array([[t]]), cache=cache))
    step = m.language_model.__dict__["_qab_decode"]
    assert step.compiled_calls == 2  # the first decode token ran eagerly
    layers = len(m.language_model.model.layers)
    # Prefill and the eager token unmarked; the one trace marked; the replay
    # runs no Python.
    assert marks == [(3, False)] * layers + [(1, False)] * layers + [(1, True)] * layers
    assert not serial_decode_tracing()


@pytest.mark.slow
def test_attention_step_takes_the_projection_row_and_the_cache(tiny_hf_f32, monkeypatch):
    # attn-step: inside the compiled decode step (in-place KV backend faked
    # here: the CPU has none), each full-attention layer hands its
    # concatenated q/k/v projection row, norm weights, cache buffers, the
    # step's offset and its own counter to ops.attention.gqa_decode_step (faked
    # with its portable reference, gqa_decode_step_ops, whose new buffers the
    # fake hands back to the cache: MLX ops cannot write in place). Logits
    # equal those of the model without the step (QAB_DISABLE=kv-in-place:
    # slice_update) token after token; QAB_DISABLE=attn-step keeps the four
    # launches and says so in the report.
    from qwen_apple_backend import decode
    from qwen_apple_backend.layers import attention as attn_layer
    from qwen_apple_backend.ops import attention as attn_ops

    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    monkeypatch.setenv("QAB_DISABLE", "kv-in-place")
    ref, _ = load(tiny_hf_f32, "fused")
    monkeypatch.delenv("QAB_DISABLE")
    claimed, calls = [], []

    def claim(self):  # the buffers, not marked written: the step returns them as outputs
        if self.in_place is None:
            return None
        claimed.append(self)
        return self.keys, self.values, self.offset

    mmas = []  # the mma flag of each step_kernel_ready / gqa_decode_step call
    splits = []  # and the merge_split flag
    spreads = []  # and the merge_spread flag

    def fake_step(qkv, qw, kw, k_buf, v_buf, offset, counter, mma=None, merge_split=None,
                  merge_spread=None, **kw_):
        calls.append((qkv.shape, k_buf.shape, offset.shape, counter.dtype, kw_["heads"]))
        mmas.append(mma)
        splits.append(merge_split)
        spreads.append(merge_spread)
        out, kb, vb = attn_ops.gqa_decode_step_ops(qkv, qw, kw, k_buf, v_buf, offset, **kw_)
        c = claimed.pop()
        c.keys, c.values = kb, vb
        return out

    monkeypatch.setattr(decode, "kv_write_ready", lambda probe, k: "fake")
    monkeypatch.setattr(decode._StepKV, "claim_in_place", claim)
    monkeypatch.setattr(attn_ops, "step_kernel_ready",
                        lambda *a, mma=None, merge_split=None, merge_spread=None:
                        mmas.append(mma) or splits.append(merge_split)
                        or spreads.append(merge_spread) or "cuda")
    monkeypatch.setattr(attn_ops, "gqa_decode_step", fake_step)
    # The step runs only inside the decode step's trace (the serial counters).
    monkeypatch.setattr(attn_layer, "serial_decode_tracing", lambda: True)
    m, _ = load(tiny_hf_f32, "fused")
    assert not any("attn-step" in n for n in m.qab_report.notes)
    caches = [make_prompt_cache(x) for x in (m, ref)]
    for x, c in zip((m, ref), caches):
        mx.eval(x(mx.array([[1, 2, 3, 4]]), cache=c))
    n_attn = sum(1 for c in caches[0] if hasattr(c, "offset"))
    for t in range(4):
        tok = mx.array([[5 + t]])
        a, b = m(tok, cache=caches[0]), ref(tok, cache=caches[1])
        mx.eval(a, b)
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), t
    # The first decode token runs eagerly (no in-place cache: no step); the
    # next traces the step (one call per full-attention layer: the row
    # [B, 1, N] of the projection, a 0-d offset, a uint32 counter), the last
    # two replay it.
    assert m.language_model.__dict__["_qab_decode"].compiled_calls == 3
    assert len(calls) == n_attn and not claimed
    heads = m.language_model.args.num_attention_heads
    assert all(len(q) == 3 and q[:2] == (1, 1) and off == () and dt == mx.uint32 and h == heads
               for q, _, off, dt, h in calls)
    # The tensor-core key pass is asked for, of the check and of the launch
    # alike; QAB_DISABLE=attn-mma asks for the lane-group pass.
    # The two-level merge (attn-merge-split) is opt-in: not asked for by
    # default; the spread merge (attn-merge-spread) is on by default.
    assert mmas and all(f is True for f in mmas), mmas
    assert splits and all(f is False for f in splits), splits
    assert spreads and all(f is True for f in spreads), spreads
    mmas.clear()
    splits.clear()
    spreads.clear()
    calls.clear()
    no_mma, _ = load(tiny_hf_f32, "fused", disable=["attn-mma"])
    assert any("attn-mma in QAB_DISABLE" in n for n in no_mma.qab_report.notes)
    c = make_prompt_cache(no_mma)
    for t in range(3):
        mx.eval(no_mma(mx.array([[1 + t]]), cache=c))
    assert len(calls) == n_attn and mmas and all(f is False for f in mmas), mmas
    assert splits and all(f is False for f in splits), splits
    mmas.clear()
    splits.clear()
    calls.clear()
    # QAB_ENABLE=attn-merge-split asks for its merge, of the check and of the
    # launch alike, and the report says so (the spread merge stays asked for:
    # the kernel's rule _step_ms leaves it out where the two-level merge
    # runs); QAB_DISABLE=attn-merge-spread asks for the one-block merge, and
    # the report says so.
    for env, value, split, spread, says in (
            ("QAB_ENABLE", "decode-compile,attn-merge-split", True, True,
             "merges its key blocks in two levels, groups first (attn-merge-split from "
             "QAB_ENABLE"),
            ("QAB_DISABLE", "attn-merge-spread", False, False,
             "merges every key block, not G more thread blocks one query head each "
             "(attn-merge-spread in QAB_DISABLE")):
        for seen in (calls, mmas, splits, spreads):
            seen.clear()
        monkeypatch.setenv(env, value)
        merged, _ = load(tiny_hf_f32, "fused")
        monkeypatch.delenv("QAB_DISABLE", raising=False)
        monkeypatch.setenv("QAB_ENABLE", "decode-compile")
        assert any(says in n for n in merged.qab_report.notes), merged.qab_report.notes
        c = make_prompt_cache(merged)
        for t in range(3):
            mx.eval(merged(mx.array([[1 + t]]), cache=c))
        assert len(calls) == n_attn and splits and all(f is split for f in splits), (
            value, splits)
        assert spreads and all(f is spread for f in spreads), (value, spreads)
        assert all(f is True for f in mmas), mmas
    claimed.clear()
    monkeypatch.setattr(decode, "kv_cache_write", lambda backend, k, v, kb, vb, off:
                        attn_ops.kv_cache_write_ops(k, v, kb, vb, off)[2])
    # From STEP_MAX_KEYS buffer rows the layer keeps the four launches where the
    # step's pass would be the lane-group one (this float32 model's; the tiny
    # model's buffers hold 256 rows; a fresh trace for another limit).
    monkeypatch.setattr(attn_ops, "STEP_MAX_KEYS", 256)
    calls.clear()
    long_model, _ = load(tiny_hf_f32, "fused")
    c = make_prompt_cache(long_model)
    for t in range(3):
        mx.eval(long_model(mx.array([[1 + t]]), cache=c))
    assert calls == []
    # attn-step-long (on by default): the step from STEP_MAX_KEYS rows on too, where
    # its key pass is the tensor-core build (the tiny model is float32, which
    # that pass does not take, as above: its rule, ops.attention._step_mma, is
    # faked); QAB_DISABLE=attn-step-long keeps the limit, as the report says.
    real_mma = attn_ops._step_mma
    monkeypatch.setattr(attn_ops, "_step_mma", lambda G, D, dtype, mma=True: mma)
    says = ("on CUDA from 64K cached keys a decode token's attention runs as four launches, "
            "not the one-launch attention step (attn-step-long in QAB_DISABLE / disable=)")
    for disable, steps in (([], n_attn), (["attn-step-long"], 0)):
        calls.clear()
        long_model, _ = load(tiny_hf_f32, "fused", disable=disable)
        assert (says in long_model.qab_report.notes) == bool(disable)
        c = make_prompt_cache(long_model)
        for t in range(3):
            mx.eval(long_model(mx.array([[1 + t]]), cache=c))
        assert len(calls) == steps, (disable, calls)
    # ... and QAB_DISABLE=attn-mma (the lane-group pass) leaves it unused, as the report says.
    calls.clear()
    no_mma, _ = load(tiny_hf_f32, "fused", disable=["attn-mma"])
    assert ("attn-step-long is not used: it needs attn-mma, which QAB_DISABLE / disable= "
            "switches off" in no_mma.qab_report.notes), no_mma.qab_report.notes
    c = make_prompt_cache(no_mma)
    for t in range(3):
        mx.eval(no_mma(mx.array([[1 + t]]), cache=c))
    assert calls == []
    monkeypatch.setattr(attn_ops, "_step_mma", real_mma)
    monkeypatch.setattr(attn_ops, "STEP_MAX_KEYS", 65536)
    # A spread-merge build that fails its self-check (step_kernel_ready None
    # with merge_spread, "cuda" without) leaves the step to the one-block
    # merge: every launch then asks for merge_spread False, and the layers'
    # setting stays as it was (each trace asks again; the verdicts are cached).
    for seen in (calls, mmas, splits, spreads):
        seen.clear()
    checked = []
    monkeypatch.setattr(attn_ops, "step_kernel_ready",
                        lambda *a, mma=None, merge_split=None, merge_spread=None:
                        checked.append(merge_spread) or (None if merge_spread else "cuda"))
    fallback, _ = load(tiny_hf_f32, "fused")
    c = make_prompt_cache(fallback)
    for t in range(3):
        mx.eval(fallback(mx.array([[1 + t]]), cache=c))
    assert checked and checked == [True, False] * (len(checked) // 2), checked
    assert len(calls) == n_attn and spreads and not any(spreads), spreads
    attns = [getattr(layer, "self_attn", None) for layer in fallback.layers]
    attns = [a for a in attns if hasattr(a, "decode_merge_spread")]
    assert len(attns) == n_attn and all(a.decode_merge_spread is True for a in attns)
    claimed.clear()
    # What it needs, switched off, is named.
    no_prep, _ = load(tiny_hf_f32, "fused", disable=["qk-prep"])
    assert ("attn-step is not used: it needs qk-prep, which QAB_DISABLE / disable= switches off"
            in no_prep.qab_report.notes)
    assert ("attn-mma is not used: it needs qk-prep, which QAB_DISABLE / disable= switches off"
            in no_prep.qab_report.notes)
    assert ("attn-merge-spread is not used: it needs qk-prep, which QAB_DISABLE / disable= "
            "switches off" in no_prep.qab_report.notes)
    monkeypatch.setenv("QAB_ENABLE", "decode-compile,attn-merge-split")
    no_prep, _ = load(tiny_hf_f32, "fused", disable=["qk-prep"])
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    assert ("attn-merge-split from QAB_ENABLE is not used: it needs qk-prep, which QAB_DISABLE "
            "/ disable= switches off" in no_prep.qab_report.notes)
    monkeypatch.setenv("QAB_DISABLE", "attn-step")
    # (The separate in-place write is faked above: only which path runs is checked.)
    off_model, _ = load(tiny_hf_f32, "fused")
    assert any("attn-step in QAB_DISABLE" in n for n in off_model.qab_report.notes)
    assert all(not getattr(layer.self_attn, "decode_step", True)
               for layer in off_model.language_model.model.layers
               if hasattr(layer, "self_attn"))
    calls.clear()
    c = make_prompt_cache(off_model)
    for t in range(3):
        mx.eval(off_model(mx.array([[1 + t]]), cache=c))
    assert calls == []


def _fake_norm_gemv(monkeypatch) -> list:
    """Fake CUDA's norm + GEMV launch on any device: ready for every shape (any
    head counts as large), its kernel the two stock ops it fuses; returns the
    list that each kernel call appends its weight's row count to."""
    from qwen_apple_backend.ops import linear as qlinear

    calls = []

    def fake_kernel(x, norm_weight, eps, w, scales, biases, group_size, pipe=None):
        calls.append(w.shape[0])
        return mx.quantized_matmul(mx.fast.rms_norm(x, norm_weight, eps), w, scales, biases,
                                   transpose=True, group_size=group_size, bits=4)

    monkeypatch.setattr(qlinear, "norm_gemv_ready", lambda *a, **k: "cuda")
    monkeypatch.setattr(qlinear, "GEMV_MIN_BYTES", 0)
    monkeypatch.setattr(qlinear, "norm_gemv_kernel", fake_kernel)
    return calls


def test_final_norm_runs_in_the_lm_head_launch_of_the_step(tiny_q4, monkeypatch):
    # Where norm_gemv is ready (CUDA; faked here, its kernel replaced by the
    # two stock ops it fuses), the step's trace runs the final RMSNorm inside
    # lm_head's GEMV call (the mixers' input projections take it too: the
    # head's is the vocabulary-wide one), the model's modules are put back,
    # and the logits equal the eager model's. QAB_DISABLE=norm-proj keeps
    # the norm apart.
    import mlx.nn as nn

    from qwen_apple_backend.layers.linear import DecodeQuantizedLinear
    from qwen_apple_backend.ops import linear as qlinear

    calls = _fake_norm_gemv(monkeypatch)
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    comp, _ = load(tiny_q4, "fused")
    text = comp.language_model
    assert type(text.lm_head) is DecodeQuantizedLinear
    head, norm = text.lm_head, text.model.norm
    monkeypatch.delenv("QAB_ENABLE")
    monkeypatch.setenv("QAB_DISABLE", "decode-compile")
    eager, _ = load(tiny_q4, "fused")
    monkeypatch.delenv("QAB_DISABLE")
    cache, ec = make_prompt_cache(comp), make_prompt_cache(eager)
    prompt = mx.array([[3, 1, 4, 1, 5]])
    comp(prompt, cache=cache)
    eager(prompt, cache=ec)
    for t in (9, 2, 6):
        calls.clear()
        a = comp(mx.array([[t]]), cache=cache)
        b = eager(mx.array([[t]]), cache=ec)
        assert float(mx.abs(a - b).max()) <= 2e-2 * float(mx.abs(b).max())
        assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()
    step = text.__dict__["_qab_decode"]
    assert step.compiled_calls == 2
    assert text.lm_head is head and text.model.norm is norm and type(norm) is nn.RMSNorm
    # A trace calls the fused norm + head once (a replay calls no Python).
    vocab = head.weight.shape[0]
    step._fn = None  # rebuild: the next call traces again
    calls.clear()
    mx.eval(comp(mx.array([[7]]), cache=cache))
    assert calls.count(vocab) == 1 and step.builds == 2
    calls.clear()
    mx.eval(comp(mx.array([[8]]), cache=cache))
    assert calls == []
    # Off with norm-proj.
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    monkeypatch.setenv("QAB_DISABLE", "norm-proj")
    off, _ = load(tiny_q4, "fused")
    c = make_prompt_cache(off)
    off(prompt, cache=c)
    calls.clear()
    for t in (9, 2, 6):
        mx.eval(off(mx.array([[t]]), cache=c))
    assert vocab not in calls and off.language_model.__dict__["_qab_decode"].compiled_calls == 2
    # A head below the GEMV kernel's size keeps MLX's matmul and its own norm.
    from qwen_apple_backend.decode import _final_norm_backend

    assert _final_norm_backend(text, mx.zeros((1, 1), mx.int32)) == "cuda"
    # A head with a bias keeps its own call (the norm + GEMV launch adds none).
    head.bias = mx.zeros((head.weight.shape[0],), dtype=head.scales.dtype)
    assert _final_norm_backend(text, mx.zeros((1, 1), mx.int32)) is None
    del head["bias"]
    assert _final_norm_backend(text, mx.zeros((1, 1), mx.int32)) == "cuda"
    monkeypatch.setattr(qlinear, "GEMV_MIN_BYTES", head.weight.nbytes + 1)
    assert _final_norm_backend(text, mx.zeros((1, 1), mx.int32)) is None


def test_final_norm_in_the_lm_head_launch_for_qwen3_next(monkeypatch):
    # Qwen3-Next's layout (qwen3_next.Model: the inner model's norm last, then
    # lm_head): the trace folds the norm into the head's call once, the
    # modules are put back, and the logits equal the unfolded model's.
    import mlx.nn as nn

    from qwen_apple_backend.decode import install_compiled_decode
    from qwen_apple_backend.layers.linear import install_gemv_lm_head

    from ._qwen3_next import small_qwen3_next

    calls = _fake_norm_gemv(monkeypatch)

    def build():
        m = small_qwen3_next(mx.float32)
        m.model.norm.weight = 1.0 + 0.2 * mx.random.normal(m.model.norm.weight.shape,
                                                           key=mx.random.key(5))
        nn.quantize(m, group_size=32, bits=4, class_predicate=lambda p, mod: p == "lm_head")
        mx.eval(m.parameters())
        assert install_gemv_lm_head(m)
        return m

    folded, plain = build(), build()
    install_compiled_decode(folded)
    install_compiled_decode(plain, final_norm=False)
    head, norm = folded.lm_head, folded.model.norm
    cf, cp = make_prompt_cache(folded), make_prompt_cache(plain)
    prompt = mx.array([[3, 1, 4, 1, 5]])
    folded(prompt, cache=cf)
    plain(prompt, cache=cp)
    vocab = head.weight.shape[0]
    seen = []
    for t in (9, 2, 6, 7):
        calls.clear()
        a = folded(mx.array([[t]]), cache=cf)
        b = plain(mx.array([[t]]), cache=cp)
        seen.append(calls.count(vocab))
        assert float(mx.abs(a - b).max()) <= 1e-5 * max(1.0, float(mx.abs(b).max()))
    # Eager first token, then the trace (one fused call), then replays.
    assert seen == [0, 1, 0, 0]
    assert folded.lm_head is head and folded.model.norm is norm
    assert folded.__dict__["_qab_decode"].compiled_calls == 3
    # Hidden states of another dtype than the norm weight's (the readiness
    # check saw the weight's): the two modules as they are, no fused call.
    from qwen_apple_backend.decode import _NormedHead

    calls.clear()
    x = mx.random.normal((1, 1, norm.weight.shape[0]), key=mx.random.key(3)).astype(mx.bfloat16)
    y = _NormedHead(head, norm, "cuda")(x)
    assert calls == [] and mx.array_equal(y, head(norm(x))).item()


@pytest.mark.parametrize("case", ["new-pack", "trace-due", "trace-due-again"])
def test_compiled_step_checks_packs_in_an_eager_call(tiny_hf_f32, monkeypatch, case):
    # A packed MoE block's self-check cannot run inside mx.compile's trace
    # (MLX evaluates nothing there). So after a build that makes new packs
    # (faked here: the CPU has none), or after a trace that left a pack out
    # for want of its check (PackCheckDue, counted by pack_checks_due; faked
    # by the step's call bumping the count while traced), the step's next
    # call first runs the token eagerly inside pack_check_pass on scratch
    # copies of the caches (dropped), then runs it through a new trace. A
    # check pass that did not help keeps the next trace (no loop). The
    # logits are those of the eager model throughout, and the caches never
    # see the check pass's token (its KV row and states would double it).
    from qwen_apple_backend import decode
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock
    from qwen_apple_backend.ops import moe as moe_ops

    if case == "new-pack":
        made = set()

        def prepare(self):
            if id(self) in made:
                return None
            made.add(id(self))
            return object()  # a pack this block did not hold before

        monkeypatch.setattr(FusedSparseMoeBlock, "prepare_block_pack", prepare)
    monkeypatch.setenv("QAB_DISABLE", "decode-compile")
    ref, _ = load(tiny_hf_f32, "fused")
    monkeypatch.delenv("QAB_DISABLE")
    monkeypatch.setenv("QAB_ENABLE", "decode-compile")
    m, _ = load(tiny_hf_f32, "fused")
    step = m.language_model.__dict__["_qab_decode"]
    assert any(isinstance(layer.mlp, FusedSparseMoeBlock) for layer in m.layers)
    calls = []
    real_call = step._call

    def call(model, tokens, cache):
        traced = moe_ops.serial_decode_compiling()
        calls.append(("trace" if traced else "eager", moe_ops.pack_check_passing()))
        if traced and (case == "trace-due-again" or len(calls) == 1):
            moe_ops._PACK_CHECKS_DUE[0] += 1  # as a PackCheckDue would
        return real_call(model, tokens, cache)

    step._call = call
    caches = [make_prompt_cache(x) for x in (ref, m)]
    for x, c in zip((ref, m), caches):
        mx.eval(x(mx.array([[1, 2, 3, 4]]), cache=c))
    for t in range(5, 11):
        a, b = (x(mx.array([[t]]), cache=c) for x, c in zip((ref, m), caches))
        mx.eval(a, b)
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item(), f"token {t}"
    # (the first token: eager, not through the step; 6 tokens after it)
    if case == "new-pack":
        # the build's new packs -> checked eagerly, then traced: one call
        assert calls == [("eager", True), ("trace", False)], calls
        assert (step.eager_calls, step.check_passes, step.compiled_calls,
                step.builds) == (1, 1, 5, 1)
    elif case == "trace-due":
        # traced (a pack left out) -> next call: checked eagerly, traced
        # again, kept
        assert calls == [("trace", False), ("eager", True), ("trace", False)], calls
        assert (step.eager_calls, step.check_passes, step.compiled_calls,
                step.builds) == (1, 1, 5, 2)
    else:
        # the second trace still leaves a pack out: kept, no third check pass
        assert calls == [("trace", False), ("eager", True), ("trace", False)], calls
        assert (step.eager_calls, step.check_passes, step.compiled_calls,
                step.builds) == (1, 1, 5, 2)
    assert step._pack_check_due is False
    kv = [c for c in caches[1] if type(c).__name__ == "KVCache"]
    assert kv and all(c.offset == 4 + 6 for c in kv)
    for x, y in zip(*caches):  # the check pass's token left no trace in them
        if type(x).__name__ == "KVCache":
            assert mx.allclose(x.keys[..., :10, :], y.keys[..., :10, :],
                               rtol=1e-5, atol=1e-5).item()
        else:
            assert mx.allclose(x[1], y[1], rtol=1e-5, atol=1e-5).item()
