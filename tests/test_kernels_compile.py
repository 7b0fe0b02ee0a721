"""Compile every CUDA kernel body with nvcc for sm_90, as MLX would wrap it.

No GPU needed, only ``nvcc`` on PATH (skipped otherwise): this catches syntax
and type errors in kernels that can only run on the GPU machine, and checks
that none spills registers to local memory at the template values the model
uses. The wrapper mirrors ``mx.fast.cuda_kernel``'s generated source: each
input as ``const T* name`` (plus ``name_shape`` / ``name_strides`` /
``name_ndim`` when the body uses them), each output as ``T* name``, template
ints/bools as constexpr, dtypes as ``using``.
MLX's own device header is replaced by the CUDA headers it pulls in
(each only where the kernel uses it). The
text compiled is what ``build_kernel`` hands MLX (compacted: no comments or
indentation); the compacted and the commented sources preprocess to the same tokens.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import mlx.core as mx
import pytest

from qwen_apple_backend.ops._sources import compact, kernel_source

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")

PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/limits>
#define inf cuda::std::numeric_limits<float>::infinity()
"""
# What MLX's source also has, here only where the kernel's text uses it: each
# header costs nvcc's front end a fixed time per build (on 2 cores, 0.6 s for
# <cuda/std/array> and 0.7 s for <cooperative_groups.h>, of 2.6 s for an empty
# kernel with all four), and a kernel that uses neither compiles the same.
SHAPES = """#include <cuda/std/array>
namespace mlx { namespace core { namespace cu {
using Shape = cuda::std::array<int32_t, 8>;
using Strides = cuda::std::array<int64_t, 8>;
}}}
"""
COOPERATIVE_GROUPS = "#include <cooperative_groups.h>\n"

T = {"bf16": "__nv_bfloat16", "f16": "__half", "f32": "float", "u32": "uint32_t",
     "i32": "int32_t", "bool": "bool"}

