// Tensor: factories, views, copies and element access.
#include "mha/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <sstream>

#include "cpu/layers/layers.h"
#include "dtype_dispatch.h"
#include "finite.h"
#include "mha/errors.h"
#include "storage.h"
#include "strided.h"

namespace mha {

std::string to_string(DType t) {
  switch (t) {
    case DType::float32: return "float32";
    case DType::float64: return "float64";
    case DType::bfloat16: return "bfloat16";
    case DType::boolean: return "bool";
    case DType::int64: return "int64";
  }
  return "?";
}

std::string to_string(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

std::string shape_string(const Shape& shape) {
  std::ostringstream s;
  s << '(';
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) s << ',';
  s << ')';
  return s.str();
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

void check_shape(const Shape& shape, const char* fn) {
  for (int64_t d : shape)
    if (d < 0)
      throw ShapeError(std::string("[") + fn + "] shape: expected sizes >= 0; got " +
                       shape_string(shape));
}

}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  check_shape(shape, "mha::Tensor::empty");
  Tensor t;
  const size_t bytes = checked_bytes(shape, dtype, "mha::Tensor::empty");
  t.storage_ = std::make_shared<Storage>(bytes, device, "mha::Tensor::empty");
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::from_values(const std::vector<double>& values, const Shape& shape, DType dtype) {
  check_shape(shape, "mha::Tensor::from_values");
  if (int64_t(values.size()) != shape_numel(shape))
    throw ShapeError("[mha::Tensor::from_values] values: expected " +
                     std::to_string(shape_numel(shape)) + " for shape " + shape_string(shape) +
                     "; got " + std::to_string(values.size()));
  Tensor t = empty(shape, dtype);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = from_double<T>(values[i]);
  });
  return t;
}

Tensor Tensor::from_values(const std::vector<float>& values, const Shape& shape) {
  return from_values(std::vector<double>(values.begin(), values.end()), shape, DType::float32);
}

Tensor Tensor::from_bools(const std::vector<bool>& values, const Shape& shape) {
  std::vector<double> v(values.begin(), values.end());
  return from_values(v, shape, DType::boolean);
}

Tensor Tensor::from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype,
                         std::shared_ptr<void> owner, Device device) {
  const char* fn = "mha::Tensor::from_blob";
  check_shape(shape, fn);
  if (strides.size() != shape.size())
    throw ShapeError(std::string("[") + fn + "] strides: expected " + std::to_string(shape.size()) +
                     " strides for shape " + shape_string(shape) + "; got " + shape_string(strides));
  int64_t extent = 1;  // elements spanned: 1 + Σ (size-1)·stride
  bool empty = false;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (strides[d] < 0)
      throw ShapeError(std::string("[") + fn + "] strides: expected >= 0; got " +
                       shape_string(strides));
    if (shape[d] == 0) empty = true;
    else extent += (shape[d] - 1) * strides[d];
  }
  if (data == nullptr && !empty)
    throw ValueError(std::string("[") + fn + "] data: expected a non-null pointer; got null");
  Tensor t;
  size_t bytes = empty ? 0 : size_t(extent * dtype_size(dtype));
  t.storage_ = std::make_shared<Storage>(data, bytes, device, std::move(owner));
  t.shape_ = shape;
  t.strides_ = strides;
  t.dtype_ = dtype;
  return t;
}

Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu; }

int64_t Tensor::wrap_dim(int64_t d, int64_t rank, const char* fn) const {
  int64_t w = d < 0 ? d + rank : d;
  if (w < 0 || w >= rank)
    throw ShapeError(std::string("[") + fn + "] dim: expected in [" + std::to_string(-rank) +
                     ", " + std::to_string(rank) + "); got " + std::to_string(d));
  return w;
}

int64_t Tensor::size(int64_t d) const { return shape_[size_t(wrap_dim(d, dim(), "mha::Tensor::size"))]; }
int64_t Tensor::stride(int64_t d) const {
  return strides_[size_t(wrap_dim(d, dim(), "mha::Tensor::stride"))];
}
int64_t Tensor::numel() const { return shape_numel(shape_); }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

Tensor Tensor::transpose(int64_t a, int64_t b) const {
  Tensor t = *this;
  a = wrap_dim(a, dim(), "mha::Tensor::transpose");
  b = wrap_dim(b, dim(), "mha::Tensor::transpose");
  std::swap(t.shape_[size_t(a)], t.shape_[size_t(b)]);
  std::swap(t.strides_[size_t(a)], t.strides_[size_t(b)]);
  return t;
}

