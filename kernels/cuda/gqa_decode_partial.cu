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
// blocks of the same KV head) per thread block, which stage the G scaled
// query rows in shared memory once. A warp walks its block in tiles of 32
// keys:
// * scores: lane i takes key i of the tile and reads its whole K row in
//   16-byte pieces (8 in flight), each dotted with the G query rows
//   read from shared memory (the same address for every lane: a broadcast),
//   so no shuffle reduces a dot product;
// * online softmax per head over the tile: the tile's max by one warp
//   reduction, p = exp2(score - max) per lane (0 for a masked key or one
//   past the block), l summed per lane and reduced once at the end;
// * p v: lane i holds the D / 32 elements i * D / 32 .. of o for the G
//   heads; the tile's V rows are read VR = 8 at a time (coalesced, one 16-byte
//   vector per lane for bf16 at D = 256), each key's G weights broadcast from
//   its lane by shuffles.
// q, K, V and the mask are read through their strides (the KV cache's views
// are not contiguous over heads; the compiled decode step's mask is one row
// of keys, [1, 1, 1, S], for every batch row); vector loads need the last
// axis contiguous and rows aligned, else scalar loads run.
//
// Launch: grid (32 * WARPS * ceil(NB / WARPS), Hk, B) threads, threadgroup
// (32 * WARPS, 1, 1), NB = ceil(S / BLOCK), BLOCK a multiple of 32. Inputs:
// q [B, Hq, 1, D], k, v [B, Hk, S, D] (InT, any strides), mask [B or 1, ...,
// S] bool (its first and last axes read, only if HAS_MASK), scale [4]
// float32 (element 0 read). Outputs: o_part [B, Hq, NB, D], ml [B, Hq, NB, 2] float32.
// Requires D % 32 == 0, D <= 256, G <= 16.

constexpr int EPL = D / 32;                  // o elements per lane
constexpr int CH = 16 / sizeof(InT);         // K elements per 16-byte piece
constexpr int VR = 8;                        // V rows in flight (a divisor of 32)
static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
static_assert(BLOCK % 32 == 0, "BLOCK must be a multiple of 32");
static_assert(G * D <= 16 * 256, "at most 16 x 256 query values in shared memory");
__shared__ __align__(16) float qs[G * D];
const int lane = threadIdx.x & 31;
const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
const int h = blockIdx.y;
const int b = blockIdx.z;
const int S = k_shape[2];
const int NB = (S + BLOCK - 1) / BLOCK;
const float qscale = scale[0] * 1.4426950408889634f;  // log2(e)
for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
  const int g = i / D, d = i - g * D;
  qs[i] = static_cast<float>(q[(int64_t)b * q_strides[0] + (int64_t)(h * G + g) * q_strides[1] +
                               (int64_t)d * q_strides[3]]) * qscale;
}
__syncthreads();
if (j >= NB) {
  return;  // the last thread block's spare warps (no barrier after this)
}
const int s0 = j * BLOCK;
const int s1 = min(s0 + BLOCK, S);

const InT* kb = k + (int64_t)b * k_strides[0] + (int64_t)h * k_strides[1];
const InT* vp = v + (int64_t)b * v_strides[0] + (int64_t)h * v_strides[1] +
                (int64_t)lane * EPL * v_strides[3];
const int64_t ks = k_strides[2], kd = k_strides[3], vs = v_strides[2];
constexpr int VA = alignof(QabVec<InT, EPL>) / sizeof(InT);  // elements per alignment unit
const bool kvec = kd == 1 && ks % CH == 0 && qab_vec_aligned<InT, CH>(kb);
const bool vvec = v_strides[3] == 1 && vs % VA == 0 && qab_vec_aligned<InT, EPL>(vp);
const bool* mp = mask;
int64_t ms = 0;
if (HAS_MASK) {
  mp = mask + (mask_shape[0] == 1 ? 0 : (int64_t)b * mask_strides[0]);
  ms = mask_strides[mask_ndim - 1];
}

float m[G], l[G], o[G][EPL];
#pragma unroll
for (int g = 0; g < G; ++g) {
  m[g] = -INFINITY;
  l[g] = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) o[g][e] = 0.f;
}

for (int t0 = s0; t0 < s1; t0 += 32) {
  // Scores: this lane's key of the tile.
  const int s = min(t0 + lane, s1 - 1);  // always a row of this block
  const bool ok = t0 + lane < s1 && (!HAS_MASK || mp[(int64_t)s * ms]);
  const InT* kr = kb + (int64_t)s * ks;
  float acc[G];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g] = 0.f;
#pragma unroll 8
  for (int c = 0; c < D; c += CH) {
    const QabVec<InT, CH> kc = qab_load_vec<InT, CH>(kr + (int64_t)c * kd, kd, kvec);
    float kf[CH];
#pragma unroll
    for (int e = 0; e < CH; ++e) kf[e] = static_cast<float>(kc.v[e]);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float4* q4 = reinterpret_cast<const float4*>(qs + g * D + c);
#pragma unroll
      for (int e4 = 0; e4 < CH / 4; ++e4) {
        const float4 qv = q4[e4];  // the same address for every lane
        acc[g] += qv.x * kf[4 * e4] + qv.y * kf[4 * e4 + 1] + qv.z * kf[4 * e4 + 2] +
                  qv.w * kf[4 * e4 + 3];
      }
    }
  }
  // Online softmax over the tile, per head.
  float p[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float sc = ok ? acc[g] : -INFINITY;
    float mt = sc;
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, w));
    const float mn = fmaxf(m[g], mt);
    if (mn == -INFINITY) {
      p[g] = 0.f;  // nothing allowed so far (warp-uniform)
      continue;
    }
    const float corr = exp2f(m[g] - mn);  // 0 while m is still -inf
    m[g] = mn;
    p[g] = exp2f(sc - mn);  // 0 for a masked key
    l[g] = l[g] * corr + p[g];
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[g][e] *= corr;
  }
  // p v over the tile's keys, VR rows in flight.
  const int n = min(32, s1 - t0);
  for (int tt = 0; tt < n; tt += VR) {
    QabVec<InT, EPL> vr[VR];
#pragma unroll
    for (int u = 0; u < VR; ++u) {
      vr[u] = qab_load_vec<InT, EPL>(vp + (int64_t)min(t0 + tt + u, s1 - 1) * vs,
                                     v_strides[3], vvec);
    }
#pragma unroll
    for (int u = 0; u < VR; ++u) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        // A key past the block repeats the last row with the weight of a
        // lane past n: 0 (ok was false there).
        const float pg = __shfl_sync(0xffffffffu, p[g], (tt + u) & 31);
#pragma unroll
        for (int e = 0; e < EPL; ++e) o[g][e] += pg * static_cast<float>(vr[u].v[e]);
      }
    }
  }
}
#pragma unroll
for (int g = 0; g < G; ++g) {
  const float lg = qab_warp_sum(l[g]);
  const int64_t row = ((int64_t)b * (gridDim.y * G) + h * G + g) * NB + j;
#pragma unroll
  for (int e = 0; e < EPL; ++e) o_part[row * D + lane * EPL + e] = o[g][e];
  if (lane == 0) {
    ml[row * 2] = m[g];
    ml[row * 2 + 1] = lg;
  }
}
