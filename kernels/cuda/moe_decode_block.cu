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
// With NP the NEXT decoder layer's input RMSNorm and its 4-bit input
// projection follow, as a last phase:
//
//   po[n] = rms_norm(out[n], pnw, peps) pw^T                    (next-projection phase)
//
// (quantized_gemv.cu's NORM arithmetic, gemv_q4.cuh: the same bits), written
// to the output po for the next layer's mixer: its norm + projection launch,
// the largest GEMV of a layer, is gone, and its weight loads are issued as
// soon as its blocks start, while the down items still run.
//
// With OP the mixer's output projection comes first, as a fourth phase:
//
//   r[n] = ox[n] ow^T                                          (out-projection phase)
//
// (the attention's o_proj or the Gated DeltaNet's out_proj, 4-bit, computed
// as quantized_gemv.cu computes it, gemv_q4.cuh: the same bits), written to
// the output ro and read by the route and gate/up items instead of the input
// r: one launch, and its fixed cost, fewer per decoder layer and token.
//
// Built with gated_delta_decode.cuh and QAB_BLOCK_GDN defined (the op
// moe_decode_block_gdn; needs OP), the Gated DeltaNet decode step of this
// decoder layer's mixer runs first, as a fifth phase:
//
//   go[n], gd_conv_state_out, gd_state_out = gdn_step(gd_proj[n], gd_conv_state, gd_state)
//                                                          (Gated DeltaNet phase)
//
// (qab_gdn_decode_head, gated_delta_decode.cu's per-head code: the same
// bits), one item per (token row, value head); its output go, a workspace
// segment, is the out-projection phase's input ox: the GDN launch, and its
// fixed host cost, is gone. Out-projection items issue their weight loads,
// then wait for every GDN item (`gd_done` reaching GDBLK N) and read go
// through L2.
//
// Ticketed phases (no grid-wide barrier, no co-residency assumption): a block
// takes a ticket (atomicAdd on the ticket counter); with GD the first GDBLK
// N tickets are GDN items, and the ticket numbers below count the ones after
// them; with OP
// tickets in [0, OBLK N) are out-projection items (rows of r[t / OBLK]), the next RBLK N
// route items (part t % RBLK of row t / RBLK), the next GBLK N gate/up
// items, the next DBLK N down items, with NP the last PBLK N
// next-projection items (they issue their weight loads, then wait for every
// down item: `d_done` == DBLK N). Route items issue their router weight
// loads, then wait for every out-projection item (`o_done` == OBLK N); so do
// EARLY gate/up items before they stage the norm; the later phases' waits
// imply it. An item waits only on items with
// smaller tickets, which blocks already running took before it, so the
// launch always makes progress whatever the hardware schedules. Gate/up items
// wait until every row is routed (`routed` == N, counted by each row's
// routing block), down items until every gate/up item is done (`gu_done` ==
// GBLK N); with PREFETCH a down item first waits for `routed` only, issues
// its weight loads (they need only the route's expert indices), then waits
// for `gu_done`. A producer meets its block at a barrier, then thread 0
// fences and counts (the fence is cumulative: it orders the block's writes
// the barrier made visible to thread 0; the route's own per-row count, in
// moe_add_norm_route.cuh, fences in every thread before its barrier, also
// valid); a consumer's thread 0 waits with an
// acquire load (qab_wait_count), the block meets at a barrier and reads the
// produced arrays through L2 (the CG loads). Without PERSIST a block runs one
// item (grid = every item); with PERSIST it takes tickets until none is left
// (any grid works: a block waits on smaller tickets only, held by running
// blocks), each phase's items in a loop of its own (a block's tickets only
// grow, so it meets the phases in order; one loop over every phase's code
// spilled registers). The last block out (`exits` == gridDim.x) zeroes the six
// launch-wide counters; the route zeroes its per-row counts itself. So count
// must be zeros at launch and is zeros again after it; launches that share it
// must not overlap (the callers pass a serial counter in the compiled decode
// step, otherwise a per-launch copy of a zero view).
//
// Counter layout: tickets, routed, gu_done, exits, o_done, d_done at
// elements 0, CS, 2 CS, 3 CS, 4 CS, 5 CS (CS apart so that waiting blocks'
// polls and the counts they wait on do not share a cache line with the
// ticket counter), then the route's per-row counts at 6 CS + n; with GD,
// gd_done at 6 CS and the route's per-row counts at 7 CS + n.
//
// Measured on the H200 (benchmarks/profile_moe_block_gpu.py, ncu, Qwen3.6's
// shape): CS 32 with PREFETCH 43.0 us per launch against 44.3 with adjacent
// counters and no prefetch; PERSIST with 264 blocks 49.1 (slower); the three
// separate launches 28.5 us in all. Its per-ticket timeline shows why the one
// launch costs more GPU time: a phase's blocks start only as the earlier
// phase's blocks leave their slots (125 registers: two blocks of 256 per SM,
// 264 of the 449), and the down items end ~14 us after the gate/up items
// against ~8 us for the down launch alone. Since then (same script, later
// runs): STAGE 34.3-34.6 us; STAGE + EARLY 29.5 and 29.3 (the three launches
// 28.1-28.2 in the same runs); EARLY with GRPW 4 34.2, GRPW 4 alone 38.1;
// EARLY's timeline: gate/up items done at 15.6 us instead of 21.2, the launch
// at 24.1 instead of 28.6. With EARLY a gate/up item that holds routed rows
// no longer waits on the route's y write, and the 33 blocks of the shared
// expert and the gate logit run during the route and leave their slots to
// the later gate/up blocks.
//
// Launch: grid (BLOCK * (GDBLK + OBLK + RBLK + GBLK + DBLK + PBLK) * N, 1, 1) threads (with
// PERSIST any number of blocks, e.g. as many as fit on the GPU at once),
// threadgroup (BLOCK, 1, 1), BLOCK = 256 (the three kernels' block), with
//   OBLK = OP ? ceil(H / (2 BLOCK / 32)) : 0, RBLK = ceil(E / (RB BLOCK / 32)),
//   GBLK = ceil(32 ((K + 1) I / GRPW + 1) / BLOCK), DBLK = ceil(32 H / 2 / BLOCK),
//   PBLK = NP ? ceil(PN / (PSM ? PSM : PRW BLOCK / 32)) : 0, GDBLK = GD ? GHv GDS : 0.
// Template: T (activations, norm weight, router scales/biases, scores),
// H (hidden size), E, K, I (expert intermediate size), G (experts' group
// size), RG (router group size), SGB, SGG (shared gate bits and group size),
// NORM (renormalise the K scores), BLOCK, RB (router rows per warp), CS
// (counter stride, elements), PERSIST (blocks loop over tickets), PREFETCH
// (down items load their weights before waiting for gate/up), STAGE (a down
// block copies the token's gate/up activations into shared memory once, with
// cp.async, instead of each lane reading its chunks from L2 one after
// another: ncu on the H200, 34.3 against 43 us per launch, two runs; on by
// default since a whole-model run), GRPW ((gate, up) row pairs per gate/up
// warp: 2 as the standalone kernel; 4 halves the gate/up blocks, so that with
// two blocks per SM the launch's blocks nearly all fit at once, but measured
// slower: 38.1 against 34.6 us, with EARLY 34.2 against 29.5), EARLY (a
// gate/up item stages y itself with the route's add + norm code instead of
// waiting for the route to write it, waits for the route only when it holds
// routed rows, and a row's gate/up items run last block first, so the shared
// expert's rows and the gate logit, which need no route, run during it), PF
// (with EARLY: those first gate/up blocks, which wait for nothing, ask the L2
// to fetch pf0, pf1, pf2, the next decoder layer's input projection, while
// the route runs: DRAM is idle then, and the next launch's GEMV then reads
// its weights from L2: under ncu without cache flushes, after an L2 flush,
// 16.8 against 19.2 us for the next layer's norm + in_proj GEMV, but the
// block itself 32.4 against 30.2: the prefetch competes with the route's and
// the gate/up items' loads). Measured and dropped: the down items' weights
// prefetched into L2 by the gate/up items (37.0 against 29.3 us per launch).
// OP (the out-projection phase above), DO (its input width), OG (its group
// size); NP (the next-projection phase above), PN (its rows), PG (its group
// size), PRW (its rows per warp: 2 as the out-projection phase's; each row's
// arithmetic does not depend on it, so every PRW gives the same bits; 4
// halves its blocks, 772 -> 386 at the Gated DeltaNet's 12,352 rows, and
// doubles each lane's weight loads in flight; 8 spills registers under the
// two-blocks-per-SM cap with nvcc 13), PSM (0: as PRW says; > 0, a multiple
// of BLOCK / 32: each next-projection item covers PSM rows whose weights,
// scales and biases it copies into the launch's dynamic shared memory with
// cp.async before it waits, gemv_q4.cuh's qab_q4_gemv_rows_staged, the same
// bits; the launch then requests the bytes of
// ops.moe.decode_block_dynamic_shared_bytes, at least 48 KB, of dynamic shared
// memory. At 12,352 rows and 64 per item the phase has 193 items instead of
// 772, so that its blocks fit the GPU's resident slots as the earlier phases
// leave them instead of arriving in three waves, each holding 72 KB of loads
// in flight; measured not faster on an H100: those loads slow the down items).
// GDS (GD builds only: 1, 2 or 4): Gated DeltaNet items per value head, each
// Dv / GDS of its state rows (qab_gdn_decode_head's SPLIT): at 4, 128 items of
// 16 KB of state in flight each instead of 32 items of 64 KB in four passes;
// the out-projection items then apply the heads' gated RMSNorm as they stage
// go (the same bits).
// UNROLL (the out- and next-projection phases' input staging and the next
// projection's norm unrolled over the block's compile-time size: the same
// values, fewer dependent L2 round trips; on by default, ops.moe's
// moe-block-unroll switch: on an H100, profile_layer_gpu.py, 77.4 against
// 83.1 us per Gated DeltaNet layer launch, bit for bit the same outputs).
// NPL (NP builds without PSM, else no effect: a block that ran a next-projection item takes
// tickets until none is left, and for items of the row it already staged
// skips the wait, the norm and the staging: each row's arithmetic and
// staged values are the same, so the same bits; the phase's 772 items at
// Qwen3.6's 12,352 rows otherwise start as 772 blocks, each waiting for its
// ticket, its weights, the down items, the norm's and the staging's reads).
// RPL (the route items, and EARLY's gate/up items, load x[n], nw and eps
// with their other early loads, before they wait for the out projection:
// QabAddNormIn, the same values and bits, one dependent trip to memory
// fewer after the wait for x and two for nw and eps).
// GSR (EARLY builds, else no effect: a gate/up item of routed rows waits
// for its row's route count to reach RBLK, i.e. for every route block's
// logits, reads them through L2 and routes the row itself with warp 0,
// qab_route_row into shared memory, the route's last block's code: the same
// experts. The route's last block still routes the row for the down items
// (inds, scores, `routed`), but no longer resets its count, which the last
// block out zeroes with the launch's counters.)
// NPS (0, 1 or 2; PSM builds with PERSIST, else no effect; ops.moe's
// _nps_build makes a build with NPS and NP one: two blocks per SM, 48 rows per
// unit): the next-projection items are not tickets but units (token row, PSM
// rows), block b taking units b, b + gridDim.x, ... once its tickets run out;
// the block copies its first unit's weights, scales and biases into its
// dynamic shared memory (qab_q4_rows_stage_issue) at its start (1) or after
// its first item (2), so that the phase after the down items is the norm, the
// staging and the arithmetic: the same bits. Measured slower on an H200
// (profile_layer_gpu.py, 74.0 / 74.3 against 71.0 us per Gated DeltaNet layer
// launch): the copies issued at the start delay the blocks' first tickets by
// ~4.7 us, and the phase still takes 12.7 us after the down items end
// (13.6 with its weights loaded in it): its loads do not set its length. (A
// STAGE down item's cp.async wait also waits for its block's NPS copies.)
// ROLL (on by default: ops.moe's moe-block-roll switch): the items' dot
// loops (out- and next-projection, qab_q4_gemv_rows, not the PSM / NPS
// builds' qab_q4_gemv_rows_staged; route logits,
// qab_add_norm_route_part; gate/up, qab_moe_gate_up_shared_part; down,
// qab_moe_down_shared_rows) run one chunk's (step's, task's) code in a loop,
// their loaded weights shifted down a register array after each, instead of
// unrolled: the same arithmetic in the same order, so the same bits, in two
// thirds of the code (nvcc 13, sm_90, the packed GD build: 121 against 176
// KiB of SASS). A phase's first block on an SM fetches the phase's code
// through the SM's instruction cache, which the launch's code overflows: in the
// profiling builds' sub-step marks (QAB_SUBMARK) the out-projection items'
// unrolled dots took 5.0 us after their input was staged and the down
// items' 4.8, against 2.5 and 3.3 rolled, and Nsight Compute sampled "no
// instruction" as the down dots' main stall. On an H100, the last of four
// chained launches (benchmarks/profile_layer_gpu.py --timeline --warm 4):
// the launch's last phase ends at 56.6 against 62.2 us; end to end at 4K
// 326.8 against 305.0 tok/s (bench-nvidia-h100-s39-roll-4k-b.json).
// Requirements: each of the three kernels' (see their sources); with OP,
// DO % 1024 == 0 and OG % 32 == 0; with NP, H % 1024 == 0 and PG % 32 == 0.
// Inputs: x, r [N, H] T (residual stream, mixer output); nw [H] T; eps [4]
// float32; gw [E, H / 4] uint32, gs, gb [E, H / RG] T (8-bit router); w,
// scales, biases: the experts' fused gate+up [E, 2I, H / 8] uint32,
// [E, 2I, H / G]; s_gate_*, s_up_*: the shared expert's [I, H / 8],
// [I, H / G]; sg_*: the shared gate's [1, H SGB / 32], [1, H / SGG]; d_w,
// d_scales, d_biases: the experts' down [E, H, I / 8], [E, H, I / G];
// s_down_*: the shared expert's [H, I / 8], [H, I / G] (scales and biases of
// the experts' dtype); count [>= 6 CS + N] uint32 zeros; pf0, pf1, pf2: any
// arrays (PF: prefetched whole into L2; else not read); ox [N, DO] T (OP: the
// mixer's output before its projection), ow [H, DO / 8] uint32, os, ob
// [H, DO / OG] T (OP: that projection, 4-bit; else any arrays, not read; r
// is then not read either); pnw [H] T, peps [4] float32 (element 0), pw
// [PN, H / 8] uint32, ps, pb [PN, H / PG] T (NP: the next layer's input norm
// and projection; else any arrays, not read).
// Outputs: out [N, H] T (the layer's output, x's shape); ws: the phases'
// intermediates in one uint32 workspace (an output so that MLX allocates it;
// callers drop it), 128-byte aligned segments in this order: h, y [N, H] T,
// logits [N, E] T, inds [N, K] uint32, scores [N, K] T, act [N, K + 1, I] T,
// sg_logit [max(N, 4)] float32, ro [N, H] T (OP; else 16 bytes, not used)
// (ops.moe.decode_block_workspace_words sizes it: one output instead of
// eight, because MLX's host cost per launch grows by about 1.5 us per
// output on the H200, benchmarks/profile_encode.py); po [N, PN] T (NP: the
// next layer's projected input, a real output; else at least one element,
// element 0 zeroed).
// With GD (op moe_decode_block_gdn; template GHk, GHv, GDk, GDv, GKc, GBIAS,
// GW: gated_delta_decode.cu's Hk, Hv, Dk, Dv, Kc, HAS_BIAS, PROJ_W > 0; its
// InT and WT are T, its BLOCK this launch's; no mask, no lengths; DO ==
// GHv GDv) also inputs gd_proj [N, GW] T (the mixer's concatenated input
// projection, q | k | v | z | b | a), gd_conv_state [N, GKc - 1, conv_dim] T,
// gd_conv_w [conv_dim, GKc, 1] T, gd_conv_b [conv_dim] T (read when GBIAS),
// gd_A_log [GHv] float32, gd_dt_bias [GHv] T, gd_norm_w [GDv] T, gd_eps [4]
// float32, gd_state [N, GHv, GDv, GDk] float32 (ox is then not read), and
// outputs gd_conv_state_out, gd_state_out (their shapes); ws ends with one
// more segment, go [N, GHv GDv] T; count must hold 7 CS + N elements.

