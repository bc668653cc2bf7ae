// Tensor: a strided view of reference-counted storage on one device.
//
// Shapes and strides count elements, not bytes, row-major. Attention tensors
// follow [B, H, L, E] (docs/design.md). Views share storage; contiguous(),
// clone() and to() copy. Storage is 64-byte aligned.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "mha/dtype.h"

namespace mha {

using Shape = std::vector<int64_t>;

std::string shape_string(const Shape& shape);

class Storage;

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  // Factories. `empty` leaves the contents unspecified.
  static Tensor empty(const Shape& shape, DType dtype = DType::float32, Device device = Device::cpu);
  static Tensor zeros(const Shape& shape, DType dtype = DType::float32, Device device = Device::cpu);
  static Tensor full(const Shape& shape, double value, DType dtype = DType::float32,
                     Device device = Device::cpu);
  // Values are given row-major and converted to `dtype` (booleans: non-zero is true).
  static Tensor from_values(const std::vector<double>& values, const Shape& shape,
                            DType dtype = DType::float32);
  static Tensor from_values(const std::vector<float>& values, const Shape& shape);
  static Tensor from_bools(const std::vector<bool>& values, const Shape& shape);
  // A view of memory that mha does not own (a NumPy or PyTorch buffer, say):
  // no copy. Strides count elements and must be >= 0; `owner` is held for
  // as long as any view of the result lives and must keep `data` valid.
  static Tensor from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype,
                          std::shared_ptr<void> owner, Device device = Device::cpu);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const;
  int64_t dim() const { return int64_t(shape_.size()); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t size(int64_t d) const;    // d < 0 counts from the end
  int64_t stride(int64_t d) const;  // d < 0 counts from the end
  int64_t numel() const;
  int64_t offset() const { return offset_; }
  bool is_contiguous() const;

  // Views (no copy).
  Tensor transpose(int64_t a, int64_t b) const;
  Tensor permute(const Shape& order) const;
  Tensor slice(int64_t d, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t d, int64_t index) const;  // removes dimension d
  Tensor unsqueeze(int64_t d) const;
  Tensor squeeze(int64_t d) const;                // dimension d must have size 1
  Tensor view(const Shape& shape) const;          // contiguous only; one -1 is inferred
  Tensor expand(const Shape& shape) const;        // broadcast: size-1 dims get stride 0

  // Copies.
  Tensor reshape(const Shape& shape) const;  // a view when contiguous, else a copy
  Tensor contiguous() const;                 // *this when already contiguous
  Tensor clone() const;
  Tensor to(DType dtype) const;              // *this when the dtype already matches

  // In place.
  void copy_(const Tensor& src);  // same shape; converts dtype
  void fill_(double value);

  // Element pointer at this view's offset. T must match dtype()
  // (float, double, bfloat16, bool); a mismatch throws DtypeError.
  template <class T> T* data();
  template <class T> const T* data() const;
  void* raw_data();
  const void* raw_data() const;

  // Element access by index (slow; for tests, tools and small set-up work).
  double item(const Shape& index) const;
  void set_item(const Shape& index, double value);
  std::vector<double> to_vector() const;  // row-major values converted to double

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::float32;

  int64_t wrap_dim(int64_t d, int64_t rank, const char* fn) const;
  int64_t element_offset(const Shape& index, const char* fn) const;
};

// Row-major strides of a contiguous tensor of `shape`.
Shape contiguous_strides(const Shape& shape);

// The row-major index of the first NaN or ±inf element, or -1 when every
// element is finite (and for integer and bool tensors).
int64_t first_non_finite(const Tensor& t);
int64_t shape_numel(const Shape& shape);

}  // namespace mha