# op -> (input C types in manifest order, output C types, template values):
# the Qwen3.6-35B-A3B shapes in bf16.
CASES = {
    "gated_delta_scan": (
        ["bf16", "bf16", "bf16", "f32", "f32", "f32", "bool"], ["bf16", "f32"],
        {"InT": "bf16", "Dk": 128, "Dv": 128, "Hk": 16, "Hv": 32, "HAS_MASK": False}),
    "gated_delta_scan_staged": (
        ["bf16", "bf16", "bf16", "f32", "f32", "f32", "bool"], ["bf16", "f32"],
        {"InT": "bf16", "Dk": 128, "Dv": 128, "Hk": 16, "Hv": 32, "HAS_MASK": True,
         "LPR": 8, "BLOCK": 128, "TC": 32}),
    "moe_gate_up_gemv": (
        ["bf16", "u32", "u32", "bf16", "bf16"], ["bf16"],
        {"OutT": "bf16", "H": 2048, "I": 512, "K": 8, "G": 64}),
    # Qwen3.6 full attention at decode: 8 query heads per KV head, D = 256.
    "gqa_decode_partial": (
        ["bf16", "bf16", "bf16", "bool", "f32"], ["f32", "f32"],
        {"InT": "bf16", "D": 256, "G": 8, "BLOCK": 256, "HAS_MASK": True}),
    # Its lane-group first pass (attn-lanes) at the model's launch: 8 lanes per
    # key, 8 warps per thread block of 64 keys (4K keys).
    "gqa_decode_partial_lanes": (
        ["bf16", "bf16", "bf16", "bool", "f32"], ["f32", "f32"],
        {"InT": "bf16", "D": 256, "G": 8, "BLOCK": 64, "LPK": 8, "WARPS": 8, "HAS_MASK": True}),
    # The layer's build: the sigmoid output gate in the epilogue.
    "gqa_decode_combine": (["f32", "f32", "bf16"], ["bf16"],
                           {"OutT": "bf16", "D": 256, "HAS_GATE": True}),
    # Qwen3.6's decode q/k preparation: 64 of 256 dims rotated ("rotate half").
    "qk_norm_rope": (["bf16", "bf16", "bf16", "bf16", "f32", "i32"], ["bf16", "bf16"],
                     {"InT": "bf16", "D": 256, "R": 64, "TRAD": False}),
    # The one-launch decode attention step (attn-step) at the model's 4K launch,
    # with the tensor-core pass (MMA) and its lane-group fallback, and the
    # two-level merge (PM; the f16 extra case below without it).
    "gqa_decode_step": (
        ["bf16", "bf16", "bf16", "f32", "i32", "bf16", "bf16", "u32"], ["bf16", "f32"],
        {"InT": "bf16", "D": 256, "G": 8, "R": 64, "TRAD": False, "BLOCK": 80, "LPK": 8,
         "WARPS": 8, "MMA": True, "PM": True, "MS": 0}),
    # The compiled decode step's in-place KV cache write.
    "kv_cache_write": (["bf16", "bf16", "bf16", "bf16", "i32"], ["bool"], {"InT": "bf16"}),
    "moe_grouped_gemm": (
        ["bf16", "u32", "bf16", "bf16", "i32", "i32", "i32"], ["bf16"],
        {"KDIM": 2048, "NOUT": 512, "E": 256, "GLU": True}),
    # Scores in the router's dtype (bf16), read as float.
    "moe_down_gemv": (
        ["bf16", "u32", "bf16", "u32", "bf16", "bf16"], ["bf16"],
        {"OutT": "bf16", "H": 2048, "I": 512, "K": 8, "G": 64, "ST": "bf16"}),
    "moe_gate_up_shared_gemv": (
        ["bf16", "u32", "u32", "bf16", "bf16", "u32", "bf16", "bf16", "u32", "bf16", "bf16",
         "u32", "bf16", "bf16"], ["bf16", "f32"],
        {"OutT": "bf16", "H": 2048, "I": 512, "K": 8, "G": 64, "SGB": 8, "SGG": 64}),
    # The decode layers' build: bf16 scores, the residual added in the epilogue.
    "moe_down_shared_gemv": (
        ["bf16", "u32", "bf16", "u32", "bf16", "bf16", "u32", "bf16", "bf16", "f32", "bf16"],
        ["bf16"],
        {"OutT": "bf16", "H": 2048, "I": 512, "K": 8, "G": 64, "ST": "bf16", "HAS_RES": True}),
    # The same with the next layer's input RMSNorm in the epilogue.
    "moe_down_shared_norm_gemv": (
        ["bf16", "u32", "bf16", "u32", "bf16", "bf16", "u32", "bf16", "bf16", "f32", "bf16",
         "bf16", "f32", "u32"], ["bf16", "bf16"],
        {"OutT": "bf16", "H": 2048, "I": 512, "K": 8, "G": 64, "ST": "bf16", "BLOCK": 256}),
    "moe_combine": (
        ["bf16", "u32", "bf16", "bf16", "bf16"], ["bf16"], {"OutT": "bf16", "H": 2048, "K": 8}),
    # The longest matrix rows (GDN out_proj / o_proj, K = 4096), 2 row sets per warp.
    # With the RMSNorm prologue (norm-proj; the plain path is NORM = false).
    "quantized_gemv": (
        ["bf16", "u32", "bf16", "bf16", "bf16", "f32"], ["bf16"],
        {"OutT": "bf16", "ST": "bf16", "KD": 4096, "N": 12352, "G": 64, "M": 1, "LPR": 32,
         "RPW": 2, "NORM": True, "PIPE": False}),
    "gated_delta_decode": (
        ["bf16", "bf16", "bf16", "bf16", "bf16", "bf16", "bf16", "f32", "bf16", "bf16", "f32",
         "f32", "bool", "i32"], ["bf16", "bf16", "f32"],
        {"InT": "bf16", "WT": "bf16", "Hk": 16, "Hv": 32, "Dk": 128, "Dv": 128, "Kc": 4,
         "BLOCK": 256, "HAS_BIAS": False, "HAS_MASK": True, "HAS_LENGTHS": True,
         "PROJ_W": 12352}),  # the packed row of Qwen3.6's in_proj: 8,192 + 4,096 + 64
    "moe_router_topk": (["bf16"], ["u32", "bf16"],
                        {"InT": "bf16", "E": 256, "K": 8, "NORM": True}),
    # Qwen3.6's router: 256 experts, 8-bit g64, 16 warps of 4 rows per pass.
    "moe_add_norm_route": (["bf16", "bf16", "bf16", "f32", "u32", "bf16", "bf16", "u32"],
                           ["bf16", "bf16", "bf16", "u32", "bf16"],
                           {"T": "bf16", "D": 2048, "E": 256, "K": 8, "G": 64, "NORM": True,
                            "BLOCK": 256, "RB": 1}),
    # The three MoE decode launches as one (route, gate/up, down phases).
    "moe_decode_block": (
        ["bf16", "bf16", "bf16", "f32", "u32", "bf16", "bf16", "u32", "bf16", "bf16", "u32",
         "bf16", "bf16", "u32", "bf16", "bf16", "u32", "bf16", "bf16", "u32", "bf16", "bf16",
         "u32", "bf16", "bf16", "u32", "u32", "u32", "u32",
         "bf16", "u32", "bf16", "bf16", "bf16", "f32", "u32", "bf16", "bf16"],
        ["bf16", "u32", "bf16"],
        {"T": "bf16", "H": 2048, "E": 256, "K": 8, "I": 512, "G": 64, "RG": 64, "SGB": 8,
         "SGG": 64, "NORM": True, "BLOCK": 256, "RB": 1, "CS": 32, "PERSIST": False,
         "PREFETCH": True, "STAGE": False, "GRPW": 2, "EARLY": False, "PF": False,
         "OP": False, "DO": 1024, "OG": 32, "NP": False, "PN": 1, "PG": 32, "PRW": 2,
         "PSM": 0, "UNROLL": False, "NPL": False, "RPL": False, "GSR": False, "NPS": 0,
         "ROLL": False}),
    # The shipped build (STAGE, EARLY, UNROLL, ROLL, OP, NP) with Qwen3.6's Gated DeltaNet step
    # first (GD): 16 key and 32 value heads of 128, conv 4, the packed 12,352-wide row.
    "moe_decode_block_gdn": (
        ["bf16", "bf16", "bf16", "f32", "u32", "bf16", "bf16", "u32", "bf16", "bf16", "u32",
         "bf16", "bf16", "u32", "bf16", "bf16", "u32", "bf16", "bf16", "u32", "bf16", "bf16",
         "u32", "bf16", "bf16", "u32", "u32", "u32", "u32",
         "bf16", "u32", "bf16", "bf16", "bf16", "f32", "u32", "bf16", "bf16",
         "bf16", "bf16", "bf16", "bf16", "f32", "bf16", "bf16", "f32", "f32"],
        ["bf16", "u32", "bf16", "bf16", "f32"],
        {"T": "bf16", "H": 2048, "E": 256, "K": 8, "I": 512, "G": 64, "RG": 64, "SGB": 8,
         "SGG": 64, "NORM": True, "BLOCK": 256, "RB": 1, "CS": 32, "PERSIST": False,
         "PREFETCH": True, "STAGE": True, "GRPW": 2, "EARLY": True, "PF": False,
         "OP": True, "DO": 4096, "OG": 64, "NP": True, "PN": 12352, "PG": 64, "PRW": 2, "PSM": 0,
         "UNROLL": True, "NPL": False, "RPL": False, "GSR": False, "NPS": 0, "ROLL": True,
         "GHk": 16, "GHv": 32, "GDk": 128, "GDv": 128, "GKc": 4, "GBIAS": False,
         "GW": 12352, "GDS": 1}),
    # Qwen3.6's token embedding (248,320 rows of 2,048, 4-bit, group 64).
    "embedding_dequantize": (
        ["u32", "u32", "bf16", "bf16"], ["bf16"],
        {"T": "bf16", "IdT": "u32", "BITS": 4, "G": 64, "D": 2048, "V": 248320, "BLOCK": 256}),
}