#ifdef QAB_BLOCK_PACK
// The packed build (ops moe_decode_block_pack, moe_decode_block_gdn_pack,
// moe-block-pack): the router's, the shared expert's and the routed experts'
// 21 arrays arrive as 128-byte aligned segments of one uint32 input pk, in
// this order (the layout ops.moe.decode_block_pack_segments builds): gw, gs,
// gb, s_gate_w, s_gate_scales, s_gate_biases, s_up_w, s_up_scales,
// s_up_biases, sg_w, sg_scales, sg_biases, s_down_w, s_down_scales,
// s_down_biases, w, scales, biases, d_w, d_scales, d_biases (shapes and
// dtypes as the inputs of the same names below). The same code reads them:
// the same bits. MLX's host cost per launch grows with every input array it
// binds (benchmarks/profile_encode.py). The names are macros over pk and
// compile-time word offsets (see moe_decode_block_pack.cuh for the build's
// launch bounds). The pack is the block's storage: the module's arrays are
// views of it (layers.moe.BlockPack), so the experts are not held twice.
// Its outputs are out and po only, for MLX's host cost also grows with every
// output (benchmarks/profile_encode.py: about 2 us to build and 3 us to
// encode per output on the H200's host): the workspace is count's tail from
// word WSO (a multiple of 32) on, so count must be the caller's own serial
// counter (ops.moe.serial_counter of ops.moe.decode_block_pack_counter_length
// elements; every launch sharing it runs after the one before); with GD the
// GDN step's states are written in place (see gcs below), so gd_conv_state
// and gd_state must be buffers the caller owns and reads only after out.
#define QAB_PKW(bytes) (((size_t)(bytes) + 127) / 128 * 32)
static_assert(BLOCK == 256, "moe_decode_block: the packed build is declared __launch_bounds__(256, 2)");
constexpr size_t QAB_PK_QS = (size_t)I * (H / G) * sizeof(T);  // a shared projection's scales
constexpr size_t QAB_PK_GS = QAB_PKW((size_t)E * H);
constexpr size_t QAB_PK_GB = QAB_PK_GS + QAB_PKW((size_t)E * (H / RG) * sizeof(T));
constexpr size_t QAB_PK_SGW = QAB_PK_GB + QAB_PKW((size_t)E * (H / RG) * sizeof(T));
constexpr size_t QAB_PK_SGS = QAB_PK_SGW + QAB_PKW((size_t)I * H / 2);
constexpr size_t QAB_PK_SGB = QAB_PK_SGS + QAB_PKW(QAB_PK_QS);
constexpr size_t QAB_PK_SUW = QAB_PK_SGB + QAB_PKW(QAB_PK_QS);
constexpr size_t QAB_PK_SUS = QAB_PK_SUW + QAB_PKW((size_t)I * H / 2);
constexpr size_t QAB_PK_SUB = QAB_PK_SUS + QAB_PKW(QAB_PK_QS);
constexpr size_t QAB_PK_GTW = QAB_PK_SUB + QAB_PKW(QAB_PK_QS);
constexpr size_t QAB_PK_GTS = QAB_PK_GTW + QAB_PKW((size_t)H * SGB / 8);
constexpr size_t QAB_PK_GTB = QAB_PK_GTS + QAB_PKW((size_t)(H / SGG) * sizeof(T));
constexpr size_t QAB_PK_SDW = QAB_PK_GTB + QAB_PKW((size_t)(H / SGG) * sizeof(T));
constexpr size_t QAB_PK_SDS = QAB_PK_SDW + QAB_PKW((size_t)H * I / 2);
constexpr size_t QAB_PK_SDB = QAB_PK_SDS + QAB_PKW((size_t)H * (I / G) * sizeof(T));
// The routed experts' fused gate+up [E, 2I, H / 8], [E, 2I, H / G] and down
// [E, H, I / 8], [E, H, I / G] projections.
constexpr size_t QAB_PK_W = QAB_PK_SDB + QAB_PKW((size_t)H * (I / G) * sizeof(T));
constexpr size_t QAB_PK_WS = QAB_PK_W + QAB_PKW((size_t)E * 2 * I * H / 2);
constexpr size_t QAB_PK_WB = QAB_PK_WS + QAB_PKW((size_t)E * 2 * I * (H / G) * sizeof(T));
constexpr size_t QAB_PK_DW = QAB_PK_WB + QAB_PKW((size_t)E * 2 * I * (H / G) * sizeof(T));
constexpr size_t QAB_PK_DS = QAB_PK_DW + QAB_PKW((size_t)E * H * I / 2);
constexpr size_t QAB_PK_DB = QAB_PK_DS + QAB_PKW((size_t)E * H * (I / G) * sizeof(T));
#define QAB_PK_AT(Ty, at) (reinterpret_cast<const Ty*>(pk + (at)))
#define gw QAB_PK_AT(uint32_t, 0)
#define gs QAB_PK_AT(T, QAB_PK_GS)
#define gb QAB_PK_AT(T, QAB_PK_GB)
#define s_gate_w QAB_PK_AT(uint32_t, QAB_PK_SGW)
#define s_gate_scales QAB_PK_AT(T, QAB_PK_SGS)
#define s_gate_biases QAB_PK_AT(T, QAB_PK_SGB)
#define s_up_w QAB_PK_AT(uint32_t, QAB_PK_SUW)
#define s_up_scales QAB_PK_AT(T, QAB_PK_SUS)
#define s_up_biases QAB_PK_AT(T, QAB_PK_SUB)
#define sg_w QAB_PK_AT(uint32_t, QAB_PK_GTW)
#define sg_scales QAB_PK_AT(T, QAB_PK_GTS)
#define sg_biases QAB_PK_AT(T, QAB_PK_GTB)
#define s_down_w QAB_PK_AT(uint32_t, QAB_PK_SDW)
#define s_down_scales QAB_PK_AT(T, QAB_PK_SDS)
#define s_down_biases QAB_PK_AT(T, QAB_PK_SDB)
#define w QAB_PK_AT(uint32_t, QAB_PK_W)
#define scales QAB_PK_AT(T, QAB_PK_WS)
#define biases QAB_PK_AT(T, QAB_PK_WB)
#define d_w QAB_PK_AT(uint32_t, QAB_PK_DW)
#define d_scales QAB_PK_AT(T, QAB_PK_DS)
#define d_biases QAB_PK_AT(T, QAB_PK_DB)
#endif
#ifdef QAB_BLOCK_GDN
// The Gated DeltaNet phase (GD): one item per (token row, value head), or
// with GDS > 1 per (token row, value head, part): GDS items share a head,
// each Dv / GDS of its state rows (qab_gdn_decode_head's SPLIT), and the
// out-projection items apply the gated RMSNorm as they stage its output.
constexpr bool GD = true;
static_assert(GDS == 1 || GDS == 2 || GDS == 4, "moe_decode_block: GDS is 1, 2 or 4");
constexpr int GDBLK = GHv * GDS;
// Phase 3 of the GDN step in passes over a warp's state rows: fewer state
// floats in registers (see qab_gdn_decode_head). At Qwen3.6's heads (Dv 128,
// 16 rows per warp) nvcc 13 for sm_90 gives this build 168 registers per
// thread with one pass, 133 with 2 and 128 with 4 (the build without GD: 124),
// and two blocks of 256 threads fit an SM only at <= 128. With GDS > 1 a
// warp's rows (4 at GDS 4) fit in one pass of at most 16 floats per lane.
constexpr int QAB_GD_ROWS = (GDv / GDS + BLOCK / 32 - 1) / (BLOCK / 32);
constexpr int QAB_GD_FLOATS = QAB_GD_ROWS * (GDk / 32);
constexpr int QAB_GD_PASSES =
    GDS == 1 ? (QAB_GD_ROWS % 4 == 0 ? 4 : QAB_GD_ROWS % 2 == 0 ? 2 : 1)
             : (QAB_GD_FLOATS > 16 && QAB_GD_ROWS % (QAB_GD_FLOATS / 16) == 0
                    ? QAB_GD_FLOATS / 16 : 1);
