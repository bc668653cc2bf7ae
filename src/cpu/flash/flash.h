// The fused ("flash") attention kernels' interface: plain structs shared by
// the dispatcher (flash.cpp) and the per-instruction-set kernels
// (kernel_*.cpp). Kernels see float32 rows only; packing, dtype conversion,
// threads and reductions happen in the dispatcher.
//
// Layout trick: every score tile is kept transposed, S_T[j][i] (keys in rows,
// queries across vector lanes), so the softmax state m, l and the rescaling
// of O are vertical vector operations, never horizontal reductions.
#pragma once

#include <cstdint>

namespace mha::cpu {

// Key j is visible to query i iff i + lo_shift <= j < i + hi_shift (and 0 <= j < S).
struct Band {
  int64_t lo_shift, hi_shift;
};

// Fills factors[j·ldf + i] (j < cols, i < ldf) with the dropout factor of
// (query i0 + i, key j0 + j), 0 or 1/(1-p), and 0 past rows: the bfloat16
// backward's products reduce over pairs or whole steps of a tile's lanes, so
// a pad lane's P∘F must be 0, not 0 times what the scratch held before (a
// stale -inf made it NaN, and the call fell back to the reference path).
using DropoutTileFn = void (*)(const void* ctx, int64_t i0, int64_t rows, int64_t j0, int64_t cols, float* factors,
                               int64_t ldf);

struct FlashDropout {
  DropoutTileFn fill = nullptr;  // null: no dropout
  const void* ctx = nullptr;
};

// One query tile of one batch entry.
struct FlashForwardTile {
  const float* qt;            // (E, br): the tile's queries transposed; pad columns 0
  float logit_scale;          // scale·log2(e)
  const float* k;             // key row 0; rows k_row apart, elements contiguous
  int64_t k_row;
  const float* v;             // value row 0; rows v_row apart
  int64_t v_row;
  const float* mask;          // additive mask at (i0, 0), or null
  int64_t mask_row, mask_col;
  int64_t i0, rows, S, E, Ev, br;
  Band band;
  FlashDropout dropout;
  float* out;                 // output row i0; rows out_row apart, Ev floats each
  int64_t out_row;
  float* lse;                 // lse of rows i0 … i0+rows-1 (natural log; -inf when fully masked)
  float* weights;             // null, or weights row i0 (rows weights_row apart, S floats): then
  int64_t weights_row;        //   lse is an input and only the weights are written
  float* scratch;             // flash_forward_scratch(E, Ev, br) floats, 64-byte aligned
                              // (+ flash_bf16_scratch(br) for the bfloat16 kernel)
  float* scores;              // null, or where to keep the tile's finished scores for the
                              //   backward: key tile n (keys from n·kFlashKeyTile, the tile's
                              //   key range starting at key 0) at scores + n·kFlashKeyTile·br
  // The bfloat16 kernel only: operands in pairs along each product's reduction.
  const uint16_t* qt2;        // (ceil(E/2), br, 2): query pairs (e, e+1) per lane; zero pad
  const uint16_t* k16;        // bf16 key rows, k16_row apart (even), 2·ceil(E/2) readable (zero pad)
  int64_t k16_row;
  const uint16_t* v2;         // this entry's values as (ceil(S/2), Ev, 2): pairs (j, j+1); zero pad
  // The AMX kernel instead: qt2 with E to a multiple of 32; k16 and vt16 with
  // S to a multiple of kFlashKeyTile, E to a multiple of 32 (zero pad).
  const uint16_t* vt16;       // values transposed: Ev (to a multiple of 16) rows, vt16_row apart, of keys
  int64_t vt16_row;
};

// One batch entry, or the part of it given by the key and query ranges below.
// "Rows" operands are read or written E_pad (Ev_pad) floats wide, a multiple
// of the vector width: the dispatcher pads where the tensors are narrower.
struct FlashBackwardHead {
  const float* qt;     // (L_pad / br) tiles of (E, br): queries transposed
  float logit_scale;   // scale·log2(e)
  const float* q;      // query rows, q_row apart, E_pad readable
  int64_t q_row;
  const float* dot;    // tiles of (Ev, br): dO transposed
  const float* dout;   // dO rows, dout_row apart, Ev_pad readable
  int64_t dout_row;
  const float* lse2;   // (L_pad): lse·log2(e); +inf for fully masked rows and pad rows
  const float* delta;  // (L_pad): D = rowsum(dO∘O); 0 for pad rows
  const float* k;      // key rows, k_row apart, E_pad readable
  int64_t k_row;
  const float* v;      // value rows, v_row apart, Ev readable
  int64_t v_row;
  const float* mask;   // additive mask at (0, 0), or null
  int64_t mask_row, mask_col;
  int64_t L, S, E, Ev, E_pad, Ev_pad, br;
  float scale;
  Band band;
  FlashDropout dropout;
  float* dq;           // dQ rows, dq_row apart, E_pad wide: zeroed by the caller, accumulated
  int64_t dq_row;
  float* dk;           // dK rows, dk_row apart: written (E floats)
  int64_t dk_row;
  float* dv;           // dV rows, dv_row apart: written (Ev floats)
  int64_t dv_row;
  float* scratch;      // flash_backward_scratch(E_pad, Ev_pad, br) floats, 64-byte aligned
  // The part to compute: key tiles in [key_begin, key_end) (multiples of the
  // key tile) against query tiles in [query_begin, query_end) (multiples of br),
  // in ascending order. dK/dV need all queries of their keys and dQ all keys of
  // its queries; every split visits the same products in the same order, so the
  // results do not depend on how the work was divided.
  int64_t key_begin, key_end, query_begin, query_end;
  bool want_dkdv, want_dq;
  // The float32 tile kernel only: null, or the forward's kept scores
  // (FlashForwardTile::scores) of this entry, query tile t's key tile 0 at
  // scores + score_tiles[t]·kFlashKeyTile·br. The backward then reads S_T
  // there instead of computing K·Q_Tᵀ again (the same sums, so the same bits).
  const float* scores;
  const int64_t* score_tiles;
  // The bfloat16 kernel only (then qt, q, dot, dout, k and v are unused):
  // operands in pairs along each product's reduction, zero padded.
  const uint16_t* qt2;    // (L_pad / br) tiles of (ceil(E/2), br, 2): query pairs (e, e+1) per lane
  const uint16_t* dot2;   // tiles of (ceil(Ev/2), br, 2): dO pairs (e, e+1) per lane
  const uint16_t* q2;     // (L_pad/2, E_pad, 2): query pairs (i, i+1) per element e
  const uint16_t* dout2;  // (L_pad/2, Ev_pad, 2): dO pairs (i, i+1) per element e
  const uint16_t* k16;    // key rows, k16_row apart (even), 2·ceil(E/2) readable
  int64_t k16_row;
  const uint16_t* v16;    // value rows, v16_row apart (even), 2·ceil(Ev/2) readable
  int64_t v16_row;
  const uint16_t* k2;     // (ceil(S/2), E_pad, 2): key pairs (j, j+1) per element e
  // The AMX kernel reads the same with more padding: qt2 and dot2 with E and
  // Ev to a multiple of 32, q2 and dout2 with 16 more query pairs than
  // L_pad/2, k16, v16 and k2 with S to a multiple of kFlashKeyTile, k16 and
  // v16 with E and Ev to a multiple of 32.
};

// A few query rows of one batch entry (decoding: one new query a step), for
// which a tile of queries across the vector lanes would leave most lanes
// idle: each row's scores are dot products along E against the keys of its
// band, its softmax runs across the keys, and its output sums value rows.
struct FlashDecodeRows {
  const float* q;      // query row i0 (unscaled), rows q_row apart, E floats
  int64_t q_row;
  float logit_scale;   // scale·log2(e)
  const float* k;      // key row 0; rows k_row apart, E floats
  int64_t k_row;
  const float* v;      // value row 0; rows v_row apart, Ev floats
  int64_t v_row;
  const uint16_t* k16;  // or, where not null, keys and values as bfloat16 (their bits),
  const uint16_t* v16;  // rows k_row and v_row apart; k and v unused then
  const float* mask;   // additive mask at (i0, 0), or null
  int64_t mask_row, mask_col;
  int64_t i0, rows, S, E, Ev;
  Band band;
  float* out;          // output row i0; rows out_row apart, Ev floats
  int64_t out_row;
  float* lse;          // lse of rows i0 … (natural log; -inf when fully masked)
  float* scratch;      // flash_decode_scratch(S, E) floats, 64-byte aligned (W ≤ 16)
};
inline int64_t flash_decode_scratch(int64_t S, int64_t E) { return S + E + 192; }
// The backward of few query rows (flash_backward_rows_*: a FlashBackwardHead
// without dropout; its tiles and the bfloat16 operands unused) needs this much.
inline int64_t flash_rows_backward_scratch(int64_t S, int64_t E_pad, int64_t Ev_pad) {
  return 2 * (S + 128) + E_pad + Ev_pad + 64;
}

// Largest query tile width a dispatcher may choose.
inline constexpr int64_t kFlashQueryTileMax = 64;

// Key tile height of every kernel.
inline constexpr int64_t kFlashKeyTile = 64;

// Rows of the forward's O_T: Ev, to a multiple of 16 (AMX writes whole tiles).
inline int64_t flash_value_rows(int64_t Ev) { return (Ev + 15) / 16 * 16; }
inline int64_t flash_forward_scratch(int64_t E, int64_t Ev, int64_t br) {
  (void)E;
  return 2 * kFlashKeyTile * br + flash_value_rows(Ev) * br + 2 * br + 64;
}
inline int64_t flash_bf16_scratch(int64_t br) { return kFlashKeyTile * br / 2 + 64; }
inline int64_t flash_backward_scratch(int64_t E_pad, int64_t Ev_pad, int64_t br) {
  return 4 * kFlashKeyTile * br + kFlashKeyTile * (E_pad + Ev_pad) + 64;
}
inline int64_t flash_bf16_backward_scratch(int64_t br) { return 3 * kFlashKeyTile * br / 2 + 64; }
inline int64_t flash_amx_backward_scratch(int64_t br) { return kFlashKeyTile * ((br + 31) / 32 * 32 + br) + 64; }

// The kernels of each instruction set (kernel_*.cpp). Call one only when the
// CPU supports its instruction set (flash.cpp chooses).
#define MHA_DECLARE_FLASH_KERNELS(isa)                         \
  void flash_forward_tile_##isa(const FlashForwardTile& t);    \
  void flash_backward_head_##isa(const FlashBackwardHead& h);  \
  void flash_decode_rows_##isa(const FlashDecodeRows& d);      \
  void flash_backward_rows_##isa(const FlashBackwardHead& h);
MHA_DECLARE_FLASH_KERNELS(scalar)
MHA_DECLARE_FLASH_KERNELS(avx2)
MHA_DECLARE_FLASH_KERNELS(avx512)
#undef MHA_DECLARE_FLASH_KERNELS
// Need AVX512-BF16. The backward's scratch is flash_backward_scratch +
// flash_bf16_backward_scratch floats.
void flash_forward_tile_bf16_avx512(const FlashForwardTile& t);
void flash_backward_head_bf16_avx512(const FlashBackwardHead& h);
// Need AMX (amx_bf16_usable(), cpu/gemm.h); the backward's scratch is
// flash_backward_scratch + flash_amx_backward_scratch floats, the forward's
// flash_forward_scratch + flash_bf16_scratch.
void flash_forward_tile_amx(const FlashForwardTile& t);
void flash_backward_head_amx(const FlashBackwardHead& h);

}  // namespace mha::cpu
