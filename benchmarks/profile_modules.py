#!/usr/bin/env python3
"""Per-module GPU times at the full Qwen3.6-35B-A3B shape: stock vs fused, plus MoE candidates.

Builds the ``full`` preset once (4-bit g64, 8-bit routers, random weights),
takes one Gated DeltaNet layer, one attention layer and one MoE block, and
times each module alone (median of ``--repeats`` synchronised runs after
warm-ups) at prefill lengths and at decode (one token against a cache of
``--context`` tokens): stock mlx-lm, the fused module with GPU kernels, and
the fused module on its portable path (``QAB_DISABLE_KERNELS``). For the MoE
prefill it also times candidate formulations (dequantize-then-bf16 gathered
GEMM, a dense GEMM of the same FLOPs) to show how far the gathered 4-bit
matmul is from the GEMM ceiling. Writes ``profile-<device>.json`` into OUT and
prints a table.

Usage:
    python benchmarks/profile_modules.py OUT [--lengths 512,4096] [--context 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def timeit(fn, repeats: int, warmup: int = 2) -> float:
    import mlx.core as mx

    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--lengths", default="512,4096")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--preset", default="full")
    args = p.parse_args(argv)
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache

    from qwen_apple_backend.bench.target import build_preset, clone_model_structure, fuse_in_memory
    from qwen_apple_backend.ops.moe import sort_by_expert

    t0 = time.perf_counter()
    b = build_preset(args.preset, seed=0)
    stock = b.model
    fused = clone_model_structure(stock)
    fuse_in_memory(fused, "fused", config=b.config)
    print(f"[{time.perf_counter() - t0:6.1f}s] built + fused", file=sys.stderr, flush=True)
    sl, fl = stock.language_model.model.layers, fused.language_model.model.layers
    ia = next(i for i, l in enumerate(sl) if not l.is_linear)
    H = b.config["text_config"]["hidden_size"] if "text_config" in b.config else b.config["hidden_size"]
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []

    def rec(module, variant, phase, T, sec, **extra):
        rows.append(dict(module=module, variant=variant, phase=phase, T=T, ms=1e3 * sec, **extra))
        print(f"[{time.perf_counter() - t0:6.1f}s] {module:5s} {variant:22s} {phase:7s} "
              f"T={T:6d} {1e3 * sec:9.3f} ms", file=sys.stderr, flush=True)

    def with_kernels(on: bool, fn):
        if on:
            os.environ.pop("QAB_DISABLE_KERNELS", None)
        else:
            os.environ["QAB_DISABLE_KERNELS"] = "1"
        try:
            return fn()
        finally:
            os.environ.pop("QAB_DISABLE_KERNELS", None)

    mods = {
        "gdn": (sl[0].linear_attn, fl[0].linear_attn),
        "attn": (sl[ia].self_attn, fl[ia].self_attn),
        "moe": (sl[0].mlp, fl[0].mlp),
    }
    key = mx.random.key(0)
    for T in lengths:
        x = (0.5 * mx.random.normal((1, T, H), key=key)).astype(mx.bfloat16)
        mx.eval(x)
        for name, (sm, fm) in mods.items():
            if name == "attn":
                mask = "causal"
                call = lambda m: m(x, mask=mask, cache=None)
            elif name == "gdn":
                call = lambda m: m(x, cache=None)
            else:
                call = lambda m: m(x)
            rec(name, "stock", "prefill", T, timeit(lambda: call(sm), args.repeats))
            rec(name, "fused", "prefill", T, with_kernels(True, lambda: timeit(lambda: call(fm), args.repeats)))
            if name == "gdn":
                rec(name, "fused-portable", "prefill", T,
                    with_kernels(False, lambda: timeit(lambda: call(fm), args.repeats)))
        # MoE candidates at this length.
        moe = fm = mods["moe"][1]
        sw = moe.switch_mlp
        from qwen_apple_backend.layers.moe import expert_weights
        from qwen_apple_backend.ops.moe import topk_route
        gu, dn = expert_weights(sw.gate_up_proj), expert_weights(sw.down_proj)
        xf = x.reshape(-1, H)
        inds, scores = topk_route(moe.gate(xf), moe.top_k, moe.norm_topk_prob)
        mx.eval(inds, scores)
        wgu = mx.dequantize(gu.weight, gu.scales, gu.biases, gu.group_size, gu.bits)
        wdn = mx.dequantize(dn.weight, dn.scales, dn.biases, dn.group_size, dn.bits)
        mx.eval(wgu, wdn)

        def experts_bf16(wgu=wgu, wdn=wdn):
            st = sort_by_expert(xf, inds)
            h = mx.gather_mm(st.x, wgu.swapaxes(-1, -2), rhs_indices=st.inds, sorted_indices=True)
            g, u = mx.split(h, 2, axis=-1)
            h = (g * mx.sigmoid(g)) * u
            y = mx.gather_mm(h, wdn.swapaxes(-1, -2), rhs_indices=st.inds, sorted_indices=True)
            return y[st.inv_order]

        def experts_q4():
            st = sort_by_expert(xf, inds)
            h = mx.gather_qmm(st.x, gu.weight, gu.scales, gu.biases, rhs_indices=st.inds,
                              transpose=True, group_size=gu.group_size, bits=gu.bits,
                              sorted_indices=True)
            g, u = mx.split(h, 2, axis=-1)
            h = (g * mx.sigmoid(g)) * u
            y = mx.gather_qmm(h, dn.weight, dn.scales, dn.biases, rhs_indices=st.inds,
                              transpose=True, group_size=dn.group_size, bits=dn.bits,
                              sorted_indices=True)
            return y[st.inv_order]

        def dequant_only():
            return [mx.dequantize(gu.weight, gu.scales, gu.biases, gu.group_size, gu.bits),
                    mx.dequantize(dn.weight, dn.scales, dn.biases, dn.group_size, dn.bits)]

        N = xf.shape[0] * moe.top_k
        xd = mx.random.normal((N, H)).astype(mx.bfloat16)
        wq = gu.weight[0], gu.scales[0], gu.biases[0]
        wb = wgu[0]
        mx.eval(xd)
        flops = 2 * N * H * (wgu.shape[1] + wdn.shape[1])
        for variant, fn in [("experts-gather_qmm", experts_q4),
                            ("experts-bf16-gather_mm", experts_bf16),
                            ("dequantize-all", dequant_only),
                            ("dense-qmm-gate_up-size", lambda: mx.quantized_matmul(
                                xd, *wq, transpose=True, group_size=gu.group_size, bits=gu.bits)),
                            ("dense-bf16-gate_up-size", lambda: xd @ wb.T)]:
            try:
                sec = timeit(fn, args.repeats)
            except RuntimeError as e:  # e.g. no bf16 gather_mm on the CPU
                print(f"  {variant}: {e}", file=sys.stderr)
                continue
            rec("moe", variant, "prefill", T, sec,
                tflops=(flops if variant.startswith("experts") else 2 * N * H * wgu.shape[1]) / sec / 1e12)
        del wgu, wdn
        mx.clear_cache()

    # Decode: one token against a cache of --context tokens.
    C = args.context
    xc = (0.5 * mx.random.normal((1, C, H), key=key)).astype(mx.bfloat16)
    x1 = (0.5 * mx.random.normal((1, 1, H), key=key)).astype(mx.bfloat16)
    for name, (sm, fm) in mods.items():
        for variant, m, kern in [("stock", sm, True), ("fused", fm, True),
                                 ("fused-portable", fm, False)]:
            if name == "moe":
                fn = lambda: m(x1)
            elif name == "attn":
                cache = KVCache()
                mx.eval(m(xc, mask="causal", cache=cache))
                fn = lambda: m(x1, mask=None, cache=cache)
            else:
                cache = ArraysCache(size=2)
                with_kernels(kern, lambda: mx.eval(m(xc, cache=cache)))
                fn = lambda: m(x1, cache=cache)
            rec(name, variant, "decode", C, with_kernels(kern, lambda: timeit(fn, 20, 3)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = mx.device_info().get("device_name", str(mx.default_device())) if hasattr(mx, "device_info") else str(mx.default_device())
    slug = "".join(c if c.isalnum() else "-" for c in str(dev)).strip("-").lower()
    path = out / f"profile-{slug}.json"
    path.write_text(json.dumps({"device": dev, "preset": args.preset, "rows": rows}, indent=1))
    print(f"\n{'module':6} {'variant':24} {'phase':8} {'T':>6} {'ms':>9} {'TFLOP/s':>8}")
    for r in rows:
        tf = f"{r['tflops']:.1f}" if "tflops" in r else ""
        print(f"{r['module']:6} {r['variant']:24} {r['phase']:8} {r['T']:>6} {r['ms']:>9.3f} {tf:>8}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
