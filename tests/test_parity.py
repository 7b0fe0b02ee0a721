"""Parity gates: fused vs stock mlx-lm on tiny real-layout checkpoints.

float32: identical greedy tokens, 100% teacher-forced top-1, logits rel-L2 <= 1e-5.
bf16 / 4-bit: random weights give almost flat next-token distributions, so the
gate is error against a float32 reference: the fused backend's rel-L2 and mean KL
must be <= 1.1x stock's own at the same dtype.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from qwen_apple_backend import get_report, load

from ._metrics import mean_kl, perplexity, rel_l2, to_np, top1_agreement
from .conftest import SMALL_VOCAB

N_POS = 200  # teacher-forced positions (>= 192, the reference engine's count)


def _ids(n=N_POS + 1, seed=1, vocab=SMALL_VOCAB):
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def _logits(model, ids):
    out = model(mx.array([ids]))
    mx.eval(out)
    return to_np(out[0])


def _greedy(model, prompt, n):
    toks = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0)):
        toks.append(int(tok))
    return toks


@pytest.fixture(scope="module")
def f32_pair(tiny_hf_f32):
    stock, _ = load(tiny_hf_f32, "stock")
    fused, _ = load(tiny_hf_f32, "fused")
    return stock, fused


def test_fused_report_covers_every_module(f32_pair):
    _, fused = f32_pair
    report = get_report(fused)
    counts = report.counts()
    assert counts == {"gdn": (3, 3), "attn": (1, 1), "moe": (4, 4)}, report.summary()
    assert report.architecture == "qwen3_5_moe"


def test_float32_logits_match_stock(f32_pair):
    stock, fused = f32_pair
    ids = _ids()
    a, b = _logits(stock, ids[:-1]), _logits(fused, ids[:-1])
    err = rel_l2(b, a)
    agree = top1_agreement(b, a)
    dppl = perplexity(b, ids[1:]) / perplexity(a, ids[1:]) - 1
    print(f"\nfloat32 fused vs stock over {len(ids) - 1} positions: rel-L2 {err:.2e}, "
          f"max|dlogit| {np.abs(a - b).max():.2e}, top-1 {agree:.2%}, dppl {dppl:+.2e}")
    assert err <= 1e-5
    assert agree == 1.0


def test_float32_greedy_32_tokens_identical(f32_pair):
    stock, fused = f32_pair
    prompt = _ids(24, seed=2)
    assert _greedy(fused, prompt, 32) == _greedy(stock, prompt, 32)


def test_float32_batch_of_two(f32_pair):
    stock, fused = f32_pair
    ids = mx.array([_ids(40, seed=3), _ids(40, seed=4)])
    a, b = to_np(stock(ids)), to_np(fused(ids))
    assert rel_l2(b, a) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_with_cache_equals_one_pass(f32_pair, chunk):
    stock, fused = f32_pair
    ids = _ids(130, seed=5)
    ref = _logits(fused, ids)
    cache = make_prompt_cache(fused)
    outs = []
    for s in range(0, len(ids), chunk):
        out = fused(mx.array([ids[s:s + chunk]]), cache=cache)
        mx.eval(out)
        outs.append(to_np(out[0]))
    got = np.concatenate(outs, 0)
    assert rel_l2(got, ref) <= 1e-5, f"chunk={chunk}"
    assert top1_agreement(got, ref) == 1.0


def test_multi_turn_prompt_cache_matches_fresh_run(f32_pair):
    _, fused = f32_pair
    turn1, turn2 = _ids(37, seed=6), _ids(23, seed=7)
    cache = make_prompt_cache(fused)
    reply = []
    for tok, _ in generate_step(mx.array(turn1), fused, max_tokens=9,
                                sampler=make_sampler(0.0), prompt_cache=cache):
        reply.append(int(tok))
    # mlx-lm pipelines generation, so ask the KV cache how much it already holds.
    n_cached = next(c.offset for c in cache if hasattr(c, "offset"))
    seq = turn1 + reply
    assert len(turn1) <= n_cached <= len(seq)
    cont = seq[n_cached:] + turn2
    out = fused(mx.array([cont]), cache=cache)
    fresh = _logits(fused, turn1 + reply + turn2)
    assert rel_l2(to_np(out[0]), fresh[-len(cont):]) <= 1e-5


def _error_vs_reference(model, ref_logits, ids):
    got = _logits(model, ids[:-1])
    return (rel_l2(got, ref_logits), mean_kl(ref_logits, got), top1_agreement(got, ref_logits),
            perplexity(got, ids[1:]) / perplexity(ref_logits, ids[1:]) - 1)


def _gate(label, stock_m, fused_m, ref, ids):
    s = _error_vs_reference(stock_m, ref, ids)
    f = _error_vs_reference(fused_m, ref, ids)
    print(f"\n{label} vs float32 reference: stock rel-L2 {s[0]:.3e} KL {s[1]:.3e} top-1 {s[2]:.2%} "
          f"dppl {s[3]:+.2e} | fused rel-L2 {f[0]:.3e} KL {f[1]:.3e} top-1 {f[2]:.2%} "
          f"dppl {f[3]:+.2e}")
    assert f[0] <= 1.1 * s[0], "fused rel-L2 vs float32 exceeds 1.1x stock's"
    assert f[1] <= 1.1 * s[1], "fused mean KL vs float32 exceeds 1.1x stock's"


def test_bfloat16_error_vs_float32_within_stock(tiny_hf_bf16):
    if mx.default_device() == mx.cpu:
        # MLX 0.32's CPU gather_mm is float32-only, so neither stock nor fused can run an
        # unquantized bf16 MoE here; the 4-bit gate below runs bf16 activations instead.
        pytest.skip("MLX CPU gather_mm supports float32 only (stock fails the same way)")
    stock, _ = load(tiny_hf_bf16, "stock")
    fused, _ = load(tiny_hf_bf16, "fused")
    ref, _ = load(tiny_hf_bf16, "stock")
    ref.set_dtype(mx.float32)  # same (bf16-rounded) weights, float32 compute
    ids = _ids(seed=8)
    _gate("bfloat16", stock, fused, _logits(ref, ids[:-1]), ids)


def test_4bit_error_vs_float32_within_stock(tiny_q4):
    from mlx_lm.utils import dequantize_model

    stock, _ = load(tiny_q4, "stock")
    fused, _ = load(tiny_q4, "fused")
    assert get_report(fused).counts()["moe"] == (4, 4)
    ref, _ = load(tiny_q4, "stock")
    ref = dequantize_model(ref)
    ref.set_dtype(mx.float32)  # same dequantized weights, float32 compute
    ids = _ids(seed=9)
    _gate("4-bit", stock, fused, _logits(ref, ids[:-1]), ids)


@pytest.mark.parametrize("kinds", [{"moe"}, {"gdn", "attn"}, {"moe", "gdn", "attn"}])
def test_disable_keeps_kinds_stock_and_logits(tiny_hf_f32, kinds, monkeypatch):
    monkeypatch.setenv("QAB_DISABLE", ",".join(sorted(kinds)))
    model, _ = load(tiny_hf_f32, "fused")
    report = get_report(model)
    for m in report.modules:
        assert (m.fused is None) == (m.kind in kinds), m
    stock, _ = load(tiny_hf_f32, "stock")
    ids = _ids(50, seed=10)
    assert rel_l2(_logits(model, ids), _logits(stock, ids)) <= 1e-5


def test_optimization_switches_reach_the_fused_modules(tiny_hf_f32, monkeypatch):
    # QAB_DISABLE also takes single optimizations: the modules stay fused with
    # that one path switched off, and the report says so; logits unchanged.
    monkeypatch.setenv("QAB_DISABLE", "gdn-kernel,moe-gemm,moe-kernel")
    model, _ = load(tiny_hf_f32, "fused")
    report = get_report(model)
    kinds = {m.kind for m in report.modules if m.fused}
    assert {"gdn", "moe", "attn"} <= kinds
    for m in report.modules:
        if m.kind == "gdn":
            assert m.reason == "without gdn-kernel (QAB_DISABLE / disable=)"
        if m.kind == "moe" and m.fused:
            assert m.reason == "without moe-gemm, moe-kernel (QAB_DISABLE / disable=)"
    layers = model.language_model.model.layers
    assert all(not l.linear_attn.use_kernel for l in layers if l.is_linear)
    assert all(not l.mlp.dequant_gemm and not l.mlp.use_kernel for l in layers)
    stock, _ = load(tiny_hf_f32, "stock")
    ids = _ids(50, seed=11)
    assert rel_l2(_logits(model, ids), _logits(stock, ids)) <= 1e-5


_OFF_NOTES = {
    "attn-blocks": "a long prompt's attention runs as one call over all query rows, not in "
                   "blocks of query rows each evaluated before the next (attn-blocks in "
                   "QAB_DISABLE / disable=)",
    "gdn-kernel": "Gated DeltaNet scans and decode steps run as MLX ops, without the GPU "
                  "gated-delta kernels (gdn-kernel in QAB_DISABLE / disable=)",
    "moe-kernel": "MoE routing and experts run as MLX ops, without the GPU MoE kernels for "
                  "the router, decode GEMVs and grouped 4-bit GEMM (moe-kernel in QAB_DISABLE "
                  "/ disable=)",
    "moe-gemm": "quantized MoE experts' prefill runs MLX's gathered quantized matmul, not "
                "dequantize-then-GEMM (moe-gemm in QAB_DISABLE / disable=)",
    "moe-block": "on CUDA a decode token's MoE layer half runs as three launches (route, "
                 "gate/up, down), not one (moe-block in QAB_DISABLE / disable=)",
    "moe-block-stage": "on CUDA the one-launch MoE block's down items read the token's "
                       "gate/up activations from L2 chunk by chunk, not staged in shared "
                       "memory (moe-block-stage in QAB_DISABLE / disable=)",
    "moe-block-early": "on CUDA the one-launch MoE block's gate/up items wait for the route "
                       "and read its normed input, not stage it themselves (moe-block-early "
                       "in QAB_DISABLE / disable=)",
    "moe-block-out-proj": "on CUDA each mixer's output projection runs as its own launch, "
                          "not as the first phase of the one-launch MoE block "
                          "(moe-block-out-proj in QAB_DISABLE / disable=)",
    "moe-block-unroll": "on CUDA the one-launch MoE block's projection phases stage their "
                        "input in a loop, not unrolled (moe-block-unroll in QAB_DISABLE / "
                        "disable=)",
    "moe-block-npl": "on CUDA each of the one-launch MoE block's next-projection items "
                     "starts its own block and stages its input itself (moe-block-npl in "
                     "QAB_DISABLE / disable=)",
    "moe-block-roll": "on CUDA the one-launch MoE block's dot loops are unrolled, not one "
                      "chunk's code in a loop (moe-block-roll in QAB_DISABLE / disable=)",
    "moe-block-npg": "on CUDA the one-launch MoE block's grid holds a block per "
                     "next-projection item, not the GPU's resident blocks looping over "
                     "them (moe-block-npg in QAB_DISABLE / disable=)",
}


def test_moe_block_switch_reaches_every_fused_moe_block(tiny_q4):
    # QAB_DISABLE=moe-block / disable=["moe-block"] clears FusedSparseMoeBlock.one_launch.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    for disable, want in (([], True), (["moe-block"], False)):
        model = load(tiny_q4, "fused", disable=disable)[0]
        blocks = [m for _, m in model.named_modules() if isinstance(m, FusedSparseMoeBlock)]
        assert blocks and all(b.one_launch is want for b in blocks)


@pytest.mark.parametrize("name,attr", [("moe-block-stage", "stage_down"),
                                       ("moe-block-early", "early_gate_up"),
                                       ("moe-block-out-proj", "out_proj_phase"),
                                       ("moe-block-unroll", "unroll_stage"),
                                       ("moe-block-npl", "npl_items"),
                                       ("moe-block-roll", "roll_dots"),
                                       ("moe-block-npg", "npg_grid")])
def test_moe_block_build_switch_reaches_every_fused_moe_block(tiny_q4, monkeypatch, name, attr):
    # FusedSparseMoeBlock.stage_down, .early_gate_up, .out_proj_phase and
    # .unroll_stage (and .npl_items, .roll_dots, .npg_grid) are on by default; QAB_DISABLE /
    # disable=[name] clears it
    # in every block, and QAB_ENABLE no longer takes the name (it is on already).
    from qwen_apple_backend.errors import EnvVarError
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    monkeypatch.delenv("QAB_DISABLE", raising=False)
    monkeypatch.delenv("QAB_ENABLE", raising=False)
    for disable, want in (([], True), ([name], False)):
        model = load(tiny_q4, "fused", disable=disable)[0]
        blocks = [m for _, m in model.named_modules() if isinstance(m, FusedSparseMoeBlock)]
        assert blocks and all(getattr(b, attr) is want for b in blocks)
    monkeypatch.setenv("QAB_ENABLE", name)
    with pytest.raises(EnvVarError, match=f"'{name}' is on by default"):
        load(tiny_q4, "fused")


@pytest.mark.parametrize("name,attr", [("moe-block-unroll", "unroll_stage"),
                                       ("moe-block-npl", "npl_items"),
                                       ("moe-block-roll", "roll_dots"),
                                       ("moe-block-npg", "npg_grid")])
def test_moe_block_build_switches_from_the_environment(tiny_q4, monkeypatch, name,
                                                                attr):
    # QAB_DISABLE=moe-block-unroll clears FusedSparseMoeBlock.unroll_stage (on
    # by default: the block's UNROLL build), moe-block-npl .npl_items (NPL),
    # moe-block-roll .roll_dots (ROLL), moe-block-npg .npg_grid (NPG), in
    # every fused MoE block and only there, and the report says so: the
    # switch's note, and each fused MoE module's record names it.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    monkeypatch.delenv("QAB_ENABLE", raising=False)
    monkeypatch.setenv("QAB_DISABLE", name)
    model = load(tiny_q4, "fused")[0]
    blocks = [m for _, m in model.named_modules() if isinstance(m, FusedSparseMoeBlock)]
    assert blocks and not any(getattr(b, attr) for b in blocks)
    assert all(b.stage_down and b.early_gate_up and b.one_launch for b in blocks)
    # (only the one switched off)
    assert all(sum((b.unroll_stage, b.npl_items, b.roll_dots, b.npg_grid)) == 3
               for b in blocks)
    report = get_report(model)
    assert _OFF_NOTES[name] in report.notes
    moe = [m for m in report.modules if m.kind == "moe" and m.fused]
    assert moe and all(m.reason == f"without {name} (QAB_DISABLE / disable=)" for m in moe)
    monkeypatch.delenv("QAB_DISABLE")
    model = load(tiny_q4, "fused")[0]
    assert all(getattr(m, attr) for _, m in model.named_modules()
               if isinstance(m, FusedSparseMoeBlock))
    assert _OFF_NOTES[name] not in get_report(model).notes


def test_mixers_hand_the_moe_block_their_output_before_its_projection(tiny_q4, monkeypatch):
    # moe-block-out-proj: each decoder layer asks its fused mixer for the
    # output before o_proj / out_proj (a DeferredProjection) and hands it to
    # the fused MoE block; with the switch off the block gets the projected
    # output. Either way (here on the CPU, where the block projects first, as
    # the mixer would have) the logits equal the stock model's path through
    # the same fused modules.
    from qwen_apple_backend.layers.linear import DeferredProjection
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    monkeypatch.delenv("QAB_DISABLE", raising=False)
    seen = []
    real = FusedSparseMoeBlock.add_norm_forward

    def spy(self, x, r, norm, next_norm=None, next_layer=None):
        seen.append(type(r))
        return real(self, x, r, norm, next_norm, next_layer=next_layer)

    monkeypatch.setattr(FusedSparseMoeBlock, "add_norm_forward", spy)
    tokens = mx.array([[3, 17, 42, 5, 9]])
    logits = {}
    for disable in ([], "moe-block-out-proj"):  # (a string: comma-separated names)
        model = load(tiny_q4, "fused", disable=disable)[0]
        seen.clear()
        logits[bool(disable)] = model(tokens)
        n_layers = len(model.language_model.model.layers)
        want = mx.array if disable else DeferredProjection
        assert len(seen) == n_layers and all(t is want for t in seen), seen
    assert mx.array_equal(logits[False], logits[True]).item()


@pytest.mark.slow
def test_l2_prefetch_links_each_moe_block_to_the_next_layers_projection(tiny_q4, monkeypatch):
    # QAB_ENABLE=l2-prefetch gives every fused MoE block but the last the next
    # layer's concatenated input projection (FusedSparseMoeBlock.l2_next),
    # whose weight, scales and biases its one launch prefetches; off by
    # default, disable=["l2-prefetch"] wins, and without proj-concat there is
    # nothing to link.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    monkeypatch.delenv("QAB_DISABLE", raising=False)
    for enable, disable, want in (("", [], False), ("l2-prefetch", [], True),
                                  ("l2-prefetch", ["l2-prefetch"], False),
                                  ("l2-prefetch", ["proj-concat"], False),
                                  ("l2-prefetch", ["moe-block-early"], True)):
        monkeypatch.setenv("QAB_ENABLE", enable)
        model = load(tiny_q4, "fused", disable=disable)[0]
        layers = model.model.layers if hasattr(model, "model") else model.layers
        blocks = [layer.mlp for layer in layers]
        assert all(isinstance(b, FusedSparseMoeBlock) for b in blocks)
        assert blocks[-1].l2_next is None
        for b, nxt in zip(blocks, layers[1:]):
            mixer = nxt.get("linear_attn") or nxt.get("self_attn")
            assert (b.l2_next is mixer._proj_cat) if want else b.l2_next is None
            arrays = b._l2_prefetch_arrays()
            if want:
                cat = mixer._proj_cat.cat
                assert [a is cat[k] for a, k in zip(arrays, ("weight", "scales", "biases"))] == [
                    True] * 3
            else:
                assert arrays == ()
        notes = [n for n in get_report(model).notes if "l2-prefetch" in n]
        assert len(notes) == (1 if enable else 0), notes
        if disable and disable != ["l2-prefetch"]:
            # Linked or not, the prefetch needs both: the note says which is off.
            assert notes[0] == (f"l2-prefetch from QAB_ENABLE is not used: it needs "
                                f"{disable[0]}, which QAB_DISABLE / disable= switches off")
        if "moe-block-early" in disable:
            assert not any(b.early_gate_up for b in blocks)
    # Whatever takes the one-launch block away is named, several at once too;
    # next-norm (whose kernels replace the block) as well.
    monkeypatch.setenv("QAB_ENABLE", "l2-prefetch")
    for disable, says in ((["moe-route", "proj-concat"], "moe-route and proj-concat"),):
        notes = [n for n in get_report(load(tiny_q4, "fused", disable=disable)[0]).notes
                 if "l2-prefetch" in n]
        assert notes == [f"l2-prefetch from QAB_ENABLE is not used: it needs {says}, which "
                         "QAB_DISABLE / disable= switches off"]
    monkeypatch.setenv("QAB_ENABLE", "l2-prefetch,next-norm")
    notes = [n for n in get_report(load(tiny_q4, "fused")[0]).notes if "l2-prefetch" in n]
    assert notes == ["l2-prefetch from QAB_ENABLE is not used: next-norm, also from QAB_ENABLE, "
                     "replaces the one-launch MoE block"]


def test_moe_block_nps_switch_reaches_every_fused_block(tiny_q4, monkeypatch):
    # QAB_ENABLE=moe-block-nps sets FusedSparseMoeBlock.nps_mode to
    # ops.moe.NPS_MODE (0 by default), which the block passes as its NPS build
    # override; disable= wins; the report says it is on (and, off CUDA, that
    # it has no effect), not used with next-norm (whose kernels replace the
    # block), or switched off.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock
    from qwen_apple_backend.ops import moe as moe_ops

    monkeypatch.delenv("QAB_DISABLE", raising=False)
    for enable, disable, want, says in (
            ("", [], 0, None),
            ("moe-block-nps", [], moe_ops.NPS_MODE, "on CUDA the one-launch MoE block runs on "
                                                    "a persistent grid"),
            ("moe-block-nps", ["moe-block-nps"], 0, "which wins"),
            ("moe-block-nps,next-norm", [], moe_ops.NPS_MODE,
             "moe-block-nps from QAB_ENABLE is not used: next-norm, also from QAB_ENABLE, "
             "replaces the one-launch MoE block")):
        monkeypatch.setenv("QAB_ENABLE", enable)
        model = load(tiny_q4, "fused", disable=disable)[0]
        blocks = [m for _, m in model.named_modules() if isinstance(m, FusedSparseMoeBlock)]
        assert blocks and all(b.nps_mode == want for b in blocks), enable
        assert all(b._block_overrides()["NPS"] == want for b in blocks)
        notes = [n for n in get_report(model).notes if "moe-block-nps" in n]
        if says is None:
            assert notes == []
        else:
            assert len(notes) == 1 and says in notes[0], notes
    assert moe_ops.NPS_MODE in (1, 2)

def test_moe_block_rpl_switch_reaches_every_fused_block(tiny_q4, monkeypatch):
    # QAB_ENABLE=moe-block-rpl sets FusedSparseMoeBlock.preload_norm (off by
    # default), which the block passes as its RPL build override; disable=
    # wins; the report says it is on, not used with next-norm (whose kernels
    # replace the block), or switched off.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    monkeypatch.delenv("QAB_DISABLE", raising=False)
    for enable, disable, want, says in (
            ("", [], False, None),
            ("moe-block-rpl", [], True, "on CUDA the one-launch MoE block's route items load "
                                        "the residual row"),
            ("moe-block-rpl", ["moe-block-rpl"], False, "which wins"),
            ("moe-block-rpl,next-norm", [], True,
             "moe-block-rpl from QAB_ENABLE is not used: next-norm, also from QAB_ENABLE, "
             "replaces the one-launch MoE block")):
        monkeypatch.setenv("QAB_ENABLE", enable)
        model = load(tiny_q4, "fused", disable=disable)[0]
        blocks = [m for _, m in model.named_modules() if isinstance(m, FusedSparseMoeBlock)]
        assert blocks and all(b.preload_norm is want for b in blocks), enable
        assert all(b._block_overrides()["RPL"] is want for b in blocks)
        notes = [n for n in get_report(model).notes if "moe-block-rpl" in n]
        if says is None:
            assert notes == []
        else:
            assert len(notes) == 1 and says in notes[0], notes



def test_attn_lanes_switch_reaches_every_fused_attention_layer(tiny_q4, monkeypatch):
    # QAB_ENABLE=attn-lanes sets FusedGQAAttention.decode_lanes (off by
    # default); disable=["attn-lanes"] wins; the report says which.
    from qwen_apple_backend.layers.attention import FusedGQAAttention

    monkeypatch.delenv("QAB_DISABLE", raising=False)
    for enable, disable, want in (("", [], False), ("attn-lanes", [], True),
                                  ("attn-lanes", ["attn-lanes"], False)):
        monkeypatch.setenv("QAB_ENABLE", enable)
        model = load(tiny_q4, "fused", disable=disable)[0]
        layers = [m for _, m in model.named_modules() if isinstance(m, FusedGQAAttention)]
        assert layers and all(m.decode_lanes is want for m in layers)
        assert all(m.decode_kernel for m in layers)
        notes = [n for n in get_report(model).notes if "attn-lanes" in n]
        if not enable:
            assert notes == []
        elif disable:
            assert len(notes) == 1 and "which wins" in notes[0]
        else:
            assert len(notes) == 1 and "lane-group kernel" in notes[0]


@pytest.mark.parametrize("opt", sorted(_OFF_NOTES))
def test_switched_off_optimization_is_a_report_note(tiny_q4, opt, monkeypatch):
    # Like add-norm or proj-concat, a module kind's optimization switched off says in the
    # report's notes what runs instead; only the one switched off, and only once.
    # (Each load builds and fuses its own model; the tokenizer is conftest's one per worker.)
    monkeypatch.delenv("QAB_DISABLE", raising=False)
    notes = get_report(load(tiny_q4, "fused", disable=[opt])[0]).notes
    assert [n for n in notes if n in _OFF_NOTES.values()] == [_OFF_NOTES[opt]]
    monkeypatch.setenv("QAB_DISABLE", opt)
    assert _OFF_NOTES[opt] in get_report(load(tiny_q4, "fused")[0]).notes
    monkeypatch.delenv("QAB_DISABLE")
    # No note when nothing of that kind was fused, nor when nothing is switched off.
    kind = opt.split("-")[0]
    notes = get_report(load(tiny_q4, "fused", disable=[kind, opt])[0]).notes
    assert _OFF_NOTES[opt] not in notes
    assert not set(get_report(load(tiny_q4, "fused")[0]).notes) & set(_OFF_NOTES.values())
