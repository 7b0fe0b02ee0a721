"""Run ``mx.fast.cuda_kernel`` bodies on the CPU through a small C++ emulation of CUDA.

CUDA kernels (``kernels/cuda/*.cu``) can only be run on a GPU that is rarely
at hand. This helper compiles a kernel body with the host C++ compiler against
an emulation of the CUDA it uses and runs it on numpy copies of mx arrays, so
its index arithmetic, shuffles, barriers, shared-memory use and epilogues are
tested before any GPU run. It does NOT check CUDA syntax or nvcc/NVRTC
acceptance, the memory model of real hardware (every emulated access is
sequentially consistent), timing, registers, occupancy, bank conflicts or
fast-math precision (``__expf`` is ``expf``); a kernel that passes here can
still fail to compile or be slow on the GPU.

What the generated program mirrors (MLX's ``mlx/backend/cuda/custom_kernel.cpp``
and the Python ``mx.fast.cuda_kernel`` call):

* the kernel is ``void custom_kernel_<name><template hash>(...)`` in namespace
  ``mlx::core::cu`` with ``namespace cg = cooperative_groups``; the header goes
  before it at file scope. Parameters: each input ``const T* name`` (``T`` from
  its dtype: ``bool``, ``uint32_t``, ``int32_t``, ``__half``, ``__nv_bfloat16``,
  ``float``, ...), followed by ``const Shape name_shape`` / ``const Strides
  name_strides`` / ``const int name_ndim`` when the BODY contains that text and
  the input has ``ndim > 0`` (``Shape`` is ``std::array<int32_t, 10>``,
  ``Strides`` ``std::array<int64_t, 10>``, element strides);
  then each output ``T* name``;
* template arguments are NOT C++ template parameters: MLX emits them at the
  top of the body as ``constexpr int N = 4;``, ``constexpr bool B = true;``,
  ``using T = float;`` (so ``if (HAS_MASK)`` is a plain ``if``);
* ``grid`` counts THREADS: blocks per axis = ceil(grid / threadgroup), and
  the threads of a partial last block run (the kernel must guard them);
  launch limits are checked (1024 threads per block, z <= 64, y, z blocks <=
  65535);
* outputs are uninitialised unless ``init_value`` is given, and every element
  of each must be written, except in an output named ``ws``: a workspace whose
  aligned segments leave padding, poisoned alike in both schedules (so its
  written bytes must still agree between them; writes outside it are still
  caught, a write across two of its segments is not); inputs are passed
  row-contiguous with ``ensure_row_contiguous=True`` (MLX's default), and as
  the views they are with ``False``: the bytes the view spans (from the
  16-byte boundary below its first element, so vector-load alignment is as
  on the device) with the view's element strides (0 for a broadcast axis)
  and the first element's offset, so a kernel that reads past the view or
  assumes contiguity or alignment is caught.

The emulation (one C++ fiber, i.e. a user-space thread, per GPU thread of a
block; blocks run one after another):

* ``threadIdx``, ``blockIdx``, ``blockDim``, ``gridDim`` (x, y, z),
  ``warpSize``; warps are 32 consecutive linear thread ranks;
* ``__syncthreads()`` is a block barrier; every thread of the block must reach
  the same ``__syncthreads()`` (file and line): a divergent or conditional
  barrier, or one that some thread never reaches because it returned, is
  reported (stricter than some hardware);
* ``__shfl_sync``, ``__shfl_xor_sync``, ``__shfl_up_sync``,
  ``__shfl_down_sync`` (with ``width``), ``__reduce_max_sync`` (a butterfly of
  them), ``__ballot_sync``, ``__any_sync``,
  ``__all_sync``, ``__syncwarp``: a per-warp slot array and a warp barrier.
  The mask must be ``0xffffffff`` and all 32 lanes must reach the same kind
  of warp operation (a lane that returned, a partial warp, or lanes at
  different operations are reported);
* ``__shared__`` arrays (and ``extern __shared__`` with ``shared_memory``)
  live in one arena, refilled with a poison pattern before every block and
  separated by sanitizer redzones; the static total is checked against
  CUDA's 48 KiB (``stats["static_shared_bytes"]``);
* ``__nv_bfloat16`` and ``__half`` convert from float with round-to-nearest-
  even (``static_cast`` both ways, ``__float2bfloat16``, ``__bfloat162float``,
  ``__float2half``, ``__half2float``); their ``+ - * /`` compute in float and
  round once; ``uint2/uint4/int2/int4/float2/float4`` with CUDA alignment and
  ``make_*``; ``__float_as_uint``, ``__uint_as_float``, ``__int_as_float``,
  ``__float_as_int``; ``expf``, ``__expf``, ``logf``, ``__logf``, ``log1pf``,
  ``rsqrtf``, ``sqrtf``, ``fmaf``, ``fmaxf``, ``fminf``, ``tanhf``, ``min``,
  ``max``, ``__fdividef``, ``__ldg``, ``__ldcg``, ``__ushort_as_bfloat16``,
  ``__ushort_as_half``, ``__popc``, ``__byte_perm`` (modes 0-7), ``atomicAdd``/``atomicMax``/
  ``atomicCAS``/``atomicExch`` (trivially atomic: one fiber runs at a time);
  ``__device__``, ``__forceinline__``, ``__restrict__``, ``__align__``,
  ``__launch_bounds__``, ``#pragma unroll`` (ignored), ``cg::this_grid()`` /
  ``this_thread_block()`` basics;
* inline PTX is not parsed. Header helpers whose body is ``asm`` are replaced
  by emulated versions looked up by name in ``SUBSTITUTES`` (their declaration
  must match the recorded one): ``qab_cp_async16`` / ``qab_cp_async_commit`` /
  ``qab_cp_async_wait<N>`` of ``kernels/cuda/common.cuh`` become a 16-byte copy
  (destination in shared memory, source in global memory, both 16-byte
  aligned) whose completion follows the commit / wait-group rules (see the
  schedules); ``qab_wait_count`` (a block waiting on a counter that other
  blocks of the launch advance) checks the count once and reports a fault
  when it is short (blocks run one after another, so it would never be
  reached); ``qab_mma_16816`` / ``qab_mma_1688`` of ``kernels/cuda/gqa_mma.cuh``
  (tensor-core ``mma.sync``, bf16 / f16 in, float32 sums) become the warp's
  product gathered through emulated shuffles (``::qab::mma_warp``: each lane
  sums its C elements in k order; the hardware's order is unspecified, so
  tests compare against references with dtype tolerances). ``asm`` anywhere
  else, e.g. the ``mma.sync`` of ``moe_grouped_gemm.cu``, raises
  :class:`NotEmulated`: out of scope.

Every launch runs twice (``schedules=2``, or ``DEFAULT_SCHEDULES`` where the
call names none), with fresh outputs, and the two runs must agree bit for bit:

====================  ==========================  ==========================
                      schedule A                  schedule B
====================  ==========================  ==========================
block order           reverse                     forward
threads of a block    highest rank first          lowest rank first
cp.async copy         done when issued            done at its wait_group
poison: shared        0xff bytes (NaN)            0x7f bytes
poison: outputs       0xff bytes (NaN)            0xfe bytes
====================  ==========================  ==========================

A fiber runs until it blocks at a barrier; the scheduler then resumes the
first runnable thread in the schedule's rank order, so in A the highest warp
runs as far ahead of the others as the barriers allow and in B the lowest. A
missing ``__syncthreads()``, a buffer refilled while other warps still read
it, a ``cp.async`` result read before its wait, a read of unwritten shared
memory, a dependence on block order or a block writing rows it does not own
then shows as a difference between the runs (or against the reference).
Inputs the manifest lists under ``writes`` (written in place, e.g. the packed
MoE block's Gated DeltaNet states) start every run from their original bytes;
the runs must leave them equal (else a race), and the write is handed back
into the input array's own memory where MLX would pass the kernel that
memory (a row-contiguous array; else MLX copies it and the write is lost).
Outputs start as the poison with a 16 KiB guard before and after: an element
holding the poison in both runs was never written; a changed guard byte is a
write out of bounds. The program is built with AddressSanitizer and UBSan's
checks of index and bit arithmetic (``SANITIZE_FLAGS``: inputs are exact-size
256-byte aligned heap blocks, so a read past an input is reported; so are
signed overflow in index math, out-of-bounds indexing of local arrays,
misaligned ``uint4`` loads and overlong shifts) and
``-ftrivial-auto-var-init=pattern`` (uninitialised registers hold garbage),
when the compiler supports them. Two runs cannot prove a kernel race-free:
a hazard between threads that both schedules order the same way is missed.

API. A test skips itself with :func:`require` when no C++20 compiler is found.
The preferred test runs the ops module's own launch code on the emulator (so
the dispatcher's grid and template arguments are checked too); a new kernel
needs about ten lines::

    from . import _cuda_emulation as emu

    def test_my_op_emulated(monkeypatch):
        emu.require()
        monkeypatch.setattr(my_ops, "build_kernel", emu.build_kernel)
        my_ops._my_kernel_object.cache_clear()  # the module caches kernel objects
        x = mx.random.normal((3, 1024))
        y = my_ops._my_kernel_call("cuda", x)  # the module's launch
        assert mx_rel_l2(y, my_ops.my_op_reference(x)) <= 1e-5
        my_ops._my_kernel_object.cache_clear()  # (or a fixture; see the test file)

or calls the manifest kernel directly, like ``mx.fast.cuda_kernel``'s object::

    (y,) = emu.run_cuda_kernel(
        "my_op", inputs=[x, w], template=[("T", mx.float32), ("N", 64)],
        grid=(32 * rows, 1, 1), threadgroup=(128, 1, 1),
        output_shapes=[(rows,)], output_dtypes=[mx.float32])

and a deliberately broken copy must fail::

    body = kernel_source("my_op", "cuda").body.replace("o >>= 1", "o >>= 2")
    with pytest.raises(AssertionError):
        check(emu.run_cuda_kernel("my_op", source=body, ...))

Functions:

* ``run_cuda_kernel(op, *, inputs, template, grid, threadgroup, output_shapes,
  output_dtypes, init_value=None, source=None, header=None, shared_memory=0,
  schedules=None) -> list[mx.array]``: the manifest kernel ``op`` (``source`` /
  ``header`` replace its body / header text);
* ``build_kernel(op, backend="cuda", *, source=None, header=None, **options)``:
  drop-in for ``qwen_apple_backend.ops.device.build_kernel`` (manifest sources,
  verified or not; ``shared_memory`` honoured);
* ``emulated_cuda_kernel(name, input_names, output_names, source, header="",
  ensure_row_contiguous=True, shared_memory=0)``: mirrors
  ``mx.fast.cuda_kernel`` for inline sources;
* the kernel object's ``__call__(*, inputs, output_shapes, output_dtypes, grid,
  threadgroup, template=None, init_value=None, verbose=False, stream=None,
  schedules=None)`` takes MLX's keywords (``verbose`` prints the generated
  program) and keeps the last run's ``stats`` (``static_shared_bytes``,
  ``blocks``, ``threads_per_block``).

Programs are compiled once per generated source (so per kernel text, template
arguments and dtypes) and cached for the session; the first use also builds
the runtime (a few seconds). Faults raise :class:`KernelFault` (an
``AssertionError``) carrying the emulator's or sanitizer's report; compile
errors raise :class:`KernelCompileError` (also an ``AssertionError``); inline
PTX or an unsupported dtype raises :class:`NotEmulated`. A new inline-PTX
helper in a header needs an emulated version in ``SUBSTITUTES``.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from qwen_apple_backend.ops._sources import kernel_dir, kernel_source, manifest

__all__ = [
    "CXX",
    "KernelCompileError",
    "KernelFault",
    "NotEmulated",
    "EmulatedCudaKernel",
    "build_kernel",
    "emulated_cuda_kernel",
    "require",
    "run_cuda_kernel",
    "sanitized",
    "unavailable_reason",
]

CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
SANITIZERS = True  # set False (e.g. monkeypatch) for a faster, unsanitised build
# The sanitizer flags of a kernel program (when SANITIZERS and the compiler has
# them): AddressSanitizer, and the UBSan checks a kernel's index and bit
# arithmetic can trip. Left out, for half the build time of a large kernel
# (the MoE decode block's program, g++ 12 at -Og: 2.4 s -> 1.2 s): UBSan's
# null, pointer-overflow and object-size checks, whose faults AddressSanitizer
# reports at the access (a null dereference as its SEGV report), vptr and the
# nonnull-attribute checks (no kernel has virtual classes or those
# attributes), and ASan's use-after-scope check of stack variables (kernels
# keep no pointers to a scope's locals past it; out-of-bounds indexing of a
# local array is still caught, by ``bounds`` and ASan's stack redzones).
UBSAN_CHECKS = ("signed-integer-overflow,shift,bounds,alignment,integer-divide-by-zero,"
                "vla-bound,return,unreachable,bool,enum,builtin")
SANITIZE_FLAGS = [f"-fsanitize=address,{UBSAN_CHECKS}", "-fno-sanitize-recover=all",
                  "-fno-sanitize-address-use-after-scope"]
STATIC_SHARED_LIMIT = 48 * 1024  # bytes of static __shared__ per block (CUDA)
SHARED_LIMIT = 227 * 1024  # static + dynamic shared memory per block (sm_90)
GUARD_BYTES = 16384  # poison before and after each output
POISON_OUT = (0xFF, 0xFE)  # output fill byte of schedule A, B
COMPILE_TIMEOUT_S = 300
RUN_TIMEOUT_S = 300
# Schedules a launch runs in when its call names none (1 or 2); see
# :func:`one_schedule` for the tests that take one.
DEFAULT_SCHEDULES = 2


class KernelFault(AssertionError):
    """The kernel misbehaved: emulator or sanitizer report, unwritten or stray outputs, a race."""


class KernelCompileError(AssertionError):
    """The kernel (with the emulation header) did not compile."""


class NotEmulated(Exception):
    """The kernel uses something the emulation does not cover (inline PTX, ...)."""


# --------------------------------------------------------------------------
# The emulation header (included by every kernel program)
# --------------------------------------------------------------------------

EMU_HEADER = r"""
#pragma once
#include <array>
#include <assert.h>
#include <limits>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__
#define __constant__ static
#define __shared__ QAB_EMULATOR_CANNOT_TRANSLATE_THIS_SHARED_DECLARATION
#define __CUDA_ARCH__ 900
#define MAX_NDIM 10
#define WARP_SIZE 32