static_assert(OP && DO == GHv * GDv, "moe_decode_block: GD needs OP over the GDN's Hv Dv outputs");
#else
constexpr bool GD = false;
constexpr int GDBLK = 0;
#endif
// The out-projection phase (OP): blocks per token row, QAB_OUT_RPW rows per warp.
constexpr int QAB_OUT_RPW = 2;
constexpr int OBLK = OP ? (H + (BLOCK / 32) * QAB_OUT_RPW - 1) / ((BLOCK / 32) * QAB_OUT_RPW) : 0;
// With UNROLL the projection phases stage their input row with the block size
// known at compile time (gemv_q4.cuh's NT: unrolled, a thread's L2 reads out
// at once), else in a loop over blockDim.x (one round trip per iteration).
constexpr int QAB_GEMV_NT = UNROLL ? BLOCK : 0;
// The next-projection phase (NP): blocks per token row of QAB_NP_ROWS rows,
// PRW per warp in registers, or with PSM > 0 PSM rows staged in the dynamic
// shared memory (qab_q4_gemv_rows_staged).
constexpr int QAB_NP_ROWS = PSM > 0 ? PSM : (BLOCK / 32) * PRW;
constexpr int PBLK = NP ? (PN + QAB_NP_ROWS - 1) / QAB_NP_ROWS : 0;
// One staging buffer for both projection phases' input rows (DO or H values).
constexpr int QAB_STAGE_NC = !(OP || NP) ? 1 : (OP && DO > H) ? DO / 32 : H / 32;
__shared__ float4 gemv_stage[8 * QAB_STAGE_NC];
__shared__ float gemv_stage_sum[QAB_STAGE_NC];
constexpr int RBLK = (E + (BLOCK / 32) * RB - 1) / ((BLOCK / 32) * RB);
constexpr int GBLK = (32 * ((K + 1) * I / GRPW + 1) + BLOCK - 1) / BLOCK;
constexpr int DBLK = (32 * H / QAB_DOWN_RPW + BLOCK - 1) / BLOCK;
// Gate/up blocks per row holding routed rows (the first GR; the rest: the
// shared expert's rows and the gate logit).
constexpr int GR = (K * I / GRPW + BLOCK / 32 - 1) / (BLOCK / 32);
static_assert(!(PREFETCH || STAGE) || H % ((BLOCK / 32) * QAB_DOWN_RPW) == 0,
              "moe_decode_block: PREFETCH and STAGE need every warp of a down block busy");
