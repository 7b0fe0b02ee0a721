// Split-K decode attention, first pass for short and medium contexts
// (flash-decoding with GQA packing, as gqa_decode_partial.cu, which stays the
// long-context build): one query token against one block of BLOCK cached keys
// for the G = Hq / Hk query heads that share a KV head, each K and V row read
// once for all G heads. Per (b, KV head h, key block j), with q_g the g-th
// query head of h and s over the block's keys that the mask allows:
//   m_g = max_s score(g, s),  l_g = sum_s exp(score - m_g),
//   o_g = sum_s exp(score - m_g) v_s,   score(g, s) = q_g . k_s * scale
// written unnormalised in float32 (scores in log2 units: exp2 of
// score * log2(e)): the partials of gqa_decode_partial.cu, so
// gqa_decode_combine.cu merges the blocks unchanged. A block with no allowed
// key writes m = -inf, l = 0, o = 0.
//
// Why another build: with one lane per key (gqa_decode_partial.cu) a warp
// needs 32 keys, so a 4K cache gives about one warp per SM, each reading its
// K rows 8 pieces at a time: latency-bound. Here LPK lanes share a key, so a
// warp takes KPS = 32 / LPK keys per step, and WARPS warps of one thread block
// share its key block, whose partials they merge in shared memory: the block
// writes ONE partial per (b, query head), so the second pass still reads few.
//
// One thread block per (b, h, j), WARPS warps; warp w takes the steps
// w, w + WARPS, ... of KPS keys (lane group k = lane / LPK takes key k of a
// step, r = lane % LPK its lane in the group). A step issues all its loads
// before any math: the group's K row as KP = D / (CH * LPK) 16-byte pieces per
// lane (pieces r, r + LPK, ...: a group reads 16 * LPK contiguous bytes per
// load) and the step's KPS V rows (lane i holds the D / 32 elements
// i * D / 32 .. of every row: one coalesced row per load), plus the mask byte.
// * scores: each lane dots its pieces with the G query rows (scaled, float32,
//   in shared memory, laid out so a group's LPK lanes read LPK consecutive
//   float4: no bank conflict, the KPS groups read the same addresses), then an
//   xor-shuffle tree over the group's LPK lanes: every lane of the group holds
//   the key's G scores (the same bits in every lane: each tree step adds the
//   same two numbers);
// * online softmax per head over the step: max over the KPS groups by xor
//   shuffles, p = exp2(score - max) (0 for a masked key or one past the
//   block), l summed per lane (the group's own key), o rescaled;
// * p v: lane i adds p(key u, g) * v_u[i * D / 32 ..] for the step's KPS keys,
//   p(u, g) broadcast from lane u * LPK by shuffles.
// At the end of its steps a warp sums l over its groups; the block then merges
// its WARPS (m, l, o) in shared memory: the block's max per head M, each
// warp's l and o scaled by exp2(m - M), then summed in a tree (WARPS / 2
// slots of G x D floats, which reuse the query rows' memory) into warp 0,
// which writes the partial. A warp without allowed keys (or without keys)
// takes part with m = -inf, l = 0, o = 0.
// q, K, V and the mask are read through their strides (the KV cache's views
// are not contiguous over heads; the compiled decode step's mask is one row
// of keys, [1, 1, 1, S], for every batch row); vector loads need the last
// axis contiguous and rows aligned, else scalar loads run.
//
// Registers (nvcc -Xptxas -v, sm_90, no spills): 214 per thread at the model's
// build (bf16, D = 256, G = 8, LPK = 8, WARPS = 8, mask on; the lane-per-key
// pass: 215), so one thread block of 8 warps per SM; 222 in float32 at D = 256,
// 196 at G = 16, D = 128. Static shared memory 4 * max(G * D, WARPS / 2 * G * D)
// + 8 * WARPS * G bytes (33 KB at the model's build).
//
// Launch: grid (32 * WARPS * NB, Hk, B) threads, threadgroup (32 * WARPS, 1,
// 1), NB = ceil(S / BLOCK), BLOCK a multiple of KPS. Inputs: q [B, Hq, 1, D],
// k, v [B, Hk, S, D] (InT, any strides), mask [B or 1, ..., S] bool (its
// first and last axes read, only if HAS_MASK), scale [4] float32 (element 0
// read). Outputs: o_part [B, Hq, NB, D], ml [B, Hq, NB, 2] float32.
// Requires D % 32 == 0, D <= 256, D a multiple of CH * LPK (CH = 16 /
// sizeof(InT) elements per 16-byte piece), LPK in {2, 4, 8, 16, 32}, WARPS in
// {1, 2, 4, 8, 16}, G <= 16, the shared memory above <= 48 KB.

