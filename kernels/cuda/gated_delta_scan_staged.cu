// Gated delta rule, sequential over T, with the per-token inputs staged in
// shared memory, for MLX's mx.fast.cuda_kernel. Same recurrence and I/O
// contract as gated_delta_scan.cu (read that file's comment); built for
// prefill, where that kernel's per-step global loads (every state row's warp
// re-reads the same k_t, q_t) leave it waiting on L2 latency.
//
// A thread block owns ROWS = BLOCK / LPR consecutive value rows of one
// (batch row, value head); LPR lanes share one state row s (Dk floats), each
// lane keeping Dk / LPR of them in registers (element i * LPR + lane, so the
// shared-memory reads of k_t / q_t are conflict-free and broadcast across the
// rows of a warp). The tokens are processed in chunks of TC: the chunk's
// k, q arrive in shared memory by cp.async (double-buffered: chunk c + 1 is
// in flight while chunk c is computed), its v, g, beta, mask through
// registers. Each step's two dot products reduce over LPR lanes only.
// The state is read once and written once, float32 throughout.
//
// Launch: grid (BLOCK * Dv / ROWS, B * Hv, 1) threads, threadgroup (BLOCK, 1, 1),
// Dv % ROWS == 0, Dk % LPR == 0, Dk * sizeof(InT) % 16 == 0.
// Inputs: q, k [B, T, Hk, Dk] InT; v [B, T, Hv, Dv] InT; g, beta [B, T, Hv]
// float32; state_in [B, Hv, Dv, Dk] float32; mask [B, T] bool (read only when
// HAS_MASK). Outputs: y [B, T, Hv, Dv] InT; state_out [B, Hv, Dv, Dk] float32.

constexpr int ROWS = BLOCK / LPR;
constexpr int NPER = Dk / LPR;
constexpr int VEC = 16 / sizeof(InT);          // elements per 16-byte copy
constexpr int NSMALL = TC * ROWS + 3 * TC;     // v rows, g, beta, mask of a chunk
constexpr int SPT = (NSMALL + BLOCK - 1) / BLOCK;
__shared__ __align__(16) InT kq_s[2][2][TC * Dk];  // [buffer][k, q][token, Dk]
__shared__ float small_s[2][NSMALL];

const int tid = threadIdx.x;
const int lane = tid % LPR;
const int r = tid / LPR;
const int dv = blockIdx.x * ROWS + r;
const int bh = blockIdx.y;
const int b = bh / Hv;
const int hv = bh - b * Hv;
const int hk = hv / (Hv / Hk);
const int T = q_shape[1];
const int nchunks = (T + TC - 1) / TC;

const size_t row = ((size_t)bh * Dv + dv) * Dk;
float s[NPER];
#pragma unroll
for (int i = 0; i < NPER; ++i) {
  s[i] = state_in[row + i * LPR + lane];
}

auto issue_kq = [&](int c, int p) {
  const int t0 = c * TC;
  const int n = min(TC, T - t0);
  for (int idx = tid; idx < n * (Dk / VEC); idx += BLOCK) {
    const int tt = idx / (Dk / VEC);
    const int cv = idx - tt * (Dk / VEC);
    const size_t src = (((size_t)b * T + t0 + tt) * Hk + hk) * Dk + cv * VEC;
    qab_cp_async16(&kq_s[p][0][tt * Dk + cv * VEC], k + src);
    qab_cp_async16(&kq_s[p][1][tt * Dk + cv * VEC], q + src);
  }
  qab_cp_async_commit();
};
float small_r[SPT];
auto load_small = [&](int c) {
  const int t0 = c * TC;
#pragma unroll
  for (int i = 0; i < SPT; ++i) {
    const int idx = tid + i * BLOCK;
    float val = 0.f;
    if (idx < TC * ROWS) {
      const int tt = idx / ROWS, rr = idx - (idx / ROWS) * ROWS;
      if (t0 + tt < T) {
        val = static_cast<float>(
            v[(((size_t)b * T + t0 + tt) * Hv + hv) * Dv + blockIdx.x * ROWS + rr]);
      }
    } else if (idx < NSMALL) {
      const int j = idx - TC * ROWS;
      const int which = j / TC, tt = j - (j / TC) * TC;
      if (t0 + tt < T) {
        const size_t gb = ((size_t)b * T + t0 + tt) * Hv + hv;
        if (which == 0) {
          val = g[gb];
        } else if (which == 1) {
          val = beta[gb];
        } else {
          val = (!HAS_MASK || mask[(size_t)b * T + t0 + tt]) ? 1.f : 0.f;
        }
      }
    }
    small_r[i] = val;
  }
};
auto store_small = [&](int p) {
#pragma unroll
  for (int i = 0; i < SPT; ++i) {
    const int idx = tid + i * BLOCK;
    if (idx < NSMALL) {
      small_s[p][idx] = small_r[i];
    }
  }
};

if (nchunks > 0) {
  issue_kq(0, 0);
  load_small(0);
  store_small(0);
}
for (int c = 0; c < nchunks; ++c) {
  const int p = c & 1;
  const bool more = c + 1 < nchunks;
  if (more) {
    issue_kq(c + 1, p ^ 1);
    qab_cp_async_wait<1>();
  } else {
    qab_cp_async_wait<0>();
  }
  __syncthreads();  // chunk c's k, q, v, g, beta, mask visible to the block
  if (more) {
    load_small(c + 1);  // in flight during this chunk's steps
  }
  const InT* ks = kq_s[p][0];
  const InT* qs = kq_s[p][1];
  const float* sm = small_s[p];
  const int t0 = c * TC;
  const int n = min(TC, T - t0);
  for (int tt = 0; tt < n; ++tt) {
    const size_t yo = (((size_t)b * T + t0 + tt) * Hv + hv) * Dv + dv;
    if (sm[TC * ROWS + 2 * TC + tt] == 0.f) {  // masked: state kept, output 0
      if (lane == 0) {
        y[yo] = static_cast<InT>(0.f);
      }
      continue;
    }
    const float gc = sm[TC * ROWS + tt];
    const float bc = sm[TC * ROWS + TC + tt];
    const float vc = sm[tt * ROWS + r];
    float kc[NPER];
    float kv = 0.f;
#pragma unroll
    for (int i = 0; i < NPER; ++i) {
      kc[i] = static_cast<float>(ks[tt * Dk + i * LPR + lane]);
      s[i] *= gc;
      kv += s[i] * kc[i];
    }
    kv = qab_group_sum<LPR>(kv);
    const float delta = (vc - kv) * bc;
    float out = 0.f;
#pragma unroll
    for (int i = 0; i < NPER; ++i) {
      s[i] += kc[i] * delta;
      out += s[i] * static_cast<float>(qs[tt * Dk + i * LPR + lane]);
    }
    out = qab_group_sum<LPR>(out);
    if (lane == 0) {
      y[yo] = static_cast<InT>(out);
    }
  }
  __syncthreads();  // everyone is done with buffer p
  if (more) {
    store_small(p ^ 1);
  }
}
#pragma unroll
for (int i = 0; i < NPER; ++i) {
  state_out[row + i * LPR + lane] = s[i];
}
