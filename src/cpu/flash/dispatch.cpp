// The fused attention path above the kernels: picks the instruction set once,
// packs query tiles (transposed, scaled, float32), converts keys/values that
// are not float32 rows (float_operands.h, bf16_operands.h), runs tiles on
// OpenMP threads and folds gradients.
#include "cpu/flash/dispatch.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "check.h"
#include "cpu/flash/bf16_operands.h"
#include "cpu/flash/float_operands.h"
#include "cpu/flash/kept_scores.h"
#include "cpu/gemm.h"
#include "cpu/parallel.h"
#include "cpu/reduce.h"
#include "cpu/scratch.h"
#include "finite.h"
#include "random/philox.h"

namespace mha::cpu {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

struct Kernels {
  Isa isa;
  int64_t width;
  void (*forward_tile)(const FlashForwardTile&);
  void (*backward_head)(const FlashBackwardHead&);
  void (*decode_rows)(const FlashDecodeRows&);
  void (*backward_rows)(const FlashBackwardHead&);
};

Kernels kernels_for(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return {isa, 16, &flash_forward_tile_avx512, &flash_backward_head_avx512, &flash_decode_rows_avx512,
              &flash_backward_rows_avx512};
    case Isa::avx2:
      return {isa, 8, &flash_forward_tile_avx2, &flash_backward_head_avx2, &flash_decode_rows_avx2,
              &flash_backward_rows_avx2};
    case Isa::scalar: break;
  }
  return {Isa::scalar, 8, &flash_forward_tile_scalar, &flash_backward_head_scalar, &flash_decode_rows_scalar,
          &flash_backward_rows_scalar};
}

bool cpu_supports(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    case Isa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::scalar: return true;
  }
  return false;
}

Isa default_isa() {
  if (const char* env = std::getenv("MHA_ISA")) {
    for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
      if (to_string(isa) == env && cpu_supports(isa)) return isa;
  }
  return supported_isas().back();
}

std::optional<Isa>& forced() {
  static std::optional<Isa> isa;
  return isa;
}

// Query tile width: 64 rows (4 AVX-512 vectors). Against 32 it halves the key
// and value traffic per query, which pays at long lengths (L = 16384, E = 128:
// forward 3.95 s vs 5.1-5.8 s) and costs nothing at L = 1024-4096; 128 gained
// little more in forward and lost in backward (coarser causal tiles).
constexpr int64_t kQueryTile = 64;
static_assert(kQueryTile <= kFlashQueryTileMax);

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Work item `item` of batch × tiles query tiles: its entry b and first query
// i0. Each entry's tiles go last first: under a causal mask a tile's keys grow
// with its index, and a dynamic schedule that hands out the largest items
// first ends on the smallest (the threads finish within one small tile of
// each other, not one large one). The results do not depend on the order.
struct QueryTileItem {
  int64_t b, i0;
};
QueryTileItem query_tile_item(int64_t item, int64_t tiles, int64_t br) {
  return {item / tiles, (tiles - 1 - item % tiles) * br};
}

// Query tile width for L queries: as few tiles as kQueryTile allows, each as
// narrow as its share of L in whole vectors. Lanes past L are computed and
// thrown away, so L = 131 in tiles of 64 filled 131 of 192 lanes (the third
// tile 3 of 64) and in tiles of 48, 131 of 144; a causal tile's keys end at
// its last query, so narrower tiles also skip more of the masked triangle.
// One decoding step's query takes one vector. The split changes which lanes
// share a tile, never a query's sums or their order.
int64_t query_tile(int64_t L, int64_t width) {
  if (L <= 0) return width;
  const int64_t tiles = (L + kQueryTile - 1) / kQueryTile;
  return std::min(kQueryTile, round_up((L + tiles - 1) / tiles, width));
}

// The kernels for bfloat16 attention, as bf16_products() chooses for the
// layers' products: on float32 rows of the widened values (widen, also for
// every other dtype and instruction set), on vdpbf16ps (dot), on AMX (amx).
Bf16Products bf16_kernel_for(const AttentionParams& p) {
  if (p.dtype != DType::bfloat16 || active_isa() != Isa::avx512) return Bf16Products::widen;
  return bf16_products();
}

// Whether an input reads one distinct block per output batch entry, in order
// (no broadcast, no grouped heads): then its gradient needs no reduction.
bool one_to_one(const Tensor& t, const AttentionParams& p) { return leading(t.shape()) == p.batch_shape; }

Band band_of(const AttentionParams& p) { return {p.lo_shift, p.hi_shift}; }

struct DropoutContext {
  uint64_t seed, b;
  uint32_t threshold;
  float scale;
};

void fill_dropout(const void* ctx, int64_t i0, int64_t rows, int64_t j0, int64_t cols, float* factors, int64_t ldf) {
  const auto& d = *static_cast<const DropoutContext*>(ctx);
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t i = 0; i < rows; ++i)
      factors[j * ldf + i] =
          dropout_keep(d.seed, d.b, uint64_t(i0 + i), uint64_t(j0 + j), d.threshold) ? d.scale : 0.0f;
    for (int64_t i = rows; i < ldf; ++i) factors[j * ldf + i] = 0.0f;
  }
}

}  // namespace