struct uint3 { unsigned int x, y, z; };
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(8))) uint2 { unsigned int x, y; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return {x, y, z, w};
}
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

namespace qab {
struct Thread {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
  unsigned int rank, lane, warp;
};
extern Thread* cur;  // the GPU thread now running
struct ArgShape {
  std::array<int32_t, MAX_NDIM> shape;
  std::array<int64_t, MAX_NDIM> strides;
  int ndim;
};
void* arg(int i);
const ArgShape& input_shape(int i);
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void syncthreads(const char* file, int line);
enum WarpOp { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, VOTE, SYNCWARP };
unsigned char* warp_exchange_begin(int op, unsigned int mask);  // this warp's 32 x 8-byte slots
void warp_exchange_wait(int op);
void* shared_alloc(int id, size_t bytes, size_t align);
void* dynamic_shared();
void cp_async(void* smem, const void* gmem, int bytes);
void cp_async_commit();
void cp_async_wait(int pending);
// qab_prefetch_l2 (common.cuh): no effect here; the range must lie in one input.
void check_prefetch(const void* p, uint32_t bytes);
// qab_wait_count (common.cuh): blocks run one after another here, so a count
// that is not reached yet never will be; reported instead of spinning forever.
inline void wait_count(const uint32_t* p, uint32_t target) {
  if (*p < target) {
    fail("qab_wait_count: the counter holds %u, waiting for %u: the blocks it waits on have not "
         "run (a wait on a later block deadlocks on a GPU too)", *p, target);
  }
}

template <typename A>
inline A& shared(int id, size_t align) {
  return *static_cast<A*>(shared_alloc(id, sizeof(A), align > alignof(A) ? align : alignof(A)));
}

template <typename T>
inline T shfl(int op, unsigned int mask, T var, int arg, int width) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                "emulated shuffles take trivially copyable values of at most 8 bytes");
  if (width < 1 || width > 32 || (width & (width - 1))) {
    fail("shuffle width %d is not a power of two <= 32", width);
  }
  unsigned char* slots = warp_exchange_begin(op, mask);
  const int lane = int(cur->lane);
  memcpy(slots + 8 * lane, &var, sizeof(T));
  warp_exchange_wait(op);
  const int base = lane & ~(width - 1);
  int src = lane;
  switch (op) {
    case SHFL_IDX: src = base + (arg & (width - 1)); break;
    case SHFL_UP: src = lane - arg; if (src < base) src = lane; break;
    case SHFL_DOWN: src = lane + arg; if (src >= base + width) src = lane; break;
    default: src = lane ^ arg; if (src < 0 || src >= base + width) src = lane; break;
  }
  T out;
  memcpy(&out, slots + 8 * src, sizeof(T));
  return out;
}

inline unsigned int vote(unsigned int mask, int pred) {
  unsigned char* slots = warp_exchange_begin(VOTE, mask);
  const unsigned int p = pred ? 1u : 0u;
  memcpy(slots + 8 * cur->lane, &p, 4);
  warp_exchange_wait(VOTE);
  unsigned int ballot = 0;
  for (int l = 0; l < 32; ++l) {
    unsigned int v;
    memcpy(&v, slots + 8 * l, 4);
    ballot |= v << l;
  }
  return ballot;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}
inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_half_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity
  if (ax < 0x38800000u) {  // half subnormal or zero: m * 2^-24, rounded to nearest even
    float af;
    memcpy(&af, &ax, 4);
    return uint16_t(sign | uint32_t(nearbyintf(af * 16777216.0f)));
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  float f;
  if (e == 0) {
    f = ldexpf(float(m), -24);
    return sign ? -f : f;
  }
  const uint32_t u = sign | ((e == 31 ? 255u : e + 112u) << 23) | (m << 13);
  memcpy(&f, &u, 4);
  return f;
}
}  // namespace qab

#define QAB_LOW_PRECISION_TYPE(NAME, TO_BITS, TO_FLOAT)                                  \
  struct NAME {                                                                        \
    unsigned short __x;                                                                \
    NAME() = default;                                                                  \
    NAME(float f) : __x(TO_BITS(f)) {}                                                 \
    NAME(double f) : __x(TO_BITS(float(f))) {}                                         \
    NAME(int i) : __x(TO_BITS(float(i))) {}                                            \
    NAME(unsigned int i) : __x(TO_BITS(float(i))) {}                                   \
    NAME(long long i) : __x(TO_BITS(float(i))) {}                                      \
    NAME(unsigned long long i) : __x(TO_BITS(float(i))) {}                             \
    NAME& operator=(float f) { __x = TO_BITS(f); return *this; }                        \
    operator float() const { return TO_FLOAT(__x); }                                   \
    explicit operator bool() const { return TO_FLOAT(__x) != 0.f; }                    \
  };                                                                                   \
  inline NAME operator+(NAME a, NAME b) { return NAME(float(a) + float(b)); }          \
  inline NAME operator-(NAME a, NAME b) { return NAME(float(a) - float(b)); }          \
  inline NAME operator*(NAME a, NAME b) { return NAME(float(a) * float(b)); }          \
  inline NAME operator/(NAME a, NAME b) { return NAME(float(a) / float(b)); }          \
  inline NAME operator-(NAME a) { NAME r = a; r.__x ^= 0x8000u; return r; }            \
  inline NAME& operator+=(NAME& a, NAME b) { return a = a + b; }                       \
  inline NAME& operator-=(NAME& a, NAME b) { return a = a - b; }                       \
  inline NAME& operator*=(NAME& a, NAME b) { return a = a * b; }                       \
  inline NAME& operator/=(NAME& a, NAME b) { return a = a / b; }                       \
  inline bool operator==(NAME a, NAME b) { return float(a) == float(b); }              \
  inline bool operator!=(NAME a, NAME b) { return float(a) != float(b); }              \
  inline bool operator<(NAME a, NAME b) { return float(a) < float(b); }                \
  inline bool operator>(NAME a, NAME b) { return float(a) > float(b); }                \
  inline bool operator<=(NAME a, NAME b) { return float(a) <= float(b); }              \
  inline bool operator>=(NAME a, NAME b) { return float(a) >= float(b); }
QAB_LOW_PRECISION_TYPE(__nv_bfloat16, ::qab::float_to_bf16_bits, ::qab::bf16_bits_to_float)
QAB_LOW_PRECISION_TYPE(__half, ::qab::float_to_half_bits, ::qab::half_bits_to_float)
#undef QAB_LOW_PRECISION_TYPE
typedef __nv_bfloat16 nv_bfloat16;
typedef __half half;
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }

#define threadIdx (::qab::cur->thread_idx)
#define blockIdx (::qab::cur->block_idx)
#define blockDim (::qab::cur->block_dim)
#define gridDim (::qab::cur->grid_dim)
constexpr int warpSize = 32;
#define __syncthreads() ::qab::syncthreads(__FILE__, __LINE__)

