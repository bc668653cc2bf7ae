// The fused attention kernels with their products on AMX tiles (bfloat16
// operands, float32 sums; cpu/amx.h), built for avx512 + AMX: kernel.h's
// forward and backward (the softmax, masks and dropout on float32 vectors),
// with these products.
//
// Every score tile stays transposed as in kernel.h, S_T (keys × queries), so
// that AMX's A operand is always a matrix read along its rows and its B
// operand one in pairs along the reduction:
//   S_T  = K · Q_T          A: key rows                B: query pairs along e (qt2)
//   dP_T = V · dO_T         A: value rows              B: dO pairs along e (dot2)
//   O_T += Vᵀ · P_T         A: values transposed       B: P_T in key pairs
//   dV  += P_T · dO         A: P_T rows (bf16)         B: dO in query pairs (dout2)
//   dK  += dS_T · Q         A: dS_T rows (bf16)        B: Q in query pairs (q2)
//   dQ  += dS · K           A: dS (dS_T's key pairs, 16 × 16 words transposed)
//                                                      B: K in key pairs (k2)
// A row of an A tile holds 32 elements along the reduction, a B tile 16
// pairs of it: the dispatcher pads E and Ev to 32 and the keys to whole key
// tiles with zeros, and the kernels zero what they pad themselves (query
// columns past the tile, key pairs past the tile's keys), so that padding
// adds 0 · (finite) = 0.
#define MHA_SIMD_AVX512 1
#define MHA_ISA_NAMESPACE amx
#include "cpu/flash/kernel.h"

#include <cstring>

#include "cpu/amx.h"

namespace mha::cpu::amx {

namespace {

constexpr int64_t T = kAmxTile;

inline int64_t up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Zero key pairs [from, to) of a (pairs, br, 2) buffer.
inline void zero_pairs(uint16_t* pairs, int64_t br, int64_t from, int64_t to) {
  if (to > from) std::memset(pairs + from * br * 2, 0, size_t((to - from) * br * 2) * sizeof(uint16_t));
}

// S_T (rows of st to a multiple of 16, br columns) = K[j0 …] · Q_T: key rows
// (k16) against a tile of query pairs (qt2: up(E, 32)/2 pair rows of br).
inline void scores_amx(const uint16_t* k16, int64_t k16_row, const uint16_t* qt2, int64_t E, int64_t br, int64_t j0,
                       int64_t cols, float* st) {
  const AmxOperand a{k16 + j0 * k16_row, k16_row * 2, T * k16_row * 2, 64};
  const AmxOperand b{qt2, br * 4, 64, T * br * 4};
  amx_product(a, (cols + T - 1) / T, b, br / T, up(E, 32) / 32, false, st, br, kFlashKeyTile, br);
}

struct AmxProducts {
  const FlashForwardTile& t;
  uint16_t* pt2;  // (Bc/2, br, 2): probabilities in key pairs
  static constexpr int64_t key_align = 1;

  void scores(int64_t j0, int64_t cols, float* st) const { scores_amx(t.k16, t.k16_row, t.qt2, t.E, t.br, j0, cols, st); }
  // O_T (Ev rows to 16 × br) += Vᵀ[:, j0 …] · P_T.
  void accumulate(int64_t j0, int64_t cols, const float* pt, float* ot) const {
    const int64_t steps = (cols + 31) / 32;
    pairs_along_keys(pt, t.br, cols, pt2);
    zero_pairs(pt2, t.br, (cols + 1) / 2, steps * T);
    const AmxOperand a{t.vt16 + j0, t.vt16_row * 2, T * t.vt16_row * 2, 64};
    const AmxOperand b{pt2, t.br * 4, 64, T * t.br * 4};
    const int64_t rows = flash_value_rows(t.Ev);
    amx_product(a, rows / T, b, t.br / T, steps, true, ot, t.br, rows, t.br);
  }
};

struct AmxBackwardProducts {
  const FlashBackwardHead& h;
  int64_t br32;    // br to a multiple of 32: the queries of a tile as whole steps
  uint16_t* p16;   // (Bc, br32): P∘F rounded, zero past br
  uint16_t* ds16;  // (Bc, br32): dS·scale rounded, zero past br
  uint16_t* ds2;   // (Bc/2, br, 2): dS·scale rounded, in key pairs
  uint32_t* dsq;   // (br, Bc/2) words: ds2 transposed, query rows of key pairs