Tensor Tensor::permute(const Shape& order) const {
  const char* fn = "mha::Tensor::permute";
  if (int64_t(order.size()) != dim())
    throw ShapeError(std::string("[") + fn + "] order: expected " + std::to_string(dim()) +
                     " dims; got " + std::to_string(order.size()));
  Tensor t = *this;
  std::vector<bool> seen(order.size(), false);
  for (size_t i = 0; i < order.size(); ++i) {
    int64_t d = wrap_dim(order[i], dim(), fn);
    if (seen[size_t(d)])
      throw ShapeError(std::string("[") + fn + "] order: expected a permutation; got " +
                       shape_string(order));
    seen[size_t(d)] = true;
    t.shape_[i] = shape_[size_t(d)];
    t.strides_[i] = strides_[size_t(d)];
  }
  return t;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  const char* fn = "mha::Tensor::slice";
  d = wrap_dim(d, dim(), fn);
  int64_t n = shape_[size_t(d)];
  if (step <= 0)
    throw ValueError(std::string("[") + fn + "] step: expected > 0; got " + std::to_string(step));
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Tensor t = *this;
  t.offset_ += start * strides_[size_t(d)];
  t.shape_[size_t(d)] = (end - start + step - 1) / step;
  t.strides_[size_t(d)] *= step;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  const char* fn = "mha::Tensor::select";
  d = wrap_dim(d, dim(), fn);
  int64_t n = shape_[size_t(d)];
  if (index < -n || index >= n)
    throw ShapeError(std::string("[") + fn + "] index: expected in [" + std::to_string(-n) + ", " +
                     std::to_string(n) + "); got " + std::to_string(index));
  if (index < 0) index += n;
  Tensor t = *this;
  t.offset_ += index * strides_[size_t(d)];
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "mha::Tensor::unsqueeze");
  Tensor t = *this;
  int64_t stride = d < dim() ? shape_[size_t(d)] * strides_[size_t(d)] : 1;
  t.shape_.insert(t.shape_.begin() + d, 1);
  t.strides_.insert(t.strides_.begin() + d, stride);
  return t;
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d, dim(), "mha::Tensor::squeeze");
  if (shape_[size_t(d)] != 1)
    throw ShapeError("[mha::Tensor::squeeze] dim " + std::to_string(d) +
                     ": expected size 1; got " + std::to_string(shape_[size_t(d)]));
  return select(d, 0);
}

namespace {

Shape infer_shape(const Shape& shape, int64_t numel, const char* fn) {
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1 && infer < 0) infer = int64_t(i);
    else if (out[i] < 0)
      throw ShapeError(std::string("[") + fn + "] shape: expected sizes >= 0 and at most one -1; got " +
                       shape_string(shape));
    else known *= out[i];
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0)
      throw ShapeError(std::string("[") + fn + "] shape: cannot infer -1 in " + shape_string(shape) +
                       " for " + std::to_string(numel) + " elements");
    out[size_t(infer)] = numel / known;
  }
  if (shape_numel(out) != numel)
    throw ShapeError(std::string("[") + fn + "] shape: expected " + std::to_string(numel) +
                     " elements; got " + shape_string(shape));
  return out;
}

}  // namespace

Tensor Tensor::view(const Shape& shape) const {
  const char* fn = "mha::Tensor::view";
  Shape out = infer_shape(shape, numel(), fn);
  if (!is_contiguous())
    throw ShapeError(std::string("[") + fn + "] self: expected a contiguous tensor; got strides " +
                     shape_string(strides_) + " for shape " + shape_string(shape_) +
                     " (use reshape, which copies)");
  Tensor t = *this;
  t.shape_ = out;
  t.strides_ = contiguous_strides(out);
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (is_contiguous()) return view(shape);
  return contiguous().view(shape);
}

Tensor Tensor::expand(const Shape& shape) const {
  const char* fn = "mha::Tensor::expand";
  if (int64_t(shape.size()) < dim())
    throw ShapeError(std::string("[") + fn + "] shape: expected at least " + std::to_string(dim()) +
                     " dims; got " + shape_string(shape));
  Tensor t = *this;
  size_t lead = shape.size() - shape_.size();
  t.shape_ = shape;
  t.strides_.assign(shape.size(), 0);
  for (size_t i = 0; i < shape_.size(); ++i) {
    int64_t want = shape[lead + i];
    if (shape_[i] == want) t.strides_[lead + i] = strides_[i];
    else if (shape_[i] != 1)
      throw ShapeError(std::string("[") + fn + "] shape: " + shape_string(shape_) +
                       " does not broadcast to " + shape_string(shape));
  }
  return t;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  Tensor t = empty(shape_, dtype, device());
  t.copy_(*this);
  return t;
}