# More template values of one op: (op, case) as in CASES.
EXTRA_CASES = [
    # The one-launch MoE block with its down items staging h in shared memory.
    ("moe_decode_block", (CASES["moe_decode_block"][0], CASES["moe_decode_block"][1],
                          {**CASES["moe_decode_block"][2], "STAGE": True})),
    # ... with 4 gate/up row pairs per warp and gate/up items staging the norm
    # themselves; the shipped build (STAGE, EARLY) with the L2 prefetch (PF).
    ("moe_decode_block", (CASES["moe_decode_block"][0], CASES["moe_decode_block"][1],
                          {**CASES["moe_decode_block"][2], "STAGE": True, "GRPW": 4,
                           "EARLY": True})),
    ("moe_decode_block", (CASES["moe_decode_block"][0][:-12] + ["u32", "bf16", "bf16"]
                          + CASES["moe_decode_block"][0][-9:],
                          CASES["moe_decode_block"][1],
                          {**CASES["moe_decode_block"][2], "STAGE": True, "EARLY": True,
                           "PF": True})),
    # The shipped build with the mixer's output projection (OP, Qwen3.6's 4,096
    # inputs), and with the next layer's norm + in_proj too (NP, 12,352 rows):
    # both projection phases share one staging buffer (static shared memory
    # stays under 48 KB). Both with UNROLL off (the projection phases' staging
    # as a loop: moe-block-unroll's ablation); the shipped, unrolled OP + NP
    # build is test_moe_block_keeps_two_blocks_per_sm's op-np.
    ("moe_decode_block", (CASES["moe_decode_block"][0], CASES["moe_decode_block"][1],
                          {**CASES["moe_decode_block"][2], "STAGE": True, "EARLY": True,
                           "OP": True, "DO": 4096, "OG": 64})),
    ("moe_decode_block", (CASES["moe_decode_block"][0], CASES["moe_decode_block"][1],
                          {**CASES["moe_decode_block"][2], "STAGE": True, "EARLY": True,
                           "OP": True, "DO": 4096, "OG": 64, "NP": True, "PN": 12352,
                           "PG": 64})),
    # The dense GEMV with double-buffered passes at the GDN in_proj's shape
    # (K = 2048; 56 registers with nvcc 13, so 4 blocks of 256 threads per SM) and o_proj's.
    ("quantized_gemv", (CASES["quantized_gemv"][0], CASES["quantized_gemv"][1],
                        {**CASES["quantized_gemv"][2], "KD": 2048, "RPW": 1, "PIPE": True})),
    ("quantized_gemv", (CASES["quantized_gemv"][0], CASES["quantized_gemv"][1],
                        {**CASES["quantized_gemv"][2], "N": 2048, "RPW": 1, "NORM": False,
                         "PIPE": True})),
    # The router at its limits: E = 1024 float32 logits (32 per lane, 8 lane
    # groups) with K = 32; and 8 half logits (one lane group, mostly padding).
    ("moe_router_topk", (["f32"], ["u32", "f32"], {"InT": "f32", "E": 1024, "K": 32,
                                                   "NORM": True})),
    ("moe_router_topk", (["f16"], ["u32", "f16"], {"InT": "f16", "E": 8, "K": 2,
                                                   "NORM": False})),
    # The fused route in half precision with 512 experts, group 128, raw scores.
    ("moe_add_norm_route", (["f16", "f16", "f16", "f32", "u32", "f16", "f16", "u32"],
                            ["f16", "f16", "f16", "u32", "f16"],
                            {"T": "f16", "D": 4096, "E": 512, "K": 10, "G": 128,
                             "NORM": False, "BLOCK": 256, "RB": 1})),
    # The fold's down kernel with float32 scores and no residual.
    ("moe_down_shared_gemv", (
        ["bf16", "u32", "f32", "u32", "bf16", "bf16", "u32", "bf16", "bf16", "f32", "bf16"],
        ["bf16"],
        {"OutT": "bf16", "H": 2048, "I": 512, "K": 8, "G": 64, "ST": "f32", "HAS_RES": False})),
    # Split-K attention in float32 at D = 128 (4 elements per lane: 16-byte
    # vectors), no mask; the ungated second pass.
    ("gqa_decode_partial", (["f32", "f32", "f32", "bool", "f32"], ["f32", "f32"],
                            {"InT": "f32", "D": 128, "G": 16, "BLOCK": 32, "HAS_MASK": False})),
    ("gqa_decode_combine", (["f32", "f32", "f32"], ["f32"],
                            {"OutT": "f32", "D": 128, "HAS_GATE": False})),
    # The lane-group first pass in float32 at D = 256 (8 K pieces per lane) and
    # at G = 16, D = 128 (the most o a lane holds: 64 floats), no mask.
    ("gqa_decode_partial_lanes", (["f32", "f32", "f32", "bool", "f32"], ["f32", "f32"],
                                  {"InT": "f32", "D": 256, "G": 8, "BLOCK": 512, "LPK": 8,
                                   "WARPS": 8, "HAS_MASK": False})),
    ("gqa_decode_partial_lanes", (["f32", "f32", "f32", "bool", "f32"], ["f32", "f32"],
                                  {"InT": "f32", "D": 128, "G": 16, "BLOCK": 64, "LPK": 8,
                                   "WARPS": 8, "HAS_MASK": False})),
    # The attention step in float32 at D = 128, traditional RoPE, G = 16.
    ("gqa_decode_step", (["f32", "f32", "f32", "f32", "i32", "f32", "f32", "u32"],
                         ["f32", "f32"],
                         {"InT": "f32", "D": 128, "G": 16, "R": 32, "TRAD": True, "BLOCK": 512,
                          "LPK": 8, "WARPS": 8, "MMA": False, "PM": True, "MS": 0})),
    # The step's MMA build in f16 at D = 64 with G = 4 (query rows past G zero).
    ("gqa_decode_step", (["f16", "f16", "f16", "f32", "i32", "f16", "f16", "u32"],
                         ["f16", "f32"],
                         {"InT": "f16", "D": 64, "G": 4, "R": 64, "TRAD": False, "BLOCK": 64,
                          "LPK": 8, "WARPS": 8, "MMA": True, "PM": False, "MS": 0})),
    # Traditional (adjacent-pair) RoPE in float32 at D = 128.
    ("qk_norm_rope", (["f32", "f32", "f32", "f32", "f32", "i32"], ["f32", "f32"],
                      {"InT": "f32", "D": 128, "R": 32, "TRAD": True})),
    # An 8-bit embedding in float16 with int32 ids; float32 at group 32.
    ("embedding_dequantize", (["i32", "u32", "f16", "f16"], ["f16"],
                              {"T": "f16", "IdT": "i32", "BITS": 8, "G": 64, "D": 1024,
                               "V": 512, "BLOCK": 256})),
    ("embedding_dequantize", (["i32", "u32", "f32", "f32"], ["f32"],
                              {"T": "f32", "IdT": "i32", "BITS": 4, "G": 32, "D": 96,
                               "V": 7, "BLOCK": 128})),
    # The grouped GEMM's down projection (no GLU epilogue, 2,048 output columns).
    ("moe_grouped_gemm", (["bf16", "u32", "bf16", "bf16", "i32", "i32", "i32"], ["bf16"],
                          {"KDIM": 512, "NOUT": 2048, "E": 256, "GLU": False})),
]


