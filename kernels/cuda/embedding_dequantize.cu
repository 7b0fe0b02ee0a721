// Decode: a quantized token embedding's rows for a few token ids, dequantized,
// in one launch, for MLX's mx.fast.cuda_kernel. Per token row n and element k:
//
//   out[n, k] = scale * T(q) + bias,  q = bits of w[ids[n], k / (32 / BITS)]
//   scale, bias = scales[ids[n], k / G], biases[ids[n], k / G]
//
// which is what mlx-lm's QuantizedEmbedding runs as three gathers (the packed
// row, its scales, its biases) and a dequantize: four launches. The
// arithmetic is MLX's affine dequantize kernel's (mlx/backend/cuda/quantized/
// affine_quantize.cu: `scale * static_cast<T>(d) + bias` in T), so the values
// are bit-identical where the compiler treats the expression alike; the
// dispatcher's self-check compares them exactly before the kernel is used.
// An id in [-V, 0) reads row id + V, as MLX's gather wraps it; beyond that
// it is clamped to [0, V - 1] (no read outside w).
//
// One thread per packed uint32 word of a row (its 32 / BITS outputs are
// adjacent: a warp writes one contiguous run), BLOCK threads per block,
// grid.y the token rows.
//
// Launch: grid (BLOCK * ceil(D BITS / 32 / BLOCK), N, 1) threads, threadgroup
// (BLOCK, 1, 1).
// Template: T (scales, biases, out), IdT (the ids' dtype: part of the kernel's
// key only), BITS (4 or 8), G (group size, a multiple of 32 / BITS), D (the
// embedding width, a multiple of G), V (rows), BLOCK.
// Inputs: ids [N] IdT (int32 / uint32); w [V, D BITS / 32] uint32; scales,
// biases [V, D / G] T.
// Outputs: out [N, D] T.

constexpr int PER = 32 / BITS;       // values per uint32 word
constexpr int WPR = D / PER;         // words per row
constexpr int GPR = D / G;           // groups per row
constexpr unsigned int MASK = (1u << BITS) - 1u;
static_assert(BITS == 4 || BITS == 8, "embedding_dequantize: 4 or 8 bits");
static_assert(G % PER == 0 && D % G == 0, "embedding_dequantize: G % (32 / BITS), D % G");

const int n = blockIdx.y;
const int j = blockIdx.x * BLOCK + threadIdx.x;  // word of the row
if (j < WPR) {
  long long id = static_cast<long long>(ids[n]);
  id = id < 0 ? id + V : id;
  id = id < 0 ? 0 : (id >= V ? V - 1 : id);
  const size_t row = static_cast<size_t>(id);
  const unsigned int val = w[row * WPR + j];
  const size_t gi = row * GPR + (size_t)(j * PER) / G;
  const T scale = scales[gi];
  const T bias = biases[gi];
  T o[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const unsigned char d = static_cast<unsigned char>((val >> (BITS * i)) & MASK);
    o[i] = scale * static_cast<T>(d) + bias;
  }
  T* dst = out + (size_t)n * D + (size_t)j * PER;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    dst[i] = o[i];
  }
}