  void scores(int64_t j0, int64_t cols, int64_t tile, float* st) const {
    scores_amx(h.k16, h.k16_row, h.qt2 + tile * up(h.E, 32) * h.br, h.E, h.br, j0, cols, st);
  }
  // (No kept scores with bfloat16 products, so nothing `ahead`.)
  void dprobs(int64_t j0, int64_t cols, int64_t tile, float* dpt, const Ahead&) const {
    scores_amx(h.v16, h.v16_row, h.dot2 + tile * up(h.Ev, 32) * h.br, h.Ev, h.br, j0, cols, dpt);
  }
  // dV (cols × Ev_pad) += (P∘F)_T · dO, dK (cols × E_pad) += (dS·scale)_T · Q
  // over the tile's queries (pad queries: P = dS = 0, and their dO and Q 0).
  void key_gradients(int64_t cols, int64_t i0, int64_t rows, const float* pdrop, const float* dst, float* dk_acc,
                     float* dv_acc, const Ahead&) const {
    (void)rows;
    round_rows(pdrop, cols, h.br, p16, br32);
    round_rows(dst, cols, h.br, ds16, br32);
    const int64_t key_tiles = (cols + T - 1) / T, steps = br32 / 32;
    const AmxOperand dout{h.dout2 + i0 * h.Ev_pad, h.Ev_pad * 4, 64, T * h.Ev_pad * 4};
    amx_product({p16, br32 * 2, T * br32 * 2, 64}, key_tiles, dout, h.Ev_pad / T, steps, true, dv_acc, h.Ev_pad,
                kFlashKeyTile, h.Ev_pad);
    const AmxOperand q{h.q2 + i0 * h.E_pad, h.E_pad * 4, 64, T * h.E_pad * 4};
    amx_product({ds16, br32 * 2, T * br32 * 2, 64}, key_tiles, q, h.E_pad / T, steps, true, dk_acc, h.E_pad,
                kFlashKeyTile, h.E_pad);
  }
  // dQ (rows × E_pad) += (dS·scale) · K over the tile's keys.
  void query_gradient(int64_t j0, int64_t cols, int64_t i0, int64_t rows, const float* dst, const Ahead&) const {
    const int64_t steps = (cols + 31) / 32;
    pairs_along_keys(dst, h.br, cols, ds2);
    zero_pairs(ds2, h.br, (cols + 1) / 2, steps * T);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(ds2);
    for (int64_t jb = 0; jb < steps; ++jb)
      for (int64_t ib = 0; ib < h.br / T; ++ib) {
        __m512i r[16];
        for (int64_t x = 0; x < T; ++x) r[x] = _mm512_loadu_si512(words + (jb * T + x) * h.br + ib * T);
        transpose16(r);
        for (int64_t x = 0; x < T; ++x) _mm512_storeu_si512(dsq + (ib * T + x) * (kFlashKeyTile / 2) + jb * T, r[x]);
      }
    const AmxOperand a{dsq, kFlashKeyTile * 2, T * kFlashKeyTile * 2, 64};
    const AmxOperand k{h.k2 + j0 * h.E_pad, h.E_pad * 4, 64, T * h.E_pad * 4};
    amx_product(a, h.br / T, k, h.E_pad / T, steps, true, h.dq + i0 * h.dq_row, h.dq_row, rows, h.E_pad);
  }
};

}  // namespace

}  // namespace mha::cpu::amx

namespace mha::cpu {

void flash_forward_tile_amx(const FlashForwardTile& t) {
  amx_configure();
  uint16_t* pt2 = reinterpret_cast<uint16_t*>(t.scratch + flash_forward_scratch(t.E, t.Ev, t.br));
  amx::forward_tile_with(t, amx::AmxProducts{t, pt2});
  _tile_release();
}

void flash_backward_head_amx(const FlashBackwardHead& h) {
  amx_configure();
  const int64_t br32 = (h.br + 31) / 32 * 32;
  uint16_t* p16 = reinterpret_cast<uint16_t*>(h.scratch + flash_backward_scratch(h.E_pad, h.Ev_pad, h.br));
  uint16_t* ds16 = p16 + kFlashKeyTile * br32;
  uint16_t* ds2 = ds16 + kFlashKeyTile * br32;
  uint32_t* dsq = reinterpret_cast<uint32_t*>(ds2 + kFlashKeyTile * h.br);
  amx::backward_head_with(h, amx::AmxBackwardProducts{h, br32, p16, ds16, ds2, dsq});
  _tile_release();
}

}  // namespace mha::cpu