constexpr int EPL = D / 32;                  // o elements per lane
constexpr int CH = 16 / sizeof(InT);         // K elements per 16-byte piece
constexpr int NP = D / CH;                   // K pieces per row
constexpr int KP = NP / LPK;                 // K pieces per lane
constexpr int KPS = 32 / LPK;                // keys per warp step
constexpr int Q4 = CH / 4;                   // float4 of q per piece
constexpr int NSLOT = WARPS > 1 ? WARPS / 2 : 1;
constexpr int SMF = NSLOT * G * D > G * D ? NSLOT * G * D : G * D;  // floats
static_assert(D % 32 == 0 && EPL <= 8, "D must be a multiple of 32, at most 256");
static_assert(LPK == 2 || LPK == 4 || LPK == 8 || LPK == 16 || LPK == 32,
              "LPK must be 2, 4, 8, 16 or 32");
static_assert(NP % LPK == 0, "D must be a multiple of CH * LPK");
static_assert(WARPS == 1 || WARPS == 2 || WARPS == 4 || WARPS == 8 || WARPS == 16,
              "WARPS must be 1, 2, 4, 8 or 16");
static_assert(BLOCK % KPS == 0, "BLOCK must be a multiple of 32 / LPK");
static_assert(G >= 1 && G <= 16, "at most 16 query heads per KV head");
static_assert(SMF * 4 + 2 * WARPS * G * 4 <= 48 * 1024, "static shared memory over 48 KB");
// Query rows (scaled, float32) as float4 [G][Q4][NP]: then the slots of the merge.
__shared__ __align__(16) float sm[SMF];
__shared__ float sm_m[WARPS * G];
__shared__ float sm_l[WARPS * G];
float4* qs4 = reinterpret_cast<float4*>(sm);
const int lane = threadIdx.x & 31;
const int w = threadIdx.x >> 5;
const int grp = lane / LPK;
const int r = lane % LPK;
const int j = blockIdx.x;
const int h = blockIdx.y;
const int b = blockIdx.z;
const int S = k_shape[2];
const int NB = (S + BLOCK - 1) / BLOCK;
const float qscale = scale[0] * 1.4426950408889634f;  // log2(e)
for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
  const int g = i / D, d = i - g * D;
  const int p = d / CH, e = d - p * CH;
  sm[((g * Q4 + e / 4) * NP + p) * 4 + (e & 3)] =
      static_cast<float>(q[(int64_t)b * q_strides[0] + (int64_t)(h * G + g) * q_strides[1] +
                           (int64_t)d * q_strides[3]]) * qscale;
}
__syncthreads();
const int s0 = j * BLOCK;
const int s1 = min(s0 + BLOCK, S);

const InT* kb = k + (int64_t)b * k_strides[0] + (int64_t)h * k_strides[1] +
                (int64_t)r * CH * k_strides[3];
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

