// MoE router in one launch: per row of router logits, softmax over the E
// experts, the K largest probabilities and (NORM) their renormalisation.
// Same contract and algorithm as kernels/cuda/moe_router_topk.cu (read that
// file's comment), one SIMD group of 32 per row: MLX's precise softmax
// (float32 max and sum of fast::exp, probabilities rounded to InT); the K
// largest keys (rounded probability, expert index), so of equal
// probabilities the higher index is kept, written in ascending slot order as
// MLX's stable GPU sort leaves them; NORM sums the K scores in InT
// arithmetic (VEC slots per lane in order, then a butterfly) and divides in
// InT. The float32 softmax sum is added in the CUDA kernel's order, not in
// that of MLX's Metal softmax, so a probability may round differently in the
// last bit from the stock route on a Mac.
//
// Launch: grid (32 * NR, 1, 1) threads, threadgroup (128, 1, 1), with NR = N rounded up to a multiple of 4; warps past row N exit.
// Template: InT (float, bfloat16_t or half), E (<= 1024), K (1 <= K <=
// min(E, 32)), NORM (bool). Input: logits [..., E] InT, row-contiguous, N
// rows (the product of the leading axes). Outputs: inds [..., K] uint32 and
// scores [..., K] InT.
// This file cannot be compiled where the package is developed (no Apple GPU):
// on first use on a Metal device it is checked against the portable path and
// used only if it passes.

constexpr int VEC = 16 / int(sizeof(InT));
constexpr int NG = (E + 32 * VEC - 1) / (32 * VEC);
constexpr int PER = NG * VEC;
const float NEG_INF = as_type<float>(0xff800000u);
const float POS_INF = as_type<float>(0x7f800000u);
const float TAKEN = -2.0f;

int N = 1;
for (int d = 0; d + 1 < int(logits_ndim); ++d) {
  N *= int(logits_shape[d]);
}
const int row = int(thread_position_in_grid.x / 32);
const ushort lane = ushort(thread_index_in_simdgroup);
if (row >= N) {
  return;
}
const device InT* x = logits + size_t(row) * E;

float v[PER];
for (int g = 0; g < NG; ++g) {
  for (int j = 0; j < VEC; ++j) {
    const int e = VEC * (32 * g + int(lane)) + j;
    v[g * VEC + j] = e < E ? static_cast<float>(x[e]) : NEG_INF;
  }
}

float gmax[NG];
float gsum[NG];
for (int g = 0; g < NG; ++g) {
  float m = -3.402823466e+38f;
  for (int j = 0; j < VEC; ++j) {
    const float t = v[g * VEC + j];
    m = m > t ? m : t;
  }
  float s = 0.0f;
  for (int j = 0; j < VEC; ++j) {
    s = s + metal::fast::exp(v[g * VEC + j] - m);
  }
  float gm = m;
  for (ushort o = 16; o > 0; o >>= 1) {
    const float t = simd_shuffle_xor(gm, o);
    gm = gm > t ? gm : t;
  }
  s = s * metal::fast::exp(m - gm);
  for (ushort o = 16; o > 0; o >>= 1) {
    s = s + simd_shuffle_xor(s, o);
  }
  gmax[g] = gm;
  gsum[g] = s;
}
float rmax = gmax[0];
for (int g = 1; g < NG; ++g) {
  rmax = rmax > gmax[g] ? rmax : gmax[g];
}
float total = 0.0f;
for (int g = 0; g < NG; ++g) {
  if (int(lane) == g) {
    total = gsum[g] * metal::fast::exp(gmax[g] - rmax);
  }
}
for (ushort o = 16; o > 0; o >>= 1) {
  total = total + simd_shuffle_xor(total, o);
}
const float inv = 1.0f / total;

float key[PER];
for (int k = 0; k < PER; ++k) {
  const int e = VEC * (32 * (k / VEC) + int(lane)) + k % VEC;
  const float p = static_cast<float>(static_cast<InT>(metal::fast::exp(v[k] - rmax) * inv));
  key[k] = e < E ? (metal::isnan(p) ? POS_INF : p) : TAKEN;
}

float mine = 0.0f;
int mine_e = 0;
for (int r = 0; r < K; ++r) {
  float bv = -1.0f;
  int be = -1;
  for (int k = 0; k < PER; ++k) {
    const int e = VEC * (32 * (k / VEC) + int(lane)) + k % VEC;
    if (key[k] > bv || (key[k] == bv && e > be)) {
      bv = key[k];
      be = e;
    }
  }
  for (ushort o = 16; o > 0; o >>= 1) {
    const float ov = simd_shuffle_xor(bv, o);
    const int oe = simd_shuffle_xor(be, o);
    if (ov > bv || (ov == bv && oe > be)) {
      bv = ov;
      be = oe;
    }
  }
  if (int(lane) == r) {
    mine = bv == POS_INF ? as_type<float>(0x7fc00000u) : bv;
    mine_e = be;
  }
  for (int k = 0; k < PER; ++k) {
    const int e = VEC * (32 * (k / VEC) + int(lane)) + k % VEC;
    if (e == be) {
      key[k] = TAKEN;
    }
  }
}

InT score = static_cast<InT>(mine);
if (NORM) {
  InT part = static_cast<InT>(0.0f);
  for (int j = 0; j < VEC; ++j) {
    const int s = VEC * int(lane) + j;
    const ushort src = ushort(s < K ? K - 1 - s : 0);
    const float t = simd_shuffle(mine, src);
    if (s < K) {
      part = part + static_cast<InT>(t);
    }
  }
  for (ushort o = 16; o > 0; o >>= 1) {
    part = part + static_cast<InT>(simd_shuffle_xor(static_cast<float>(part), o));
  }
  score = score / part;
}
if (int(lane) < K) {
  const size_t at = size_t(row) * K + size_t(K - 1 - int(lane));
  inds[at] = static_cast<uint32_t>(mine_e);
  scores[at] = score;
}