std::string to_string(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::scalar: break;
  }
  return "scalar";
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (cpu_supports(isa)) out.push_back(isa);
  return out;
}

Isa active_isa() {
  static const Isa chosen = default_isa();
  return forced() ? *forced() : chosen;
}

void force_isa(std::optional<Isa> isa) {
  if (isa && !cpu_supports(*isa))
    raise<DeviceError>("mha::cpu::force_isa", "isa", "an instruction set this CPU supports", to_string(*isa));
  forced() = isa;
}

namespace {

// Whether L queries go by rows (decode_rows, backward_rows) instead of query
// tiles: a tile of W lanes would leave at least three quarters of them idle
// (decoding: one query, 1 of 16 lanes busy). Not with dropout or returned
// weights, which the tile kernel draws and writes; the backward follows the
// forward's choice, since P from the saved lse needs the forward's scores.
bool by_rows(const AttentionParams& p, int64_t width) {
  return 4 * p.L <= width && p.dropout_p == 0 && !p.return_weights;
}

// The forward by rows: each entry's few queries on one thread; K and V as
// float32 rows, or bfloat16 rows with a unit last stride as they are (the
// kernel widens them as it reads: converting a decoding step's KV cache
// first took 22% of bf16-mixed decoding at wide).
bool forward_by_rows(const AttentionParams& p, const Kernels& k, AttentionOutput& r) {
  const int64_t L = p.L, S = p.S, E = p.E, Ev = p.Ev;
  const bool bf16 = p.k.dtype() == DType::bfloat16 && p.v.dtype() == DType::bfloat16 && p.k.stride(-1) == 1 &&
                    p.v.stride(-1) == 1;
  const FloatRows keys = float_rows(p.k, p, E, false, bf16), values = float_rows(p.v, p, Ev, false, bf16);
  const Loader q{p.q.raw_data(), p.dtype};
  const bool float_out = p.dtype == DType::float32;
  const float* mask = p.mask.defined() ? p.mask.data<float>() : nullptr;
  const int64_t f = sizeof(float);
  const PerThread queries = per_thread_scratch(ScratchSlot::flash_a, L * E * f);
  const PerThread works = per_thread_scratch(ScratchSlot::flash_b, flash_decode_scratch(S, E) * f);
  const PerThread outs = per_thread_scratch(ScratchSlot::flash_c, float_out ? 0 : L * Ev * f);
  const EntryRows o = entry_rows(r.out, p);
  bool finite = true;
#pragma omp parallel for schedule(static) reduction(&& : finite) if (p.batch * L * S * (E + Ev) >= (int64_t(1) << 15))
  for (int64_t b = 0; b < p.batch; ++b) {
    FlashDecodeRows d{};
    float* qrows = static_cast<float*>(own_slice(queries));
    q.typed(p.q_offset[size_t(b)], [&](const auto* first) {
      for (int64_t i = 0; i < L; ++i)
        for (int64_t e = 0; e < E; ++e) qrows[i * E + e] = float(first[i * p.q_row + e * p.q_col]);
    });
    d.q = qrows, d.q_row = E, d.logit_scale = float(p.scale) * kLog2e;
    if (bf16) d.k16 = keys.at16(b), d.v16 = values.at16(b);
    else d.k = keys.at(b), d.v = values.at(b);
    d.k_row = keys.row, d.v_row = values.row;
    d.mask = mask ? mask + p.mask_offset[size_t(b)] : nullptr;
    d.mask_row = p.mask_row, d.mask_col = p.mask_col;
    d.i0 = 0, d.rows = L, d.S = S, d.E = E, d.Ev = Ev;
    d.band = band_of(p);
    d.out = float_out ? r.out.data<float>() + o.offset[size_t(b)] : static_cast<float*>(own_slice(outs));
    d.out_row = float_out ? o.row : Ev;
    d.lse = r.lse.data<float>() + b * L;
    d.scratch = static_cast<float*>(own_slice(works));
    k.decode_rows(d);
    finite = finite && all_finite(d.out, L, Ev, d.out_row) && all_finite(d.lse, L, true);
    if (!float_out) store_rows(d.out, L, Ev, r.out.data<bfloat16>() + o.offset[size_t(b)], o.row);
  }
  return finite;
}

}  // namespace

