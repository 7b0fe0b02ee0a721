// Helpers shared by this package's CUDA kernel bodies.

__device__ __forceinline__ float qab_warp_sum(float x) {
  // Butterfly reduction: every lane ends with the warp's sum.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}
