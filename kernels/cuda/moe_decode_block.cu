// Decode, one launch for a whole MoE decoder-layer half: what
// moe_add_norm_route, moe_gate_up_shared_gemv and moe_down_shared_gemv
// (HAS_RES) compute in three launches, as three ticketed phases of one grid.
// Per token row n:
//
//   h, y, logits, inds, scores = add_norm_route(x[n], r[n])   (route phase)
//   act, sg_logit = gate_up_shared(y[n], inds[n])              (gate/up phase)
//   out[n] = h[n] + down_shared(act[n], inds[n], scores[n], sg_logit[n])   (down phase)
//
// with the three kernels' own per-block code (moe_add_norm_route.cuh,
// moe_gate_up_shared.cuh, moe_down_shared.cuh), so every output is
// bit-identical to the three launches'. It exists because decode on MLX's
// CUDA backend is bound by the host's per-launch cost: two launches fewer per
// MoE layer and token.
//
// Ticketed phases (no grid-wide barrier, no co-residency assumption): a block
// starts by taking a ticket (atomicAdd on count[0]); tickets in
// [0, RBLK N) are route blocks (part t % RBLK of row t / RBLK), the next
// GBLK N gate/up blocks, the last DBLK N down blocks. A block waits only on
// blocks with smaller tickets, which are already running (they took theirs
// before it), so the launch always makes progress whatever the hardware
// schedules. Gate/up blocks wait until every row is routed (count[1] == N,
// counted by each row's routing block), down blocks until every gate/up
// block is done (count[2] == GBLK N). A producer's threads fence their
// writes, meet at a barrier, then thread 0 counts; a consumer's thread 0
// waits with an acquire load (qab_wait_count), the block meets at a barrier
// and reads the produced arrays through L2 (the CG loads). The last block to
// finish (count[3]) resets count[0..3]; the route resets count[4 + n] itself.
// So count must be zeros at launch and is zeros again after it; launches that
// share it must not overlap (the callers pass a serial counter in the
// compiled decode step, otherwise a per-launch copy of a zero view).
//
// Launch: grid (BLOCK * (RBLK + GBLK + DBLK) * N, 1, 1) threads, threadgroup
// (BLOCK, 1, 1), BLOCK = 256 (the three kernels' block), with
//   RBLK = ceil(E / (RB BLOCK / 32)), GBLK = ceil(32 ((K + 1) I / 2 + 1) / BLOCK),
//   DBLK = ceil(32 H / 2 / BLOCK).
// Template: T (activations, norm weight, router scales/biases, scores),
// H (hidden size), E, K, I (expert intermediate size), G (experts' group
// size), RG (router group size), SGB, SGG (shared gate bits and group size),
// NORM (renormalise the K scores), BLOCK, RB (router rows per warp).
// Requirements: each of the three kernels' (see their sources).
// Inputs: x, r [N, H] T (residual stream, mixer output); nw [H] T; eps [4]
// float32; gw [E, H / 4] uint32, gs, gb [E, H / RG] T (8-bit router); w,
// scales, biases: the experts' fused gate+up [E, 2I, H / 8] uint32,
// [E, 2I, H / G]; s_gate_*, s_up_*: the shared expert's [I, H / 8],
// [I, H / G]; sg_*: the shared gate's [1, H SGB / 32], [1, H / SGG]; d_w,
// d_scales, d_biases: the experts' down [E, H, I / 8], [E, H, I / G];
// s_down_*: the shared expert's [H, I / 8], [H, I / G] (scales and biases of
// the experts' dtype); count [>= 4 + N] uint32 zeros.
// Outputs: out [N, H] T (the layer's output, x's shape); h, y [N, H] T,
// logits [N, E] T, inds [N, K] uint32, scores [N, K] T, act [N, K + 1, I] T,
// sg_logit [max(N, 4)] float32: the phases' intermediates (outputs so that
// MLX allocates them; callers drop them).

constexpr int RPW_GU = 2;  // moe_gate_up_shared.cuh's row pairs per warp
constexpr int RBLK = (E + (BLOCK / 32) * RB - 1) / ((BLOCK / 32) * RB);
constexpr int GBLK = (32 * ((K + 1) * I / RPW_GU + 1) + BLOCK - 1) / BLOCK;
constexpr int DBLK = (32 * H / QAB_DOWN_RPW + BLOCK - 1) / BLOCK;
__shared__ uint32_t ticket;

uint32_t* c = const_cast<uint32_t*>(count);
const int tid = threadIdx.x;
const int rows = gridDim.x / (RBLK + GBLK + DBLK);
if (tid == 0) {
  ticket = atomicAdd(c, 1u);
}
__syncthreads();
const int tk = static_cast<int>(ticket);

if (tk < RBLK * rows) {
  const int n = tk / RBLK;
  const bool routed = qab_add_norm_route_part<T, H, E, K, RG, NORM, BLOCK, RB>(
      tk - n * RBLK, RBLK, n, x, r, nw, eps, gw, gs, gb, c + 4, h, y, logits, inds, scores);
  if (routed) {
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      atomicAdd(c + 1, 1u);
    }
  }
} else if (tk < (RBLK + GBLK) * rows) {
  const int g = tk - RBLK * rows;
  const int n = g / GBLK;
  if (tid == 0) {
    qab_wait_count(c + 1, static_cast<uint32_t>(rows));
  }
  __syncthreads();
  qab_moe_gate_up_shared_part<T, H, I, K, G, SGB, SGG, true>(
      g - n * GBLK, n, rows, y, inds, w, scales, biases, s_gate_w, s_gate_scales,
      s_gate_biases, s_up_w, s_up_scales, s_up_biases, sg_w, sg_scales, sg_biases, act,
      sg_logit);
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    atomicAdd(c + 2, 1u);
  }
} else {
  const int d = tk - (RBLK + GBLK) * rows;
  const int n = d / DBLK;
  if (tid == 0) {
    qab_wait_count(c + 2, static_cast<uint32_t>(GBLK * rows));
  }
  __syncthreads();
  const int warp = (d - n * DBLK) * (BLOCK / 32) + (tid >> 5);
  if (warp * QAB_DOWN_RPW < H) {
    qab_moe_down_shared_rows<T, H, I, K, G, true, true>(
        warp, tid & 31, n, act, inds, scores, d_w, d_scales, d_biases, s_down_w,
        s_down_scales, s_down_biases, sg_logit, h, out);
  }
}

// The last block out resets the launch's counters (the route reset its own).
__syncthreads();
if (tid == 0) {
  const unsigned int done = atomicAdd(c + 3, 1u);
  if (done == gridDim.x - 1) {
    c[0] = 0u;
    c[1] = 0u;
    c[2] = 0u;
    c[3] = 0u;
  }
}
