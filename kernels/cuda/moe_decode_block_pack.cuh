// Included last by the ops moe_decode_block_pack and moe_decode_block_gdn_pack
// (kernels/MANIFEST.toml): builds moe_decode_block.cu with the router's, the
// shared expert's and the routed experts' arrays as segments of one input pk
// (see that file), which only those ops' signatures have.
#define QAB_BLOCK_PACK 1
// The kernel MLX declares after the headers gets __launch_bounds__(256, 2):
// the packed GD build's addresses from pk took nvcc 13 (sm_90) 133 registers
// per thread without them, one block of 256 per SM instead of two; with them
// 128 and no spills (tests/test_kernels_compile.py). The block is always 256
// threads (ops.moe._decode_block_launch; static_assert in the body). Where
// the CUDA headers' __location__ is not defined (the CPU emulator), the
// declaration stays as it is.
#if defined(__location__)
#undef __global__
#define __global__ __location__(global) __launch_bounds__(256, 2)
#endif
