// The fused attention path above the kernels: picks the instruction set once,
// packs query tiles (transposed, scaled, float32), converts keys/values that
// are not float32 rows, runs tiles on OpenMP threads and folds gradients.
#include "cpu/flash/dispatch.h"

#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "check.h"
#include "cpu/reduce.h"
#include "random/philox.h"

namespace mha::cpu {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

struct Kernels {
  Isa isa;
  int64_t width;
  void (*forward_tile)(const FlashForwardTile&);
  void (*backward_head)(const FlashBackwardHead&);
};

Kernels kernels_for(Isa isa) {
  switch (isa) {
    case Isa::avx512: return {isa, 16, &flash_forward_tile_avx512, &flash_backward_head_avx512};
    case Isa::avx2: return {isa, 8, &flash_forward_tile_avx2, &flash_backward_head_avx2};
    case Isa::scalar: break;
  }
  return {Isa::scalar, 8, &flash_forward_tile_scalar, &flash_backward_head_scalar};
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

// Query tile width: two micro-tile columns on AVX-512, four vectors elsewhere.
constexpr int64_t kQueryTile = 32;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Scratch memory, 64-byte aligned, that lives as long as the call.
struct Buffer {
  float* data = nullptr;
  explicit Buffer(int64_t floats) {
    const size_t bytes = size_t(round_up(floats > 0 ? floats : 1, 16)) * sizeof(float);
    data = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (!data) throw std::bad_alloc();
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// Element (row, col) of a strided operand as float.
struct Loader {
  const void* base;
  DType dtype;
  float at(int64_t offset) const {
    if (dtype == DType::bfloat16) return float(static_cast<const bfloat16*>(base)[offset]);
    return static_cast<const float*>(base)[offset];
  }
};

// Keys or values as float32 rows with contiguous elements: the tensor itself
// when it already is, else a converted contiguous copy.
struct FloatRows {
  Tensor tensor;
  std::vector<int64_t> offset;
  int64_t row;
  const float* at(int64_t b) const { return tensor.data<float>() + offset[size_t(b)]; }
};

FloatRows float_rows(const Tensor& t, const AttentionParams& p) {
  FloatRows r;
  r.tensor = t.dtype() == DType::float32 && t.stride(-1) == 1 ? t : t.to(DType::float32).contiguous();
  const Shape& s = r.tensor.shape();
  const Shape& st = r.tensor.strides();
  r.offset = batch_offsets(p.batch_shape, Shape(s.begin(), s.end() - 2), Shape(st.begin(), st.end() - 2));
  r.row = r.tensor.stride(-2);
  return r;
}

Band band_of(const AttentionParams& p) { return {p.lo_shift, p.hi_shift}; }

struct DropoutContext {
  uint64_t seed, b;
  uint32_t threshold;
  float scale;
};

void fill_dropout(const void* ctx, int64_t i0, int64_t rows, int64_t j0, int64_t cols, float* factors, int64_t ldf) {
  const auto& d = *static_cast<const DropoutContext*>(ctx);
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t i = 0; i < rows; ++i)
      factors[j * ldf + i] =
          dropout_keep(d.seed, d.b, uint64_t(i0 + i), uint64_t(j0 + j), d.threshold) ? d.scale : 0.0f;
}

// qt (E × br) = Q rows [i0, i0+rows) transposed, times `factor`; pad columns 0.
void pack_transposed(const Loader& src, int64_t base, int64_t row, int64_t col, int64_t i0, int64_t rows,
                     int64_t E, int64_t br, float factor, float* qt) {
  for (int64_t e = 0; e < E; ++e) {
    float* dst = qt + e * br;
    for (int64_t i = 0; i < rows; ++i) dst[i] = src.at(base + (i0 + i) * row + e * col) * factor;
    for (int64_t i = rows; i < br; ++i) dst[i] = 0.0f;
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

void flash_attention_forward(const AttentionParams& p, AttentionOutput& r) {
  const Kernels k = kernels_for(active_isa());
  const int64_t br = kQueryTile, tiles = (p.L + br - 1) / br, E = p.E, Ev = p.Ev, L = p.L, S = p.S;
  const FloatRows keys = float_rows(p.k, p), values = float_rows(p.v, p);
  const Loader q{p.q.raw_data(), p.dtype};
  const bool float_out = p.dtype == DType::float32;
  const float* mask = p.mask.defined() ? p.mask.data<float>() : nullptr;
  float* lse = r.lse.data<float>();
  const float qscale = float(p.scale) * kLog2e;
  const uint32_t threshold = dropout_threshold(p.dropout_p);
  const float drop_scale = float(1.0 / (1.0 - p.dropout_p));

#pragma omp parallel
  {
    Buffer qt(E * br), scratch(flash_forward_scratch(E, Ev, br));
    Buffer out_tile(float_out ? 0 : br * Ev), weights_tile(p.return_weights && !float_out ? br * S : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < p.batch * tiles; ++item) {
      const int64_t b = item / tiles, i0 = item % tiles * br, rows = std::min(br, L - i0);
      pack_transposed(q, p.q_offset[size_t(b)], p.q_row, p.q_col, i0, rows, E, br, 1.0f, qt.data);
      const DropoutContext drop{p.dropout_seed, uint64_t(b), threshold, drop_scale};
      FlashForwardTile t{};
      t.qt = qt.data;
      t.logit_scale = qscale;
      t.k = keys.at(b), t.k_row = keys.row;
      t.v = values.at(b), t.v_row = values.row;
      t.mask = mask ? mask + p.mask_offset[size_t(b)] + i0 * p.mask_row : nullptr;
      t.mask_row = p.mask_row, t.mask_col = p.mask_col;
      t.i0 = i0, t.rows = rows, t.S = S, t.E = E, t.Ev = Ev, t.br = br;
      t.band = band_of(p);
      if (p.dropout_p > 0) t.dropout = {&fill_dropout, &drop};
      t.out = float_out ? r.out.data<float>() + (b * L + i0) * Ev : out_tile.data;
      t.out_row = Ev;
      t.lse = lse + b * L + i0;
      t.scratch = scratch.data;
      k.forward_tile(t);
      if (!float_out) {
        bfloat16* o = r.out.data<bfloat16>() + (b * L + i0) * Ev;
        for (int64_t x = 0; x < rows * Ev; ++x) o[x] = bfloat16(out_tile.data[x]);
      }
      if (p.return_weights) {  // a second pass: P = exp(s - lse), now that lse is known
        t.weights = float_out ? r.weights.data<float>() + (b * L + i0) * S : weights_tile.data;
        t.weights_row = S;
        k.forward_tile(t);
        if (!float_out) {
          bfloat16* w = r.weights.data<bfloat16>() + (b * L + i0) * S;
          for (int64_t x = 0; x < rows * S; ++x) w[x] = bfloat16(weights_tile.data[x]);
        }
      }
    }
  }
}

void flash_attention_backward(const AttentionParams& p, const Tensor& dout_t, const AttentionOutput& fwd,
                              AttentionGradients& g) {
  const Kernels k = kernels_for(active_isa());
  const int64_t br = kQueryTile, W = k.width, L = p.L, S = p.S, E = p.E, Ev = p.Ev;
  const int64_t tiles = (L + br - 1) / br, L_pad = tiles * br, E_pad = round_up(E, W), Ev_pad = round_up(Ev, W);
  const FloatRows keys = float_rows(p.k, p), values = float_rows(p.v, p);
  const Loader q{p.q.raw_data(), p.dtype};
  const Tensor out_c = fwd.out.contiguous(), dout_c = dout_t.contiguous(), lse_c = fwd.lse.contiguous();
  const Loader out{out_c.raw_data(), p.dtype}, dout{dout_c.raw_data(), p.dtype};
  const float* lse = lse_c.data<float>();
  const float* mask = p.mask.defined() ? p.mask.data<float>() : nullptr;
  const float qscale = float(p.scale) * kLog2e;
  const uint32_t threshold = dropout_threshold(p.dropout_p);
  const float drop_scale = float(1.0 / (1.0 - p.dropout_p));
  std::vector<float> dq_full(size_t(p.batch * L * E)), dk_full(size_t(p.batch * S * E)),
      dv_full(size_t(p.batch * S * Ev));

#pragma omp parallel
  {
    Buffer qt(L_pad * E), qrows(L_pad * E_pad), dot(L_pad * Ev), drows(L_pad * Ev_pad), lse2(L_pad), delta(L_pad),
        dqt(L_pad * E), scratch(flash_backward_scratch(E_pad, Ev_pad, br));
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t qbase = p.q_offset[size_t(b)];
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * br, rows = std::min(br, L - i0);
        pack_transposed(q, qbase, p.q_row, p.q_col, i0, rows, E, br, 1.0f, qt.data + tile * E * br);
        pack_transposed(dout, b * L * Ev, Ev, 1, i0, rows, Ev, br, 1.0f, dot.data + tile * Ev * br);
      }
      for (int64_t i = 0; i < L_pad; ++i) {
        float* qr = qrows.data + i * E_pad;
        float* dr = drows.data + i * Ev_pad;
        double d = 0;
        for (int64_t e = 0; e < E_pad; ++e) qr[e] = i < L && e < E ? q.at(qbase + i * p.q_row + e * p.q_col) : 0.0f;
        for (int64_t e = 0; e < Ev_pad; ++e) {
          dr[e] = i < L && e < Ev ? dout.at((b * L + i) * Ev + e) : 0.0f;
          if (i < L && e < Ev) d += double(dr[e]) * double(out.at((b * L + i) * Ev + e));
        }
        const float l = i < L ? lse[b * L + i] : -INFINITY;
        lse2.data[i] = l == -INFINITY ? INFINITY : l * kLog2e;
        delta.data[i] = float(d);
      }
      std::memset(dqt.data, 0, size_t(L_pad * E) * sizeof(float));
      const DropoutContext drop{p.dropout_seed, uint64_t(b), threshold, drop_scale};
      FlashBackwardHead h{};
      h.qt = qt.data, h.logit_scale = qscale, h.q = qrows.data, h.dot = dot.data, h.dout = drows.data;
      h.lse2 = lse2.data, h.delta = delta.data;
      h.k = keys.at(b), h.k_row = keys.row, h.v = values.at(b), h.v_row = values.row;
      h.mask = mask ? mask + p.mask_offset[size_t(b)] : nullptr;
      h.mask_row = p.mask_row, h.mask_col = p.mask_col;
      h.L = L, h.S = S, h.E = E, h.Ev = Ev, h.E_pad = E_pad, h.Ev_pad = Ev_pad, h.br = br;
      h.scale = float(p.scale);
      h.band = band_of(p);
      if (p.dropout_p > 0) h.dropout = {&fill_dropout, &drop};
      h.dqt = dqt.data;
      h.dk = dk_full.data() + b * S * E, h.dk_row = E;
      h.dv = dv_full.data() + b * S * Ev, h.dv_row = Ev;
      h.scratch = scratch.data;
      k.backward_head(h);
      float* dq = dq_full.data() + b * L * E;
      for (int64_t i = 0; i < L; ++i)
        for (int64_t e = 0; e < E; ++e) dq[i * E + e] = dqt.data[(i / br) * E * br + e * br + i % br] * float(p.scale);
    }
  }
  store_reduced(dq_full, p, g.dquery);
  store_reduced(dk_full, p, g.dkey);
  store_reduced(dv_full, p, g.dvalue);
}

}  // namespace mha::cpu