static_assert(!PF || EARLY, "moe_decode_block: PF needs EARLY");
// NPL where it applies: NP builds without PSM.
constexpr bool QAB_NPL = NPL && NP && PSM == 0;
// GSR where it applies: EARLY builds (the gate/up items that stage y themselves).
constexpr bool QAB_GSR = GSR && EARLY;
// NPS where it applies: PSM builds on a persistent grid. The next-projection
// items are then not tickets: block b takes units b, b + gridDim.x, ... of
// the rows * PBLK (token row, PSM-row chunk) units after its tickets run out,
// and copies its first unit's weights into its shared memory early.
static_assert(NPS == 0 || NPS == 1 || NPS == 2, "moe_decode_block: NPS is 0, 1 or 2");
constexpr bool QAB_NPS = NPS > 0 && NP && PSM > 0 && PERSIST;
// The next projection's rows staged in the dynamic shared memory (PSM builds).
extern __shared__ uint4 qab_np_stage[];
__shared__ uint32_t ticket;

uint32_t* c = const_cast<uint32_t*>(count);
uint32_t* tickets = c;            // next ticket
uint32_t* routed = c + CS;        // token rows routed
uint32_t* gu_done = c + 2 * CS;   // gate/up items done
uint32_t* exits = c + 3 * CS;     // blocks finished
uint32_t* o_done = c + 4 * CS;    // out-projection items done (OP)
uint32_t* d_done = c + 5 * CS;    // down items done (NP)
uint32_t* gd_done = c + 6 * CS;   // GDN items done (GD)
uint32_t* route_counts = c + (GD ? 7 : 6) * CS;  // per row: route blocks done (the route resets them)
const int tid = threadIdx.x;
int rows = 1;
for (int i = 0; i + 1 < x_ndim; ++i) {
  rows *= x_shape[i];
}
const int items = (OBLK + RBLK + GBLK + DBLK + (QAB_NPS ? 0 : PBLK)) * rows;
// The intermediates' segments of ws (see Outputs).
#ifdef QAB_BLOCK_PACK
// The packed build has no workspace output: its intermediates live in count
// from word WSO on (a serial counter's tail, kept between launches).
char* ws_next = reinterpret_cast<char*>(c + WSO);
#else
char* ws_next = reinterpret_cast<char*>(ws);
#endif
auto ws_take = [&](const size_t bytes) {
  char* at = ws_next;
  ws_next += (bytes + 127) / 128 * 128;
  return at;
};
T* h = reinterpret_cast<T*>(ws_take(sizeof(T) * rows * H));
T* y = reinterpret_cast<T*>(ws_take(sizeof(T) * rows * H));
T* logits = reinterpret_cast<T*>(ws_take(sizeof(T) * rows * E));
uint32_t* inds = reinterpret_cast<uint32_t*>(ws_take(sizeof(uint32_t) * rows * K));
T* scores = reinterpret_cast<T*>(ws_take(sizeof(T) * rows * K));
T* act = reinterpret_cast<T*>(ws_take(sizeof(T) * rows * (K + 1) * I));
float* sg_logit = reinterpret_cast<float*>(ws_take(sizeof(float) * (rows > 4 ? rows : 4)));
T* ro = reinterpret_cast<T*>(ws_take(OP ? sizeof(T) * rows * H : 16));
#ifdef QAB_BLOCK_GDN
T* go = reinterpret_cast<T*>(ws_take(sizeof(T) * rows * DO));  // the GDN phase's output
#ifdef QAB_BLOCK_PACK
// The packed GD build writes the GDN step's states in place (no outputs): the
// recurrent state into gd_state (each GDN item reads, then writes, only its
// own head's rows), the new conv state into gcs here, which the
// out-projection items copy over gd_conv_state once every GDN item has read
// the old one (several items read a key head's q/k channels).
constexpr int QAB_GD_CONV = (GKc - 1) * (2 * GHk * GDk + GHv * GDv);
T* gcs = reinterpret_cast<T*>(ws_take(sizeof(T) * rows * QAB_GD_CONV));
#define QAB_GD_CONV_OUT gcs
#define QAB_GD_STATE_OUT const_cast<float*>(gd_state)
#else
#define QAB_GD_CONV_OUT gd_conv_state_out
#define QAB_GD_STATE_OUT gd_state_out
#endif
#endif
// The mixer's output: an input, or with OP this launch's own out-projection
// (written by its first items, read through L2 once they are all done).
const T* rr = OP ? ro : r;
// With OP: every thread, until each out-projection item is done (thread 0
// polls, then a block barrier).
auto wait_out_proj = [&]() {
  if constexpr (OP) {
    if (tid == 0) {
      qab_wait_count(o_done, static_cast<uint32_t>(OBLK * rows));
    }
    __syncthreads();
  }
};