def wrap(op: str, case=None, raw: bool = False, texts=None) -> str:
    """The kernel as MLX's generated source (``raw``: the files' text, not compacted;
    ``texts``: the ``(header, body)`` handed to MLX, e.g. the ``#include`` form)."""
    return "".join(wrap_parts(op, case, raw, texts))


def wrap_parts(op: str, case=None, raw: bool = False, texts=None) -> tuple[str, str]:
    """``wrap``'s text as (the CUDA includes and definitions it starts with, the kernel)."""
    src = kernel_source(op, "cuda")
    header, body = (src.header, src.body) if raw else (compact(src.header), compact(src.body))
    if texts is not None:
        header, body = texts
    in_types, out_types, template = case or CASES[op]
    assert (len(in_types), len(out_types)) == (len(src.inputs), len(src.outputs)), (
        f"{op}: a type per manifest input and output")
    params = []
    for name, t in zip(src.inputs, in_types):
        params.append(f"const {T[t]}* {name}")
        # MLX's test: the text it is handed contains the name (a substring search).
        if f"{name}_shape" in body:
            params.append(f"const __grid_constant__ Shape {name}_shape")
        if f"{name}_strides" in body:
            params.append(f"const __grid_constant__ Strides {name}_strides")
        if f"{name}_ndim" in body:
            params.append(f"const __grid_constant__ int {name}_ndim")
    params += [f"{T[t]}* {name}" for name, t in zip(src.outputs, out_types)]
    consts = []
    for name, value in template.items():
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            consts.append(f"  constexpr int {name} = {value};")
        else:
            consts.append(f"  using {name} = {T[value]};")
    code = compact(header) + compact(body)  # comments out (the raw text may name cg in one)
    cg = "cg::" in code or "cooperative_groups" in code
    prelude = (PRELUDE + (SHAPES if any(" Shape " in p or " Strides " in p for p in params) else "")
               + (COOPERATIVE_GROUPS if cg else ""))
    return prelude, (header + "namespace mlx { namespace core { namespace cu {\n"
            + ("namespace cg = cooperative_groups;\n" if cg else "")
            + f"__global__ void {src.name}(\n    " + ",\n    ".join(params) + ") {\n"
            + "\n".join(consts) + "\n" + body + "\n}\n}}}\n")


