// One decode token of a whole Gated DeltaNet layer, short of its projections,
// in one launch, for MLX's mx.fast.metal_kernel. Same contract and phases as
// kernels/cuda/gated_delta_decode.cu (read that file's comment): one
// threadgroup per (batch row, value head); conv + SiLU of the head's q, k, v
// channels into threadgroup memory (and the new conv state, each element
// written by one threadgroup); q/k l2norm and the gates; SIMD group w owns
// state rows dv = r * NW + w in registers (Dk / 32 floats per lane, element
// i * 32 + lane), simd_sum reductions; the gated RMSNorm over the head's Dv
// outputs. float32 sums, with every intermediate the ops path keeps in the
// input dtype rounded to InT at the same point (QAB_RND); threadgroup memory
// (2 Dk + 2 Dv) * 4 bytes (2 KB at Dk = Dv = 128, far below 32 KB).
//
// Launch: grid (BLOCK, B * Hv, 1) threads, threadgroup (BLOCK, 1, 1).
// Inputs: qkv [B, 2 Hk Dk + Hv Dv] InT (channels q | k | v); z [B, Hv * Dv] InT;
// (with PROJ_W > 0, qkv, z, b_proj and a_proj are one [B, PROJ_W] InT array,
// channels q | k | v | z | b | a);
// b_proj, a_proj [B, Hv] InT; conv_state [B, Kc - 1, conv_dim] InT; conv_w
// [conv_dim, Kc, 1] WT; conv_b [conv_dim] WT (read only when HAS_BIAS);
// A_log [Hv] float32; dt_bias [Hv] WT; norm_w [Dv] WT; norm_eps [4] float32 (element 0 read);
// state_in [B, Hv, Dv, Dk] float32; mask [B] bool (read only when HAS_MASK);
// lengths [B] int32 (read only when HAS_LENGTHS).
// Outputs: out [B, Hv, Dv] InT; conv_state_out [B, Kc - 1, conv_dim] InT;
// state_out [B, Hv, Dv, Dk] float32.
// This file cannot be compiled where the package is developed (no Apple GPU):
// on first use on a Metal device it is checked against the portable path and
// used only if it passes.

constexpr int NW = BLOCK / 32;
constexpr int RPW = (Dv + NW - 1) / NW;
constexpr int NPER = Dk / 32;
constexpr int KEY_DIM = Hk * Dk;
constexpr int CONV_DIM = 2 * KEY_DIM + Hv * Dv;
// Where the projections are read: PROJ_W = 0, four arrays; else qkv, z,
// b_proj and a_proj are one [B, PROJ_W] array, the concatenated input
// projection's row qkv | z | b | a (no split views to encode per token).
constexpr int QKV_ROW = PROJ_W ? PROJ_W : CONV_DIM;
constexpr int Z_ROW = PROJ_W ? PROJ_W : Hv * Dv;
constexpr int Z_OFF = PROJ_W ? CONV_DIM : 0;
constexpr int BA_ROW = PROJ_W ? PROJ_W : Hv;
constexpr int B_OFF = PROJ_W ? CONV_DIM + Hv * Dv : 0;
constexpr int A_OFF = PROJ_W ? CONV_DIM + Hv * Dv + Hv : 0;
constexpr int NCH = 2 * Dk + Dv;
constexpr float QK_EPS = 1e-6f;
threadgroup float conv_s[NCH];
threadgroup float y_s[Dv];

// The dispatcher passes these inputs in the template's dtypes.
const device WT* conv_w_t = conv_w;
const device WT* dt_bias_t = dt_bias;
const device WT* norm_w_t = norm_w;

// Round to the input dtype and back, where the ops path rounds (MSL has no
// lambdas; #undef at the end).
#define QAB_RND(v) static_cast<float>(static_cast<InT>(v))

const int tid = int(thread_position_in_threadgroup.x);
const int lane = int(thread_index_in_simdgroup);
const int warp = int(simdgroup_index_in_threadgroup);
const int bh = int(threadgroup_position_in_grid.y);
const int b = bh / Hv;
const int hv = bh - b * Hv;
const int hk = hv / (Hv / Hk);
const bool live = HAS_MASK ? static_cast<bool>(mask[b]) : true;
const bool shift = HAS_LENGTHS ? lengths[b] > 0 : true;

const size_t sbase = size_t(bh) * Dv * Dk;
float s[RPW][NPER];
for (int r = 0; r < RPW; ++r) {
  const int dv = r * NW + warp;
  for (int i = 0; i < NPER; ++i) {
    s[r][i] = dv < Dv ? state_in[sbase + size_t(dv) * Dk + i * 32 + lane] : 0.0f;
  }
}

