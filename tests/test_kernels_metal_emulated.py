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

import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from qwen_apple_backend.ops import moe as moe_ops
from qwen_apple_backend.ops._sources import kernel_source

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
    kernel = (f"template <{tparams}>\nvoid qab_kernel({', '.join(params)}) {{\n"
              + _translate(src.header + src.body) + "\n}\n")
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


def _build(tmp: Path, op: str, in_types, out_types, instances) -> Path:
    (tmp / "k.cpp").write_text(_program(op, in_types, out_types, instances), encoding="utf-8")
    exe = tmp / "k"
    proc = subprocess.run([CXX, "-std=c++20", "-O2", "-pthread", "-w", str(tmp / "k.cpp"),
                           "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


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

# (rows per expert, KDIM, NOUT, GLU): a partial tile, an idle expert, a full
# tile, a one-row expert; the down projection (no GLU, two column blocks);
# every row on the last of three experts (two tiles, the second partial).
GEMM_CASES = [
    ((70, 0, 64, 1, 15), 128, 64, True),
    ((70, 0, 64, 1, 15), 128, 128, False),
    ((0, 0, 130), 64, 128, True),
]


@pytest.fixture(scope="module")
def grouped_gemm_exe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metal_emulated")
    instances = [{"KDIM": k, "NOUT": n, "E": len(c), "GLU": glu} for c, k, n, glu in GEMM_CASES]
    return _build(tmp, "moe_grouped_gemm", ["bf16", "u32", "bf16", "bf16", "i32", "i32"],
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
    rows, tiles = moe_ops.grouped_gemm_block_map(mx.array(inds, dtype=mx.uint32), E)
    n_tiles = M // moe_ops.GROUPED_GEMM_BM + E
    (y_bits,), peak = _run(
        exe, tmp, case,
        [_bf16_bits(x), np.array(w), _bf16_bits(scales), _bf16_bits(biases),
         np.array(rows), np.array(tiles)],
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