template <typename T>
inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = 32) {
  return ::qab::shfl(::qab::SHFL_IDX, mask, var, src_lane, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
  return ::qab::shfl(::qab::SHFL_UP, mask, var, int(delta), width);
}
template <typename T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
  return ::qab::shfl(::qab::SHFL_DOWN, mask, var, int(delta), width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32) {
  return ::qab::shfl(::qab::SHFL_XOR, mask, var, lane_mask, width);
}
inline unsigned int __ballot_sync(unsigned int mask, int pred) { return ::qab::vote(mask, pred); }
inline int __any_sync(unsigned int mask, int pred) { return ::qab::vote(mask, pred) != 0; }
inline int __all_sync(unsigned int mask, int pred) {
  return ::qab::vote(mask, pred) == 0xffffffffu;
}
// redux.sync's warp max (sm_80+), as a butterfly of the emulated shuffles.
inline unsigned int __reduce_max_sync(unsigned int mask, unsigned int v) {
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned int t = __shfl_xor_sync(mask, v, o);
    v = v > t ? v : t;
  }
  return v;
}
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  ::qab::warp_exchange_begin(::qab::SYNCWARP, mask);
  ::qab::warp_exchange_wait(::qab::SYNCWARP);
}
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap() { ::qab::fail("__trap()"); }

inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.__x = u; return b; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
// __byte_perm (selector modes 0-7 per nibble: byte i of the result is byte
// (s >> 4 i) & 7 of y:x; the sign-replicate bit 3 is not emulated).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const unsigned long long xy = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) {
    r |= static_cast<unsigned int>((xy >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  }
  return r;
}
namespace qab {
// One 16-bit element of a packed pair as float (H: __nv_bfloat16 or __half).
template <typename H>
inline float half_bits(unsigned int bits) {
  if constexpr (sizeof(H) == 2 && std::is_same<H, __half>::value) {
    return static_cast<float>(__ushort_as_half(static_cast<unsigned short>(bits)));
  } else {
    return static_cast<float>(__ushort_as_bfloat16(static_cast<unsigned short>(bits)));
  }
}
// mma.sync.aligned.m16n8k{16,8}.row.col.f32.{bf16,f16}.{bf16,f16}.f32, d += a b,
// as the warp computes it: all 32 lanes call it together (as the hardware
// requires), each gathers the others' A and B fragments through the emulated
// shuffles and sums its own four C elements in k order (the hardware's order
// within the float32 accumulation is unspecified). Fragments: lane = 4 g + t;
// A[row][k] in register (row >= 8) + 2 (k >= 8), half k & 1, of lane 4 (row
// & 7) + (k & 7) / 2; B[k][n] in register k >= 8, half k & 1, of lane 4 n +
// (k & 7) / 2; C elements c: row g + 8 (c >= 2), column 2 t + (c & 1).
template <typename H, int K>
inline void mma_warp(float* d, const unsigned int* a, const unsigned int* b) {
  constexpr int NA = K / 4, NB = K / 8;
  unsigned int A[32][NA], B[32][NB];
  for (int r = 0; r < NA; ++r) {
    for (int L = 0; L < 32; ++L) A[L][r] = ::__shfl_sync(0xffffffffu, a[r], L);
  }
  for (int r = 0; r < NB; ++r) {
    for (int L = 0; L < 32; ++L) B[L][r] = ::__shfl_sync(0xffffffffu, b[r], L);
  }
  const int lane = static_cast<int>(threadIdx.x) & 31, g = lane >> 2, t = lane & 3;
  for (int c = 0; c < 4; ++c) {
    const int row = g + (c >= 2 ? 8 : 0), col = 2 * t + (c & 1);
    float acc = d[c];
    for (int k = 0; k < K; ++k) {
      const unsigned int wa = A[(row & 7) * 4 + (k & 7) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
      const unsigned int wb = B[col * 4 + (k & 7) / 2][k >= 8 ? 1 : 0];
      acc += half_bits<H>((k & 1) ? wa >> 16 : wa & 0xffffu) *
             half_bits<H>((k & 1) ? wb >> 16 : wb & 0xffffu);
    }
    d[c] = acc;
  }
}
}  // namespace qab
template <typename A, typename B>
inline constexpr std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(b) < C(a) ? C(b) : C(a);
}
template <typename A, typename B>
inline constexpr std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}
// One fiber runs at a time, so read-modify-write is atomic.
template <typename T>
inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T>
inline T atomicMax(T* p, T v) { T old = *p; *p = old < v ? v : old; return old; }
template <typename T>
inline T atomicMin(T* p, T v) { T old = *p; *p = v < old ? v : old; return old; }
template <typename T>
inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <typename T>
inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }

