// MoE router in one launch: per row of router logits, softmax over the E
// experts, the K largest probabilities, and (NORM) their renormalisation.
// It computes what the stock route computes with MLX's CUDA kernels:
//
//   gates  = softmax(logits, precise=True)             (float32, rounded to InT)
//   inds   = argpartition(gates, -K)[..., -K:]           (a stable sort on the GPU)
//   scores = take_along_axis(gates, inds)
//   scores = scores / scores.sum(-1, keepdims=True)      (NORM; InT arithmetic)
//
// One warp per row, with MLX's own arithmetic at each step (as read from
// MLX 0.32's CUDA softmax, sort and row-reduction kernels), so that the
// experts, their slot order and (for bf16 / fp16) the scores come out
// bit-identical to the stock route on the same GPU wherever the two
// compilations round alike (tests/test_kernels_gpu.py measures it):
//
// * softmax as MLX's CUDA softmax kernel computes it: thread i of its block
//   reads the VEC = 16 / sizeof(InT) elements [VEC i, VEC i + VEC) (here lane
//   l of group w holds those of i = 32 w + l), keeps its own max and a
//   running sum of __expf(x - max); each 32-thread group combines them by a
//   butterfly (max, then the sums rescaled to the group's max), the groups'
//   sums are rescaled to the row's max and added by a butterfly over groups;
//   p = __expf(x - max) * (1 / sum), rounded to InT. Selection and scores use
//   these rounded probabilities.
// * top-K as the last K of a stable ascending sort: the K largest keys
//   (p, expert index), compared lexicographically, so of equal probabilities
//   the HIGHER expert index is kept; NaN ranks above every number (MLX's sort
//   puts NaN last; a +inf probability, which softmax cannot give, ranks with
//   NaN and comes back as NaN). K rounds of a warp argmax; in half precision each key
//   is one uint32, (probability bits << 16 | expert) + 1, whose unsigned
//   order is that order, so a round is a lane max and one redux.sync warp
//   max (__reduce_max_sync) instead of five shuffle pairs (the fused route,
//   moe_add_norm_route: 10.9 -> 9.1 us per launch on the H200, ncu). Slot order ascending by key
//   (slot K - 1 holds the largest probability), as argpartition returns them.
// * NORM: the sum of the K scores as MLX's row reduction adds them: thread t
//   sums slots [VEC t, VEC t + VEC) in order in InT arithmetic (every add
//   rounded to InT), a butterfly adds the threads' sums (in InT); then
//   score = p / sum, an InT division (correctly rounded for bf16 / fp16).
//   (float32: MLX reduces one row of a single-token call 8 slots per thread,
//   so its sum may differ in the last bit; no rounding to a narrower type.)
//   A float32 sum rounded once (what MLX's CPU reduction does) is another
//   value in 23-34 % of rows at E = 256, K = 8 in bf16 and fp16 (random
//   logits of scale 1-4).
//
// Launch: grid (32 * NR, 1, 1) threads, threadgroup (128, 1, 1), with NR = N rounded up to a multiple of 4; warps past row N exit.
// Template: InT (logits dtype: float, bfloat16 or float16), E (experts,
// <= 1024), K (1 <= K <= min(E, 32)), NORM (bool).
// Input: logits [..., E] InT, row-contiguous, N rows (the product of the
// leading axes: decode passes [B, 1, E] as the gate projection made it, with no
// reshape). Outputs: inds [..., K] uint32 and scores [..., K] InT.
// Header: moe_route_row.cuh (the per-row route, shared with moe_add_norm_route.cu).

int N = 1;
for (int d = 0; d + 1 < logits_ndim; ++d) {
  N *= logits_shape[d];
}
const int row = int((blockIdx.x * blockDim.x + threadIdx.x) / 32);
const int lane = int(threadIdx.x & 31);
if (row >= N) {
  return;
}
qab_route_row<InT, E, K, NORM>(logits + (size_t)row * E, lane, inds + (size_t)row * K,
                               scores + (size_t)row * K);
