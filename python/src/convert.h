// NumPy arrays <-> mha::Tensor without copies.
//
// An array becomes a Tensor::from_blob view whose owner holds a reference to
// the array; a Tensor becomes an array whose base is a capsule holding the
// Tensor (and so its storage). bfloat16 travels as uint16/int16 bits: NumPy
// has no bfloat16, and the Python side reinterprets the bits as
// torch.bfloat16.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "mha/attention.h"
#include "mha/errors.h"
#include "mha/tensor.h"

namespace mha::python {

namespace py = pybind11;

inline DType dtype_of(const py::array& a, bool bf16, const char* fn, const char* name) {
  const char kind = a.dtype().kind();
  const auto size = a.itemsize();
  if (bf16 && (kind == 'u' || kind == 'i') && size == 2) return DType::bfloat16;
  if (kind == 'f' && size == 4) return DType::float32;
  if (kind == 'f' && size == 8) return DType::float64;
  if (kind == 'b') return DType::boolean;
  if (kind == 'i' && size == 8) return DType::int64;
  throw DtypeError(std::string("[") + fn + "] " + name +
                   ": expected float32, float64, bfloat16, bool or int64; got " +
                   std::string(py::str(a.dtype())));
}

// An undefined Tensor for None.
inline Tensor to_tensor(const py::object& obj, const char* fn, const char* name, bool bf16 = false) {
  if (obj.is_none()) return {};
  if (!py::isinstance<py::array>(obj))
    throw ValueError(std::string("[") + fn + "] " + name + ": expected a numpy array; got " +
                     std::string(py::str(obj.get_type())));
  auto a = py::reinterpret_borrow<py::array>(obj);
  const DType dtype = dtype_of(a, bf16, fn, name);
  Shape shape(static_cast<size_t>(a.ndim())), strides(static_cast<size_t>(a.ndim()));
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    if (a.strides(d) < 0 || a.strides(d) % a.itemsize() != 0)
      throw ValueError(std::string("[") + fn + "] " + name +
                       ": expected non-negative strides that are multiples of the item size; got " +
                       std::to_string(a.strides(d)) + " bytes");
    shape[size_t(d)] = a.shape(d);
    strides[size_t(d)] = a.strides(d) / a.itemsize();
  }
  // The owner may be released on a thread without the GIL (inside a released
  // section), so its deleter takes the GIL.
  auto* ref = new py::object(a);
  std::shared_ptr<void> owner(ref, [](void* p) {
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
  return Tensor::from_blob(const_cast<void*>(a.data()), shape, strides, dtype, std::move(owner));
}

inline py::object to_numpy(const Tensor& t) {
  if (!t.defined()) return py::none();
  py::dtype dt;
  switch (t.dtype()) {
    case DType::float32: dt = py::dtype::of<float>(); break;
    case DType::float64: dt = py::dtype::of<double>(); break;
    case DType::bfloat16: dt = py::dtype::of<uint16_t>(); break;
    case DType::boolean: dt = py::dtype::of<bool>(); break;
    case DType::int64: dt = py::dtype::of<int64_t>(); break;
  }
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end()), strides;
  for (int64_t s : t.strides()) strides.push_back(s * dtype_size(t.dtype()));
  auto* keep = new Tensor(t);
  py::capsule base(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(dt, shape, strides, const_cast<void*>(t.raw_data()), base);
}

// "automatic", "reference" or "fused".
inline AttentionPath path_of(const std::string& s, const char* fn) {
  if (s == "automatic") return AttentionPath::automatic;
  if (s == "reference") return AttentionPath::reference;
  if (s == "fused") return AttentionPath::fused;
  throw ValueError(std::string("[") + fn + "] path: expected 'automatic', 'reference' or 'fused'; got '" + s + "'");
}

}  // namespace mha::python