namespace cooperative_groups {
struct thread_block {
  void sync() const { ::qab::syncthreads("cooperative_groups::thread_block::sync", 0); }
  unsigned int thread_rank() const { return ::qab::cur->rank; }
  unsigned int size() const {
    return blockDim.x * blockDim.y * blockDim.z;
  }
  dim3 group_index() const { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
  dim3 thread_index() const { return dim3(threadIdx.x, threadIdx.y, threadIdx.z); }
};
inline thread_block this_thread_block() { return {}; }
struct grid_group {
  unsigned long long thread_rank() const {
    using u64 = unsigned long long;
    const u64 b = blockIdx.x + u64(gridDim.x) * (blockIdx.y + u64(gridDim.y) * blockIdx.z);
    return b * (blockDim.x * blockDim.y * blockDim.z) + ::qab::cur->rank;
  }
  unsigned long long size() const {
    return (unsigned long long)gridDim.x * gridDim.y * gridDim.z * blockDim.x * blockDim.y *
           blockDim.z;
  }
  void sync() const { ::qab::fail("grid-wide sync is not emulated"); }
};
inline grid_group this_grid() { return {}; }
}  // namespace cooperative_groups

namespace cuda {
namespace std = ::std;
}
namespace mlx::core::cu {
using Shape = ::std::array<int32_t, MAX_NDIM>;
using Strides = ::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
#ifndef QAB_EMULATOR_RUNTIME
#define inf (::std::numeric_limits<float>::infinity())
#endif
"""

# --------------------------------------------------------------------------
# The runtime: fibers, barriers, shared memory, cp.async, I/O (built once)
# --------------------------------------------------------------------------

EMU_RUNTIME = r"""
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700
#endif
#include <stdarg.h>
#include <stdlib.h>
#include <vector>
#define QAB_EMULATOR_RUNTIME 1
#include "qab_cuda_emu.h"

// QAB_ASAN: the program is linked with AddressSanitizer (this file itself is
// built without instrumentation, so the build defines it).
#if defined(__SANITIZE_ADDRESS__) && !defined(QAB_ASAN)
#define QAB_ASAN 1
#endif
#ifdef QAB_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define QAB_POISON(a, n) __asan_poison_memory_region((a), (n))
#define QAB_UNPOISON(a, n) __asan_unpoison_memory_region((a), (n))
#else
#define QAB_POISON(a, n) ((void)(a), (void)(n))
#define QAB_UNPOISON(a, n) ((void)(a), (void)(n))
#endif

extern "C" void qab_kernel_entry();

// Fiber context switch: save the callee-saved registers on the current stack,
// store its pointer in *save, continue on the stack `load` (which holds the same
// frame). A new fiber's stack holds a frame that "returns" into fiber_main.
#if defined(__x86_64__) || defined(__aarch64__)
#define QAB_ASM_SWITCH 1
#if defined(__APPLE__)
#define QAB_SYM "_qab_ctx_switch"
#else
#define QAB_SYM "qab_ctx_switch"
#endif
extern "C" void qab_ctx_switch(void** save, void* load);
#if defined(__x86_64__)
__asm__(".text\n.globl " QAB_SYM "\n.p2align 4\n" QAB_SYM ":\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
        "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
        "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n");
#else
__asm__(".text\n.globl " QAB_SYM "\n.p2align 2\n" QAB_SYM ":\n"
        "  sub sp, sp, #176\n"
        "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n"
        "  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n"
        "  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n  stp d12, d13, [sp, #128]\n"
        "  stp d14, d15, [sp, #144]\n"
        "  mov x2, sp\n  str x2, [x0]\n  mov sp, x1\n"
        "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n"
        "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n"
        "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n  ldp d12, d13, [sp, #128]\n"
        "  ldp d14, d15, [sp, #144]\n"
        "  add sp, sp, #176\n  ret\n");
#endif
#else
#include <ucontext.h>
#endif

namespace qab {
Thread* cur = nullptr;

namespace {
constexpr size_t kStack = 128 * 1024;
constexpr size_t kArena = 1024 * 1024;
constexpr size_t kRedzone = 64;
enum State { RUNNABLE, AT_SYNCTHREADS, AT_WARP_OP, DONE };
const char* kOpNames[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                          "__ballot_sync/__any_sync/__all_sync", "__syncwarp"};
struct Copy { void* dst; const void* src; int bytes; };
struct Fiber {
  Thread t;
#ifdef QAB_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  char* stack = nullptr;
  State state = DONE;
  int op = -1;
  std::vector<Copy> copies;  // cp.async issued, not yet done
  size_t copies_done = 0;
  std::vector<size_t> group_ends;  // end of each committed group in `copies`
};
struct Warp {
  int size = 0, arrived = 0, op = -1;
  unsigned int phase = 0;
  unsigned char slots[2][32 * 8];
};

std::vector<Fiber> fibers;
std::vector<Warp> warps;
Fiber* running = nullptr;
#ifdef QAB_ASM_SWITCH
void* sched_sp = nullptr;
#else
ucontext_t sched_ctx;
#endif
const void* sched_stack_bottom = nullptr;
size_t sched_stack_size = 0;
unsigned int nthreads = 0, block_dim[3], grid_dim[3];
int block_arrived = 0;
const char* block_file = "";
int block_line = 0;
unsigned int block_first = 0;
// The scheduler's order (see run_block) and a cursor into it: no thread before
// position `first_runnable` in that order is runnable, so a search starts there.
bool sched_reverse = false;
unsigned int first_runnable = 0;
bool deferred_copies = false;
alignas(256) unsigned char arena[kArena];
size_t dyn_bytes = 0, next_off = 0, static_bytes = 0, static_peak = 0;
// The arena's first `filled` bytes hold this block's poison byte (`block_poison`); past
// them it is ASan-poisoned and refilled by shared_alloc as arrays reach there (a block
// uses kilobytes: filling the whole arena per block was ~5% of a large launch's time).
size_t filled = 0;
bool arena_poisoned = false;
unsigned char block_poison = 0;
std::vector<std::pair<size_t, size_t>> shared_table;
std::vector<void*> args;
std::vector<std::pair<const unsigned char*, size_t>> input_ranges;  // each input's buffer
std::vector<ArgShape> shapes;

void switch_to_fiber(Fiber& f) {
  running = &f;
  cur = &f.t;
#ifdef QAB_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStack);
#endif
#ifdef QAB_ASM_SWITCH
  qab_ctx_switch(&sched_sp, f.sp);
#else
  swapcontext(&sched_ctx, &f.ctx);
#endif
#ifdef QAB_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  running = nullptr;
  cur = nullptr;
}

// Make a waiting thread runnable; the search for the next thread to resume
// must then start no later than its place in the order.
void wake(Fiber& g) {
  g.state = RUNNABLE;
  const unsigned int pos = sched_reverse ? nthreads - 1 - g.t.rank : g.t.rank;
  if (pos < first_runnable) first_runnable = pos;
}

void yield() {
  Fiber& f = *running;
#ifdef QAB_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, sched_stack_bottom, sched_stack_size);
#endif
#ifdef QAB_ASM_SWITCH
  qab_ctx_switch(&f.sp, sched_sp);
#else
  swapcontext(&f.ctx, &sched_ctx);
#endif
#ifdef QAB_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// Complete the copies of every committed group but the newest `keep`.
void complete_copies(Fiber& f, size_t keep, bool uncommitted) {
  size_t upto = f.copies_done;
  if (f.group_ends.size() > keep) {
    const size_t k = f.group_ends.size() - keep;
    upto = f.group_ends[k - 1];
    f.group_ends.erase(f.group_ends.begin(), f.group_ends.begin() + long(k));
  }
  if (uncommitted) upto = f.copies.size();
  for (size_t i = f.copies_done; i < upto; ++i) {
    memcpy(f.copies[i].dst, f.copies[i].src, size_t(f.copies[i].bytes));
  }
  f.copies_done = upto;
}

void fiber_main() {
#ifdef QAB_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &sched_stack_bottom, &sched_stack_size);
#endif
  qab_kernel_entry();
  Fiber& f = *running;
  complete_copies(f, 0, true);  // a copy still in flight lands eventually
  f.state = DONE;
#ifdef QAB_ASAN
  __sanitizer_start_switch_fiber(nullptr, sched_stack_bottom, sched_stack_size);
#endif
#ifdef QAB_ASM_SWITCH
  void* dead = nullptr;
  qab_ctx_switch(&dead, sched_sp);
#else
  setcontext(&sched_ctx);
#endif
  abort();
}

void init_fiber(Fiber& f) {
  QAB_UNPOISON(f.stack + kStack - 16384, 16384);
#ifdef QAB_ASM_SWITCH
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStack) & ~uintptr_t(15);
#if defined(__x86_64__)
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                   // fiber_main's return address
  *--sp = reinterpret_cast<void*>(&fiber_main);      // where qab_ctx_switch returns
  for (int i = 0; i < 6; ++i) *--sp = nullptr;       // rbp rbx r12 r13 r14 r15
  --sp;
  const uint32_t csr[2] = {0x1f80u, 0x037fu};        // mxcsr, x87 control word
  memcpy(sp, csr, 8);
  f.sp = sp;
#else
  void** sp = reinterpret_cast<void**>(top - 176);
  memset(sp, 0, 176);
  sp[11] = reinterpret_cast<void*>(&fiber_main);     // x30
  f.sp = sp;
#endif
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = kStack;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, fiber_main, 0);
#endif
}

const char* where(const Fiber& f, char* buf, size_t n) {
  snprintf(buf, n, "block (%u, %u, %u) thread (%u, %u, %u)", f.t.block_idx.x, f.t.block_idx.y,
           f.t.block_idx.z, f.t.thread_idx.x, f.t.thread_idx.y, f.t.thread_idx.z);
  return buf;
}

void reset_block(unsigned char poison) {
  if (!arena_poisoned) {  // (a global: addressable until poisoned once)
    QAB_POISON(arena, kArena);
    arena_poisoned = true;
  }
  // The last block allocated (and unpoisoned) nothing past next_off.
  filled = next_off > dyn_bytes ? next_off : dyn_bytes;
  block_poison = poison;
  QAB_UNPOISON(arena, filled);
  memset(arena, poison, filled);
  QAB_POISON(arena, filled);
  QAB_UNPOISON(arena, dyn_bytes);
  next_off = dyn_bytes;
  static_bytes = 0;
  shared_table.clear();
}

// No fiber can run: report who waits where and who has returned.
[[noreturn]] void deadlock() {
  const Fiber *exited = nullptr, *at_warp = nullptr;
  int at_block = 0;
  for (const Fiber& f : fibers) {
    if (f.state == DONE && !exited) exited = &f;
    if (f.state == AT_SYNCTHREADS) ++at_block;
    if (f.state == AT_WARP_OP && !at_warp) at_warp = &f;
  }
  char a[96], b[96];
  running = nullptr;
  if (at_block && exited) {
    fail("deadlock: %d threads wait at __syncthreads() (%s:%d) but %s has returned (every "
         "thread of the block must reach it)", at_block, block_file, block_line,
         where(*exited, a, sizeof a));
  }
  if (at_block && at_warp) {
    fail("deadlock: %d threads wait at __syncthreads() (%s:%d) while %s waits at %s", at_block,
         block_file, block_line, where(*at_warp, a, sizeof a), kOpNames[at_warp->op]);
  }
  if (at_warp) {
    const Fiber* gone = nullptr;
    for (const Fiber& f : fibers) {
      if (f.t.warp == at_warp->t.warp && f.state == DONE) { gone = &f; break; }
    }
    fail("deadlock: %s waits at %s but %s of its warp has returned", where(*at_warp, a, sizeof a),
         kOpNames[at_warp->op], gone ? where(*gone, b, sizeof b) : "a lane");
  }
  fail("deadlock");
}

void run_block(const uint3& blk, bool reverse, unsigned char shared_poison) {
  reset_block(shared_poison);
  for (unsigned int r = 0; r < nthreads; ++r) {
    Fiber& f = fibers[r];
    f.t.thread_idx = {r % block_dim[0], (r / block_dim[0]) % block_dim[1],
                      r / (block_dim[0] * block_dim[1])};
    f.t.block_idx = blk;
    f.t.block_dim = dim3(block_dim[0], block_dim[1], block_dim[2]);
    f.t.grid_dim = dim3(grid_dim[0], grid_dim[1], grid_dim[2]);
    f.t.rank = r;
    f.t.lane = r % 32;
    f.t.warp = r / 32;
    f.state = RUNNABLE;
    f.copies.clear();
    f.copies_done = 0;
    f.group_ends.clear();
    init_fiber(f);
  }
  for (Warp& w : warps) { w.arrived = 0; w.op = -1; }
  block_arrived = 0;
  // Greedy: always resume the first runnable thread in priority order (highest
  // rank first when `reverse`), so one warp runs as far ahead of the others
  // as the barriers allow. Threads become runnable only through wake(), which
  // moves the cursor back, so the search starts at the cursor, not at 0 (a
  // full scan per switch was 40% of a large launch's run time).
  sched_reverse = reverse;
  first_runnable = 0;
  unsigned int done = 0;
  for (;;) {
    Fiber* next = nullptr;
    for (unsigned int i = first_runnable; i < nthreads; ++i) {
      Fiber& f = fibers[reverse ? nthreads - 1 - i : i];
      if (f.state == RUNNABLE) { next = &f; first_runnable = i; break; }
    }
    if (next == nullptr) {
      if (done == nthreads) break;
      deadlock();
    }
    switch_to_fiber(*next);
    if (next->state == DONE) ++done;
  }
  if (static_bytes > static_peak) static_peak = static_bytes;
}
}  // namespace

void* arg(int i) { return args[size_t(i)]; }
void check_prefetch(const void* p, uint32_t bytes) {
  const unsigned char* a = static_cast<const unsigned char*>(p);
  for (const auto& r : input_ranges) {
    if (a >= r.first && a + bytes <= r.first + r.second) return;
  }
  fail("qab_prefetch_l2 of %u bytes at %p: not inside one input buffer", bytes, p);
}
const ArgShape& input_shape(int i) { return shapes[size_t(i)]; }

void fail(const char* fmt, ...) {
  fflush(stdout);
  char buf[96];
  if (running) fprintf(stderr, "qab-emu: %s: ", where(*running, buf, sizeof buf));
  else fprintf(stderr, "qab-emu: ");
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  fflush(stderr);
  _Exit(86);
}

void syncthreads(const char* file, int line) {
  Fiber& f = *running;
  if (block_arrived == 0) {
    block_file = file;
    block_line = line;
    block_first = f.t.rank;
  } else if (line != block_line || (file != block_file && strcmp(file, block_file) != 0)) {
    char buf[96];
    fail("divergent __syncthreads(): this thread is at %s:%d, %s at %s:%d", file, line,
         where(fibers[block_first], buf, sizeof buf), block_file, block_line);
  }
  f.state = AT_SYNCTHREADS;
  if (++block_arrived == int(nthreads)) {
    for (Fiber& g : fibers) if (g.state == AT_SYNCTHREADS) wake(g);
    block_arrived = 0;
  }
  yield();
}

unsigned char* warp_exchange_begin(int op, unsigned int mask) {
  Warp& w = warps[cur->warp];
  if (mask != 0xffffffffu) {
    fail("%s with mask 0x%08x: only the full-warp mask 0xffffffff is emulated", kOpNames[op], mask);
  }
  if (w.size != 32) {
    fail("%s with the full mask in a partial warp of %d threads (blockDim is not a multiple of 32)",
         kOpNames[op], w.size);
  }
  return w.slots[w.phase & 1u];
}

void warp_exchange_wait(int op) {
  Fiber& f = *running;
  Warp& w = warps[f.t.warp];
  if (w.arrived == 0) {
    w.op = op;
  } else if (w.op != op) {
    fail("lanes of warp %u are at different warp operations: this lane at %s, others at %s",
         f.t.warp, kOpNames[op], kOpNames[w.op]);
  }
  f.state = AT_WARP_OP;
  f.op = op;
  if (++w.arrived == w.size) {
    for (unsigned int l = 0; l < unsigned(w.size); ++l) wake(fibers[f.t.warp * 32 + l]);
    w.arrived = 0;
    ++w.phase;
  }
  yield();
}

void* shared_alloc(int id, size_t bytes, size_t align) {
  if (size_t(id) >= shared_table.size()) shared_table.resize(size_t(id) + 1, {SIZE_MAX, 0});
  auto& e = shared_table[size_t(id)];
  if (e.first == SIZE_MAX) {
    if (align < 16) align = 16;
    const size_t off = (next_off + kRedzone + align - 1) / align * align;
    if (off + bytes > kArena) fail("__shared__ arrays exceed the %zu-byte arena", kArena);
    e = {off, bytes};
    next_off = off + bytes;
    if (next_off > filled) {
      QAB_UNPOISON(arena + filled, next_off - filled);
      memset(arena + filled, block_poison, next_off - filled);
      QAB_POISON(arena + filled, next_off - filled);
      filled = next_off;
    }
    static_bytes = (static_bytes + align - 1) / align * align + bytes;
    QAB_UNPOISON(arena + off, bytes);
  } else if (e.second != bytes) {
    fail("__shared__ declaration %d has %zu bytes here, %zu bytes in another thread", id, bytes,
         e.second);
  }
  return arena + e.first;
}

void* dynamic_shared() { return arena; }

void cp_async(void* smem, const void* gmem, int bytes) {
  const unsigned char* d = static_cast<const unsigned char*>(smem);
  const unsigned char* s = static_cast<const unsigned char*>(gmem);
  if (d < arena || d + bytes > arena + kArena) fail("cp.async destination %p is not shared", smem);
  if (s >= arena && s < arena + kArena) fail("cp.async source %p is shared, not global", gmem);
  const uintptr_t misaligned = (reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s));
  if (misaligned % unsigned(bytes)) {
    fail("cp.async of %d bytes needs %d-byte aligned addresses (shared %p, global %p)", bytes,
         bytes, smem, gmem);
  }
  if (deferred_copies) running->copies.push_back({smem, gmem, bytes});
  else memcpy(smem, gmem, size_t(bytes));
}

void cp_async_commit() { running->group_ends.push_back(running->copies.size()); }

void cp_async_wait(int pending) {
  if (pending < 0) fail("cp.async wait_group %d", pending);
  complete_copies(*running, size_t(pending), false);
}
}  // namespace qab