// The next-projection items' input, token row np_n of out normed as
// quantized_gemv's NORM staging: T(nw * T(x * inv)), with inv computed by
// np_wait once every down item is done, through L2.
int tk = 0;  // this block's ticket, after the GDN items' (its phase marks' index)
int np_n = 0;
float np_inv = 0.f;
auto np_x = [&](const int k) {
  const float nv = static_cast<float>(static_cast<T>(
      static_cast<float>(qab_ldcg(out + (size_t)np_n * H + k)) * np_inv));
  return static_cast<float>(static_cast<T>(static_cast<float>(pnw[k]) * nv));
};
auto np_wait = [&]() {
  if (tid == 0) {
    qab_wait_count(d_done, static_cast<uint32_t>(DBLK * rows));
  }
  __syncthreads();
  QAB_MARK(1);
  np_inv = qab_q4_row_norm_inv<H, QAB_GEMV_NT>(
      [&](const int k) { return static_cast<float>(qab_ldcg(out + (size_t)np_n * H + k)); },
      peps[0]);
  QAB_MARK(8);  // (profiling builds: the norm's factor)
};
// NPS: the next-projection chunk whose rows this block's shared memory holds
// or is copying (-1: none), and the copy of its first unit's (every thread).
int np_staged = -1;
auto np_issue_first = [&]() {
  if constexpr (QAB_NPS) {
    if (np_staged < 0 && (int)blockIdx.x < rows * PBLK) {
      np_staged = (int)blockIdx.x % PBLK;
      qab_q4_rows_stage_issue<T, H, PG, PSM, BLOCK>(np_staged * PSM, PN, pw, ps, pb,
                                                   qab_np_stage);
    }
  }
};
if constexpr (QAB_NPS && NPS == 1) {
  np_issue_first();  // at the block's start
}

