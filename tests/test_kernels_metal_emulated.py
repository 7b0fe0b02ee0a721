"""Metal kernel bodies run on the CPU through a small C++ emulation of the MSL they use.

Metal kernels cannot be run where this package is developed (no Apple GPU, no
Metal compiler); on a Mac each one is used only after its on-device self-check
passes. This test catches what a C++ compiler can see before that: the index
arithmetic, tiling, masking, barriers and epilogues, at small shapes, against a
float64 reference. It does NOT check Metal syntax or the real SIMD-group
hardware: a kernel that passes here may still fail to compile on a Mac (then
the self-check keeps it off).

The wrapper mirrors ``mx.fast.metal_kernel``'s generated function: inputs
``const T* name``, outputs ``T* name``, template parameters as a C++ template,
and the thread attributes the body names as arguments. The emulation:

* a threadgroup is one OS thread per GPU thread (``std::barrier`` for
  ``threadgroup_barrier``, one barrier per SIMD group of 32 for
  ``simdgroup_barrier``); threadgroups run one after another, in reverse order
  (so a tile that writes rows it does not own is caught);
* ``threadgroup`` arrays live in a shared arena filled with NaN before every
  threadgroup (reads of unwritten threadgroup memory poison the result), and
  its high-water mark is checked against Apple's 32 KB;
* a ``simdgroup_matrix<T, 8, 8>`` is held whole by every lane (the SIMD
  group's cooperative operations give every lane the same result);
  ``simdgroup_store`` writes from lane 0 only, so a missing
  ``simdgroup_barrier`` before other lanes read it can show;
* ``bfloat16_t`` rounds to nearest even;
* outputs start as NaN with a NaN guard after them: every element must be
  written, nothing past the end.

Skipped when no C++20 compiler is on PATH.
"""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from qwen_apple_backend.ops import attention as attn_ops
from qwen_apple_backend.ops import moe as moe_ops
from qwen_apple_backend.ops._sources import compact, kernel_source

from ._metrics import mx_rel_l2

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")

THREADGROUP_MEMORY_LIMIT = 32768  # bytes, every Apple GPU family
GUARD = 1 << 14  # NaN elements after each output (more than one stray tile)

PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>
using std::min;
using std::max;
typedef unsigned int uint;
struct uint3 { uint x, y, z; };

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

namespace metal {
inline float exp(float x) { return std::exp(x); }
}

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
static std::barrier<>* qab_tg_barrier;
static std::vector<std::barrier<>*> qab_sg_barriers;
thread_local int qab_lane = 0, qab_sg = 0;
inline void threadgroup_barrier(mem_flags) { qab_tg_barrier->arrive_and_wait(); }
inline void simdgroup_barrier(mem_flags) { qab_sg_barriers[qab_sg]->arrive_and_wait(); }

// threadgroup memory: every thread declares the same arrays in the same order.
alignas(16) static unsigned char qab_arena[1 << 20];
thread_local size_t qab_arena_off = 0;
static std::atomic<size_t> qab_arena_peak{0};
template <typename T>
T* qab_tg_alloc(size_t n) {
  qab_arena_off = (qab_arena_off + 15) & ~size_t(15);
  T* p = reinterpret_cast<T*>(qab_arena + qab_arena_off);
  qab_arena_off += n * sizeof(T);
  if (qab_arena_off > sizeof(qab_arena)) { std::fprintf(stderr, "arena overflow\n"); std::abort(); }
  size_t seen = qab_arena_peak.load();
  while (qab_arena_off > seen && !qab_arena_peak.compare_exchange_weak(seen, qab_arena_off)) {}
  return p;
}

template <typename T, int Cols, int Rows>
struct simdgroup_matrix { T m[Rows][Cols]; };
template <typename T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T v) {
  simdgroup_matrix<T, Cols, Rows> d;
  for (int r = 0; r < Rows; ++r) for (int c = 0; c < Cols; ++c) d.m[r][c] = v;
  return d;
}
template <typename T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, size_t per_row = Cols) {
  for (int r = 0; r < Rows; ++r) for (int c = 0; c < Cols; ++c) d.m[r][c] = src[r * per_row + c];
}
template <typename T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, T* dst, size_t per_row = Cols) {
  if (qab_lane != 0) return;
  for (int r = 0; r < Rows; ++r) for (int c = 0; c < Cols; ++c) dst[r * per_row + c] = a.m[r][c];
}
template <typename T, int N>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, N, N>& d, const simdgroup_matrix<T, N, N>& a,
                                   const simdgroup_matrix<T, N, N>& b,
                                   const simdgroup_matrix<T, N, N>& c) {
  simdgroup_matrix<T, N, N> t;
  for (int r = 0; r < N; ++r)
    for (int col = 0; col < N; ++col) {
      T s = c.m[r][col];
      for (int k = 0; k < N; ++k) s += a.m[r][k] * b.m[k][col];
      t.m[r][col] = s;
    }
  d = t;
}
"""

C_TYPES = {"bf16": ("bfloat16_t", 2), "f32": ("float", 4), "u32": ("uint32_t", 4),
           "i32": ("int32_t", 4)}
UINT3_ATTRS = ("thread_position_in_grid", "thread_position_in_threadgroup",
               "threadgroup_position_in_grid")
UINT_ATTRS = ("thread_index_in_threadgroup", "thread_index_in_simdgroup",
              "simdgroup_index_in_threadgroup")
# The emulator's local variable holding each attribute (see main() below).
ATTR_VALUES = {"thread_position_in_grid": "pos", "thread_position_in_threadgroup": "loc",
               "threadgroup_position_in_grid": "grp", "thread_index_in_threadgroup": "tid",
               "thread_index_in_simdgroup": "lane", "simdgroup_index_in_threadgroup": "sg"}


def _translate(body: str) -> str:
    """MSL body -> C++: threadgroup arrays from the arena, address spaces dropped."""
    decl = re.compile(r"^(\s*)threadgroup\s+(\w+)\s+(\w+)\s*\[([^\]]+)\]\s*;", re.M)
    body = decl.sub(lambda m: f"{m[1]}{m[2]}* {m[3]} = qab_tg_alloc<{m[2]}>({m[4]});", body)
    return re.sub(r"\b(threadgroup|device|constant)\b(?!_)\s+", "", body)


def _attrs(body: str) -> list[str]:
    # Like MLX: an attribute is an argument when its name occurs in the body.
    return [a for a in (*UINT3_ATTRS, *UINT_ATTRS) if a in body]


def _program(op: str, in_types, out_types, instances) -> str:
    src = kernel_source(op, "metal")
    assert src is not None, f"{op} has no Metal source"
    attrs = _attrs(src.body)
    params = [f"const {C_TYPES[t][0]}* {n}" for n, t in zip(src.inputs, in_types)]
    params += [f"{C_TYPES[t][0]}* {n}" for n, t in zip(src.outputs, out_types)]
    params += [f"{'uint3' if a in UINT3_ATTRS else 'uint'} {a}" for a in attrs]
    tparams = ", ".join(f"{'bool' if isinstance(v, bool) else 'int'} {k}"
                        for k, v in instances[0].items())
    # As MLX does: the header before the generated function, the body inside it,
    # compacted as build_kernel hands them over.
    kernel = (_translate(compact(src.header)) + f"\ntemplate <{tparams}>\nvoid qab_kernel("
              f"{', '.join(params)}) {{\n" + _translate(compact(src.body)) + "\n}\n")
    call_args = [*src.inputs, *src.outputs, *(ATTR_VALUES[a] for a in attrs)]
    cases = []
    for i, inst in enumerate(instances):
        targs = ", ".join(("true" if v else "false") if isinstance(v, bool) else str(v)
                          for v in inst.values())
        cases.append(f"    case {i}: qab_kernel<{targs}>({', '.join(call_args)}); break;")
    loads = []
    for i, (n, t) in enumerate(zip(src.inputs, in_types)):
        loads.append(f"  auto* {n} = reinterpret_cast<const {C_TYPES[t][0]}*>"
                     f"(load(dir, \"in{i}\"));")
    for i, (n, t) in enumerate(zip(src.outputs, out_types)):
        loads.append(f"  auto* {n} = reinterpret_cast<{C_TYPES[t][0]}*>(load(dir, \"out{i}\"));")
    saves = [f"  save(dir, \"out{i}\");" for i in range(len(src.outputs))]
    return PRELUDE + kernel + r"""
