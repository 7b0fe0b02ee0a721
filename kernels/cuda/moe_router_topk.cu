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
//   puts NaN last). K rounds of a warp argmax. Slot order ascending by key
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

constexpr int VEC = 16 / int(sizeof(InT));
constexpr int NG = (E + 32 * VEC - 1) / (32 * VEC);  // 32-thread groups of MLX's softmax
constexpr int PER = NG * VEC;                       // elements per lane
static_assert(E >= 1 && E <= 1024, "moe_router_topk: 1 <= E <= 1024");
static_assert(K >= 1 && K <= E && K <= 32, "moe_router_topk: 1 <= K <= min(E, 32)");

const float NEG_INF = __uint_as_float(0xff800000u);
const float POS_INF = __uint_as_float(0x7f800000u);
const float TAKEN = -2.0f;  // below every probability and the empty-lane key -1

int N = 1;
for (int d = 0; d + 1 < logits_ndim; ++d) {
  N *= logits_shape[d];
}
const int row = int((blockIdx.x * blockDim.x + threadIdx.x) / 32);
const int lane = int(threadIdx.x & 31);
if (row >= N) {
  return;
}
const InT* x = logits + (size_t)row * E;

// Lane `lane` of group g holds experts VEC * (32 g + lane) + j, j < VEC.
float v[PER];
#pragma unroll
for (int g = 0; g < NG; ++g) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const int e = VEC * (32 * g + lane) + j;
    v[g * VEC + j] = e < E ? static_cast<float>(x[e]) : NEG_INF;
  }
}

// Softmax statistics, group by group (MLX: one 32-thread warp each).
float gmax[NG], gsum[NG];
#pragma unroll
for (int g = 0; g < NG; ++g) {
  float m = -3.402823466e+38f;  // MLX's finite_min start
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float t = v[g * VEC + j];
    m = m > t ? m : t;
  }
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    s = s + __expf(v[g * VEC + j] - m);
  }
  float gm = m;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float t = __shfl_xor_sync(0xffffffffu, gm, o);
    gm = gm > t ? gm : t;
  }
  s = s * __expf(m - gm);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s = s + __shfl_xor_sync(0xffffffffu, s, o);
  }
  gmax[g] = gm;
  gsum[g] = s;
}
float rmax = gmax[0];
#pragma unroll
for (int g = 1; g < NG; ++g) {
  rmax = rmax > gmax[g] ? rmax : gmax[g];
}
// The groups' sums, rescaled to the row max, added as MLX's second butterfly
// adds them: lane g holds group g's, the other lanes 0.
float total = 0.0f;
#pragma unroll
for (int g = 0; g < NG; ++g) {
  if (lane == g) {
    total = gsum[g] * __expf(gmax[g] - rmax);
  }
}
#pragma unroll
for (int o = 16; o > 0; o >>= 1) {
  total = total + __shfl_xor_sync(0xffffffffu, total, o);
}
const float inv = 1.0f / total;

// Rounded probabilities as selection keys (NaN ranks above every number).
float key[PER];
#pragma unroll
for (int k = 0; k < PER; ++k) {
  const int e = VEC * (32 * (k / VEC) + lane) + k % VEC;
  const float p = static_cast<float>(static_cast<InT>(__expf(v[k] - rmax) * inv));
  key[k] = e < E ? (p != p ? POS_INF : p) : TAKEN;
}

// K rounds of a warp argmax over (key, expert); round r finds the r-th
// largest, which lane r keeps (slot K - 1 - r).
float mine = 0.0f;
int mine_e = 0;
#pragma unroll 1
for (int r = 0; r < K; ++r) {
  float bv = -1.0f;
  int be = -1;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int e = VEC * (32 * (k / VEC) + lane) + k % VEC;
    if (key[k] > bv || (key[k] == bv && e > be)) {
      bv = key[k];
      be = e;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oe = __shfl_xor_sync(0xffffffffu, be, o);
    if (ov > bv || (ov == bv && oe > be)) {
      bv = ov;
      be = oe;
    }
  }
  if (lane == r) {
    mine = bv == POS_INF ? __uint_as_float(0x7fc00000u) : bv;  // NaN back
    mine_e = be;
  }
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int e = VEC * (32 * (k / VEC) + lane) + k % VEC;
    if (e == be) {
      key[k] = TAKEN;
    }
  }
}

InT score = static_cast<InT>(mine);
if (NORM) {
  // MLX's row sum of the K slots: thread t adds slots VEC t .. VEC t + VEC - 1
  // in order (slot s is held by lane K - 1 - s), then a butterfly.
  InT part = static_cast<InT>(0.0f);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const int s = VEC * lane + j;
    const int src = s < K ? K - 1 - s : 0;
    const float t = __shfl_sync(0xffffffffu, mine, src);
    if (s < K) {
      part = part + static_cast<InT>(t);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    part = part + static_cast<InT>(__shfl_xor_sync(0xffffffffu, static_cast<float>(part), o));
  }
  score = score / part;
}
if (lane < K) {
  const size_t at = (size_t)row * K + (K - 1 - lane);
  inds[at] = static_cast<uint32_t>(mine_e);
  scores[at] = score;
}