bool flash_attention_forward(const AttentionParams& p, AttentionOutput& r) {
  const Kernels k = kernels_for(active_isa());
  if (by_rows(p, k.width)) return forward_by_rows(p, k, r);
  const int64_t br = query_tile(p.L, k.width), tiles = (p.L + br - 1) / br, E = p.E, Ev = p.Ev, L = p.L, S = p.S;
  const Bf16Products kernel16 = bf16_kernel_for(p);
  const bool bf16_kernel = kernel16 != Bf16Products::widen, amx = kernel16 == Bf16Products::amx;
  // Each key and value row is read once per query tile: compact rows when there are several.
  const FloatRows keys = bf16_kernel ? FloatRows{} : float_rows(p.k, p, E, tiles > 1);
  const FloatRows values = bf16_kernel ? FloatRows{} : float_rows(p.v, p, Ev, tiles > 1);
  const int64_t E2 = bf16_e_pairs(kernel16 == Bf16Products::amx, E), S_pad = round_up(S, kFlashKeyTile);
  Bf16Rows keys16, value_pairs, values_t;
  if (kernel16 == Bf16Products::dot) keys16 = bf16_rows(p.k, p, round_up(E, 2), S), value_pairs = bf16_pairs(p.v, p, Ev, (S + 1) / 2);
  if (amx) keys16 = bf16_rows(p.k, p, 2 * E2, S_pad), values_t = bf16_transposed(p.v, p, flash_value_rows(Ev), S_pad);
  void (*forward_tile)(const FlashForwardTile&) =
      amx ? &flash_forward_tile_amx : bf16_kernel ? &flash_forward_tile_bf16_avx512 : k.forward_tile;
  const Loader q{p.q.raw_data(), p.dtype};
  const bool float_out = p.dtype == DType::float32;
  const float* mask = p.mask.defined() ? p.mask.data<float>() : nullptr;
  float* lse = r.lse.data<float>();
  const float logit_scale = float(p.scale) * kLog2e;
  const uint32_t threshold = dropout_threshold(p.dropout_p);
  const float drop_scale = float(1.0 / (1.0 - p.dropout_p));

  // Each thread's buffers, taken before the region (an allocation that fails
  // there throws on the calling thread): the packed query tile, the tile's
  // work space, and (bfloat16 outputs) the float32 output and weights.
  const int64_t f = sizeof(float);
  const PerThread query_tiles = per_thread_scratch(ScratchSlot::flash_a, (bf16_kernel ? E2 * br : E * br) * f);
  const PerThread works = per_thread_scratch(ScratchSlot::flash_b, (flash_forward_scratch(E, Ev, br) + flash_bf16_scratch(br)) * f);
  const PerThread outs = per_thread_scratch(ScratchSlot::flash_c, float_out ? 0 : br * Ev * f);
  const PerThread weight_tiles = per_thread_scratch(ScratchSlot::flash_d, float_out || !p.return_weights ? 0 : br * S * f);
  const EntryRows o = entry_rows(r.out, p);
  // The float32 kernels keep the scores when asked and they fit, in the
  // budget and under the memory limit (set_memory_limit): past it the call
  // runs as without them, not into a MemoryError of its own making.
  std::optional<ScoreLayout> kept = bf16_kernel ? std::nullopt : score_layout(p, br);
  if (kept) try {
      r.scores = Tensor::empty(kept->shape(p.batch), DType::float32);
    } catch (const MemoryError&) {
      kept.reset();
    }

  bool finite = true;
#pragma omp parallel for schedule(dynamic, 1) reduction(&& : finite)
  for (int64_t item = 0; item < p.batch * tiles; ++item) {
    const auto [b, i0] = query_tile_item(item, tiles, br);
    const int64_t rows = std::min(br, L - i0);
    const DropoutContext drop{p.dropout_seed, uint64_t(b), threshold, drop_scale};
    FlashForwardTile t{};
    if (bf16_kernel) {
      uint16_t* qt2 = static_cast<uint16_t*>(own_slice(query_tiles));
      pack_query_pairs(p.q.data<bfloat16>() + p.q_offset[size_t(b)], p.q_row, p.q_col, i0, rows, E, E2, br, qt2);
      t.qt2 = qt2;
      t.k16 = keys16.at(b), t.k16_row = keys16.row;
      if (amx) t.vt16 = values_t.at(b), t.vt16_row = values_t.row;
      else t.v2 = value_pairs.at(b);
    } else {
      float* qt = static_cast<float*>(own_slice(query_tiles));
      pack_transposed(q, p.q_offset[size_t(b)], p.q_row, p.q_col, i0, rows, E, br, qt);
      t.qt = qt;
      t.k = keys.at(b), t.k_row = keys.row;
      t.v = values.at(b), t.v_row = values.row;
    }
    t.logit_scale = logit_scale;
    t.mask = mask ? mask + p.mask_offset[size_t(b)] + i0 * p.mask_row : nullptr;
    t.mask_row = p.mask_row, t.mask_col = p.mask_col;
    t.i0 = i0, t.rows = rows, t.S = S, t.E = E, t.Ev = Ev, t.br = br;
    t.band = band_of(p);
    if (p.dropout_p > 0) t.dropout = {&fill_dropout, &drop};
    t.out = float_out ? r.out.data<float>() + o.offset[size_t(b)] + i0 * o.row : static_cast<float*>(own_slice(outs));
    t.out_row = float_out ? o.row : Ev;
    t.lse = lse + b * L + i0;
    t.scratch = static_cast<float*>(own_slice(works));
    if (kept) t.scores = kept->entry(r.scores.data<float>(), b) + kept->first[size_t(i0 / br)] * kept->tile_floats();
    forward_tile(t);
    finite = finite && all_finite(t.out, rows, Ev, t.out_row) && all_finite(t.lse, rows, true);
    if (!float_out) store_rows(t.out, rows, Ev, r.out.data<bfloat16>() + o.offset[size_t(b)] + i0 * o.row, o.row);
    if (p.return_weights) {  // a second pass: P = exp(s - lse), now that lse is known
      t.weights = float_out ? r.weights.data<float>() + (b * L + i0) * S : static_cast<float*>(own_slice(weight_tiles));
      t.weights_row = S;
      forward_tile(t);
      if (!float_out) {
        bfloat16* w = r.weights.data<bfloat16>() + (b * L + i0) * S;
        for (int64_t x = 0; x < rows * S; ++x) w[x] = bfloat16(t.weights[x]);
      }
    }
  }
  return finite;
}