#include <map>
#include <string>
static std::map<std::string, std::vector<unsigned char>> files;
static void* load(const char* dir, const char* name) {
  std::string path = std::string(dir) + "/" + name + ".bin";
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) { std::fprintf(stderr, "missing %s\n", path.c_str()); std::exit(2); }
  std::fseek(f, 0, SEEK_END);
  long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  auto& buf = files[name];
  buf.resize(n + 16);
  if (std::fread(buf.data(), 1, n, f) != size_t(n)) std::exit(3);
  std::fclose(f);
  buf.resize(n);
  return buf.data();
}
static void save(const char* dir, const char* name) {
  std::string path = std::string(dir) + "/" + name + ".bin";
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(files[name].data(), 1, files[name].size(), f);
  std::fclose(f);
}

int main(int argc, char** argv) {
  if (argc != 9) return 1;
  const char* dir = argv[1];
  const int which = std::atoi(argv[2]);
  const uint g[3] = {uint(std::atoi(argv[3])), uint(std::atoi(argv[4])), uint(std::atoi(argv[5]))};
  const uint t[3] = {uint(std::atoi(argv[6])), uint(std::atoi(argv[7])), uint(std::atoi(argv[8]))};
""" + "\n".join(loads) + r"""
  const uint n_threads = t[0] * t[1] * t[2];
  const uint groups[3] = {g[0] / t[0], g[1] / t[1], g[2] / t[2]};
  const uint n_groups = groups[0] * groups[1] * groups[2];
  std::barrier<> tg_barrier(n_threads);
  qab_tg_barrier = &tg_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> sg_barriers;
  for (uint s = 0; s * 32 < n_threads; ++s) {
    sg_barriers.emplace_back(new std::barrier<>(std::min(32u, n_threads - s * 32)));
    qab_sg_barriers.push_back(sg_barriers.back().get());
  }
  std::barrier<> group_barrier(n_threads);
  std::vector<std::thread> threads;
  for (uint tid = 0; tid < n_threads; ++tid) {
    threads.emplace_back([&, tid] {
      qab_lane = int(tid % 32);
      qab_sg = int(tid / 32);
      const uint lane = tid % 32, sg = tid / 32;
      const uint3 loc = {tid % t[0], (tid / t[0]) % t[1], tid / (t[0] * t[1])};
      for (uint gi = n_groups; gi-- > 0;) {  // reverse order
        if (tid == 0) std::memset(qab_arena, 0xff, sizeof(qab_arena));  // NaN
        group_barrier.arrive_and_wait();
        qab_arena_off = 0;
        const uint3 grp = {gi % groups[0], (gi / groups[0]) % groups[1],
                           gi / (groups[0] * groups[1])};
        const uint3 pos = {grp.x * t[0] + loc.x, grp.y * t[1] + loc.y, grp.z * t[2] + loc.z};
        (void)lane; (void)sg; (void)pos;
        switch (which) {
""" + "\n".join(cases) + r"""
          default: std::abort();
        }
        group_barrier.arrive_and_wait();
      }
    });
  }
  for (auto& th : threads) th.join();
""" + "\n".join(saves) + r"""
  std::printf("threadgroup_bytes %zu\n", qab_arena_peak.load());
  return 0;
}
"""


CXX_FLAGS = ["-std=c++20", "-O2", "-pthread", "-w"]


@functools.lru_cache(maxsize=None)
def _prelude_dir() -> Path:
    """A folder of this process holding PRELUDE as ``qab_metal_prelude.h`` and, where the
    compiler makes one, its precompiled ``.gch`` (GCC reads it for a program's first
    ``#include``): the standard headers PRELUDE includes took ~1 s of each program's
    compile on 2 cores. Without the ``.gch`` the header is read as text: the same program."""
    folder = Path(tempfile.mkdtemp(prefix="qab-metal-emu-"))
    atexit.register(shutil.rmtree, folder, True)
    header = folder / "qab_metal_prelude.h"
    header.write_text("#pragma once\n" + PRELUDE, encoding="utf-8")
    try:
        subprocess.run([CXX, *CXX_FLAGS, "-x", "c++-header", str(header), "-o",
                        f"{header}.gch"], capture_output=True, timeout=300, check=True)
    except (OSError, subprocess.SubprocessError):
        Path(f"{header}.gch").unlink(missing_ok=True)
    return folder


def _compile(tmp: Path, prog: str) -> Path:
    """Compile the C++ program ``prog`` in ``tmp``; the executable's path. A program that
    starts with PRELUDE includes it from ``_prelude_dir`` instead (the same text)."""
    args = []
    if prog.startswith(PRELUDE):
        prog = '#include "qab_metal_prelude.h"\n' + prog[len(PRELUDE):]
        args = ["-I", str(_prelude_dir())]
    (tmp / "k.cpp").write_text(prog, encoding="utf-8")
    exe = tmp / "k"
    proc = subprocess.run([CXX, *CXX_FLAGS, *args, str(tmp / "k.cpp"), "-o", str(exe)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


def _build(tmp: Path, op: str, in_types, out_types, instances) -> Path:
    return _compile(tmp, _program(op, in_types, out_types, instances))


def _run(exe: Path, tmp: Path, which: int, inputs, outputs, grid, threadgroup):
    """Run instance ``which``; outputs are (count, numpy dtype) pairs; returns them and the
    threadgroup memory high-water mark."""
    for i, a in enumerate(inputs):
        np.ascontiguousarray(a).tofile(tmp / f"in{i}.bin")
    for i, (count, dt) in enumerate(outputs):
        np.full(count + GUARD, np.iinfo(dt).max, dtype=dt).tofile(tmp / f"out{i}.bin")  # NaN
    proc = subprocess.run([str(exe), str(tmp), str(which), *map(str, grid), *map(str, threadgroup)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    peak = int(re.search(r"threadgroup_bytes (\d+)", proc.stdout)[1])
    outs = [np.fromfile(tmp / f"out{i}.bin", dtype=dt) for i, (_, dt) in enumerate(outputs)]
    for (count, _), o in zip(outputs, outs):
        assert (o[count:] == np.iinfo(o.dtype).max).all(), "wrote past the end of an output"
    return [o[:count] for (count, _), o in zip(outputs, outs)], peak


def _bf16_bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.bfloat16).view(mx.uint16))


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# --------------------------------------------------------------------------
# moe_grouped_gemm
# --------------------------------------------------------------------------

# (rows per expert, KDIM, NOUT, GLU): every tile height (16, 32, 64 rows by
# the expert's load): 64-row tiles full and partial, an idle expert, one-row
# and 15-row experts on 16-row tiles, 17 and 24 rows on 32-row tiles, 33 on a
# partial 64-row tile; the down projection (no GLU, two column blocks); every
# row on the last of three experts (three 64-row tiles, the last partial).
GEMM_CASES = [
    ((70, 0, 64, 1, 15, 24, 17, 33), 128, 64, True),
    ((70, 0, 64, 1, 15, 24, 17, 33), 128, 128, False),
    ((0, 0, 130), 64, 128, True),
]


@pytest.fixture(scope="module")
def grouped_gemm_exe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metal_emulated")
    instances = [{"KDIM": k, "NOUT": n, "E": len(c), "GLU": glu} for c, k, n, glu in GEMM_CASES]
    return _build(tmp, "moe_grouped_gemm", ["bf16", "u32", "bf16", "bf16", "i32", "i32", "i32"],
                  ["bf16"], instances), tmp


@pytest.mark.parametrize("case", range(len(GEMM_CASES)))
def test_moe_grouped_gemm_metal_emulated(grouped_gemm_exe, case):
    exe, tmp = grouped_gemm_exe
    counts, kdim, nout, glu = GEMM_CASES[case]
    E, M = len(counts), sum(counts)
    R = 2 * nout if glu else nout
    kw, kx = mx.random.split(mx.random.key(100 + case))
    # Real MLX affine 4-bit packing from mx.quantize.
    wf = (0.1 * mx.random.normal((E, R, kdim), key=kw)).astype(mx.bfloat16)
    w, scales, biases = mx.quantize(wf, group_size=64, bits=4)
    x = mx.random.normal((M, kdim), key=kx).astype(mx.bfloat16)
    inds = np.repeat(np.arange(E), counts)
    rows, tiles, height = moe_ops.grouped_gemm_block_map(mx.array(inds, dtype=mx.uint32), E)
    if case == 0:
        assert sorted(set(np.array(height).tolist())) == [16, 32, 64]
    n_tiles = M // moe_ops.GROUPED_GEMM_BM + E
    (y_bits,), peak = _run(
        exe, tmp, case,
        [_bf16_bits(x), np.array(w), _bf16_bits(scales), _bf16_bits(biases),
         np.array(rows), np.array(tiles), np.array(height)],
        [(M * nout, np.uint16)], grid=(128 * n_tiles, nout // 64, 1), threadgroup=(128, 1, 1))
    assert peak <= THREADGROUP_MEMORY_LIMIT, f"{peak} bytes of threadgroup memory"

    wd = np.array(mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                                group_size=64, bits=4), dtype=np.float64)
    xd = _bf16_values(_bf16_bits(x))
    acc = np.einsum("mk,mrk->mr", xd, wd[inds])
    ref = acc[:, :nout] / (1 + np.exp(-acc[:, :nout])) * acc[:, nout:] if glu else acc
    y = _bf16_values(y_bits).reshape(M, nout)
    assert np.isfinite(y).all(), "some outputs were never written"
    # float32 accumulation, one bf16 rounding of the result.
    err = np.abs(y - ref)
    bound = 2.0 ** -8 * np.abs(ref) + 1e-4 * np.abs(ref).max()
    worst = np.unravel_index(err.argmax(), err.shape)
    assert (err <= bound).all(), f"max error {err.max():.3g} at (row, column) {worst}"
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 4e-3


# --------------------------------------------------------------------------
# MoE decode with the shared expert folded in (moe_gate_up_shared_gemv,
# moe_down_shared_gemv) and the prefill combine (moe_combine)
# --------------------------------------------------------------------------

# What these bodies use beyond the prelude: uint4 (components and [i]) and
# simd_sum, which gives every lane of the SIMD group the group's sum.
SIMD_PRELUDE = r"""
struct uint4 {
  uint x, y, z, w;
  uint operator[](int i) const { return i == 0 ? x : i == 1 ? y : i == 2 ? z : w; }
};
static float qab_simd_vals[64][32];
inline float simd_sum(float v) {
  qab_simd_vals[qab_sg][qab_lane] = v;
  simdgroup_barrier(mem_flags::mem_none);
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += qab_simd_vals[qab_sg][i];
  simdgroup_barrier(mem_flags::mem_none);
  return s;
}
"""

C_OUT = {"f32": "float", "bf16": "bfloat16_t"}


def _build_typed(tmp: Path, op: str, in_types, out_types, instances) -> Path:
    """Like _build, for bodies with an ``OutT`` type parameter (given as a C type name)."""
    prog = _program(op, in_types, out_types, instances)
    prog = prog.replace(PRELUDE, PRELUDE + SIMD_PRELUDE, 1)
    prog = prog.replace("template <int OutT,", "template <typename OutT,", 1)
    exe = _compile(tmp, prog)
    return exe


def _as_input(a: mx.array, t: str) -> np.ndarray:
    if t == "bf16":
        return _bf16_bits(a)
    if t == "f32":
        return np.array(a.astype(mx.float32), dtype=np.float32)
    return np.array(a)


def _values(a: mx.array, t: str) -> np.ndarray:
    """What the kernel reads for ``a`` given as type ``t``, in float64."""
    if t == "bf16":
        return _bf16_values(_bf16_bits(a))
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _out_values(bits: np.ndarray, t: str) -> np.ndarray:
    return _bf16_values(bits) if t == "bf16" else bits.view(np.float32).astype(np.float64)


OUT_NP = {"bf16": np.uint16, "f32": np.uint32}


def _q(shape, bits, group_size, key, dtype):
    w = (mx.random.normal(shape, key=key) * shape[-1] ** -0.5).astype(dtype)
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    deq = np.array(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32),
                                 group_size=group_size, bits=bits), dtype=np.float64)
    return q, s, b, deq


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _bound_check(y, ref, rounding, what):
    # float32 accumulation, then one rounding to the output type.
    err = np.abs(y - ref)
    bound = rounding * np.abs(ref) + 1e-5 * np.abs(ref).max()
    worst = np.unravel_index(err.argmax(), err.shape)
    assert (err <= bound).all(), f"{what}: max error {err.max():.3g} at {worst}"


# (N, E, H, I, K, G, shared gate bits, gate group): two tokens with an 8-bit
# gate (one 32-value chunk per lane); one token with K = 1, two chunks per
# lane, 32-wide groups and a 4-bit gate. Both leave the gate-logit warp in a
# threadgroup of idle warps.
FOLD_CASES = [
    (2, 8, 1024, 64, 4, 64, 8, 64),
    (1, 3, 2048, 32, 1, 32, 4, 32),
]
FOLD_GRID_BLOCK = 256


def _fold_weights(case, dtype):
    N, E, H, I, K, G, SGB, SGG = case
    keys = mx.random.split(mx.random.key(300 + H + K), 9)
    gu = _q((E, 2 * I, H), 4, G, keys[0], dtype)
    dn = _q((E, H, I), 4, G, keys[1], dtype)
    sg = _q((I, H), 4, G, keys[2], dtype)
    su = _q((I, H), 4, G, keys[3], dtype)
    sd = _q((H, I), 4, G, keys[4], dtype)
    gate = _q((1, H), SGB, SGG, keys[5], dtype)
    x = mx.random.normal((N, H), key=keys[6]).astype(dtype)
    inds = mx.argsort(mx.random.uniform(shape=(N, E), key=keys[7]), axis=-1)[:, :K]
    scores = mx.softmax(mx.random.normal((N, K), key=keys[8]), axis=-1)
    return x, np.array(inds.astype(mx.uint32)), scores, gu, dn, sg, su, sd, gate


@pytest.fixture(scope="module", params=["f32", "bf16"])
def fold_exes(request, tmp_path_factory):
    t = request.param
    tmp = tmp_path_factory.mktemp(f"metal_fold_{t}")
    gu_inst = [{"OutT": C_OUT[t], "H": c[2], "I": c[3], "K": c[4], "G": c[5], "SGB": c[6],
                "SGG": c[7]} for c in FOLD_CASES]
    # Each case twice: without (even ids) and with (odd) the residual in the epilogue.
    dn_inst = [{"OutT": C_OUT[t], "H": c[2], "I": c[3], "K": c[4], "G": c[5], "HAS_RES": r}
               for c in FOLD_CASES for r in (False, True)]
    (tmp / "gu").mkdir()
    (tmp / "dn").mkdir()
    gu = _build_typed(tmp / "gu", "moe_gate_up_shared_gemv",
                      [t, "u32", "u32", t, t, "u32", t, t, "u32", t, t, "u32", t, t],
                      [t, "f32"], gu_inst)
    # Scores in the activations' type, as the router gives them (read as float).
    dn = _build_typed(tmp / "dn", "moe_down_shared_gemv",
                      [t, "u32", t, "u32", t, t, "u32", t, t, "f32", t], [t], dn_inst)
    return t, tmp, gu, dn


@pytest.mark.parametrize("case", range(len(FOLD_CASES)))
def test_moe_shared_fold_metal_emulated(fold_exes, case):
    t, tmp, gu_exe, dn_exe = fold_exes
    N, E, H, I, K, G, SGB, SGG = FOLD_CASES[case]
    dtype = mx.float32 if t == "f32" else mx.bfloat16
    x, inds, scores, gu, dn, sg, su, sd, gate = _fold_weights(FOLD_CASES[case], dtype)
    warps = (K + 1) * I // moe_ops._GEMV_RPW + 1
    assert moe_ops._fold_grid_x(K, I) == -(-32 * warps // FOLD_GRID_BLOCK) * FOLD_GRID_BLOCK
    grid = (moe_ops._fold_grid_x(K, I), N, 1)

    def qin(w):
        return [np.array(w[0]), _as_input(w[1], t), _as_input(w[2], t)]

    (h_bits, logit_bits), _ = _run(
        gu_exe, tmp / "gu", case,
        [_as_input(x, t), inds, *qin(gu), *qin(sg), *qin(su), *qin(gate)],
        [(N * (K + 1) * I, OUT_NP[t]), (N, np.uint32)], grid=grid, threadgroup=(256, 1, 1))
    xv = _values(x, t)
    gate_up = np.einsum("nh,nkrh->nkr", xv, gu[3][inds])
    routed = _silu(gate_up[..., :I]) * gate_up[..., I:]
    shared = _silu(xv @ sg[3].T) * (xv @ su[3].T)
    h_ref = np.concatenate([routed, shared[:, None]], axis=1)
    h = _out_values(h_bits, t).reshape(N, K + 1, I)
    assert np.isfinite(h).all(), "some h elements were never written"
    rounding = 2.0 ** -8 if t == "bf16" else 1e-5
    _bound_check(h, h_ref, rounding, "h")
    logit = logit_bits.view(np.float32).astype(np.float64)
    logit_ref = (xv @ gate[3].T)[:, 0]
    assert np.isfinite(logit).all()
    assert np.allclose(logit, logit_ref, rtol=1e-5, atol=1e-5 * np.abs(logit_ref).max())

    # The down kernel on the h the first one wrote, scores in the activations' type.
    sc = _values(scores, t)
    res = (3.0 * mx.random.normal((N, H), key=mx.random.key(11))).astype(dtype)
    dn_inputs = [h_bits, inds, _as_input(scores, t), *qin(dn), *qin(sd),
                 logit_bits.view(np.float32), _as_input(res, t)]
    (y_bits,), _ = _run(dn_exe, tmp / "dn", 2 * case, dn_inputs, [(N * H, OUT_NP[t])],
                        grid=(32 * H // moe_ops._GEMV_RPW, N, 1), threadgroup=(256, 1, 1))
    (yr_bits,), _ = _run(dn_exe, tmp / "dn", 2 * case + 1, dn_inputs, [(N * H, OUT_NP[t])],
                         grid=(32 * H // moe_ops._GEMV_RPW, N, 1), threadgroup=(256, 1, 1))
    routed_y = np.einsum("nki,nkoi->nko", h[:, :K], dn[3][inds])
    y_ref = (routed_y * sc[..., None]).sum(axis=1)
    y_ref += (1.0 / (1.0 + np.exp(-logit)))[:, None] * (h[:, K] @ sd[3].T)
    y = _out_values(y_bits, t).reshape(N, H)
    assert np.isfinite(y).all(), "some outputs were never written"
    _bound_check(y, y_ref, rounding, "y")
    # HAS_RES: the residual plus the rounded block output, rounded once more.
    y_out = mx.array(y.astype(np.float32)).astype(dtype)
    expect = np.array((res + y_out).astype(mx.float32), dtype=np.float64)
    assert np.array_equal(_out_values(yr_bits, t).reshape(N, H), expect)


# (N, H, K): H not a multiple of the 256-thread group (the last one partial),
# K = 1, and one token at the real H.
COMBINE_CASES = [(7, 300, 8), (5, 256, 1), (1, 2048, 8)]


@pytest.fixture(scope="module", params=["f32", "bf16"])
def combine_exe(request, tmp_path_factory):
    t = request.param
    tmp = tmp_path_factory.mktemp(f"metal_combine_{t}")
    inst = [{"OutT": C_OUT[t], "H": h, "K": k} for _, h, k in COMBINE_CASES]
    return t, tmp, _build_typed(tmp, "moe_combine", [t, "u32", t, t, t], [t], inst)


@pytest.mark.parametrize("case", range(len(COMBINE_CASES)))
def test_moe_combine_metal_emulated(combine_exe, case):
    t, tmp, exe = combine_exe
    N, H, K = COMBINE_CASES[case]
    dtype = mx.float32 if t == "f32" else mx.bfloat16
    k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(400 + case), 5)
    y = mx.random.normal((N * K, H), key=k1).astype(dtype)
    pos = np.array(mx.argsort(mx.random.uniform(shape=(N * K,), key=k2)).astype(mx.uint32))
    pos = pos.reshape(N, K)
    sc = mx.softmax(mx.random.normal((N, K), key=k3), axis=-1).astype(dtype)
    sy = mx.random.normal((N, H), key=k4).astype(dtype)
    lg = mx.random.normal((N,), key=k5).astype(dtype)
    (out_bits,), _ = _run(exe, tmp, case,
                          [_as_input(y, t), pos, _as_input(sc, t), _as_input(sy, t),
                           _as_input(lg, t)],
                          [(N * H, OUT_NP[t])], grid=(-(-H // 256) * 256, N, 1),
                          threadgroup=(256, 1, 1))
    yv, scv, syv, lgv = (_values(a, t) for a in (y, sc, sy, lg))
    ref = (yv[pos] * scv[..., None]).sum(axis=1) + (1 / (1 + np.exp(-lgv)))[:, None] * syv
    out = _out_values(out_bits, t).reshape(N, H)
    assert np.isfinite(out).all(), "some outputs were never written"
    _bound_check(out, ref, 2.0 ** -8 if t == "bf16" else 1e-6, "out")


# --------------------------------------------------------------------------
# gated_delta_decode: one decode token of a whole Gated DeltaNet layer
# --------------------------------------------------------------------------

# What the decode body uses beyond the prelude: simd_sum (every lane gets the
# SIMD group's sum, added in lane order between two SIMD-group barriers) and
# metal::log / fabs / rsqrt / sqrt.
GDN_DECODE_PRELUDE = r"""
static float qab_gdn_simd_vals[32][32];
inline float simd_sum(float v) {
  qab_gdn_simd_vals[qab_sg][qab_lane] = v;
  simdgroup_barrier(mem_flags::mem_none);
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += qab_gdn_simd_vals[qab_sg][i];
  simdgroup_barrier(mem_flags::mem_none);
  return s;
}
namespace metal {
inline float log(float x) { return std::log(x); }
inline float fabs(float x) { return std::fabs(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float sqrt(float x) { return std::sqrt(x); }
}
"""

C_TYPES.setdefault("bool", ("bool", 1))
GDN_DECODE_C = {"f32": "float", "bf16": "bfloat16_t"}
GDN_DECODE_OUT_NP = {"f32": np.uint32, "bf16": np.uint16}  # all-ones bits: NaN


def _gdn_decode_in(a: mx.array, t: str) -> np.ndarray:
    if t == "bf16":
        return _bf16_bits(a)
    if t == "f32":
        return np.array(a.astype(mx.float32), dtype=np.float32)
    return np.array(a)


def _gdn_decode_out(bits: np.ndarray, t: str) -> np.ndarray:
    return _bf16_values(bits) if t == "bf16" else bits.view(np.float32).astype(np.float64)

# (B, Hk, Hv, Dk, Dv, Kc, conv bias, mask / lengths), BLOCK = 64 (two SIMD
# groups): GQA with 16 state rows per SIMD group; Dk = 64 (two floats per lane)
# with a prime Dv (19 rows per group, the last one idle in the second group),
# a conv bias, and a live, a left-padded (masked, conv state shifts) and a
# finished (lengths 0, conv state kept) row; Hk == Hv with a 3-tap conv.
GDN_DECODE_CASES = [
    (2, 2, 4, 32, 32, 4, False, False),
    (3, 2, 4, 64, 37, 4, True, True),
    (1, 3, 3, 32, 16, 3, False, False),
]
GDN_DECODE_BLOCK = 64


def _gdn_decode_instance(case, t, packed=False):
    # packed: qkv, z, b and a are one [B, PROJ_W] row (the concatenated
    # projection), read at channel offsets.
    B, Hk, Hv, Dk, Dv, Kc, bias, masked = case
    c = GDN_DECODE_C[t]
    width = 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv
    return {"InT": c, "WT": c, "Hk": Hk, "Hv": Hv, "Dk": Dk, "Dv": Dv, "Kc": Kc,
            "BLOCK": GDN_DECODE_BLOCK, "HAS_BIAS": bias, "HAS_MASK": masked,
            "HAS_LENGTHS": masked, "PROJ_W": width if packed else 0}


@pytest.fixture(scope="module", params=["f32", "bf16"])
def gdn_decode_exe(request, tmp_path_factory):
    t = request.param
    tmp = tmp_path_factory.mktemp(f"metal_gdn_decode_{t}")
    # Every instance shares the argument types: absent optional inputs get
    # dummies of their real type (the body reads them only when flagged).
    in_types = [t] * 7 + ["f32", t, t, "f32", "f32", "bool", "i32"]
    prog = _program("gated_delta_decode", in_types, [t, t, "f32"],
                    [_gdn_decode_instance(c, t, packed) for packed in (False, True)
                     for c in GDN_DECODE_CASES])
    prog = prog.replace(PRELUDE, PRELUDE + GDN_DECODE_PRELUDE, 1)
    prog = prog.replace("template <int InT, int WT,", "template <typename InT, typename WT,", 1)
    exe = _compile(tmp, prog)
    return exe, tmp, t


@pytest.mark.parametrize("packed", [False, True], ids=["four-arrays", "packed"])
@pytest.mark.parametrize("case", range(len(GDN_DECODE_CASES)))
def test_gated_delta_decode_metal_emulated(gdn_decode_exe, case, packed):
    from qwen_apple_backend.ops import gated_delta as gd

    exe, tmp, t = gdn_decode_exe
    B, Hk, Hv, Dk, Dv, Kc, bias, masked = GDN_DECODE_CASES[case]
    dtype = mx.float32 if t == "f32" else mx.bfloat16
    C = 2 * Hk * Dk + Hv * Dv
    keys = mx.random.split(mx.random.key(500 + case), 11)
    qkv = mx.random.normal((B, C), key=keys[0]).astype(dtype)
    z = mx.random.normal((B, Hv * Dv), key=keys[1]).astype(dtype)
    b = mx.random.normal((B, Hv), key=keys[2]).astype(dtype)
    a = mx.random.normal((B, Hv), key=keys[3]).astype(dtype)
    conv_state = mx.random.normal((B, Kc - 1, C), key=keys[4]).astype(dtype)
    conv_w = (0.5 * mx.random.normal((C, Kc, 1), key=keys[5])).astype(dtype)
    conv_b = (0.1 * mx.random.normal((C,), key=keys[6])).astype(dtype)
    A_log = mx.log(mx.random.uniform(0.05, 2.0, (Hv,), key=keys[7]))
    dt_bias = (1.0 + 0.5 * mx.random.normal((Hv,), key=keys[8])).astype(dtype)
    norm_w = (1.0 + 0.1 * mx.random.normal((Dv,), key=keys[9])).astype(dtype)
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=keys[10])
    mask = mx.array([True, False, False]) if masked else mx.ones((B,), dtype=mx.bool_)
    lengths = mx.array([1, 1, 0], dtype=mx.int32) if masked else mx.ones((B,), dtype=mx.int32)
    eps = mx.array([1e-6], dtype=mx.float32)
    acts = [qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias, norm_w, eps, state,
            mask, lengths]
    if packed:
        acts[:4] = [mx.concatenate([qkv, z, b, a], axis=-1)] * 4
    types = [t] * 7 + ["f32", t, t, "f32", "f32", "bool", "i32"]
    (out_bits, conv_bits, state_bits), peak = _run(
        exe, tmp, case + len(GDN_DECODE_CASES) * packed,
        [_gdn_decode_in(x, ty) for x, ty in zip(acts, types)],
        [(B * Hv * Dv, GDN_DECODE_OUT_NP[t]), (B * (Kc - 1) * C, GDN_DECODE_OUT_NP[t]),
         (B * Hv * Dv * Dk, np.uint32)],
        grid=(GDN_DECODE_BLOCK, B * Hv, 1), threadgroup=(GDN_DECODE_BLOCK, 1, 1))
    assert peak <= THREADGROUP_MEMORY_LIMIT, f"{peak} bytes of threadgroup memory"

    # float32 reference on the values the kernel reads.
    f32 = [x.astype(mx.float32) for x in (qkv, z, b, a, conv_state, conv_w, conv_b, A_log,
                                          dt_bias, norm_w)]
    ref = gd.gated_delta_decode_ops(
        *f32[:6], f32[6] if bias else None, *f32[7:], state,
        mask if masked else None, lengths if masked else None)
    got = [_gdn_decode_out(out_bits, t), _gdn_decode_out(conv_bits, t),
           state_bits.view(np.float32).astype(np.float64)]
    ref = [np.array(r.astype(mx.float32), dtype=np.float64).reshape(-1) for r in ref]

    def rel(u, r):
        return np.linalg.norm(u - r) / max(np.linalg.norm(r), 1e-30)

    # float32: another summation order. bf16: the kernel rounds where the ops
    # path in bf16 rounds (conv, SiLU, q/k, beta, y, the norm), so it must be
    # as close to the float32 reference as that path (as in
    # tests/test_kernels_gpu.py). The conv state is copied exactly.
    if t == "f32":
        tols = (1e-5, 0.0, 1e-5)
    else:
        ops = gd.gated_delta_decode_ops(qkv, z, b, a, conv_state, conv_w,
                                        conv_b if bias else None, A_log, dt_bias, norm_w,
                                        state, mask if masked else None,
                                        lengths if masked else None)
        ops = [np.array(o.astype(mx.float32), dtype=np.float64).reshape(-1) for o in ops]
        tols = (1.5 * rel(ops[0], ref[0]) + 2e-3, 0.0, 1.5 * rel(ops[2], ref[2]) + 2e-4)
    for name, g, r, tol in zip(("out", "conv state", "state"), got, ref, tols):
        assert np.isfinite(g).all(), f"{name}: some elements were never written"
        err = rel(g, r)
        worst = int(np.abs(g - r).argmax())
        assert err <= tol, f"{name}: rel-L2 {err:.3g} > {tol:.3g}; worst at flat index {worst}"
    if masked:
        out = got[0].reshape(B, Hv, Dv)
        assert (out[1:] == 0).all(), "masked rows must output zeros"
        assert np.array_equal(got[2].reshape(B, Hv, Dv, Dk)[1:],
                              np.array(state[1:], dtype=np.float64)), "masked rows keep the state"


# --------------------------------------------------------------------------
# moe_router_topk: softmax + top-K + renormalisation, one SIMD group per row
# --------------------------------------------------------------------------

# What the router body uses beyond the prelude: simd_shuffle_xor /
# simd_shuffle (each lane publishes its value, a SIMD-group barrier, each
# reads its source lane's, another barrier), as_type, metal::fast::exp,
# metal::isnan, logits_shape[0] (N, read from QAB_ROUTER_N) and logits_ndim (2).
SHUFFLE_PRELUDE = r"""
typedef unsigned short ushort;
static unsigned char qab_rt_slots[64][32][8];
template <typename T>
T qab_rt_exchange(T v, int src) {
  std::memcpy(qab_rt_slots[qab_sg][qab_lane], &v, sizeof(T));
  simdgroup_barrier(mem_flags::mem_none);
  T out;
  std::memcpy(&out, qab_rt_slots[qab_sg][src & 31], sizeof(T));
  simdgroup_barrier(mem_flags::mem_none);
  return out;
}
template <typename T>
T simd_shuffle_xor(T v, ushort mask) { return qab_rt_exchange(v, qab_lane ^ mask); }
template <typename T>
T simd_shuffle(T v, ushort lane) { return qab_rt_exchange(v, lane); }
"""
ROUTER_PRELUDE = SHUFFLE_PRELUDE + r"""
template <typename T, typename U> T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U));
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}
namespace metal {
namespace fast { inline float exp(float x) { return std::exp(x); } }
inline bool isnan(float x) { return std::isnan(x); }
}
static int logits_shape[1] = {std::atoi(std::getenv("QAB_ROUTER_N"))};
static const int logits_ndim = 2;
"""

# (N, E, K, NORM): Qwen3.6 decode (one token, the other 3 SIMD groups of the
# threadgroup idle), 5 tokens (two threadgroups), 8 experts K = 2, E = 300
# (two lane groups in bf16, the second partial) with K = 16, and K = 1.
ROUTER_METAL_CASES = [
    (1, 256, 8, True),
    (5, 256, 8, False),
    (6, 8, 2, True),
    (3, 300, 16, True),
    (4, 16, 1, False),
]


@pytest.fixture(scope="module", params=["f32", "bf16"])
def router_exe(request, tmp_path_factory):
    t = request.param
    tmp = tmp_path_factory.mktemp(f"metal_router_{t}")
    inst = [{"InT": C_OUT[t], "E": e, "K": k, "NORM": norm}
            for _, e, k, norm in ROUTER_METAL_CASES]
    prog = _program("moe_router_topk", [t], ["u32", t], inst)
    prog = prog.replace(PRELUDE, PRELUDE + ROUTER_PRELUDE, 1)
    prog = prog.replace("template <int InT,", "template <typename InT,", 1)
    exe = _compile(tmp, prog)
    return t, tmp, exe


@pytest.mark.parametrize("case", range(len(ROUTER_METAL_CASES)))
def test_moe_router_metal_emulated(router_exe, case, monkeypatch):
    from .test_kernels_gpu import _assert_route_is_the_gpu_route, _assert_route_matches_stock

    t, tmp, exe = router_exe
    N, E, K, norm = ROUTER_METAL_CASES[case]
    dtype = mx.float32 if t == "f32" else mx.bfloat16
    logits = (2.0 * mx.random.normal((N, E), key=mx.random.key(600 + case))).astype(dtype)
    monkeypatch.setenv("QAB_ROUTER_N", str(N))
    rows = -(-N // 4) * 4
    (ind_bits, score_bits), peak = _run(exe, tmp, case, [_as_input(logits, t)],
                                        [(N * K, np.uint32), (N * K, OUT_NP[t])],
                                        grid=(32 * rows, 1, 1), threadgroup=(128, 1, 1))
    assert peak == 0  # no threadgroup memory
    inds = ind_bits.reshape(N, K)
    scores = _out_values(score_bits, t).astype(np.float32).reshape(N, K)
    assert (inds < E).all(), "some indices were never written"
    where = f"{ROUTER_METAL_CASES[case]} {t}"
    _assert_route_matches_stock(logits, mx.array(inds), mx.array(scores), K, norm, where)
    # The GPU route's slots and scores, as for the CUDA body.
    _assert_route_is_the_gpu_route(logits, mx.array(inds), mx.array(scores), K, norm, where)


# --------------------------------------------------------------------------
# add_rms_norm: residual add + RMSNorm in one launch
# (kernels/metal/add_rms_norm.metal)
# --------------------------------------------------------------------------

# What the body uses beyond the prelude and SIMD_PRELUDE.
ADD_NORM_PRELUDE = r"""
namespace metal { namespace precise {
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
} }
"""
# (N, D), launched as ops.norm launches them: D = 2048 (8 SIMD groups of 8
# elements per thread), odd D with a partial last chunk (100 in one SIMD
# group, 264 in two), D = 1.
ADD_NORM_METAL_CASES = [(3, 2048), (7, 100), (2, 264), (2, 1)]
ADD_NORM_C = {"f32": ("float", mx.float32, np.uint32), "bf16": ("bfloat16_t", mx.bfloat16,
                                                                np.uint16)}


@pytest.fixture(scope="module", params=["f32", "bf16"])
def add_norm_metal_exe(request, tmp_path_factory):
    from qwen_apple_backend.ops.norm import add_rms_norm_launch

    t = request.param
    tmp = tmp_path_factory.mktemp(f"metal_add_norm_{t}")
    instances = [{"T": ADD_NORM_C[t][0], "D": D, "BLOCK": add_rms_norm_launch(D)["BLOCK"]}
                 for _, D in ADD_NORM_METAL_CASES]
    prog = _program("add_rms_norm", [t, t, t, "f32"], [t, t], instances)
    prog = prog.replace(PRELUDE, PRELUDE + SIMD_PRELUDE + ADD_NORM_PRELUDE, 1)
    prog = prog.replace("template <int T,", "template <typename T,", 1)
    exe = _compile(tmp, prog)
    return exe, tmp, t


@pytest.mark.parametrize("case", range(len(ADD_NORM_METAL_CASES)))
def test_add_rms_norm_metal_emulated(add_norm_metal_exe, case):
    from qwen_apple_backend.ops.norm import add_rms_norm_launch

    from .test_kernels_gpu import _add_rms_norm_inputs, _assert_add_rms_norm_matches

    exe, tmp, t = add_norm_metal_exe
    N, D = ADD_NORM_METAL_CASES[case]
    _, dtype, out_np = ADD_NORM_C[t]
    x, r, w, eps = _add_rms_norm_inputs((N, D), dtype, seed=N * D + 1)
    block = add_rms_norm_launch(D)["BLOCK"]
    ins = [np.array(a.view(mx.uint16)) if t == "bf16" else np.array(a) for a in (x, r, w)]
    (h_bits, y_bits), peak = _run(exe, tmp, case, [*ins, np.array([eps], dtype=np.float32)],
                                  [(N * D, out_np), (N * D, out_np)],
                                  grid=(block * N, 1, 1), threadgroup=(block, 1, 1))
    assert peak <= THREADGROUP_MEMORY_LIMIT
    h, y = (mx.array(b).view(dtype).reshape(N, D) for b in (h_bits, y_bits))
    # Same bounds as the CUDA body: h bit-identical to x + r, y within two
    # ulps of mx.fast.rms_norm on a few elements (see the helper).
    _assert_add_rms_norm_matches(h, y, x, r, w, eps, f"{N}x{D} {t}")


# --------------------------------------------------------------------------
# qk_norm_rope: a decode token's q/k RMSNorm + RoPE in one launch
# (kernels/metal/qk_norm_rope.metal)
# --------------------------------------------------------------------------

# What the body uses beyond the prelude, SIMD_PRELUDE, SHUFFLE_PRELUDE (the
# router's simd_shuffle) and ADD_NORM_PRELUDE (metal::precise::rsqrt):
# metal::exp2 / fast::cos / fast::sin (the C library's float functions), and
# q's / k's shapes and strides, as MLX passes them (int / int64_t arrays), read
# from QAB_QK_DIMS (q's shape, q's strides, k's shape, k's strides: 16 integers).
QK_PRELUDE = r"""
namespace metal {
inline float exp2(float x) { return std::exp2(x); }
namespace fast {
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
}
}
static int q_shape[4], k_shape[4];
static int64_t q_strides[4], k_strides[4];
static const bool qab_qk_dims = [] {
  const char* s = std::getenv("QAB_QK_DIMS");
  if (s == nullptr) { std::fprintf(stderr, "QAB_QK_DIMS unset\n"); std::exit(4); }
  long long v[16];
  for (int i = 0; i < 16; ++i) { v[i] = std::strtoll(s, const_cast<char**>(&s), 10); ++s; }
  for (int i = 0; i < 4; ++i) {
    q_shape[i] = int(v[i]); q_strides[i] = v[4 + i];
    k_shape[i] = int(v[8 + i]); k_strides[i] = v[12 + i];
  }
  return true;
}();
"""
# (Hq, Hk, D, R, traditional, dtype, position), as the CUDA body's cases:
# Qwen3.6's full attention (16 / 2 heads, D 256, 64 rotary dims, 2 idle SIMD
# groups in the last threadgroup), a smaller "rotate half" with 2 elements per
# lane (partner 8 lanes away), a traditional RoPE; bf16 and float32 (the
# emulator has no half type).
QK_METAL_CASES = [
    (16, 2, 256, 64, False, "bf16", 4097),
    (16, 2, 256, 64, False, "f32", 131071),
    (3, 1, 64, 32, False, "bf16", 7),
    (4, 2, 64, 16, True, "bf16", 300),
    (4, 2, 64, 16, True, "f32", 300),
]


@pytest.fixture(scope="module")
def qk_metal_exe(tmp_path_factory):
    """``get(t)``: the body built for dtype ``t``'s cases (once), its folder and cases."""
    built = {}

    def get(t):
        if t not in built:
            tmp = tmp_path_factory.mktemp(f"metal_qk_{t}")
            cases = [c for c in QK_METAL_CASES if c[5] == t]
            instances = [{"InT": C_OUT[t], "D": D, "R": R, "TRAD": trad}
                         for _, _, D, R, trad, _, _ in cases]
            prog = _program("qk_norm_rope", [t, t, t, t, "f32", "i32"], [t, t], instances)
            prog = prog.replace(PRELUDE, PRELUDE + SIMD_PRELUDE + SHUFFLE_PRELUDE
                                + ADD_NORM_PRELUDE + QK_PRELUDE, 1)
            prog = prog.replace("template <int InT,", "template <typename InT,", 1)
            built[t] = (_compile(tmp, prog), tmp, cases)
        return built[t]

    return get