for (int t0 = s0 + w * KPS; t0 < s1; t0 += WARPS * KPS) {
  // Loads, all before any math: this group's K row, the step's V rows, the
  // mask byte. (Two steps' loads at once held more registers than a thread
  // has at the model's build: spills.)
  const int s = min(t0 + grp, s1 - 1);  // always a row of this block
  const InT* kr = kb + (int64_t)s * ks;
  QabVec<InT, CH> kc[KP];
#pragma unroll
  for (int c = 0; c < KP; ++c) {
    kc[c] = qab_load_vec<InT, CH>(kr + (int64_t)c * LPK * CH * kd, kd, kvec);
  }
  QabVec<InT, EPL> vr[KPS];
#pragma unroll
  for (int u = 0; u < KPS; ++u) {
    // A key past the block repeats the last row, with weight 0 (below).
    vr[u] = qab_load_vec<InT, EPL>(vp + (int64_t)min(t0 + u, s1 - 1) * vs, v_strides[3], vvec);
  }
  const bool ok = t0 + grp < s1 && (!HAS_MASK || mp[(int64_t)s * ms]);
  // Scores: this lane's pieces, then the group's tree.
  float kf[KP][CH];
#pragma unroll
  for (int c = 0; c < KP; ++c) {
#pragma unroll
    for (int e = 0; e < CH; ++e) kf[c][e] = static_cast<float>(kc[c].v[e]);
  }
  float acc[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    acc[g] = 0.f;
#pragma unroll
    for (int c = 0; c < KP; ++c) {
#pragma unroll
      for (int e4 = 0; e4 < Q4; ++e4) {
        const float4 qv = qs4[(g * Q4 + e4) * NP + c * LPK + r];
        acc[g] += qv.x * kf[c][4 * e4] + qv.y * kf[c][4 * e4 + 1] + qv.z * kf[c][4 * e4 + 2] +
                  qv.w * kf[c][4 * e4 + 3];
      }
    }
  }
#pragma unroll
  for (int x = 1; x < LPK; x <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], x);
  }
  // Online softmax over the step, per head.
  float p[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float sc = ok ? acc[g] : -INFINITY;
    float mt = sc;
#pragma unroll
    for (int x = LPK; x < 32; x <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, x));
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
  // p v over the step's keys.
#pragma unroll
  for (int u = 0; u < KPS; ++u) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float pg = __shfl_sync(0xffffffffu, p[g], u * LPK);
#pragma unroll
      for (int e = 0; e < EPL; ++e) o[g][e] += pg * static_cast<float>(vr[u].v[e]);
    }
  }
}
// l over the warp's groups (the LPK lanes of a group hold the same sums).
#pragma unroll
for (int g = 0; g < G; ++g) {
#pragma unroll
  for (int x = LPK; x < 32; x <<= 1) l[g] += __shfl_xor_sync(0xffffffffu, l[g], x);
}
if (WARPS > 1) {
  // The block's max per head; every warp scales its l and o to it.
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) sm_m[w * G + g] = m[g];
  }
  __syncthreads();  // also: every warp is past its scores (the slots reuse q's memory)
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float mb = -INFINITY;
    for (int i = 0; i < WARPS; ++i) mb = fmaxf(mb, sm_m[i * G + g]);
    const float c = m[g] == -INFINITY ? 0.f : exp2f(m[g] - mb);
    m[g] = mb;
    l[g] *= c;
#pragma unroll
    for (int e = 0; e < EPL; ++e) o[g][e] *= c;
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) sm_l[w * G + g] = l[g];
  }
  // Tree: warps n / 2 .. n - 1 hand their o to warps 0 .. n / 2 - 1 (element
  // e of lane i at slot word e * 32 + i of its head: no bank conflict).
#pragma unroll
  for (int n = WARPS; n > 1; n >>= 1) {
    const int half = n >> 1;
    if (w >= half && w < n) {
      float* slot = sm + (w - half) * (G * D);
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) slot[g * D + e * 32 + lane] = o[g][e];
      }
    }
    __syncthreads();
    if (w < half) {
      const float* slot = sm + w * (G * D);
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) o[g][e] += slot[g * D + e * 32 + lane];
      }
    }
    __syncthreads();
  }
  // The block's l: the warps' scaled sums in warp order.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float lb = 0.f;
    for (int i = 0; i < WARPS; ++i) lb += sm_l[i * G + g];
    l[g] = lb;
  }
}
if (w == 0) {
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
}