namespace {

// Everything the backward of one call shares between batch entries.
struct BackwardPlan {
  const AttentionParams& p;
  Kernels kernels;
  int64_t br, L, S, E, Ev, tiles, L_pad, E_pad, Ev_pad;
  FloatRows keys, values, queries, douts;
  Tensor out, lse;  // out as the forward left it (perhaps a view: rows per out_rows)
  EntryRows out_rows;
  // The gradients' float rows, per batch entry: the outputs themselves or buffers.
  float* dq_base;
  float* dk_base;
  float* dv_base;
  EntryRows dq_rows, dk_rows, dv_rows;
  float* dq_at(int64_t b) const { return dq_base + dq_rows.offset[size_t(b)]; }
  float* dk_at(int64_t b) const { return dk_base + dk_rows.offset[size_t(b)]; }
  float* dv_at(int64_t b) const { return dv_base + dv_rows.offset[size_t(b)]; }
  uint32_t threshold;
  float drop_scale;
  // The forward's kept scores and their layout, where the backward reads them.
  const float* scores = nullptr;
  std::optional<ScoreLayout> kept;
  // A bfloat16 kernel (kernel16 dot or amx) reads these instead of the float rows.
  Bf16Products kernel16 = Bf16Products::widen;
  int64_t E2 = 0, Ev2 = 0, pair_rows = 0;  // pair rows of qt2's and dot2's tiles, of q2 and dout2
  Bf16Rows k16, v16, k2;
  Tensor dout16;  // dO, contiguous
  bool bf16() const { return kernel16 != Bf16Products::widen; }

  void use_bf16_kernel(Bf16Products kernel, const Tensor& dout) {
    kernel16 = kernel;
    const bool amx = kernel == Bf16Products::amx;
    E2 = bf16_e_pairs(amx, E), Ev2 = bf16_e_pairs(amx, Ev);
    pair_rows = L_pad / 2 + (amx ? 16 : 0);  // AMX reads whole steps of 32 queries from any tile
    const int64_t rows = amx ? round_up(S, kFlashKeyTile) : S;
    k16 = bf16_rows(p.k, p, amx ? 2 * E2 : round_up(E, 2), rows);
    v16 = bf16_rows(p.v, p, amx ? 2 * Ev2 : round_up(Ev, 2), rows);
    k2 = bf16_pairs(p.k, p, E_pad, (rows + 1) / 2);
    dout16 = dout.contiguous();
  }