@pytest.mark.parametrize("op", sorted(CASES))
def test_cuda_kernel_compiles_without_spills(op, tmp_path):
    _compile_without_spills(op, None, tmp_path)


@pytest.mark.parametrize("op,case", EXTRA_CASES,
                         ids=lambda c: c if isinstance(c, str)
                         else "-".join(str(v) for v in c[2].values()))
def test_cuda_kernel_extra_cases_compile_without_spills(op, case, tmp_path):
    _compile_without_spills(op, case, tmp_path)


def _compile_without_spills(op, case, tmp_path, spill_bytes=0, log_out=None):
    """nvcc for sm_90: the registers per thread (``ptxas -v``), after asserting
    at most ``spill_bytes`` of spill stores (0: none); ``log_out`` (a list), if
    given, gets nvcc's output.

    Device code only (``-cubin``), as NVRTC compiles MLX's kernels: the host
    compiler's pass over the CUDA headers, which ``-c`` adds, took 3-4 s of
    each 5-9 s build on 2 cores and checks nothing a kernel can get wrong."""
    cu = tmp_path / f"{op}.cu"
    cu.write_text(wrap(op, case), encoding="utf-8")
    r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-o", str(tmp_path / f"{op}.cubin"),
                        "-Xptxas", "-v", str(cu)], capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) <= spill_bytes, log[-2000:]
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 255, log[-2000:]
    if log_out is not None:
        log_out.append(log)
    return regs


