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

// The pass itself is gqa_lanes.cuh's qab_lanes_block (shared with gqa_decode_step.cu).
constexpr int EPL = D / 32;                  // o elements per lane
constexpr int KPS = 32 / LPK;                // keys per warp step
constexpr int SMF = qab_lanes_smem_floats<InT, D, G, WARPS>();  // floats
static_assert(BLOCK % KPS == 0, "BLOCK must be a multiple of 32 / LPK");
static_assert(SMF * 4 + 2 * WARPS * G * 4 <= 48 * 1024, "static shared memory over 48 KB");
// Query rows (scaled, float32) as float4 [G][Q4][NP]: then the slots of the merge.
__shared__ __align__(16) float sm[SMF];
__shared__ float sm_m[WARPS * G];
__shared__ float sm_l[WARPS * G];
const int lane = threadIdx.x & 31;
const int w = threadIdx.x >> 5;
const int j = blockIdx.x;
const int h = blockIdx.y;
const int b = blockIdx.z;
const int S = k_shape[2];
const int NB = (S + BLOCK - 1) / BLOCK;
const float qscale = scale[0] * 1.4426950408889634f;  // log2(e)
for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
  const int g = i / D, d = i - g * D;
  sm[qab_lanes_q_at<InT, D>(g, d)] =
      static_cast<float>(q[(int64_t)b * q_strides[0] + (int64_t)(h * G + g) * q_strides[1] +
                           (int64_t)d * q_strides[3]]) * qscale;
}
__syncthreads();
const int s0 = j * BLOCK;
const int s1 = min(s0 + BLOCK, S);

const bool* mp = mask;
int64_t ms = 0;
if (HAS_MASK) {
  mp = mask + (mask_shape[0] == 1 ? 0 : (int64_t)b * mask_strides[0]);
  ms = mask_strides[mask_ndim - 1];
}

float m[G], l[G], o[G][EPL];
qab_lanes_block<InT, D, G, LPK, WARPS, HAS_MASK>(
    sm, sm_m, sm_l, k + (int64_t)b * k_strides[0] + (int64_t)h * k_strides[1], k_strides[2],
    k_strides[3], v + (int64_t)b * v_strides[0] + (int64_t)h * v_strides[1], v_strides[2],
    v_strides[3], mp, ms, s0, s1, m, l, o);
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