  // Per-entry packed operands: lse·log2e and D, and Q and dO in transposed
  // tiles (float32), or, for the bfloat16 kernel, in tiles of pairs along e
  // and in row pairs. Float rows of Q, dO and K that lie apart (the heads of
  // a (N, L, H·E) tensor) are copied together as well: the kernel's products
  // read 64 such rows as B for each 6-row micro-tile, and at a stride of 1
  // KiB their 256 lines fall into 16 of L1's 64 sets, 192 lines' room, so
  // that each micro-tile fetched them again from L2 (training at L = 2040:
  // 2.6% more tokens/s with the copies, which cost what a pass over the rows
  // costs, here where they are read for the transposed tiles anyway).
  struct Packed {
    float *lse2, *delta, *qt, *dot;
    uint16_t *qt2, *dot2, *q2, *dout2;
    float *q = nullptr, *dout = nullptr, *k = nullptr;
  };
  bool copies_rows() const { return !bf16() && (queries.row != E_pad || douts.row != Ev_pad || keys.row != E_pad); }
  int64_t packed_floats() const {
    if (!bf16()) return L_pad * (E + Ev + 2) + (copies_rows() ? L * (E_pad + Ev_pad) + S * E_pad : 0);
    return L_pad * (2 + E2 + Ev2) + pair_rows * (E_pad + Ev_pad);
  }
  Packed carve(float* base) const {
    Packed d{base, base + L_pad, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
    float* rest = base + 2 * L_pad;
    if (!bf16()) {
      d.qt = rest, d.dot = rest + L_pad * E;
      if (copies_rows()) d.q = d.dot + L_pad * Ev, d.dout = d.q + L * E_pad, d.k = d.dout + L * Ev_pad;
      return d;
    }
    d.qt2 = reinterpret_cast<uint16_t*>(rest);
    d.dot2 = d.qt2 + L_pad * 2 * E2;
    d.q2 = d.dot2 + L_pad * 2 * Ev2;
    d.dout2 = d.q2 + pair_rows * 2 * E_pad;
    return d;
  }

  void pack(int64_t b, const Packed& d) const {
    const Loader o{out.raw_data(), p.dtype};
    const float* l = lse.data<float>();
    if (bf16()) {
      const bfloat16* q = p.q.data<bfloat16>() + p.q_offset[size_t(b)];
      const bfloat16* dout = dout16.data<bfloat16>() + b * L * Ev;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * br, rows = std::min(br, L - i0);
        pack_query_pairs(q, p.q_row, p.q_col, i0, rows, E, E2, br, d.qt2 + tile * E2 * br * 2);
        pack_query_pairs(dout, Ev, 1, i0, rows, Ev, Ev2, br, d.dot2 + tile * Ev2 * br * 2);
      }
      pack_row_pairs(q, p.q_row, p.q_col, L, E, 2 * pair_rows, E_pad, d.q2);
      pack_row_pairs(dout, Ev, 1, L, Ev, 2 * pair_rows, Ev_pad, d.dout2);
    } else {
      const float* q_rows = queries.at(b);
      const float* d_rows = douts.at(b);
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * br, rows = std::min(br, L - i0);
        pack_transposed({q_rows, DType::float32}, 0, queries.row, 1, i0, rows, E, br, d.qt + tile * E * br);
        pack_transposed({d_rows, DType::float32}, 0, douts.row, 1, i0, rows, Ev, br, d.dot + tile * Ev * br);
      }
      if (d.q) {  // whole padded rows: the products read the pad columns too (a padded copy's are 0)
        const auto copy_rows = [](float* dst, const float* src, int64_t rows, int64_t row, int64_t width) {
          for (int64_t i = 0; i < rows; ++i) std::memcpy(dst + i * width, src + i * row, size_t(width) * sizeof(float));
        };
        copy_rows(d.q, q_rows, L, queries.row, E_pad);
        copy_rows(d.dout, d_rows, L, douts.row, Ev_pad);
        copy_rows(d.k, keys.at(b), S, keys.row, E_pad);
      }
    }
    // D_i = Σ_e dO_ie·O_ie in double, in four running sums (one chain of
    // dependent adds took as long as the backward's products at E = 32).
    const Loader dl = bf16() ? Loader{dout16.data<bfloat16>() + b * L * Ev, p.dtype} : Loader{douts.at(b), DType::float32};
    const int64_t d_row = bf16() ? Ev : douts.row;
    dl.typed(0, [&](const auto* d_rows) {
      o.typed(out_rows.offset[size_t(b)], [&](const auto* o_rows) {
        for (int64_t i = 0; i < L_pad; ++i) {
          double part[4] = {};
          if (i < L) {
            const auto* dr = d_rows + i * d_row;
            const auto* orow = o_rows + i * out_rows.row;
            int64_t e = 0;
            for (; e + 4 <= Ev; e += 4)
              for (int u = 0; u < 4; ++u) part[u] += double(float(dr[e + u])) * double(float(orow[e + u]));
            for (; e < Ev; ++e) part[0] += double(float(dr[e])) * double(float(orow[e]));
          }
          const double delta = (part[0] + part[1]) + (part[2] + part[3]);
          const float li = i < L ? l[b * L + i] : -INFINITY;
          d.lse2[i] = li == -INFINITY ? INFINITY : li * kLog2e;
          d.delta[i] = float(delta);
        }
      });
    });
  }

  FlashBackwardHead head(int64_t b, const Packed& d, const DropoutContext& drop, float* scratch) const {
    FlashBackwardHead h{};
    h.logit_scale = float(p.scale) * kLog2e;
    if (bf16()) {
      h.qt2 = d.qt2, h.dot2 = d.dot2, h.q2 = d.q2, h.dout2 = d.dout2;
      h.k16 = k16.at(b), h.k16_row = k16.row, h.v16 = v16.at(b), h.v16_row = v16.row, h.k2 = k2.at(b);
    } else {
      h.qt = d.qt, h.q = d.q ? d.q : queries.at(b), h.q_row = d.q ? E_pad : queries.row;
      h.dot = d.dot, h.dout = d.dout ? d.dout : douts.at(b), h.dout_row = d.dout ? Ev_pad : douts.row;
      h.k = d.k ? d.k : keys.at(b), h.k_row = d.k ? E_pad : keys.row, h.v = values.at(b), h.v_row = values.row;
    }
    h.lse2 = d.lse2, h.delta = d.delta;
    h.mask = p.mask.defined() ? p.mask.data<float>() + p.mask_offset[size_t(b)] : nullptr;
    h.mask_row = p.mask_row, h.mask_col = p.mask_col;
    h.L = L, h.S = S, h.E = E, h.Ev = Ev, h.E_pad = E_pad, h.Ev_pad = Ev_pad, h.br = br;
    h.scale = float(p.scale);
    h.band = band_of(p);
    if (p.dropout_p > 0) h.dropout = {&fill_dropout, &drop};
    h.dq = dq_at(b), h.dq_row = dq_rows.row;
    h.dk = dk_at(b), h.dk_row = dk_rows.row;
    h.dv = dv_at(b), h.dv_row = dv_rows.row;
    h.scratch = scratch;
    h.key_begin = 0, h.key_end = S, h.query_begin = 0, h.query_end = L;
    h.want_dkdv = h.want_dq = true;
    if (scores) h.scores = kept->entry(scores, b), h.score_tiles = kept->first.data();
    return h;
  }
};