namespace {
// Elements from which a copy or fill runs on every thread.
constexpr int64_t kParallelCopy = int64_t(1) << 15;
}  // namespace

void Tensor::copy_(const Tensor& src) {
  const char* fn = "mha::Tensor::copy_";
  if (!defined() || !src.defined())
    throw ShapeError(std::string("[") + fn + "] src: expected defined tensors; got an undefined one");
  if (src.shape_ != shape_)
    throw ShapeError(std::string("[") + fn + "] src: expected shape " + shape_string(shape_) +
                     "; got " + shape_string(src.shape_));
  backend_for(device(), fn);
  backend_for(src.device(), fn);
  dispatch_dtype(dtype_, [&](auto dtag) {
    using D = decltype(dtag);
    dispatch_dtype(src.dtype_, [&](auto stag) {
      using S = decltype(stag);
      D* d = data<D>();
      const S* s = src.data<S>();
      // Row by row, on every thread for large copies (a layer's heads to
      // its rows and back: serial, they left the other core idle).
      for_each_row2(shape_, strides_, src.strides_, kParallelCopy,
                    [&](int64_t od, int64_t os, int64_t n, int64_t step_d, int64_t step_s) {
                      if constexpr (std::is_same_v<D, S>) {
                        if (step_d == 1 && step_s == 1) return void(std::memcpy(d + od, s + os, size_t(n) * sizeof(D)));
                        for (int64_t i = 0; i < n; ++i) d[od + i * step_d] = s[os + i * step_s];
                      } else {
                        for (int64_t i = 0; i < n; ++i) d[od + i * step_d] = from_double<D>(to_double(s[os + i * step_s]));
                      }
                    });
    });
  });
}

void Tensor::fill_(double value) {
  backend_for(device(), "mha::Tensor::fill_");
  dispatch_dtype(dtype_, [&](auto tag) {
    using T = decltype(tag);
    T v = from_double<T>(value);
    T* d = data<T>();
    for_each_row2(shape_, strides_, strides_, kParallelCopy, [&](int64_t o, int64_t, int64_t n, int64_t step, int64_t) {
      if (step == 1) std::fill(d + o, d + o + n, v);  // (vectorised; the strided loop is not, for bfloat16)
      else
        for (int64_t i = 0; i < n; ++i) d[o + i * step] = v;
    });
  });
}

namespace {
template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::float32; }
template <> constexpr DType dtype_of<double>() { return DType::float64; }
template <> constexpr DType dtype_of<bfloat16>() { return DType::bfloat16; }
template <> constexpr DType dtype_of<bool>() { return DType::boolean; }
template <> constexpr DType dtype_of<int64_t>() { return DType::int64; }
}  // namespace

template <class T>
T* Tensor::data() {
  return const_cast<T*>(std::as_const(*this).data<T>());
}

template <class T>
const T* Tensor::data() const {
  if (!defined()) throw ShapeError("[mha::Tensor::data] self: expected a defined tensor; got an undefined one");
  if (dtype_of<T>() != dtype_)
    throw DtypeError("[mha::Tensor::data] T: expected " + to_string(dtype_) + "; got " +
                     to_string(dtype_of<T>()));
  return static_cast<const T*>(storage_->data()) + offset_;
}

template float* Tensor::data<float>();
template double* Tensor::data<double>();
template bfloat16* Tensor::data<bfloat16>();
template bool* Tensor::data<bool>();
template int64_t* Tensor::data<int64_t>();
template const float* Tensor::data<float>() const;
template const double* Tensor::data<double>() const;
template const bfloat16* Tensor::data<bfloat16>() const;
template const bool* Tensor::data<bool>() const;
template const int64_t* Tensor::data<int64_t>() const;

void* Tensor::raw_data() {
  return static_cast<char*>(storage_->data()) + offset_ * dtype_size(dtype_);
}
const void* Tensor::raw_data() const {
  return static_cast<const char*>(storage_->data()) + offset_ * dtype_size(dtype_);
}

int64_t Tensor::element_offset(const Shape& index, const char* fn) const {
  if (!defined()) throw ShapeError(std::string("[") + fn + "] self: expected a defined tensor; got an undefined one");
  if (index.size() != shape_.size())
    throw ShapeError(std::string("[") + fn + "] index: expected " + std::to_string(dim()) +
                     " indices; got " + std::to_string(index.size()));
  int64_t o = 0;
  for (size_t i = 0; i < index.size(); ++i) {
    if (index[i] < 0 || index[i] >= shape_[i])
      throw ShapeError(std::string("[") + fn + "] index: " + shape_string(index) +
                       " is out of range for shape " + shape_string(shape_));
    o += index[i] * strides_[i];
  }
  return o;
}