// Phase 1: conv + SiLU of this threadgroup's channels; new conv state.
for (int c = tid; c < NCH; c += BLOCK) {
  int ch;
  bool owner;
  if (c < Dk) {
    ch = hk * Dk + c;
    owner = hv % (Hv / Hk) == 0;
  } else if (c < 2 * Dk) {
    ch = KEY_DIM + hk * Dk + (c - Dk);
    owner = hv % (Hv / Hk) == 0;
  } else {
    ch = 2 * KEY_DIM + hv * Dv + (c - 2 * Dk);
    owner = true;
  }
  float x[Kc];
  for (int j = 0; j < Kc - 1; ++j) {
    x[j] = static_cast<float>(conv_state[(size_t(b) * (Kc - 1) + j) * CONV_DIM + ch]);
  }
  x[Kc - 1] = live ? static_cast<float>(qkv[size_t(b) * QKV_ROW + ch]) : 0.0f;
  float acc = 0.0f;
  for (int j = 0; j < Kc; ++j) {
    acc += static_cast<float>(conv_w_t[size_t(ch) * Kc + j]) * x[j];
  }
  acc = QAB_RND(acc);
  if (HAS_BIAS) {
    acc = QAB_RND(acc + static_cast<float>(conv_b[ch]));
  }
  conv_s[c] = QAB_RND(acc * QAB_RND(1.0f / (1.0f + metal::exp(-acc))));  // SiLU
  if (owner) {
    const int from = shift ? 1 : 0;
    for (int j = 0; j < Kc - 1; ++j) {
      conv_state_out[(size_t(b) * (Kc - 1) + j) * CONV_DIM + ch] = static_cast<InT>(x[j + from]);
    }
  }
}

const float decay = metal::exp(A_log[hv]);
const float ax = QAB_RND(static_cast<float>(a_proj[size_t(b) * BA_ROW + A_OFF + hv]) + static_cast<float>(dt_bias_t[hv]));
const float sp =
    QAB_RND((ax > 0.0f ? ax : 0.0f) + metal::log(1.0f + metal::exp(-metal::fabs(ax))));
const float gate = metal::exp(-decay * sp);
const float beta = QAB_RND(1.0f / (1.0f + metal::exp(-static_cast<float>(b_proj[size_t(b) * BA_ROW + B_OFF + hv]))));
threadgroup_barrier(mem_flags::mem_threadgroup);

// Phase 2: l2-normalised k and q (q also scaled by Dk^-0.5).
float kn[NPER], qn[NPER];
float kk = 0.0f, qq = 0.0f;
for (int i = 0; i < NPER; ++i) {
  qn[i] = conv_s[i * 32 + lane];
  kn[i] = conv_s[Dk + i * 32 + lane];
  qq += qn[i] * qn[i];
  kk += kn[i] * kn[i];
}
qq = simd_sum(qq);
kk = simd_sum(kk);
const float kinv = metal::rsqrt(kk / Dk + QK_EPS / Dk);
const float qinv = metal::rsqrt(qq / Dk + QK_EPS / Dk);
const float kmul = QAB_RND(1.0f / metal::sqrt(float(Dk)));
const float qmul = QAB_RND(1.0f / float(Dk));
for (int i = 0; i < NPER; ++i) {
  kn[i] = QAB_RND(kmul * QAB_RND(kn[i] * kinv));
  qn[i] = QAB_RND(qmul * QAB_RND(qn[i] * qinv));
}

// Phase 3: the recurrent step on this SIMD group's rows.
float yr[RPW];
for (int r = 0; r < RPW; ++r) {
  yr[r] = 0.0f;
}
if (live) {
  float kv[RPW];
  for (int r = 0; r < RPW; ++r) {
    kv[r] = 0.0f;
    for (int i = 0; i < NPER; ++i) {
      s[r][i] *= gate;
      kv[r] += s[r][i] * kn[i];
    }
  }
  for (int r = 0; r < RPW; ++r) {
    kv[r] = simd_sum(kv[r]);
  }
  for (int r = 0; r < RPW; ++r) {
    const int dv = r * NW + warp;
    const float vr = dv < Dv ? conv_s[2 * Dk + dv] : 0.0f;
    const float delta = (vr - kv[r]) * beta;
    for (int i = 0; i < NPER; ++i) {
      s[r][i] += kn[i] * delta;
      yr[r] += s[r][i] * qn[i];
    }
  }
  for (int r = 0; r < RPW; ++r) {
    yr[r] = simd_sum(yr[r]);
  }
}
for (int r = 0; r < RPW; ++r) {
  const int dv = r * NW + warp;
  if (dv < Dv) {
    for (int i = 0; i < NPER; ++i) {
      state_out[sbase + size_t(dv) * Dk + i * 32 + lane] = s[r][i];
    }
    if (lane == 0) {
      y_s[dv] = QAB_RND(yr[r]);
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// Phase 4: gated RMSNorm over the head's Dv outputs.
float ss = 0.0f;
for (int i = lane; i < Dv; i += 32) {
  ss += y_s[i] * y_s[i];
}
ss = simd_sum(ss);
const float inv = metal::rsqrt(ss / float(Dv) + norm_eps[0]);
for (int dv = tid; dv < Dv; dv += BLOCK) {
  const float xw = QAB_RND(static_cast<float>(norm_w_t[dv]) * QAB_RND(y_s[dv] * inv));
  const float zz = static_cast<float>(z[size_t(b) * Z_ROW + Z_OFF + size_t(hv) * Dv + dv]);
  out[size_t(bh) * Dv + dv] = static_cast<InT>(zz / (1.0f + metal::exp(-zz)) * xw);
}
#undef QAB_RND