// The returned weights' share of dQ and dK (p.dweights given), added to the
// plan's float accumulators. The returned weights are W = P∘C (P the softmax,
// C the dropout factors); a loss with gradient dW on them reaches P as C∘dW,
// and through the softmax the logits s as
//   G_ij = P_ij (x_ij − Σ_j' P_ij' x_ij'),  x = C∘dW,
// then dq_i += scale Σ_j G_ij k_j and dk_j += scale Σ_i G_ij q_i.
// P comes from the forward kernel's weights pass (dropout off, the saved lse
// given) for chunks of kChunkRows queries, scale·G is formed in place over
// each row's band, and two float32 products per chunk (rows·(hi − lo)·E
// multiply-adds each, over the band's keys) add it into dQ and dK. P is 0
// where the mask excludes a key; a non-finite dW there (never to be read)
// makes the sums non-finite, and the call then runs on the reference path. A
// work item is a whole entry, its products on one thread, so that each
// entry's dK sums its chunks in one order whatever the thread count (a
// threaded product need not: OpenBLAS's bits change with its threads); with
// fewer entries than threads, some idle. Returns whether the accumulators are
// finite afterwards.
bool add_weights_gradient(const BackwardPlan& plan) {
  constexpr int64_t kChunkRows = 4 * kQueryTile;  // rows per product
  const AttentionParams& p = plan.p;
  const int64_t L = plan.L, S = plan.S, E = plan.E, Ev = plan.Ev, br = plan.br;
  const float* lse = plan.lse.data<float>();
  const float* mask = p.mask.defined() ? p.mask.data<float>() : nullptr;
  const bool float_dw = p.dtype == DType::float32, drop = p.dropout_p > 0;
  const int64_t f = sizeof(float), chunk = std::min(kChunkRows, round_up(L, br));
  const PerThread operands = per_thread_scratch(ScratchSlot::flash_a, (E * br + br * Ev + S) * f);
  const PerThread works = per_thread_scratch(ScratchSlot::flash_b, flash_forward_scratch(E, Ev, br) * f);
  const PerThread chunks = per_thread_scratch(ScratchSlot::flash_c, chunk * S * f);

  // G (rows × S) for the queries [c0, c0 + rows) of entry b, in place of P.
  const auto logit_gradient = [&](int64_t b, int64_t c0, int64_t rows, float* G) {
    float* qt = static_cast<float*>(own_slice(operands));
    float* x = qt + E * br + br * Ev;  // one row of C∘dW
    for (int64_t i0 = c0; i0 < c0 + rows; i0 += br) {
      pack_transposed({plan.queries.at(b), DType::float32}, 0, plan.queries.row, 1, i0, std::min(br, L - i0), E, br,
                      qt);
      FlashForwardTile t{};
      t.qt = qt, t.logit_scale = float(p.scale) * kLog2e;
      t.k = plan.keys.at(b), t.k_row = plan.keys.row, t.v = plan.values.at(b), t.v_row = plan.values.row;
      t.mask = mask ? mask + p.mask_offset[size_t(b)] + i0 * p.mask_row : nullptr;
      t.mask_row = p.mask_row, t.mask_col = p.mask_col;
      t.i0 = i0, t.rows = std::min(br, L - i0), t.S = S, t.E = E, t.Ev = Ev, t.br = br;
      t.band = band_of(p);
      t.out = qt + E * br, t.out_row = Ev;
      t.lse = const_cast<float*>(lse + b * L + i0);  // read: the weights pass writes only the weights
      t.weights = G + (i0 - c0) * S, t.weights_row = S;
      t.scratch = static_cast<float*>(own_slice(works));
      plan.kernels.forward_tile(t);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = c0 + r, begin = p.key_begin(i), end = std::max(begin, p.key_end(i));
      float* Gi = G + r * S;  // P on entry
      const int64_t at = (b * L + i) * S;
      const float* xi = float_dw ? p.dweights.data<float>() + at : x;
      if (!float_dw || drop) {
        const Loader dw{p.dweights.raw_data(), p.dtype};
        for (int64_t j = begin; j < end; ++j) {
          const bool kept = !drop || dropout_keep(p.dropout_seed, uint64_t(b), uint64_t(i), uint64_t(j), plan.threshold);
          x[j] = kept ? dw.at(at + j) * (drop ? plan.drop_scale : 1.0f) : 0.0f;
        }
        xi = x;
      }
      // D = Σ_j P_ij x_ij in 8 partial sums (a fixed order the compiler can put in vectors).
      float part[8] = {};
      int64_t j = begin;
      for (; j + 8 <= end; j += 8)
        for (int l = 0; l < 8; ++l) part[l] += Gi[j + l] * xi[j + l];
      for (; j < end; ++j) part[0] += Gi[j] * xi[j];
      const float D = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      const float scale = float(p.scale);  // dS = scale·G: the products then add it as it is
      for (j = begin; j < end; ++j) Gi[j] *= scale * (xi[j] - D);
      std::fill(Gi, Gi + begin, 0.0f);
      std::fill(Gi + end, Gi + S, 0.0f);
    }
  };

  RegionErrors errors;  // the products take their own scratch inside the region
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < p.batch; ++b)
    errors.run([&] {
      float* G = static_cast<float*>(own_slice(chunks));
      for (int64_t c0 = 0; c0 < L; c0 += chunk) {
        const int64_t rows = std::min(chunk, L - c0);
        // The band's keys for these rows: [lo, hi) (its bounds grow with i); G is 0 outside.
        const int64_t lo = p.key_begin(c0), hi = p.key_end(c0 + rows - 1);
        if (hi <= lo) continue;
        logit_gradient(b, c0, rows, G);
        gemm<float>(false, false, rows, E, hi - lo, 1.0f, G + lo, S, plan.keys.at(b) + lo * plan.keys.row,
                    plan.keys.row, 1.0f, plan.dq_at(b) + c0 * plan.dq_rows.row, plan.dq_rows.row);
        gemm<float>(true, false, hi - lo, E, rows, 1.0f, G + lo, S, plan.queries.at(b) + c0 * plan.queries.row,
                    plan.queries.row, 1.0f, plan.dk_at(b) + lo * plan.dk_rows.row, plan.dk_rows.row);
      }
    });
  errors.rethrow();
  bool finite = true;
  for (int64_t b = 0; b < p.batch; ++b)
    finite = finite && all_finite(plan.dq_at(b), L, E, plan.dq_rows.row) && all_finite(plan.dk_at(b), S, E, plan.dk_rows.row);
  return finite;
}

}  // namespace