double Tensor::item(const Shape& index) const {
  int64_t o = element_offset(index, "mha::Tensor::item");
  backend_for(device(), "mha::Tensor::item");
  return dispatch_dtype(dtype_, [&](auto tag) {
    using T = decltype(tag);
    return to_double(data<T>()[o]);
  });
}

void Tensor::set_item(const Shape& index, double value) {
  int64_t o = element_offset(index, "mha::Tensor::set_item");
  backend_for(device(), "mha::Tensor::set_item");
  dispatch_dtype(dtype_, [&](auto tag) {
    using T = decltype(tag);
    data<T>()[o] = from_double<T>(value);
  });
}

std::vector<double> Tensor::to_vector() const {
  std::vector<double> out;
  out.reserve(size_t(numel()));
  backend_for(device(), "mha::Tensor::to_vector");
  dispatch_dtype(dtype_, [&](auto tag) {
    using T = decltype(tag);
    const T* d = data<T>();
    for_each_offset(shape_, strides_, [&](int64_t o) { out.push_back(to_double(d[o])); });
  });
  return out;
}

int64_t first_non_finite(const Tensor& t) {
  backend_for(t.device(), "mha::first_non_finite");
  return dispatch_dtype(t.dtype(), [&](auto tag) -> int64_t {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, bool>) return -1;
    else {
      const T* d = t.data<T>();
      if (t.is_contiguous()) {
        for (int64_t i = 0, n = t.numel(); i < n; ++i)
          if (!std::isfinite(load_as<double>(d[i]))) return i;
        return -1;
      }
      int64_t i = 0, found = -1;
      for_each_offset(t.shape(), t.strides(), [&](int64_t o) {
        if (found < 0 && !std::isfinite(load_as<double>(d[o]))) found = i;
        ++i;
      });
      return found;
    }
  });
}

namespace {

// Branch-free scans on the bits (they vectorise): an exponent of all ones is
// NaN or ±inf; with minus_inf_ok, the one pattern of -inf is let through.
template <class Bits>
bool bits_finite(const void* data, int64_t n, Bits exponent, Bits minus_inf, bool minus_inf_ok) {
  const Bits* x = static_cast<const Bits*>(data);
  Bits bad = 0;
  if (minus_inf_ok)
    for (int64_t i = 0; i < n; ++i) bad |= Bits((x[i] & exponent) == exponent && x[i] != minus_inf);
  else
    for (int64_t i = 0; i < n; ++i) bad |= Bits((x[i] & exponent) == exponent);
  return bad == 0;
}

}  // namespace

// Without -inf let through, on the active instruction set's vectors (the
// attention checks every output and gradient it writes: the bit scan, built for
// the baseline ISA, took ~1% of a long training step).
bool all_finite(const float* x, int64_t n, bool minus_inf_ok) {
  if (!minus_inf_ok) return cpu::finite_floats(x, n);
  return bits_finite<uint32_t>(x, n, 0x7f800000u, 0xff800000u, minus_inf_ok);
}

bool all_finite(const double* x, int64_t n, bool minus_inf_ok) {
  return bits_finite<uint64_t>(x, n, 0x7ff0000000000000ull, 0xfff0000000000000ull, minus_inf_ok);
}

bool all_finite(const float* x, int64_t rows, int64_t cols, int64_t pitch) {
  return pitch == cols ? cpu::finite_floats(x, rows * cols) : cpu::finite_floats(x, rows, cols, pitch);
}

bool all_finite(const Tensor& t, bool minus_inf_ok) {
  backend_for(t.device(), "mha::all_finite");
  if (!t.is_contiguous()) return all_finite(t.contiguous(), minus_inf_ok);
  const void* x = t.raw_data();
  switch (t.dtype()) {
    case DType::float32: return all_finite(static_cast<const float*>(x), t.numel(), minus_inf_ok);
    case DType::float64: return all_finite(static_cast<const double*>(x), t.numel(), minus_inf_ok);
    case DType::bfloat16: return bits_finite<uint16_t>(x, t.numel(), 0x7f80u, 0xff80u, minus_inf_ok);
    case DType::boolean:
    case DType::int64: break;
  }
  return true;
}

}  // namespace mha
