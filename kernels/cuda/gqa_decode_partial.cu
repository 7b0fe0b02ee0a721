// Split-K decode attention, first pass (flash-decoding): one query token
// against one block of BLOCK cached keys, for the G = Hq / Hk query heads that
// share a KV head, so each K and V row is read once for all G heads (GQA
// packing). Per (b, KV head h, key block j), with q_g the g-th query head of h
// and s over the block's keys that the mask allows:
//   m_g = max_s score(g, s),  l_g = sum_s exp(score - m_g),
//   o_g = sum_s exp(score - m_g) v_s,   score(g, s) = q_g . k_s * scale
// written unnormalised in float32 (scores in log2 units: exp2 of
// score * log2(e)); gqa_decode_combine.cu merges the blocks. A block with no
// allowed key writes m = -inf, l = 0, o = 0.
//
// One warp per (b, h, j), WARPS = blockDim.x / 32 warps (consecutive key
// blocks) per thread block; lane i holds the D / 32 elements i * D / 32 .. of
// each row (q of the G heads in registers). The warp walks its keys U = 2 at
// a time, the next two keys' K and V rows loaded before the current ones are
// used (one 16-byte vector load per lane and row for bf16 at D = 256 when
// the rows are contiguous and aligned, strided scalar loads otherwise); G
// dot products per key are reduced by butterflies and folded into the
// online softmax. A masked key
// (or the padding key past the block's end) is loaded but weighs 0, so the
// loads never wait on the mask. q, K, V and the mask are read through their
// strides (the KV cache's views are not contiguous over heads; the compiled
// decode step's mask is one row of keys, [1, 1, 1, S], for every batch row).
//
// Launch: grid (32 * WARPS * ceil(NB / WARPS), Hk, B) threads, threadgroup
// (32 * WARPS, 1, 1), NB = ceil(S / BLOCK). Inputs: q [B, Hq, 1, D], k, v
// [B, Hk, S, D] (InT, any strides), mask [B or 1, ..., S] bool (its first and
// last axes read, only if HAS_MASK), scale [1] float32. Outputs: o_part
// [B, Hq, NB, D], ml [B, Hq, NB, 2] float32. Requires D % 32 == 0, D <= 256.

constexpr int EPL = D / 32;
constexpr int U = 2;
static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
const int lane = threadIdx.x & 31;
const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
const int h = blockIdx.y;
const int b = blockIdx.z;
const int S = k_shape[2];
const int NB = (S + BLOCK - 1) / BLOCK;
if (j >= NB) {
  return;  // the last thread block's spare warps (no barrier in this kernel)
}
const int s0 = j * BLOCK;
const int s1 = min(s0 + BLOCK, S);
const float qscale = scale[0] * 1.4426950408889634f;  // log2(e)

float qf[G][EPL];
#pragma unroll
for (int g = 0; g < G; ++g) {
  const int64_t qb = (int64_t)b * q_strides[0] + (int64_t)(h * G + g) * q_strides[1];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    qf[g][e] = static_cast<float>(q[qb + (int64_t)(lane * EPL + e) * q_strides[3]]) * qscale;
  }
}
float m[G], l[G], o[G][EPL];
#pragma unroll
for (int g = 0; g < G; ++g) {
  m[g] = -INFINITY;
  l[g] = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) o[g][e] = 0.f;
}
const InT* kp = k + (int64_t)b * k_strides[0] + (int64_t)h * k_strides[1] +
                (int64_t)lane * EPL * k_strides[3];
const InT* vp = v + (int64_t)b * v_strides[0] + (int64_t)h * v_strides[1] +
                (int64_t)lane * EPL * v_strides[3];
const int64_t ks = k_strides[2], vs = v_strides[2];
constexpr int VA = alignof(QabVec<InT, EPL>) / sizeof(InT);  // elements per alignment unit
const bool vec = k_strides[3] == 1 && v_strides[3] == 1 && ks % VA == 0 && vs % VA == 0 &&
                 qab_vec_aligned<InT, EPL>(kp) && qab_vec_aligned<InT, EPL>(vp);
const bool* mp = mask;
int64_t ms = 0;
if (HAS_MASK) {
  mp = mask + (mask_shape[0] == 1 ? 0 : (int64_t)b * mask_strides[0]);
  ms = mask_strides[mask_ndim - 1];
}

// Software pipelining: the next U keys' rows are loaded before the current
// ones are used, so a warp always has 4 rows' loads in flight.
QabVec<InT, EPL> kr[U], vr[U];
bool ok[U];
#pragma unroll
for (int u = 0; u < U; ++u) {
  const int t = min(s0 + u, s1 - 1);  // always a row of this block
  ok[u] = s0 + u < s1 && (!HAS_MASK || mp[(int64_t)t * ms]);
  kr[u] = qab_load_vec<InT, EPL>(kp + (int64_t)t * ks, k_strides[3], vec);
  vr[u] = qab_load_vec<InT, EPL>(vp + (int64_t)t * vs, v_strides[3], vec);
}
for (int s = s0; s < s1; s += U) {
  QabVec<InT, EPL> kn[U], vn[U];
  bool okn[U];
  const int sn = s + U;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = min(sn + u, s1 - 1);
    okn[u] = sn + u < s1 && (!HAS_MASK || mp[(int64_t)t * ms]);
    if (sn < s1) {  // warp-uniform
      kn[u] = qab_load_vec<InT, EPL>(kp + (int64_t)t * ks, k_strides[3], vec);
      vn[u] = qab_load_vec<InT, EPL>(vp + (int64_t)t * vs, v_strides[3], vec);
    } else {
      kn[u] = kr[u];  // past the block: never used
      vn[u] = vr[u];
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float d[U];
    float mn = m[g];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float acc = 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc += qf[g][e] * static_cast<float>(kr[u].v[e]);
      acc = qab_warp_sum(acc);  // every lane reduces, masked or not
      d[u] = ok[u] ? acc : -INFINITY;
      mn = fmaxf(mn, d[u]);
    }
    if (mn == -INFINITY) {
      continue;  // no allowed key so far (warp-uniform)
    }
    const float corr = exp2f(m[g] - mn);  // 0 while m is still -inf
    m[g] = mn;
    l[g] *= corr;
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[g][e] *= corr;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float p = exp2f(d[u] - mn);  // 0 for a masked key
      l[g] += p;
#pragma unroll
      for (int e = 0; e < EPL; ++e) o[g][e] += p * static_cast<float>(vr[u].v[e]);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    kr[u] = kn[u];
    vr[u] = vn[u];
    ok[u] = okn[u];
  }
}
#pragma unroll
for (int g = 0; g < G; ++g) {
  const int64_t row = ((int64_t)b * (gridDim.y * G) + h * G + g) * NB + j;
#pragma unroll
  for (int e = 0; e < EPL; ++e) o_part[row * D + lane * EPL + e] = o[g][e];
  if (lane == 0) {
    ml[row * 2] = m[g];
    ml[row * 2 + 1] = l[g];
  }
}
