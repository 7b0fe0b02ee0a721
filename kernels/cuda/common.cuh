// Helpers shared by this package's CUDA kernel bodies.

__device__ __forceinline__ float qab_warp_sum(float x) {
  // Butterfly reduction: every lane ends with the warp's sum.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

template <int W>
__device__ __forceinline__ float qab_group_sum(float x) {
  // Butterfly reduction over aligned groups of W lanes (W a power of two,
  // W <= 32); every lane of a group ends with the group's sum. The whole warp
  // must be converged.
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

__device__ __forceinline__ void qab_cp_async16(void* smem, const void* gmem) {
  // 16-byte asynchronous global -> shared copy (sm_80+), L2 only (.cg).
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void qab_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void qab_cp_async_wait() {
  // Wait until at most N committed groups of this thread are still in flight.
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