using namespace qab;

static const char* dir = "";
static const char* path_of(const char* name, unsigned int i, int sched = -1) {
  static char buf[4096];
  if (sched < 0) snprintf(buf, sizeof buf, "%s/%s%u.bin", dir, name, i);
  else snprintf(buf, sizeof buf, "%s/%s%u.s%d.bin", dir, name, i, sched);
  return buf;
}

static std::vector<unsigned char> read_file(const char* path) {
  FILE* fp = fopen(path, "rb");
  if (!fp) { fprintf(stderr, "qab-emu: cannot read %s\n", path); exit(2); }
  std::vector<unsigned char> data;
  unsigned char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, fp)) > 0) data.insert(data.end(), buf, buf + n);
  fclose(fp);
  return data;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  dir = argv[1];
  char spec_path[4096];
  snprintf(spec_path, sizeof spec_path, "%s/spec.txt", dir);
  FILE* spec = fopen(spec_path, "r");
  if (!spec) return 2;
  unsigned int schedules = 0, n_in = 0, n_out = 0;
  if (fscanf(spec, "blocks %u %u %u threads %u %u %u dynamic_shared %zu schedules %u inputs %u",
             &grid_dim[0], &grid_dim[1], &grid_dim[2], &block_dim[0], &block_dim[1], &block_dim[2],
             &dyn_bytes, &schedules, &n_in) != 9) return 3;
  if (dyn_bytes > kArena) fail("%zu bytes of dynamic shared memory exceed the %zu-byte arena",
                               dyn_bytes, kArena);
  nthreads = block_dim[0] * block_dim[1] * block_dim[2];
  std::vector<void*> inputs(n_in), input_bases(n_in);
  std::vector<std::vector<unsigned char>> originals(n_in);
  shapes.resize(n_in);
  for (unsigned int i = 0; i < n_in; ++i) {
    size_t nbytes = 0;
    ArgShape& s = shapes[i];
    s.shape.fill(0);
    s.strides.fill(0);
    if (fscanf(spec, "%zu %d", &nbytes, &s.ndim) != 2) return 3;
    for (int d = 0; d < s.ndim; ++d) if (fscanf(spec, "%d", &s.shape[size_t(d)]) != 1) return 3;
    for (int d = 0; d < s.ndim; ++d) {
      long long st = 0;
      if (fscanf(spec, "%lld", &st) != 1) return 3;
      s.strides[size_t(d)] = st;
    }
    size_t offset = 0;  // bytes from the buffer's start to the first element
    if (fscanf(spec, "%zu", &offset) != 1) return 3;
    std::vector<unsigned char> data = read_file(path_of("in", i));
    if (data.size() != nbytes) return 4;
    // Exact size: the sanitizer reports reads past the end.
    void* base = nullptr;
    if (posix_memalign(&base, 256, nbytes ? nbytes : 1)) return 5;
    if (nbytes) memcpy(base, data.data(), nbytes);
    originals[i] = std::move(data);
    input_bases[i] = base;
    inputs[i] = static_cast<unsigned char*>(base) + offset;
    input_ranges.emplace_back(static_cast<const unsigned char*>(base), nbytes);
  }
  if (fscanf(spec, " outputs %u", &n_out) != 1) return 3;
  std::vector<size_t> out_bytes(n_out), guard(n_out);
  std::vector<int> has_init(n_out);
  for (unsigned int i = 0; i < n_out; ++i) {
    if (fscanf(spec, "%zu %zu %d", &out_bytes[i], &guard[i], &has_init[i]) != 3) return 3;
  }
  // Inputs the kernel writes in place (the manifest's `writes`): each
  // schedule starts from the original bytes and hands them back after.
  unsigned int n_writes = 0;
  if (fscanf(spec, " writes %u", &n_writes) != 1) return 3;
  std::vector<unsigned int> written(n_writes);
  for (unsigned int& w : written) {
    if (fscanf(spec, "%u", &w) != 1 || w >= n_in) return 3;
  }
  fclose(spec);

  fibers.resize(nthreads);
  for (Fiber& f : fibers) f.stack = static_cast<char*>(malloc(kStack));
  warps.resize((nthreads + 31) / 32);
  for (size_t w = 0; w < warps.size(); ++w) {
    warps[w].size = int(nthreads - 32 * w < 32 ? nthreads - 32 * w : 32);
  }
  const unsigned int n_blocks = grid_dim[0] * grid_dim[1] * grid_dim[2];
  for (unsigned int sched = 0; sched < schedules; ++sched) {
    const bool reverse = sched % 2 == 0;
    deferred_copies = sched % 2 == 1;
    const unsigned char out_poison = reverse ? 0xff : 0xfe;
    const unsigned char shared_poison = reverse ? 0xff : 0x7f;
    std::vector<unsigned char*> bufs(n_out);
    for (unsigned int w : written) {
      if (!originals[w].empty()) memcpy(input_bases[w], originals[w].data(), originals[w].size());
    }
    args.assign(inputs.begin(), inputs.end());
    for (unsigned int i = 0; i < n_out; ++i) {
      const size_t total = guard[i] + out_bytes[i] + guard[i];
      void* p = nullptr;
      if (posix_memalign(&p, 256, total)) return 5;
      bufs[i] = static_cast<unsigned char*>(p);
      memset(bufs[i], has_init[i] == 2 ? 0xff : out_poison, total);
      if (has_init[i] == 1) {
        std::vector<unsigned char> init = read_file(path_of("init", i));
        if (init.size() != out_bytes[i]) return 4;
        if (out_bytes[i]) memcpy(bufs[i] + guard[i], init.data(), out_bytes[i]);
      }
      args.push_back(bufs[i] + guard[i]);
    }
    for (unsigned int k = 0; k < n_blocks; ++k) {
      const unsigned int b = reverse ? n_blocks - 1 - k : k;
      const uint3 blk = {b % grid_dim[0], (b / grid_dim[0]) % grid_dim[1],
                         b / (grid_dim[0] * grid_dim[1])};
      run_block(blk, reverse, shared_poison);
    }
    for (unsigned int i = 0; i < n_out; ++i) {
      FILE* fp = fopen(path_of("out", i, int(sched)), "wb");
      const size_t total = guard[i] + out_bytes[i] + guard[i];
      if (!fp || fwrite(bufs[i], 1, total, fp) != total) return 6;
      fclose(fp);
      free(bufs[i]);
    }
    for (unsigned int w : written) {
      FILE* fp = fopen(path_of("inw", w, int(sched)), "wb");
      const size_t n = originals[w].size();
      if (!fp || (n && fwrite(input_bases[w], 1, n, fp) != n)) return 6;
      fclose(fp);
    }
  }
  for (Fiber& f : fibers) free(f.stack);
  for (void* p : input_bases) free(p);
  printf("qab-emu static_shared_bytes %zu\n", static_peak);
  return 0;
}
"""

# --------------------------------------------------------------------------
# Inline-PTX helpers replaced by emulated versions (kernels/cuda/common.cuh)
# --------------------------------------------------------------------------

# name -> (its declaration as written in the header, whitespace-normalised;
#          the emulated body). A helper whose declaration changed is refused.
SUBSTITUTES = {
    "qab_cp_async16": (
        "__device__ __forceinline__ void qab_cp_async16(void* smem, const void* gmem)",
        "::qab::cp_async(smem, gmem, 16);"),
    "qab_cp_async_commit": (
        "__device__ __forceinline__ void qab_cp_async_commit()",
        "::qab::cp_async_commit();"),
    "qab_cp_async_wait": (
        "template <int N> __device__ __forceinline__ void qab_cp_async_wait()",
        "::qab::cp_async_wait(N);"),
    "qab_wait_count": (
        "__device__ __forceinline__ void qab_wait_count(const uint32_t* p, uint32_t target)",
        "::qab::wait_count(p, target);"),
    # An L2 prefetch is a hint with no visible effect: the emulator only checks
    # that the range lies in one input buffer.
    # Tensor-core mma (kernels/cuda/gqa_mma.cuh): the warp's product from every
    # lane's fragments (::qab::mma_warp, float32 sums in k order).
    "qab_mma_16816": (
        "template <typename InT> __device__ __forceinline__ void qab_mma_16816(float (&d)[4], "
        "const uint32_t a0, const uint32_t a1, const uint32_t a2, const uint32_t a3, "
        "const uint32_t b0, const uint32_t b1)",
        "const unsigned int a[4] = {a0, a1, a2, a3}; const unsigned int b[2] = {b0, b1}; "
        "::qab::mma_warp<InT, 16>(d, a, b);"),
    "qab_mma_1688": (
        "template <typename InT> __device__ __forceinline__ void qab_mma_1688(float* d, "
        "const uint32_t a0, const uint32_t a1, const uint32_t b0)",
        "const unsigned int a[2] = {a0, a1}; const unsigned int b[1] = {b0}; "
        "::qab::mma_warp<InT, 8>(d, a, b);"),
    "qab_prefetch_l2": (
        "__device__ __forceinline__ void qab_prefetch_l2(const void* p, uint32_t bytes)",
        "::qab::check_prefetch(p, bytes);"),
}

_C_TYPES = {
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float", mx.float64: "double",
}
_NP_TYPES = {
    mx.bool_: np.bool_, mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32,
    mx.int64: np.int64, mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32,
    mx.uint64: np.uint64, mx.float16: np.float16, mx.bfloat16: np.uint16,
    mx.float32: np.float32, mx.float64: np.float64,
}


def _blank_comments_and_strings(text: str) -> str:
    """Same length as ``text``, comments and string/char literal contents as spaces."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out[i:j] = [ch if ch == "\n" else " " for ch in text[i:j]]
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out[i + 1:j] = [ch if ch == "\n" else " " for ch in text[i + 1:j]]
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _top_level_block(code: str, pos: int) -> tuple:
    """(open, close) offsets of the top-level ``{...}`` enclosing ``pos``, or None."""
    depth, open_at = 0, None
    for i, ch in enumerate(code[:pos]):
        if ch == "{":
            if depth == 0:
                open_at = i
            depth += 1
        elif ch == "}":
            depth -= 1
    if open_at is None or depth < 1:
        return None
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return open_at, i
    return None


