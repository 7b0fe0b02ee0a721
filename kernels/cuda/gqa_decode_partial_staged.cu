// Split-K decode attention, first pass, K staged in shared memory: the same
// contract, launch and outputs as gqa_decode_partial.cu (read that file's
// comment), for 2-byte InT (bf16 / f16) only, ONE warp per thread block.
// A CANDIDATE for long KV caches, used only with QAB_ENABLE=attn-staged.
//
// What differs: a warp's 32-key tile of K rows is copied into shared memory
// with cp.async, each instruction one coalesced 16-byte piece per lane (a
// 512-byte row per instruction at D = 256), the next tile's copy in flight
// while this tile's scores and p v run (double buffer). Rows are padded by
// 16 bytes so that lane i reading row i's pieces hits distinct banks. K rows
// that are not contiguous and 16-byte aligned are copied with plain strided
// loads instead (same tile layout). V rows are read from global memory as in
// gqa_decode_partial.cu (coalesced, 4 in flight).
//
// Launch: grid (32 * NB, Hk, B) threads, threadgroup (32, 1, 1). Inputs and
// outputs as gqa_decode_partial.cu. Requires sizeof(InT) == 2, D % 32 == 0,
// D <= 256, G * D <= 2048 (static shared memory: 2 tiles of 32 padded rows
// plus the G query rows).

constexpr int EPL = D / 32;                 // o elements per lane
constexpr int PIECE = 8;                    // elements per 16-byte piece
constexpr int PPR = D / PIECE;              // pieces per row
constexpr int RS = D + PIECE;               // padded row stride in elements
static_assert(sizeof(InT) == 2, "2-byte K/V only");
static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
static_assert(BLOCK % 32 == 0, "BLOCK must be a multiple of 32");
static_assert(G * D <= 2048, "at most 2048 query values in shared memory");
__shared__ __align__(16) float qs[G * D];
__shared__ __align__(16) InT kt[2][32 * RS];
const int lane = threadIdx.x;
const int j = blockIdx.x;
const int h = blockIdx.y;
const int b = blockIdx.z;
const int S = k_shape[2];
const int NB = (S + BLOCK - 1) / BLOCK;
const float qscale = scale[0] * 1.4426950408889634f;  // log2(e)
for (int i = lane; i < G * D; i += 32) {
  const int g = i / D, d = i - g * D;
  qs[i] = static_cast<float>(q[(int64_t)b * q_strides[0] + (int64_t)(h * G + g) * q_strides[1] +
                               (int64_t)d * q_strides[3]]) * qscale;
}
__syncwarp();
if (j >= NB) {
  return;
}
const int s0 = j * BLOCK;
const int s1 = min(s0 + BLOCK, S);

const InT* kb = k + (int64_t)b * k_strides[0] + (int64_t)h * k_strides[1];
const InT* vp = v + (int64_t)b * v_strides[0] + (int64_t)h * v_strides[1] +
                (int64_t)lane * EPL * v_strides[3];
const int64_t ks = k_strides[2], kd = k_strides[3], vs = v_strides[2];
constexpr int VA = alignof(QabVec<InT, EPL>) / sizeof(InT);
const bool kvec = kd == 1 && ks % PIECE == 0 && qab_vec_aligned<InT, PIECE>(kb);
const bool vvec = v_strides[3] == 1 && vs % VA == 0 && qab_vec_aligned<InT, EPL>(vp);
const bool* mp = mask;
int64_t ms = 0;
if (HAS_MASK) {
  mp = mask + (mask_shape[0] == 1 ? 0 : (int64_t)b * mask_strides[0]);
  ms = mask_strides[mask_ndim - 1];
}

// Copy the 32 K rows of the tile at t0 (rows past the block repeat the last).
auto fill = [&](int buf, int t0) {
  if (kvec) {
    for (int i = lane; i < 32 * PPR; i += 32) {
      const int r = i / PPR, c = i - r * PPR;
      const int s = min(t0 + r, s1 - 1);
      qab_cp_async16(&kt[buf][r * RS + c * PIECE], kb + (int64_t)s * ks + c * PIECE);
    }
  } else {
    for (int i = lane; i < 32 * D; i += 32) {
      const int r = i / D, d = i - r * D;
      const int s = min(t0 + r, s1 - 1);
      kt[buf][r * RS + d] = kb[(int64_t)s * ks + (int64_t)d * kd];
    }
  }
  qab_cp_async_commit();
};

float m[G], l[G], o[G][EPL];
#pragma unroll
for (int g = 0; g < G; ++g) {
  m[g] = -INFINITY;
  l[g] = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) o[g][e] = 0.f;
}

fill(0, s0);
int buf = 0;
for (int t0 = s0; t0 < s1; t0 += 32, buf ^= 1) {
  if (t0 + 32 < s1) {
    fill(buf ^ 1, t0 + 32);  // the next tile's copy, in flight during this one
    qab_cp_async_wait<1>();
  } else {
    qab_cp_async_wait<0>();
  }
  __syncwarp();  // every lane's pieces of this tile have landed
  // Scores: this lane's key of the tile, its row read from shared memory.
  const int s = min(t0 + lane, s1 - 1);
  const bool ok = t0 + lane < s1 && (!HAS_MASK || mp[(int64_t)s * ms]);
  const InT* kr = &kt[buf][lane * RS];
  float acc[G];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g] = 0.f;
#pragma unroll 4
  for (int c = 0; c < D; c += PIECE) {
    const QabVec<InT, PIECE> kc = *reinterpret_cast<const QabVec<InT, PIECE>*>(kr + c);
    float kf[PIECE];
#pragma unroll
    for (int e = 0; e < PIECE; ++e) kf[e] = static_cast<float>(kc.v[e]);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float4* q4 = reinterpret_cast<const float4*>(qs + g * D + c);
      const float4 qa = q4[0], qb = q4[1];  // the same address for every lane
      acc[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] +
                qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
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
    const float corr = exp2f(m[g] - mn);
    m[g] = mn;
    p[g] = exp2f(sc - mn);
    l[g] = l[g] * corr + p[g];
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[g][e] *= corr;
  }
  // p v over the tile's keys, 4 V rows in flight.
  const int n = min(32, s1 - t0);
  for (int tt = 0; tt < n; tt += 4) {
    QabVec<InT, EPL> vr[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      vr[u] = qab_load_vec<InT, EPL>(vp + (int64_t)min(t0 + tt + u, s1 - 1) * vs,
                                     v_strides[3], vvec);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pg = __shfl_sync(0xffffffffu, p[g], (tt + u) & 31);
#pragma unroll
        for (int e = 0; e < EPL; ++e) o[g][e] += pg * static_cast<float>(vr[u].v[e]);
      }
    }
  }
  __syncwarp();  // this tile's rows are read before the buffer is refilled
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