bool flash_attention_backward(const AttentionParams& p, const Tensor& dout_t, const AttentionOutput& fwd,
                              AttentionGradients& g) {
  const Kernels k = kernels_for(active_isa());
  const int64_t br = query_tile(p.L, k.width), W = k.width, L = p.L, S = p.S, E = p.E, Ev = p.Ev;
  const int64_t tiles = (L + br - 1) / br, E_pad = round_up(E, W), Ev_pad = round_up(Ev, W);
  // Gradients go straight into the outputs when they are float32 rows that
  // need no reduction; else into per-entry buffers folded at the end.
  // dQ, added to once per key tile, only where its rows are compact: rows
  // apart (the heads of an (N, L, H·E) buffer, 1 KiB and more) share a few
  // of L1's sets, and the dQ tile fell out of L1 between its additions
  // (training at L = 2040: about 2% fewer tokens/s, medians of four
  // alternating runs); those go through the buffer, stored once at the end.
  const bool f32 = p.dtype == DType::float32;
  const bool direct_q = f32 && E == E_pad && one_to_one(p.q, p) && g.dquery.stride(-2) == E_pad;
  const bool direct_k = f32 && one_to_one(p.k, p), direct_v = f32 && one_to_one(p.v, p);
  // (Tensors, not vectors: the allocator's cached blocks, where a vector's
  // fresh pages each faulted, 120-280 MiB a step of the wide model in bf16.)
  // dQ's is zeroed below, on every thread.
  const auto buffer = [](bool direct, int64_t floats, bool zeroed) {
    return direct ? Tensor() : zeroed ? Tensor::zeros({floats}, DType::float32) : Tensor::empty({floats}, DType::float32);
  };
  Tensor dq_full = buffer(direct_q, p.batch * L * E_pad, false), dk_full = buffer(direct_k, p.batch * S * E, true),
         dv_full = buffer(direct_v, p.batch * S * Ev, true);
  // A bfloat16 kernel where its products pay (not for a loss on the
  // returned weights: their share runs on float32 rows).
  const bool rows_kernel = by_rows(p, k.width) && !p.dweights.defined();
  const Bf16Products kernel16 = p.dweights.defined() || rows_kernel ? Bf16Products::widen : bf16_kernel_for(p);
  const bool bf16 = kernel16 != Bf16Products::widen;
  const auto rows = [&](const Tensor& t, int64_t width) { return bf16 ? FloatRows{} : float_rows(t, p, width); };
  BackwardPlan plan{p, k, br, L, S, E, Ev, tiles, tiles * br, E_pad, Ev_pad,
                    rows(p.k, E_pad), rows(p.v, Ev), rows(p.q, E_pad), rows(dout_t, Ev_pad),
                    fwd.out, fwd.lse.contiguous(), entry_rows(fwd.out, p),
                    (direct_q ? g.dquery : dq_full).data<float>(), (direct_k ? g.dkey : dk_full).data<float>(),
                    (direct_v ? g.dvalue : dv_full).data<float>(),
                    direct_q ? entry_rows(g.dquery, p) : packed_entries(p.batch, L, E_pad),
                    direct_k ? entry_rows(g.dkey, p) : packed_entries(p.batch, S, E),
                    direct_v ? entry_rows(g.dvalue, p) : packed_entries(p.batch, S, Ev),
                    dropout_threshold(p.dropout_p), float(1.0 / (1.0 - p.dropout_p))};
  if (bf16) plan.use_bf16_kernel(kernel16, dout_t);
  // The forward's kept scores, where this backward's float32 tiles match them
  // (else, as without them, the kernel computes Q·Kᵀ again).
  if (!bf16 && !rows_kernel && fwd.scores.defined()) plan.kept = score_layout(p, br);
  if (plan.kept && fwd.scores.shape() == plan.kept->shape(p.batch) && fwd.scores.dtype() == DType::float32 &&
      fwd.scores.is_contiguous())
    plan.scores = fwd.scores.data<float>();
  void (*backward_head)(const FlashBackwardHead&) = rows_kernel                    ? k.backward_rows
                                                    : kernel16 == Bf16Products::amx ? &flash_backward_head_amx
                                                    : bf16                         ? &flash_backward_head_bf16_avx512
                                                                                   : k.backward_head;
  // dQ accumulates: its rows (E_pad wide either way) start at zero, on every thread.
#pragma omp parallel for schedule(static) if (p.batch * L * E_pad >= (int64_t(1) << 16))
  for (int64_t row = 0; row < p.batch * L; ++row)
    std::memset(plan.dq_at(row / L) + row % L * plan.dq_rows.row, 0, size_t(E_pad) * sizeof(float));
  const int64_t packed = plan.packed_floats();
  const int64_t scratch = rows_kernel ? flash_rows_backward_scratch(S, E_pad, Ev_pad)
                          : flash_backward_scratch(E_pad, Ev_pad, br) +
                                (kernel16 == Bf16Products::amx ? flash_amx_backward_scratch(br)
                                 : bf16                      ? flash_bf16_backward_scratch(br)
                                                             : 0);

  const PerThread packs = per_thread_scratch(ScratchSlot::flash_a, (p.batch >= omp_get_max_threads() ? packed : 0) * int64_t(sizeof(float)));
  const PerThread works = per_thread_scratch(ScratchSlot::flash_b, scratch * int64_t(sizeof(float)));

  bool finite = true;  // of every gradient row, checked as each work item finishes its rows
  if (p.batch >= omp_get_max_threads()) {
    // Enough entries for every thread: one entry per work item, start to end.
#pragma omp parallel for schedule(dynamic, 1) reduction(&& : finite)
    for (int64_t b = 0; b < p.batch; ++b) {
      const BackwardPlan::Packed d = plan.carve(static_cast<float*>(own_slice(packs)));
      plan.pack(b, d);
      const DropoutContext drop{p.dropout_seed, uint64_t(b), plan.threshold, plan.drop_scale};
      const FlashBackwardHead h = plan.head(b, d, drop, static_cast<float*>(own_slice(works)));
      backward_head(h);
      finite = finite && all_finite(h.dq, L, E, h.dq_row) && all_finite(h.dk, S, E, h.dk_row) &&
               all_finite(h.dv, S, Ev, h.dv_row);
    }
  } else {
    // Few entries: split each into key tiles (dK, dV) and then query tiles
    // (dQ). The products for S and dP are computed twice (7 products instead
    // of 5), but every thread has work, and each gradient row is still summed
    // by one work item in the same order as above: same bits either way.
    Tensor packed_all = Tensor::zeros({p.batch * packed}, DType::float32);
    float* packed_base = packed_all.data<float>();
    auto packed_of = [&](int64_t b) { return plan.carve(packed_base + b * packed); };
#pragma omp parallel for schedule(static, 1)
    for (int64_t b = 0; b < p.batch; ++b) plan.pack(b, packed_of(b));
    const int64_t key_tiles = (S + kFlashKeyTile - 1) / kFlashKeyTile;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < p.batch * key_tiles; ++item) {
      const int64_t b = item / key_tiles, j0 = item % key_tiles * kFlashKeyTile;
      const DropoutContext drop{p.dropout_seed, uint64_t(b), plan.threshold, plan.drop_scale};
      FlashBackwardHead h = plan.head(b, packed_of(b), drop, static_cast<float*>(own_slice(works)));
      h.key_begin = j0, h.key_end = j0 + kFlashKeyTile, h.want_dq = false;
      backward_head(h);
      const int64_t cols = std::min(kFlashKeyTile, S - j0);
      finite = finite && all_finite(h.dk + j0 * h.dk_row, cols, E, h.dk_row) &&
               all_finite(h.dv + j0 * h.dv_row, cols, Ev, h.dv_row);
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < p.batch * tiles; ++item) {
      const auto [b, i0] = query_tile_item(item, tiles, br);
      const DropoutContext drop{p.dropout_seed, uint64_t(b), plan.threshold, plan.drop_scale};
      FlashBackwardHead h = plan.head(b, packed_of(b), drop, static_cast<float*>(own_slice(works)));
      h.query_begin = i0, h.query_end = i0 + br, h.want_dkdv = false;
      backward_head(h);
      finite = finite && all_finite(h.dq + i0 * h.dq_row, std::min(br, L - i0), E, h.dq_row);
    }
  }
  if (p.dweights.defined()) finite = finite && add_weights_gradient(plan);
  if (!direct_q) {  // drop the padding, then fold (or copy into rows apart)
    const float* padded = dq_full.data<float>();
    if (E != E_pad) {
      Tensor compact = Tensor::empty({p.batch * L * E}, DType::float32);
      float* c = compact.data<float>();
#pragma omp parallel for schedule(static) if (p.batch * L * E >= (int64_t(1) << 16))
      for (int64_t row = 0; row < p.batch * L; ++row)
        std::memcpy(c + row * E, padded + row * E_pad, size_t(E) * sizeof(float));
      store_reduced(c, p, g.dquery);
    } else {
      store_reduced(padded, p, g.dquery);
    }
  }
  if (!direct_k) store_reduced(dk_full.data<float>(), p, g.dkey);
  if (!direct_v) store_reduced(dv_full.data<float>(), p, g.dvalue);
  return finite;
}

}  // namespace mha::cpu