def _substitute_asm_helpers(text: str, where: str) -> str:
    """Replace top-level functions whose body has inline ``asm`` by SUBSTITUTES."""
    code = _blank_comments_and_strings(text)
    blocks = []
    for m in re.finditer(r"\basm\b", code):
        block = _top_level_block(code, m.start())
        if block is None:
            raise NotEmulated(f"inline PTX (asm) outside a top-level helper function in {where}")
        if block not in blocks:
            blocks.append(block)
    for open_at, close_at in reversed(blocks):  # from the end: line numbers stay right
        start = max(code.rfind(";", 0, open_at), code.rfind("}", 0, open_at)) + 1
        # Preprocessor lines are not part of the declaration.
        while True:
            nl = code.find("\n", start, open_at)
            line = code[start:nl if nl >= 0 else open_at].strip()
            if nl < 0 or (line and not line.startswith("#")):
                break
            start = nl + 1
        decl_raw = code[start:open_at]
        decl = " ".join(decl_raw.split())
        names = [n for n in re.findall(r"(\w+)\s*\(", decl)
                 if n not in ("__align__", "__launch_bounds__", "alignas", "__attribute__")]
        name = names[0] if names else "?"
        if name not in SUBSTITUTES:
            raise NotEmulated(
                f"{where}: helper {name!r} is inline PTX (asm) and has no emulated version; "
                "add one to SUBSTITUTES in tests/_cuda_emulation.py (tensor-core mma and other "
                "PTX are out of scope)")
        want, body = SUBSTITUTES[name]
        if decl != want:
            raise NotEmulated(f"{where}: helper {name!r} is declared as {decl!r}, the emulated "
                              f"version expects {want!r}; update SUBSTITUTES")
        lead = decl_raw[:len(decl_raw) - len(decl_raw.lstrip())]
        close_line = text.count("\n", 0, close_at) + 1
        text = (text[:start] + f"{lead}{want} {{ {body} }}\n#line {close_line}\n"
                + text[close_at + 1:])
    return text


_SHARED_DECL = re.compile(
    r"(?P<extern>\bextern\s+)?\b__shared__\s+"
    r"(?P<pre>(?:(?:__align__|alignas)\s*\(\s*\d+\s*\)\s*)*)"
    r"(?P<type>(?:(?:const|volatile|unsigned|signed|long|short)\s+)*[A-Za-z_][\w:]*"
    r"(?:\s*<[^;{}()]*?>)?)\s+"
    r"(?P<post>(?:(?:__align__|alignas)\s*\(\s*\d+\s*\)\s*)*)"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]*\]\s*)*);")


class _SharedIds:
    def __init__(self):
        self.next = 0


def _translate_shared(text: str, ids: _SharedIds) -> str:
    """``__shared__ T a[N][M];`` -> a reference into the emulator's per-block arena."""

    def repl(m: re.Match) -> str:
        align = max([int(a) for a in re.findall(r"\((\s*\d+\s*)\)", m["pre"] + m["post"])] or [0])
        ctype, name, dims = m["type"].strip(), m["name"], re.sub(r"\s+", "", m["dims"])
        if m["extern"]:
            if dims != "[]":
                raise NotEmulated(f"extern __shared__ {name}{dims}: expected an unsized array")
            return f"{ctype}* {name} = reinterpret_cast<{ctype}*>(::qab::dynamic_shared());"
        ident = ids.next
        ids.next += 1
        return f"auto& {name} = ::qab::shared<{ctype}{dims}>({ident}, {align});"

    code = _blank_comments_and_strings(text)
    pieces, last = [], 0
    for m in _SHARED_DECL.finditer(code):
        real = _SHARED_DECL.fullmatch(text[m.start():m.end()]) or m
        pieces.append(text[last:m.start()])
        pieces.append(repl(real))
        last = m.end()
    pieces.append(text[last:])
    return "".join(pieces)


def _check_no_asm(text: str, where: str) -> None:
    if re.search(r"\basm\b", _blank_comments_and_strings(text)):
        raise NotEmulated(f"{where} has inline PTX (asm), e.g. tensor-core mma: out of scope for "
                          "the CPU emulation")


def _template_hash(template) -> str:
    out = ""
    for _, v in template:
        if isinstance(v, bool):
            out += "_t" if v else "_f"
        elif isinstance(v, int):
            out += f"_{v}"
        else:
            out += "_" + str(v).rsplit(".", 1)[-1]
    return out


def _template_lines(template) -> str:
    lines = []
    for name, v in template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {name} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            lines.append(f"  constexpr int {name} = {v};")
        elif isinstance(v, mx.Dtype):
            lines.append(f"  using {name} = {_c_type(v)};")
        else:
            raise TypeError(f"template argument {name}={v!r}: expected bool, int or mx.Dtype")
    return "\n".join(lines)


def _c_type(dtype: mx.Dtype) -> str:
    if dtype not in _C_TYPES:
        raise NotEmulated(f"dtype {dtype} is not emulated")
    return _C_TYPES[dtype]


# --------------------------------------------------------------------------
# Building (compiler probe, runtime object, per-kernel programs)
# --------------------------------------------------------------------------

_LOCK = threading.Lock()
_WORK: Optional[Path] = None
_FLAGS: Optional[list] = None
_RUNTIME: Optional[Path] = None
_LINK_FLAGS: list = []  # a faster linker's -fuse-ld=, where one works (link only)
_UNAVAILABLE: Optional[str] = None
_PROGRAMS: dict = {}


def _workdir() -> Path:
    global _WORK
    if _WORK is None:
        _WORK = Path(tempfile.mkdtemp(prefix="qab-cuda-emu-"))
        atexit.register(shutil.rmtree, _WORK, True)
    return _WORK