// One item of phase P (QabPhase: 0 GDN, 1 out projection, 2 route, 3 gate/up,
// 4 down, 5 next projection) for the ticket tk.
auto run_item = [&](auto phase) {
  constexpr int P = decltype(phase)::value;
  if constexpr (P == 0) {
#ifdef QAB_BLOCK_GDN
    // GDN item: value head hv (part hp - hv GDS of its GDS) of token row n,
    // gated_delta_decode's per-head code.
    const int n = (tk + GDBLK * rows) / GDBLK;
    const int hp = tk + GDBLK * rows - n * GDBLK;
    const int hv = hp / GDS;
    qab_gdn_decode_head<T, T, GHk, GHv, GDk, GDv, GKc, BLOCK, GBIAS, false, false, GW,
                        QAB_GD_PASSES, GDS>(
        n, hv, gd_proj, gd_proj, gd_proj, gd_proj, gd_conv_state, gd_conv_w, gd_conv_b,
        gd_A_log, gd_dt_bias, gd_norm_w, gd_eps, gd_state, gd_eps, gd_eps, go,
        QAB_GD_CONV_OUT, QAB_GD_STATE_OUT, hp - hv * GDS);
    QAB_MARK(2);
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      atomicAdd(gd_done, 1u);
      QAB_MARK(11);  // (profiling builds: fenced and counted)
    }
#endif
  } else if constexpr (P == 1) {
    // Out-projection item: rows [o * 8 QAB_OUT_RPW, ...) of r[n] = ox[n] ow^T.
    const int n = tk / OBLK;
    const int o = tk - n * OBLK;
#ifdef QAB_BLOCK_GDN
    // The GDN items' output: weight loads first, then the wait, then go through L2.
    const T* gon = go + (size_t)n * DO;
    auto gd_wait = [&]() {
      if (tid == 0) {
        qab_wait_count(gd_done, static_cast<uint32_t>(GDBLK * rows));
      }
      __syncthreads();
      QAB_MARK(1);
    };
    if constexpr (GDS > 1) {
      // go holds each head's y before the gated RMSNorm: each warp computes
      // its heads' inv (qab_gdn_gated_norm_inv), then the staging applies it
      // with z (qab_gdn_gated_out): the unsplit phase 4's bits.
      __shared__ float gd_inv[GHv];
      const T* zn = gd_proj + (size_t)n * GW + 2 * GHk * GDk + GHv * GDv;
      qab_q4_gemv_rows<T, T, DO, OG, QAB_OUT_RPW, QAB_GEMV_NT, ROLL>(
          o * (BLOCK / 32) * QAB_OUT_RPW, H,
          [&](const int k) {
            const int hv = k / GDv;
            const int dv = k - hv * GDv;
            return static_cast<float>(qab_gdn_gated_out<T>(
                static_cast<float>(qab_ldcg(gon + k)), gd_inv[hv],
                static_cast<float>(gd_norm_w[dv]), static_cast<float>(zn[k])));
          },
          ow, os, ob, ro + (size_t)n * H, gemv_stage, gemv_stage_sum, [&]() {
            gd_wait();
            const int lane = tid & 31;
            constexpr int NWB = BLOCK / 32;
#pragma unroll
            for (int j = 0; j < (GHv + NWB - 1) / NWB; ++j) {
              const int hv = (tid >> 5) + j * NWB;
              if (hv < GHv) {
                const float inv = qab_gdn_gated_norm_inv<GDv>(
                    [&](const int i) { return static_cast<float>(qab_ldcg(gon + hv * GDv + i)); },
                    lane, gd_eps[0]);
                if (lane == 0) {
                  gd_inv[hv] = inv;
                }
              }
            }
            __syncthreads();
          });
    } else {
      qab_q4_gemv_rows<T, T, DO, OG, QAB_OUT_RPW, QAB_GEMV_NT, ROLL>(
          o * (BLOCK / 32) * QAB_OUT_RPW, H, qab_row_load<true>(gon), ow, os, ob,
          ro + (size_t)n * H, gemv_stage, gemv_stage_sum, gd_wait);
    }
#ifdef QAB_BLOCK_PACK
    // This item's share of the new conv state, copied in place through L2 (the
    // projection above waited for every GDN item).
    {
      constexpr size_t QAB_GD_PER = ((size_t)QAB_GD_CONV + OBLK - 1) / OBLK;
      T* cs = const_cast<T*>(gd_conv_state) + (size_t)n * QAB_GD_CONV;
      const T* from = gcs + (size_t)n * QAB_GD_CONV;
      const size_t end = (size_t)(o + 1) * QAB_GD_PER < (size_t)QAB_GD_CONV
                             ? (size_t)(o + 1) * QAB_GD_PER : (size_t)QAB_GD_CONV;
      for (size_t e = (size_t)o * QAB_GD_PER + tid; e < end; e += BLOCK) {
        cs[e] = qab_ldcg(from + e);
      }
    }
#endif
#else
    qab_q4_gemv_rows<T, T, DO, OG, QAB_OUT_RPW, QAB_GEMV_NT, ROLL>(
        o * (BLOCK / 32) * QAB_OUT_RPW, H, qab_row_load<false>(ox + (size_t)n * DO), ow, os, ob,
        ro + (size_t)n * H, gemv_stage, gemv_stage_sum);
#endif
    QAB_MARK(2);
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      atomicAdd(o_done, 1u);
      QAB_MARK(11);  // (profiling builds: fenced and counted)
    }
  } else if constexpr (P == 2) {
    const int n = (tk - OBLK * rows) / RBLK;
    const bool last = qab_add_norm_route_part<T, H, E, K, RG, NORM, BLOCK, RB, OP, RPL, !QAB_GSR, ROLL>(
        tk - OBLK * rows - n * RBLK, RBLK, n, x, rr, nw, eps, gw, gs, gb, route_counts, h, y,
        logits, inds, scores, [&]() {
          wait_out_proj();
          QAB_MARK(1);  // (profiling builds: the route's own time starts here)
        }, [&]() {
          QAB_MARK(3);  // (profiling builds: its logits counted; the last block then routes)
        });
    QAB_MARK(2);
    if (last) {
      __syncthreads();
      if (tid == 0) {
        __threadfence();
        atomicAdd(routed, 1u);
        QAB_MARK(11);  // (profiling builds: fenced and counted)
      }
    }
  } else if constexpr (P == 3) {
    const int g = tk - (OBLK + RBLK) * rows;
    const int n = g / GBLK;
    if constexpr (EARLY) {
      // The last blocks of a row first: the shared expert's and the gate
      // logit's, which wait for nothing. Each item stages y itself (the
      // route's own add + norm code), then waits for the route only if it
      // holds a routed row.
      const int bx = GBLK - 1 - (g - n * GBLK);
      const bool routed_rows = bx < GR;
      if constexpr (PF) {
        if (!routed_rows) {
          // The blocks that wait for nothing ask the L2 for the next layer's
          // input projection while the route runs.
          const int t = (n * (GBLK - GR) + bx - GR) * BLOCK + tid;
          const int nt = rows * (GBLK - GR) * BLOCK;
          qab_prefetch_l2_share(pf0, qab_input_bytes(pf0, pf0_shape, pf0_ndim), t, nt);
          qab_prefetch_l2_share(pf1, qab_input_bytes(pf1, pf1_shape, pf1_ndim), t, nt);
          qab_prefetch_l2_share(pf2, qab_input_bytes(pf2, pf2_shape, pf2_ndim), t, nt);
        }
      }
      // With RPL x[n], nw and eps are loaded before the wait (the same bits).
      QabAddNormIn<T, H, BLOCK> in;
      if constexpr (RPL) {
        in.load(n, x, nw, eps);
      }
      wait_out_proj();
      const T* ys;
      if constexpr (RPL) {
        ys = qab_add_norm_row<T, H, BLOCK, OP>(n, in, rr, h, y, false);
      } else {
        ys = qab_add_norm_row<T, H, BLOCK, OP>(n, x, rr, nw, eps, h, y, false);
      }
      // With GSR an item of routed rows routes row n itself (qab_route_row
      // over the row's logits, as the route's last block does: the same
      // bits) once every route block of the row has counted its logits,
      // instead of waiting for that block to route, write and count the row.
      __shared__ T gsr_logits[QAB_GSR ? E : 1];
      __shared__ uint32_t gsr_inds[K];
      __shared__ T gsr_scores[K];
      qab_moe_gate_up_shared_part<T, H, I, K, G, SGB, SGG, !QAB_GSR, GRPW, QAB_GSR, ROLL>(
          bx, n, rows, qab_row_load<false>(ys), QAB_GSR ? gsr_inds : inds, w, scales, biases,
          s_gate_w, s_gate_scales, s_gate_biases, s_up_w, s_up_scales, s_up_biases, sg_w,
          sg_scales, sg_biases, act, sg_logit, [&]() {
            if (routed_rows) {
              if constexpr (QAB_GSR) {
                if (tid == 0) {
                  qab_wait_count(route_counts + n, static_cast<uint32_t>(RBLK));
                }
                __syncthreads();
                for (int e = tid; e < E; e += BLOCK) {
                  gsr_logits[e] = qab_ldcg(logits + (size_t)n * E + e);
                }
                __syncthreads();
                if (tid < 32) {
                  qab_route_row<T, E, K, NORM>(gsr_logits, tid, gsr_inds, gsr_scores);
                }
              } else if (tid == 0) {
                qab_wait_count(routed, static_cast<uint32_t>(rows));
              }
              __syncthreads();
            }
            QAB_MARK(1);
          });
    } else {
      if (tid == 0) {
        qab_wait_count(routed, static_cast<uint32_t>(rows));
      }
      __syncthreads();
      QAB_MARK(1);
      qab_moe_gate_up_shared_part<T, H, I, K, G, SGB, SGG, true, GRPW, false, ROLL>(
          g - n * GBLK, n, rows, qab_row_load<true>(y + (size_t)n * H), inds, w, scales, biases,
          s_gate_w, s_gate_scales, s_gate_biases, s_up_w, s_up_scales, s_up_biases, sg_w,
          sg_scales, sg_biases, act, sg_logit);
    }
    QAB_MARK(2);
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      atomicAdd(gu_done, 1u);
      QAB_MARK(11);  // (profiling builds: fenced and counted)
    }
  } else if constexpr (P == 4) {
    const int d = tk - (OBLK + RBLK + GBLK) * rows;
    const int n = d / DBLK;
    const uint32_t gu_items = static_cast<uint32_t>(GBLK * rows);
    if (tid == 0) {
      qab_wait_count(PREFETCH ? routed : gu_done, PREFETCH ? static_cast<uint32_t>(rows) : gu_items);
    }
    __syncthreads();
    QAB_MARK(1);
    // With PREFETCH the block issues its weight loads (they need only the
    // route's inds) before it waits for the gate/up items.
    auto wait_gate_up = [&]() {
      if constexpr (PREFETCH) {
        if (tid == 0) {
          qab_wait_count(gu_done, gu_items);
        }
        __syncthreads();
        QAB_MARK(3);
      }
    };
    const int warp = (d - n * DBLK) * (BLOCK / 32) + (tid >> 5);
    if (warp * QAB_DOWN_RPW < H) {
      qab_moe_down_shared_rows<T, H, I, K, G, true, true, STAGE, ROLL>(
          warp, tid & 31, n, act, inds, scores, d_w, d_scales, d_biases, s_down_w,
          s_down_scales, s_down_biases, sg_logit, h, out, wait_gate_up);
    }
    QAB_MARK(2);
    if constexpr (NP) {
      __syncthreads();
      if (tid == 0) {
        __threadfence();
        atomicAdd(d_done, 1u);
        QAB_MARK(11);  // (profiling builds: fenced and counted)
      }
    }
  } else {
    // Next-projection item: rows [p * 8 PRW, ...) of
    // po[n] = rms_norm(out[n], pnw, peps) pw^T. Its weight loads go out
    // first; then it waits for every down item and reads out[n] through L2.
    int q = tk - (OBLK + RBLK + GBLK + DBLK) * rows;
    int n = q / PBLK;
    np_n = n;
    if constexpr (PSM > 0) {
      qab_q4_gemv_rows_staged<T, T, H, PG, PSM, BLOCK>(
          (q - n * PBLK) * PSM, PN, np_x, pw, ps, pb, po + (size_t)n * PN, gemv_stage,
          gemv_stage_sum, qab_np_stage, np_wait);
      QAB_MARK(2);
    } else {
      // With NPL the block then takes the next tickets (next-projection items
      // too, or none left), each while the item before loads its weights (the
      // atomic's round trip hidden behind them), and for items of the row it
      // has staged skips the wait, the norm and the staging (nothing else
      // writes gemv_stage or its sums here): no block has to start for them.
      bool stage_input = true;
      uint32_t next = 0u;  // (thread 0's)
      while (true) {
        if constexpr (QAB_NPL) {
          if (tid == 0) {
            next = atomicAdd(tickets, 1u);
          }
        }
        qab_q4_gemv_rows<T, T, H, PG, PRW, QAB_GEMV_NT, ROLL>(
            (q - n * PBLK) * (BLOCK / 32) * PRW, PN, np_x, pw, ps, pb, po + (size_t)n * PN,
            gemv_stage, gemv_stage_sum, np_wait, stage_input);
        QAB_MARK(2);
        if constexpr (!QAB_NPL) {
          break;
        }
        __syncthreads();  // every thread is past this item's reads of ticket and the stage
        if (tid == 0) {
          ticket = next;
        }
        __syncthreads();
        const int tn = static_cast<int>(ticket) - GDBLK * rows;
        if (tn >= items) {
          if constexpr (PERSIST) {
            __syncthreads();  // every thread has read ticket before thread 0 takes the next
          }
          break;
        }
        QAB_MARK(0);
        q = tn - (OBLK + RBLK + GBLK + DBLK) * rows;
        stage_input = q / PBLK != n;
        n = q / PBLK;
        np_n = n;
      }
    }
  }
};
// The block's next ticket into tk (every thread; block barriers).
auto take_ticket = [&]() {
  if (tid == 0) {
    ticket = atomicAdd(tickets, 1u);
  }
  __syncthreads();
  // With GD the GDN items hold the first GDBLK N tickets: tk < 0.
  tk = static_cast<int>(ticket) - GDBLK * rows;
  __syncthreads();  // every thread has read it before thread 0 takes the next
};
auto item_done = [&]() {
  if constexpr (QAB_NPS && NPS == 2) {
    np_issue_first();  // after the block's first item
  }
};
// A persistent block runs its items phase by phase, a loop each: its tickets
// only grow, so it meets the phases in order, and each loop holds one
// phase's code (nvcc 13, sm_90: one loop over every phase's code spilled
// 176 bytes in the packed GD build; values every phase uses stayed live
// across it). Without PERSIST a block runs the one item of its ticket.
take_ticket();
if constexpr (PERSIST) {
  auto run_phase = [&](auto phase, const int end) {
    while (tk < end) {
      QAB_MARK(0);
      run_item(phase);
      item_done();
      take_ticket();
    }
  };
  run_phase(QabPhase<0>{}, 0);
  run_phase(QabPhase<1>{}, OBLK * rows);
  run_phase(QabPhase<2>{}, (OBLK + RBLK) * rows);
  run_phase(QabPhase<3>{}, (OBLK + RBLK + GBLK) * rows);
  run_phase(QabPhase<4>{}, (OBLK + RBLK + GBLK + DBLK) * rows);
  run_phase(QabPhase<5>{}, items);
} else if (tk < items) {
  QAB_MARK(0);
  if (GD && tk < 0) {
    run_item(QabPhase<0>{});
  } else if (tk < OBLK * rows) {
    run_item(QabPhase<1>{});
  } else if (tk < (OBLK + RBLK) * rows) {
    run_item(QabPhase<2>{});
  } else if (tk < (OBLK + RBLK + GBLK) * rows) {
    run_item(QabPhase<3>{});
  } else if (tk < (OBLK + RBLK + GBLK + DBLK) * rows) {
    run_item(QabPhase<4>{});
  } else {
    run_item(QabPhase<5>{});
  }
  item_done();
}