def _preprocessed_variants(cu, variants):
    """nvcc's preprocessor over ``variants``, ``wrap_parts`` pairs with the same CUDA
    includes, in one run: each kernel's text after it, as one line of single-spaced tokens.

    One run per op instead of one per variant: each run paid nvcc's fixed cost and
    preprocessed the CUDA headers it includes (~0.6 s on 2 cores). After each variant the
    macros its text defines are undefined again (a packed MoE block defines ``w``,
    ``scales``...), so the next starts from the includes' definitions alone; a variant that
    ``#include``s its kernel (whose macros this does not see) must come last."""
    prelude = variants[0][0]
    assert all(p == prelude for p, _ in variants), "variants with different includes"
    parts = [prelude]
    for i, (_, kernel) in enumerate(variants):
        defined = sorted(set(re.findall(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", kernel, re.M)))
        parts += [f"\nqab_variant_start_{i}\n", kernel, f"\nqab_variant_end_{i}\n"]
        parts += [f"#undef {name}\n" for name in defined]
    cu.write_text("".join(parts), encoding="utf-8")
    r = subprocess.run([NVCC, "-arch=sm_90", "-E", str(cu)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    code = [ln for ln in r.stdout.splitlines() if not ln.lstrip().startswith("#")]
    tokens = " ".join(" ".join(code).split())
    texts = []
    for i in range(len(variants)):
        m = re.search(rf"\bqab_variant_start_{i} (.*) qab_variant_end_{i}\b", tokens)
        assert m, f"variant {i}'s markers are not in nvcc's output"
        texts.append(m[1])
    return texts


@pytest.mark.parametrize("op", sorted(CASES))
def test_compacted_and_included_sources_are_the_same_code(op, tmp_path, monkeypatch):
    # compact() drops comments and indentation only: after nvcc's preprocessor
    # (which drops comments itself), the raw and the compacted sources are the same
    # tokens with the same spacing inside each line. (Not the PTX: nvcc's output for
    # the same code can differ with the source's line layout, e.g. register numbering
    # and load order in gqa_decode_partial in about 1 build of 4.)
    # And what build_kernel hands MLX by default on CUDA (QAB_KERNEL_INCLUDE): two
    # #include lines of files under the cache dir. After the preprocessor the kernel
    # is the compacted text's, kernel parameters (the inputs' shapes / strides MLX
    # passes when the body names them) included.
    from qwen_apple_backend.ops.device import included_cuda_source

    monkeypatch.setenv("QAB_CACHE_DIR", str(tmp_path / "cache"))
    src = kernel_source(op, "cuda")
    assert len(compact(src.body)) < len(src.body)
    header, body = compact(src.header), compact(src.body)
    short = included_cuda_source(src.name, header, body, tuple(src.inputs))
    assert short is not None and len(short[1]) < 400 and "#include" in short[1]
    assert wrap(op, texts=short) != wrap(op)
    raw, compacted, included = _preprocessed_variants(
        tmp_path / "variants.cu", [wrap_parts(op, raw=True), wrap_parts(op),
                                   wrap_parts(op, texts=short)])
    assert f"void {src.name}(" in compacted
    assert raw == compacted
    assert included == compacted


def test_every_cuda_op_has_a_compile_case():
    from qwen_apple_backend.ops._sources import manifest

    assert {op for op, e in manifest().items() if e.get("cuda")} == set(CASES)


# --------------------------------------------------------------------------
# add_rms_norm: residual add + RMSNorm (kernels/cuda/add_rms_norm.cu)
# --------------------------------------------------------------------------

# Qwen3.6-35B-A3B: D = 2048 in bf16, 256 threads of 8 elements.
CASES["add_rms_norm"] = (["bf16", "bf16", "bf16", "f32"], ["bf16", "bf16"],
                         {"T": "bf16", "D": 2048, "BLOCK": 256})
# Also the largest row (16 float32 elements per thread at 1,024 threads) and
# an odd D in half precision (264 in 64 threads, a partial last chunk).
ADD_NORM_COMPILE_CASES = [
    CASES["add_rms_norm"],
    (["f32", "f32", "f32", "f32"], ["f32", "f32"], {"T": "f32", "D": 16384, "BLOCK": 1024}),
    (["f16", "f16", "f16", "f32"], ["f16", "f16"], {"T": "f16", "D": 264, "BLOCK": 64}),
]



def _packed_inputs(dtypes):
    """A moe_decode_block input dtype list with the 21 arrays of its packed build
    (router, routed experts, shared expert: inputs 4-24) as the one uint32 pk."""
    return dtypes[:4] + ["u32"] + dtypes[25:]


# The packed builds (moe-block-pack): the shipped OP + NP block, and the GD one;
# outputs out and po only (the workspace in count from word WSO, the GDN
# states written in place).
CASES["moe_decode_block_pack"] = (
    _packed_inputs(CASES["moe_decode_block"][0]), ["bf16", "bf16"],
    {**CASES["moe_decode_block"][2], "STAGE": True, "EARLY": True, "OP": True, "DO": 4096,
     "OG": 64, "NP": True, "PN": 12352, "PG": 64, "UNROLL": True, "WSO": 256})
CASES["moe_decode_block_gdn_pack"] = (
    _packed_inputs(CASES["moe_decode_block_gdn"][0]), ["bf16", "bf16"],
    {**CASES["moe_decode_block_gdn"][2], "WSO": 256})

@pytest.mark.parametrize("case", ADD_NORM_COMPILE_CASES,
                         ids=lambda c: "-".join(str(v) for v in c[2].values()))
def test_add_rms_norm_compiles_without_spills(case, tmp_path):
    _compile_without_spills("add_rms_norm", case, tmp_path)


# The shipped block build with both projection phases (OP + NP) at Qwen3.6's shape.
_BLOCK_OP_NP = (CASES["moe_decode_block"][0], CASES["moe_decode_block"][1],
                {**CASES["moe_decode_block"][2], "STAGE": True, "EARLY": True, "OP": True,
                 "DO": 4096, "OG": 64, "NP": True, "PN": 12352, "PG": 64, "UNROLL": True})


@pytest.mark.parametrize("op,case", [("moe_decode_block", _BLOCK_OP_NP),
                                     ("moe_decode_block_gdn", CASES["moe_decode_block_gdn"]),
                                     ("moe_decode_block_pack", CASES["moe_decode_block_pack"]),
                                     ("moe_decode_block_gdn_pack",
                                      CASES["moe_decode_block_gdn_pack"]),
                                     ("moe_decode_block_gdn_pack",
                                      (*CASES["moe_decode_block_gdn_pack"][:2],
                                       {**CASES["moe_decode_block_gdn_pack"][2], "PRW": 4})),
                                     ("moe_decode_block_gdn_pack",
                                      (*CASES["moe_decode_block_gdn_pack"][:2],
                                       {**CASES["moe_decode_block_gdn_pack"][2], "GDS": 4})),
                                     ("moe_decode_block_gdn_pack",
                                      (*CASES["moe_decode_block_gdn_pack"][:2],
                                       {**CASES["moe_decode_block_gdn_pack"][2], "GDS": 2})),
                                     ("moe_decode_block_gdn_pack",
                                      (*CASES["moe_decode_block_gdn_pack"][:2],
                                       {**CASES["moe_decode_block_gdn_pack"][2],
                                        "UNROLL": False})),
                                     ("moe_decode_block_pack",
                                      (*CASES["moe_decode_block_pack"][:2],
                                       {**CASES["moe_decode_block_pack"][2], "UNROLL": False})),
                                     ("moe_decode_block_gdn_pack",
                                      (*CASES["moe_decode_block_gdn_pack"][:2],
                                       {**CASES["moe_decode_block_gdn_pack"][2], "NPL": True})),
                                     ("moe_decode_block_pack",
                                      (*CASES["moe_decode_block_pack"][:2],
                                       {**CASES["moe_decode_block_pack"][2], "NPL": True})),
                                     ("moe_decode_block_gdn_pack",
                                      (*CASES["moe_decode_block_gdn_pack"][:2],
                                       {**CASES["moe_decode_block_gdn_pack"][2], "NPL": True,
                                        "RPL": True, "GSR": True})),
                                     ("moe_decode_block_pack",
                                      (*CASES["moe_decode_block_pack"][:2],
                                       {**CASES["moe_decode_block_pack"][2], "NPL": True,
                                        "RPL": True, "GSR": True})),
                                     ("moe_decode_block_gdn_pack",
                                      (*CASES["moe_decode_block_gdn_pack"][:2],
                                       {**CASES["moe_decode_block_gdn_pack"][2], "NPL": True,
                                        "PERSIST": True, "PSM": 48, "NPS": 1})),
                                     ("moe_decode_block_pack",
                                      (*CASES["moe_decode_block_pack"][:2],
                                       {**CASES["moe_decode_block_pack"][2], "NPL": True,
                                        "PERSIST": True, "PSM": 48, "NPS": 1})),
                                     ("moe_decode_block_gdn_pack",
                                      (*CASES["moe_decode_block_gdn_pack"][:2],
                                       {**CASES["moe_decode_block_gdn_pack"][2], "NPL": True,
                                        "ROLL": False})),
                                     ("moe_decode_block_pack",
                                      (*CASES["moe_decode_block_pack"][:2],
                                       {**CASES["moe_decode_block_pack"][2], "NPL": True,
                                        "ROLL": True}))],
                         ids=["op-np", "gd-op-np", "pack-op-np", "pack-gd-op-np",
                              "pack-gd-op-np-prw4", "pack-gd-op-np-gds4", "pack-gd-op-np-gds2",
                              "pack-gd-op-np-no-unroll", "pack-op-np-no-unroll",
                              "pack-gd-op-np-npl", "pack-op-np-npl",
                              "pack-gd-op-np-npl-rpl-gsr", "pack-op-np-npl-rpl-gsr",
                              "pack-gd-op-np-nps", "pack-op-np-nps",
                              "pack-gd-op-np-npl-no-roll", "pack-op-np-npl-roll"])
def test_moe_block_keeps_two_blocks_per_sm(op, case, tmp_path):
    # The one-launch MoE block at Qwen3.6's shape (OP + NP; and with the GDN
    # step first, GD; and with 4 next-projection rows per warp, PRW; with 8
    # nvcc 13 spills 32 bytes at this cap, so ops.moe refuses PRW 8; UNROLL as
    # shipped and, -no-unroll, off: moe-block-unroll's ablation; ROLL as
    # shipped and, -no-roll, off: moe-block-roll's; -nps:
    # moe-block-nps's build, a persistent grid whose phases' items run in a
    # loop each) must
    # fit two blocks of 256 threads on an SM: at most 128 registers per thread
    # (65,536 per SM), without spills. With the GDN step's 64 state floats
    # in registers at once the GD build needed 168 (one block per SM); its
    # phase 3 therefore runs in passes (qab_gdn_decode_head's PASSES).
    regs = _compile_without_spills(op, case, tmp_path)
    assert max(regs) <= 128, regs


@pytest.mark.slow
@pytest.mark.parametrize("psm,nps", [(32, 0), (64, 0), (48, 1), (48, 2)])
def test_moe_block_with_staged_next_projection_keeps_two_blocks_per_sm(psm, nps, tmp_path):
    # PSM: the next-projection items stage PSM rows (weights, scales, biases)
    # in dynamic shared memory; with NPS on a persistent grid, each block's
    # first unit's rows from its start (1) or after its first item (2). The
    # packed GD build at Qwen3.6's shape must still fit two blocks of 256
    # threads on an SM of sm_90: at most 128 registers without spills, and
    # twice its static shared memory plus the dynamic bytes ops.moe requests
    # (and the 1 KB the driver reserves per block) within the SM's 228 KB.
    from qwen_apple_backend.ops.moe import decode_block_dynamic_shared_bytes

    # NPS 2 (the copy issued after each block's first item, a call in every
    # phase's loop) spills 60 bytes with nvcc 13 with the dot loops unrolled
    # (ROLL off), 124 rolled, so ops.moe._nps_build builds it unrolled; the
    # bound catches more.
    case = (*CASES["moe_decode_block_gdn_pack"][:2],
            {**CASES["moe_decode_block_gdn_pack"][2], "PSM": psm, "NPS": nps,
             "PERSIST": nps > 0, "ROLL": nps != 2})
    logs = []
    regs = _compile_without_spills("moe_decode_block_gdn_pack", case, tmp_path,
                                   64 if nps == 2 else 0, log_out=logs)
    assert max(regs) <= 128, regs
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", logs[0]))
    dynamic = decode_block_dynamic_shared_bytes(psm, 2048, 64, mx.bfloat16)
    # (raised to 48 KB, so that MLX lifts the kernel's limit: see ops.moe)
    assert dynamic == max(psm * (1024 + 128), 48 * 1024)
    assert 2 * (static + dynamic + 1024) <= 228 * 1024, (static, dynamic)