def _compile(args: list, what: str) -> None:
    proc = subprocess.run([CXX, *args], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if proc.returncode != 0:
        raise KernelCompileError(f"{what} did not compile:\n{proc.stderr[-6000:]}")


def _setup() -> None:
    """Probe the compiler's flags and build the runtime object once per session."""
    global _FLAGS, _RUNTIME, _UNAVAILABLE
    if _RUNTIME is not None or _UNAVAILABLE is not None:
        return
    if CXX is None:
        _UNAVAILABLE = "no C++ compiler on PATH (g++ or clang++)"
        return
    work = _workdir()
    (work / "qab_cuda_emu.h").write_text(EMU_HEADER, encoding="utf-8")
    probe = work / "probe.cpp"
    probe.write_text("static_assert(__cplusplus >= 202002L);\n#include <array>\n"
                     "int main() { std::array<int, 2> a{}; return a[1]; }\n")
    # -Og: a kernel program, sanitized, compiled in about half -O1's time and
    # ran no slower (two model-level tests on 2 cores: 44 s compiling and
    # 237 s running at -Og, 86 and 267 s at -O1; -O0 ran twice as long).
    base = ["-std=c++20", "-Og", "-g1", "-fno-omit-frame-pointer", "-w"]
    pattern = ["-ftrivial-auto-var-init=pattern"]
    # The richest flag set that builds and runs here.
    for extra in ([*pattern, *SANITIZE_FLAGS] if SANITIZERS else [], pattern, []):
        try:
            _compile([*base, *extra, str(probe), "-o", str(work / "probe")], "a C++20 probe")
            if subprocess.run([str(work / "probe")], env=_run_env(), timeout=60).returncode == 0:
                break
        except (KernelCompileError, OSError, subprocess.TimeoutExpired) as exc:
            error = exc
    else:
        _UNAVAILABLE = f"{CXX} cannot build and run C++20 programs: {error}"
        return
    flags = base + extra
    # The runtime is not instrumented (it is the emulator, not the kernel); it
    # is told when the program is linked with AddressSanitizer, for the fiber
    # switch annotations and the shared-memory redzones.
    # At -O2: it runs once per session to build, and every launch runs its fiber switches,
    # barriers and warp exchanges (kernel launches of three model-level tests: 68.6 -> 58.6
    # CPU-s of 150 runs, against -Og).
    rt_flags = ["-O2" if f == "-Og" else f for f in flags if not f.startswith("-fsanitize")]
    if sanitized_flags(flags):
        rt_flags.append("-DQAB_ASAN=1")
    runtime = work / "qab_cuda_runtime.cpp"
    runtime.write_text(EMU_RUNTIME, encoding="utf-8")
    # The fiber switch returns into new stacks: keep x86 shadow stacks off.
    attempts = ([["-fcf-protection=none"], []] if platform.machine().lower() in ("x86_64", "amd64")
                else [[]])
    for more in attempts:
        try:
            _compile([*rt_flags, *more, "-I", str(work), "-c", str(runtime),
                      "-o", str(work / "runtime.o")], "the emulator runtime")
            break
        except KernelCompileError as exc:
            error = exc
    else:
        _UNAVAILABLE = f"{CXX} cannot build the CUDA emulator runtime: {error}"
        return
    _FLAGS, _RUNTIME = flags, work / "runtime.o"
    _LINK_FLAGS[:] = _faster_linker(work, flags)
    _precompile_header(work, flags)


def _faster_linker(work: Path, flags: list) -> list:
    """``-fuse-ld=`` of the first of mold, lld, gold that links and runs the probe, or []:
    gold linked a kernel program in 0.05-0.07 s against GNU ld's 0.17-0.20 s (2 cores)."""
    for linker in ("mold", "lld", "gold"):
        flag = f"-fuse-ld={linker}"
        exe = work / f"probe-{linker}"
        try:
            _compile([*flags, flag, str(work / "probe.cpp"), "-o", str(exe)], "a linker probe")
            if subprocess.run([str(exe)], env=_run_env(), timeout=60).returncode == 0:
                return [flag]
        except (KernelCompileError, OSError, subprocess.TimeoutExpired):
            pass
    return []


def _precompile_header(work: Path, flags: list) -> None:
    """Precompile ``qab_cuda_emu.h`` with the programs' flags (GCC reads the ``.gch`` beside
    the header for each program's first ``#include``), kept only where the compiler uses it.

    Its standard headers and inline helpers took 0.44 s of every program's compile; with
    the ``.gch``, 0.11 s (2 cores, sanitized flags): a kernel program of 20 KB built in
    0.25 s instead of 0.74 s with the faster linker, one of 136 KB in 2.0 s instead of 2.7 s.
    """
    gch = work / "qab_cuda_emu.h.gch"
    try:
        _compile([*flags, "-x", "c++-header", str(work / "qab_cuda_emu.h"), "-o", str(gch)],
                 "the emulator header")
        if reads_precompiled_header(work, flags):
            return
    except (KernelCompileError, OSError, subprocess.TimeoutExpired):
        pass
    gch.unlink(missing_ok=True)


def reads_precompiled_header(work: Path, flags: Sequence[str]) -> bool:
    """Whether the compiler, with ``flags``, reads ``work``'s ``qab_cuda_emu.h.gch`` for a
    program's ``#include "qab_cuda_emu.h"`` (GCC's ``-H`` marks a precompiled header it
    read with "!", an unusable one with "x").

    Raises:
        OSError, subprocess.TimeoutExpired: the compiler could not be run.
    """
    probe = work / "pch-probe.cpp"
    probe.write_text('#include "qab_cuda_emu.h"\n', encoding="utf-8")
    proc = subprocess.run([CXX, *flags, "-H", "-fsyntax-only", "-I", str(work), str(probe)],
                          capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    return proc.returncode == 0 and bool(
        re.search(r"^! .*qab_cuda_emu\.h\.gch$", proc.stderr, re.M))


def unavailable_reason() -> Optional[str]:
    """Why emulated kernels cannot run here (no or too old C++ compiler), or None."""
    with _LOCK:
        _setup()
    return _UNAVAILABLE


def sanitized() -> bool:
    """Whether programs are built with AddressSanitizer and UBSan here."""
    with _LOCK:
        _setup()
    return bool(_FLAGS) and sanitized_flags(_FLAGS)


def sanitized_flags(flags: Sequence[str]) -> bool:
    """Whether ``flags`` build with AddressSanitizer (and the UBSan checks)."""
    return any(f.startswith("-fsanitize=address") for f in flags)


def require() -> None:
    """``pytest.skip`` the calling test when the emulator cannot be built here."""
    import pytest

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _run_env() -> dict:
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = ("detect_leaks=0:detect_stack_use_after_return=0:halt_on_error=1:"
                           "detect_odr_violation=0:" + env.get("ASAN_OPTIONS", ""))
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:" + env.get("UBSAN_OPTIONS", "")
    return env


def _program(source_text: str) -> Path:
    """Compile (once per session) a kernel translation unit linked with the runtime."""
    with _LOCK:
        _setup()
        if _UNAVAILABLE is not None:
            raise RuntimeError(_UNAVAILABLE)
        key = hashlib.sha256(source_text.encode() + " ".join(_FLAGS).encode()).hexdigest()[:20]
        exe = _PROGRAMS.get(key)
        if exe is not None:
            return exe
        work = _workdir()
        cpp = work / f"k_{key}.cpp"
        cpp.write_text(source_text, encoding="utf-8")
        exe = work / f"k_{key}"
        _compile([*_FLAGS, *_LINK_FLAGS, "-I", str(work), str(cpp), str(_RUNTIME), "-o", str(exe)],
                 f"kernel program {cpp.name}")
        _PROGRAMS[key] = exe
        return exe


# --------------------------------------------------------------------------
# The kernel object
# --------------------------------------------------------------------------


def _numpy_compatible(a: mx.array) -> mx.array:
    """``a`` in a dtype numpy has (bf16 as its uint16 bits, same strides)."""
    if a.dtype == mx.bfloat16:
        return a.view(mx.uint16)
    if a.dtype not in _NP_TYPES:
        raise NotEmulated(f"input dtype {a.dtype} is not emulated")
    return a


def _to_numpy(a: mx.array) -> np.ndarray:
    return np.ascontiguousarray(np.array(_numpy_compatible(a)))


def _view_bytes(a: mx.array) -> tuple[bytes, list, int]:
    """(bytes, element strides, offset) of the memory the view ``a`` spans, from
    the 16-byte boundary at or below its lowest element (MLX buffers are at
    least 16-byte aligned, so nothing outside its buffer is read)."""
    n = np.asarray(_numpy_compatible(a))  # MLX's own strides and offset, no copy
    item = n.itemsize
    if n.size == 0:
        return b"", [0] * n.ndim, 0
    ptr = n.__array_interface__["data"][0]
    lo = sum(min(0, (d - 1) * st) for d, st in zip(n.shape, n.strides))
    hi = sum(max(0, (d - 1) * st) for d, st in zip(n.shape, n.strides)) + item
    start = ptr + lo
    start -= start % 16
    data = ctypes.string_at(start, ptr + hi - start)
    return data, [st // item for st in n.strides], ptr - start


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


class EmulatedCudaKernel:
    """A kernel object with the call signature of ``mx.fast.cuda_kernel``'s, run on the CPU.

    Attributes:
        stats (dict): of the last call: ``static_shared_bytes``, ``blocks``,
            ``threads_per_block``.
    """

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 shared_memory: int = 0, *, header_files: Optional[Sequence] = None,
                 body_file: str = "<source>", writes: Sequence[str] = ()):
        if not output_names:
            raise ValueError("[cuda_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.shared_memory = int(shared_memory)
        self.ensure_row_contiguous = bool(ensure_row_contiguous)
        unknown = [n for n in writes if n not in self.input_names]
        if unknown:
            raise ValueError(f"{name}: writes {unknown} are not inputs")
        #: Indices of the inputs written in place (handed back, see _run).
        self.writes = [self.input_names.index(n) for n in writes]
        self.stats: dict = {}
        self._sources: dict = {}  # generated_source per instantiation (see __call__)
        # (file name, text) pairs; #line directives keep compiler and
        # sanitizer reports pointing at the real files.
        self._header_files = list(header_files) if header_files is not None else (
            [("<header>", header)] if header else [])
        self._body_file = body_file
        _check_no_asm(source, f"the body of {name}")
        self._shape_info = [(f"{n}_shape" in source, f"{n}_strides" in source,
                             f"{n}_ndim" in source) for n in self.input_names]

    def generated_source(self, input_dtypes, input_ndims, output_dtypes, template) -> str:
        """The C++ program for one instantiation (header, kernel function, glue)."""
        ids = _SharedIds()
        parts = ['#include "qab_cuda_emu.h"\n']
        for fname, text in self._header_files:
            text = _substitute_asm_helpers(text, fname)
            _check_no_asm(text, fname)
            parts.append(f'#line 1 "{fname}"\n{_translate_shared(text, ids)}\n')
        fn = f"custom_kernel_{self.name}{_template_hash(template)}"
        params, call = [], []
        for i, (n, dt, nd) in enumerate(zip(self.input_names, input_dtypes, input_ndims)):
            params.append(f"    const {_c_type(dt)}* {n}")
            call.append(f"static_cast<const {_c_type(dt)}*>(::qab::arg({i}))")
            shape, strides, ndim = self._shape_info[i]
            if nd > 0:
                if shape:
                    params.append(f"    const __grid_constant__ Shape {n}_shape")
                    call.append(f"::qab::input_shape({i}).shape")
                if strides:
                    params.append(f"    const __grid_constant__ Strides {n}_strides")
                    call.append(f"::qab::input_shape({i}).strides")
                if ndim:
                    params.append(f"    const __grid_constant__ int {n}_ndim")
                    call.append(f"::qab::input_shape({i}).ndim")
        for j, (n, dt) in enumerate(zip(self.output_names, output_dtypes)):
            params.append(f"    {_c_type(dt)}* {n}")
            call.append(f"static_cast<{_c_type(dt)}*>(::qab::arg({len(self.input_names) + j}))")
        body = _translate_shared(self.source, ids)
        parts.append(
            "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {fn}(\n" + ",\n".join(params) + ") {\n"
            + _template_lines(template) + f'\n#line 1 "{self._body_file}"\n' + body
            + "\n}\n\n} // namespace mlx::core::cu\n")
        parts.append(f'#line 1 "<emulator glue>"\nextern "C" void qab_kernel_entry() {{\n'
                     f"  ::mlx::core::cu::{fn}(\n      " + ",\n      ".join(call) + ");\n}\n")
        return "".join(parts)

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None, schedules=None):
        del stream  # always the CPU
        schedules = DEFAULT_SCHEDULES if schedules is None else schedules
        if len(inputs) != len(self.input_names):
            raise ValueError(f"[cuda_kernel] Expected `inputs` to have size "
                             f"{len(self.input_names)} but got size {len(inputs)}.")
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(
                self.output_names):
            raise ValueError(f"[cuda_kernel] Expected {len(self.output_names)} output shapes "
                             "and dtypes.")
        template = list(template or [])
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        grid, tg = tuple(int(g) for g in grid), tuple(int(t) for t in threadgroup)
        if len(grid) != 3 or len(tg) != 3 or min(tg) < 1 or min(grid) < 0:
            raise ValueError(f"grid {grid} and threadgroup {tg} must be three positive ints")
        blocks = tuple((g + t - 1) // t for g, t in zip(grid, tg))
        n_threads = tg[0] * tg[1] * tg[2]
        if n_threads > 1024 or tg[2] > 64 or blocks[1] > 65535 or blocks[2] > 65535:
            raise KernelFault(f"invalid CUDA launch: {blocks} blocks of {tg} threads "
                              "(<= 1024 threads per block, z <= 64, y/z blocks <= 65535)")
        out_dtypes = list(output_dtypes)
        # One instantiation's program text, made once per kernel object (its
        # translation re-scans the headers: ~0.1 s a launch otherwise).
        sig = (tuple(str(x.dtype) for x in inputs), tuple(x.ndim for x in inputs),
               tuple(str(d) for d in out_dtypes), repr(template))
        src = self._sources.get(sig)
        if src is None:
            src = self._sources[sig] = self.generated_source(
                [x.dtype for x in inputs], [x.ndim for x in inputs], out_dtypes, template)
        if verbose:
            print(f"Generated emulation source for `{self.name}`:\n```\n{src}\n```")
        exe = _program(src)
        shapes = [tuple(int(d) for d in s) for s in output_shapes]
        with tempfile.TemporaryDirectory(dir=_workdir()) as tmp:
            outs = self._run(exe, Path(tmp), inputs, shapes, out_dtypes, blocks, tg,
                             init_value, schedules)
        self.stats["blocks"], self.stats["threads_per_block"] = blocks, n_threads
        return outs

    def _run(self, exe, tmp, inputs, shapes, dtypes, blocks, tg, init_value, schedules):
        spec = [f"blocks {blocks[0]} {blocks[1]} {blocks[2]}", f"threads {tg[0]} {tg[1]} {tg[2]}",
                f"dynamic_shared {self.shared_memory}", f"schedules {int(schedules)}",
                f"inputs {len(inputs)}"]
        back = {}  # written input -> (address of its bytes in x's own buffer, length)
        for i, x in enumerate(inputs):
            if self.ensure_row_contiguous:
                a = _to_numpy(x)
                strides = [int(np.prod(x.shape[d + 1:], dtype=np.int64)) for d in range(x.ndim)]
                data, offset = a.tobytes(), 0
                if i in self.writes:
                    # MLX hands the kernel x's own buffer only where x is
                    # row-contiguous (else a copy, whose writes are lost).
                    n = np.asarray(_numpy_compatible(x))
                    if n.flags["C_CONTIGUOUS"] and n.nbytes == len(data):
                        back[i] = (n.__array_interface__["data"][0], len(data))
            else:
                data, strides, offset = _view_bytes(x)
                if i in self.writes and data:
                    n = np.asarray(_numpy_compatible(x))
                    back[i] = (n.__array_interface__["data"][0] - offset, len(data))
            (tmp / f"in{i}.bin").write_bytes(data)
            spec.append(f"{len(data)} {x.ndim} " + " ".join(str(d) for d in x.shape) + " "
                        + " ".join(str(d) for d in strides) + f" {offset}")
        spec.append(f"outputs {len(shapes)}")
        out_np = []
        for j, (shape, dt) in enumerate(zip(shapes, dtypes)):
            npt = np.dtype(_NP_TYPES[dt])
            count = int(np.prod(shape, dtype=np.int64))
            out_np.append((npt, count))
            if init_value is not None:
                init = mx.full((count,), init_value, dtype=dt)
                _to_numpy(init).tofile(tmp / f"init{j}.bin")
            # 1: initialised; 2: a workspace (named ``ws``), poisoned alike in
            # every schedule so that its unwritten padding compares equal.
            fill = 1 if init_value is not None else 2 if self._workspace(j) else 0
            spec.append(f"{count * npt.itemsize} {GUARD_BYTES} {fill}")
        spec.append(f"writes {len(self.writes)} " + " ".join(str(i) for i in self.writes))
        (tmp / "spec.txt").write_text("\n".join(spec) + "\n")
        try:
            proc = subprocess.run([str(exe), str(tmp)], capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S, env=_run_env())
        except subprocess.TimeoutExpired:
            raise KernelFault(f"{self.name} did not finish in {RUN_TIMEOUT_S} s on the CPU "
                              "emulator (an endless loop?)") from None
        if proc.returncode != 0:
            raise KernelFault(f"{self.name} failed on the CPU emulator (exit "
                              f"{proc.returncode}):\n{_trim_report(proc.stderr)}")
        m = re.search(r"qab-emu static_shared_bytes (\d+)", proc.stdout)
        self.stats["static_shared_bytes"] = int(m[1]) if m else 0
        if self.stats["static_shared_bytes"] > STATIC_SHARED_LIMIT:
            raise KernelFault(f"{self.name}: {self.stats['static_shared_bytes']} bytes of static "
                              f"__shared__ memory (CUDA allows {STATIC_SHARED_LIMIT})")
        if self.stats["static_shared_bytes"] + self.shared_memory > SHARED_LIMIT:
            raise KernelFault(f"{self.name}: static + dynamic shared memory over {SHARED_LIMIT}")
        for i in self.writes:
            runs = [(tmp / f"inw{i}.s{s}.bin").read_bytes() for s in range(int(schedules))]
            if any(r != runs[0] for r in runs[1:]):
                raise KernelFault(f"{self.name}: input `{self.input_names[i]}`, written in place, "
                                  "differs between schedule A and schedule B: a race")
            if i in back:
                # The write in place, into x's own buffer (what the GPU does).
                addr, length = back[i]
                ctypes.memmove(addr, runs[0], length)
        results = []
        for j, ((npt, count), shape, dt) in enumerate(zip(out_np, shapes, dtypes)):
            runs = [np.fromfile(tmp / f"out{j}.s{s}.bin", dtype=np.uint8)
                    for s in range(int(schedules))]
            data = self._check_output(j, runs, npt, count, shape, init_value is not None)
            results.append(_from_numpy(data.reshape(shape), dt))
        return results

    def _workspace(self, j) -> bool:
        """Output ``j`` is a workspace (named ``ws``): intermediates in aligned
        segments whose padding may stay unwritten."""
        return self.output_names[j] == "ws"

    def _check_output(self, j, runs, npt, count, shape, initialised):
        name = self.output_names[j]
        nbytes = count * npt.itemsize
        workspace = self._workspace(j) and not initialised
        views = []
        for s, raw in enumerate(runs):
            poison = POISON_OUT[0] if workspace else POISON_OUT[s % 2]
            for side, guard in (("before the start", raw[:GUARD_BYTES]),
                                ("past the end", raw[GUARD_BYTES + nbytes:])):
                bad = np.flatnonzero(guard != poison)
                if bad.size:
                    off = (bad[0] - GUARD_BYTES if side.startswith("before") else bad[0])
                    raise KernelFault(f"{self.name} wrote {side} of output `{name}` (byte "
                                      f"offset {off} from the {'start' if off < 0 else 'end'})")
            views.append(raw[GUARD_BYTES:GUARD_BYTES + nbytes])
        # A workspace may keep padding unwritten; it starts as the same poison in
        # every schedule, so its padding compares equal and a written byte that
        # differs between schedules is still a race. Its bounds still hold.
        if not initialised and count and not workspace:
            unwritten = np.ones(count, dtype=bool)
            for s, v in enumerate(views):
                elems = v.reshape(count, npt.itemsize)
                unwritten &= (elems == POISON_OUT[s % 2]).all(axis=1)
            if unwritten.any():
                first = np.unravel_index(int(np.flatnonzero(unwritten)[0]), shape)
                raise KernelFault(f"{self.name} never wrote {int(unwritten.sum())} of {count} "
                                  f"elements of output `{name}`{list(shape)}, first at "
                                  f"{tuple(int(i) for i in first)}")
        for s in range(1, len(views)):
            diff = views[0].reshape(count, npt.itemsize) != views[s].reshape(count, npt.itemsize)
            bad = np.flatnonzero(diff.any(axis=1)) if count else np.array([], dtype=np.int64)
            if bad.size:
                first = np.unravel_index(int(bad[0]), shape)
                raise KernelFault(
                    f"{self.name}: output `{name}` differs between schedule A (reverse block "
                    f"and thread order, eager cp.async) and schedule B (forward, deferred "
                    f"cp.async) at {bad.size} of {count} elements, first at "
                    f"{tuple(int(i) for i in first)}: a race (missing __syncthreads / wait, a "
                    "buffer reused too early), a read of unwritten shared memory, or a "
                    "dependence on block order")
        return views[0].view(npt).copy()


def _trim_report(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines()
             if "WARNING: ASan doesn't fully support makecontext" not in ln]
    text = "\n".join(lines)
    return text if len(text) < 8000 else text[:4000] + "\n...\n" + text[-4000:]


def emulated_cuda_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                         source: str, header: str = "", ensure_row_contiguous: bool = True,
                         shared_memory: int = 0) -> EmulatedCudaKernel:
    """``mx.fast.cuda_kernel`` on the CPU emulator (same arguments)."""
    return EmulatedCudaKernel(name, input_names, output_names, source, header,
                              ensure_row_contiguous, shared_memory)


def build_kernel(op: str, backend: str = "cuda", *, source: Optional[str] = None,
                 header: Optional[str] = None, **options: Any) -> EmulatedCudaKernel:
    """Drop-in for ``qwen_apple_backend.ops.device.build_kernel`` on the emulator.

    Args:
        op (str): manifest key.
        backend (str): must be ``"cuda"``.
        source (str | None): a kernel body to use instead of the manifest's
            (e.g. a deliberately broken copy).
        header (str | None): header text instead of the manifest's header files.
        **options: ``shared_memory``, ``ensure_row_contiguous`` as for MLX.

    Returns:
        EmulatedCudaKernel: built whether or not the manifest marks it verified.
    """
    if backend != "cuda":
        raise ValueError(f"the emulator runs CUDA kernels, not {backend!r}")
    src = kernel_source(op, "cuda")
    if src is None:
        raise KeyError(f"{op} has no CUDA source in kernels/MANIFEST.toml")
    files = manifest()[op]["cuda"]
    if header is None:
        header_files = [(f"kernels/{h}", (kernel_dir() / h).read_text(encoding="utf-8"))
                        for h in files.get("header", [])]
    else:
        header_files = [("<header>", header)] if header else []
    body_file = f"kernels/{files['body']}" if source is None else f"<{op} source=>"
    return EmulatedCudaKernel(
        src.name, src.inputs, src.outputs, src.body if source is None else source,
        src.header if header is None else header,
        options.get("ensure_row_contiguous", True), options.get("shared_memory", 0),
        header_files=header_files, body_file=body_file, writes=src.writes)


def run_cuda_kernel(op: str, *, inputs, template, grid, threadgroup, output_shapes,
                    output_dtypes, init_value=None, source: Optional[str] = None,
                    header: Optional[str] = None, shared_memory: int = 0,
                    schedules: Optional[int] = None) -> list:
    """Build (cached) and run the manifest kernel ``op`` once on the emulator.

    Arguments as ``mx.fast.cuda_kernel`` and its kernel call (``grid`` in
    threads); ``source`` / ``header`` replace the manifest's body / header.

    Returns:
        list[mx.array]: the outputs.

    Raises:
        KernelFault: sanitizer or emulator report, unwritten output elements,
            writes out of bounds, or runs that disagree.
        KernelCompileError: the kernel did not compile.
        NotEmulated: inline PTX or a dtype the emulation lacks.
    """
    kernel = build_kernel(op, source=source, header=header, shared_memory=shared_memory)
    return kernel(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                  output_shapes=output_shapes, output_dtypes=output_dtypes,
                  init_value=init_value, schedules=schedules)