if constexpr (QAB_NPS) {
  // The next-projection units of this block, after every ticket is taken:
  // the first one's rows are in (or on their way to) the shared memory; a
  // unit of another chunk copies its own (then not early).
  for (int q = blockIdx.x; q < rows * PBLK; q += gridDim.x) {
    np_n = q / PBLK;
    const int p = q - np_n * PBLK;
    tk = items + q;  // (profiling builds: the unit's marks where its ticket would be)
    if (tid == 0) {
      ticket = static_cast<uint32_t>(GDBLK * rows + tk);
    }
    QAB_MARK(0);
    const bool issue = p != np_staged;
    np_staged = p;
    qab_q4_gemv_rows_staged<T, T, H, PG, PSM, BLOCK>(
        p * PSM, PN, np_x, pw, ps, pb, po + (size_t)np_n * PN, gemv_stage, gemv_stage_sum,
        qab_np_stage, np_wait, issue);
    QAB_MARK(2);
    __syncthreads();  // every thread is done with the staging before the next unit's
  }
}

// The last block out resets the launch's counters (the route reset its own).
__syncthreads();
if (tid == 0) {
  __threadfence();
  const unsigned int done = atomicAdd(exits, 1u);
  if (done == gridDim.x - 1) {
    *tickets = 0u;
    *routed = 0u;
    *gu_done = 0u;
    *o_done = 0u;
    *d_done = 0u;
    *exits = 0u;
    if constexpr (GD) {
      *gd_done = 0u;
    }
    if constexpr (QAB_GSR) {
      for (int i = 0; i < rows; ++i) {
        route_counts[i] = 0u;  // the route left them for the GSR items
      }
    }
    if (!NP) {
      po[0] = static_cast<T>(0.f);  // the one-element placeholder: written, never read
    }
  }
}