def _launch_qk_metal(exe, tmp, which, t, q, q_layout, k, q_w, k_w, params, offset,
                     monkeypatch, grid=None, threadgroup=(128, 1, 1)):
    """One emulated launch of the Metal body with its inputs as
    ``ops.attention._qk_prep_call`` passes them: q by its base buffer (numpy)
    and ``q_layout``, its ``(shape, strides)`` in elements; k, the weights,
    params and offset as mx arrays (k contiguous). ``grid``: the body's
    launch contract unless given. Returns ``(q_out, k_out)`` as mx arrays."""
    (B, _, Hq, D), q_strides = q_layout
    Hk = k.shape[2]
    dims = [B, 1, Hq, D, *q_strides, B, 1, Hk, D, Hk * D, Hk * D, D, 1]
    monkeypatch.setenv("QAB_QK_DIMS", ",".join(map(str, dims)))
    dtype = mx.bfloat16 if t == "bf16" else mx.float32
    ins = [q, *(_as_input(a, t) for a in (k, q_w, k_w)), np.array(params),
           np.array(offset, dtype=np.int32).reshape(1)]
    grid = grid or (128 * -(-(Hq + Hk) // 4), B, 1)
    (qb, kb), peak = _run(exe, tmp, which, ins, [(B * Hq * D, OUT_NP[t]), (B * Hk * D, OUT_NP[t])],
                          grid=grid, threadgroup=threadgroup)
    assert peak == 0  # no threadgroup memory
    return (mx.array(qb).view(dtype).reshape(B, Hq, 1, D),
            mx.array(kb).view(dtype).reshape(B, Hk, 1, D))


def _run_qk_metal(exe, tmp, which, t, q, k, q_layout, q_w, k_w, eps, rope, pos, monkeypatch):
    """:func:`_launch_qk_metal` with the params of ``eps`` and ``rope`` at position ``pos``."""
    params = attn_ops._qk_prep_params(eps[0], eps[1], rope.scale, rope.base)
    return _launch_qk_metal(exe, tmp, which, t, q, q_layout, k, q_w, k_w, params,
                            mx.array(pos), monkeypatch)


@pytest.mark.parametrize("case", range(len(QK_METAL_CASES)),
                         ids=lambda i: "x".join(map(str, QK_METAL_CASES[i][:4]))
                         + f"-{'trad' if QK_METAL_CASES[i][4] else 'half'}-{QK_METAL_CASES[i][5]}")
def test_qk_norm_rope_metal_emulated(qk_metal_exe, case, monkeypatch):
    # One launch = prep_qk's rms_norm, transpose and rope for q and k, q read
    # through its strides as the first half of each head of q_proj's output.
    from .test_kernels_cuda_emulated import _qk_prep_reference

    Hq, Hk, D, R, trad, t, pos = QK_METAL_CASES[case]
    exe, tmp, cases = qk_metal_exe(t)
    dtype = mx.bfloat16 if t == "bf16" else mx.float32
    rope = attn_ops.RopeSpec(R, trad, 1e7 if not trad else 1e4, 1.0)
    kq, kk, kw = mx.random.split(mx.random.key(D + R + 1), 3)
    B = 2
    qg = mx.random.normal((B, 1, Hq, 2 * D), key=kq).astype(dtype)
    q = mx.split(qg, 2, axis=-1)[0]
    k = mx.random.normal((B, 1, Hk, D), key=kk).astype(dtype)
    w = (1.0 + 0.2 * mx.random.normal((2, D), key=kw)).astype(dtype)
    eps = (1e-6, 1e-5)
    q_out, k_out = _run_qk_metal(
        exe, tmp, cases.index(QK_METAL_CASES[case]), t, _as_input(qg, t), k,
        ((B, 1, Hq, D), (Hq * 2 * D, Hq * 2 * D, 2 * D, 1)), w[0], w[1], eps, rope, pos,
        monkeypatch)
    q_ref, k_ref = attn_ops.prep_qk(q, k, w[0], w[1], q_eps=eps[0], k_eps=eps[1], rope=rope,
                                    offset=mx.array(pos, dtype=mx.int32))
    exact = _qk_prep_reference(q, k, w[0], w[1], eps, rope, pos)
    for out, ref, formula in ((q_out, q_ref, exact[0]), (k_out, k_ref, exact[1])):
        assert out.shape == ref.shape and out.dtype == dtype
        # Against MLX's CPU ops (the self-check's reference on a Mac is
        # MLX's Metal ops) and against the documented formula, as the CUDA
        # body's test bounds them (see there): the angle's last bit, which
        # RoPE's large positions amplify in float32, and this CPU's cos / sin
        # in place of Metal's fast ones.
        assert mx_rel_l2(out, ref) <= (1e-4 if dtype == mx.float32 else 1e-2)
        if dtype != mx.float32:
            same = mx.mean((out == formula).astype(mx.float32)).item()
            assert same >= 0.99, same
        assert mx_rel_l2(out, formula) <= (1e-6 if dtype == mx.float32 else 2e-3)
    # Dims past R keep the normed value: changing the RoPE base moves only
    # the first R of each row.
    other = attn_ops.RopeSpec(R, trad, 10.0, 1.0)
    q_b, _ = _run_qk_metal(
        exe, tmp, cases.index(QK_METAL_CASES[case]), t, _as_input(qg, t), k,
        ((B, 1, Hq, D), (Hq * 2 * D, Hq * 2 * D, 2 * D, 1)), w[0], w[1], eps, other, pos,
        monkeypatch)
    assert mx.array_equal(q_b[..., R:], q_out[..., R:])
    assert not mx.array_equal(q_b[..., :R], q_out[..., :R])


def test_qk_prep_on_metal_is_ready_after_the_emulated_body_passes_its_self_check(
        qk_metal_exe, monkeypatch):
    # ops.attention's Metal path end to end, with MLX's Metal kernel object
    # replaced by the emulated body: the readiness check's self-check (strided
    # q, position 4,097) passes, the launch is the body's contract (the
    # position as [1]: a Metal kernel takes a 0-d input by reference), and
    # prep_qk_decode(backend="metal") returns prep_qk's values. A body that
    # rotates at the wrong position fails its check and leaves prep_qk's ops.
    import warnings

    from qwen_apple_backend.ops import device

    exe, tmp, cases = qk_metal_exe("bf16")
    which = cases.index((16, 2, 256, 64, False, "bf16", 4097))
    launches = []

    class EmulatedMetalKernel:
        def __init__(self, shift: int = 0):
            self.shift = shift

        def __call__(self, *, inputs, template, grid, threadgroup, output_shapes,
                     output_dtypes):
            q, k, qw, kw, params, offset = inputs
            launches.append((dict(template), grid, threadgroup, offset.shape))
            B, _, Hq, D = q.shape
            # MLX hands the body q's strides; here q is copied contiguous.
            layout = ((B, 1, Hq, D), (Hq * D, Hq * D, D, 1))
            out = _launch_qk_metal(exe, tmp, which, "bf16", _as_input(q, "bf16"), layout, k, qw,
                                   kw, params, offset + self.shift, monkeypatch, grid=grid,
                                   threadgroup=threadgroup)
            assert [o.shape for o in out] == [tuple(s) for s in output_shapes]
            return list(out)

    bf16 = mx.bfloat16
    rope = attn_ops.RopeSpec(64, False, 1e7, 1.0)
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(attn_ops, "gpu_backend", lambda: "metal")
    kernel = EmulatedMetalKernel()
    monkeypatch.setattr(attn_ops, "_qk_prep_object", lambda backend: kernel)
    device.reset_self_checks()
    try:
        assert attn_ops.qk_prep_kernel_ready(16, 2, 256, bf16, bf16, rope) == "metal"
        verdicts = {k: v for k, v in device.self_check_results().items()
                    if k[0] == "qk_norm_rope"}
        assert list(verdicts) == [("qk_norm_rope", "metal", (16, 2, 256, str(bf16), rope))]
        assert list(verdicts.values()) == [(True, "passed")], verdicts
        assert launches[0] == ({"InT": bf16, "D": 256, "R": 64, "TRAD": False},
                               (128 * 5, 2, 1), (128, 1, 1), (1,))
        # The decode call itself.
        kq, kk, kw = mx.random.split(mx.random.key(5), 3)
        q = mx.split(mx.random.normal((2, 1, 16, 512), key=kq).astype(bf16), 2, axis=-1)[0]
        k = mx.random.normal((2, 1, 2, 256), key=kk).astype(bf16)
        w = (1.0 + 0.2 * mx.random.normal((2, 256), key=kw)).astype(bf16)
        pos = mx.array(77, dtype=mx.int32)
        got = attn_ops.prep_qk_decode(q, k, w[0], w[1], q_eps=1e-6, k_eps=1e-6, rope=rope,
                                      offset=pos, backend="metal")
        ref = attn_ops.prep_qk(q, k, w[0], w[1], q_eps=1e-6, k_eps=1e-6, rope=rope, offset=pos)
        for g, r in zip(got, ref):
            assert g.shape == r.shape and mx_rel_l2(g, r) <= 1e-2
        with pytest.raises(ValueError, match="backend 'cpu' is not 'cuda' or 'metal'"):
            attn_ops.prep_qk_decode(q, k, w[0], w[1], q_eps=1e-6, k_eps=1e-6, rope=rope,
                                    offset=pos, backend="cpu")
        # A wrong body: rotated one position late.
        device.reset_self_checks()
        kernel.shift = 1
        with pytest.warns(device.KernelSelfCheckWarning,
                          match="metal kernel for qk_norm_rope failed its self-check"):
            assert attn_ops.qk_prep_kernel_ready(16, 2, 256, bf16, bf16, rope) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the verdict is cached: no second warning
            assert attn_ops.qk_prep_kernel_ready(16, 2, 256, bf16, bf16, rope) is None
    finally:
        device.reset_self_checks()
