// The _mha extension: attention forward/backward and the layers, on NumPy
// arrays. The Python package (python/mha) wraps it in PyTorch's signatures.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "checkpoint.h"
#include "convert.h"
#include "layers.h"
#include "variants.h"
#include "mha/attention.h"
#include "mha/errors.h"
#include "mha/memory.h"
#include "mha/nn/multihead_attention.h"
#include "mha/version.h"

namespace py = pybind11;
using namespace mha;
using mha::python::path_of;
using mha::python::to_numpy;
using mha::python::to_tensor;

namespace {

Causal causal_of(const std::string& s, const char* fn) {
  if (s == "none") return Causal::none;
  if (s == "top_left") return Causal::top_left;
  if (s == "bottom_right") return Causal::bottom_right;
  throw ValueError(std::string("[") + fn + "] causal: expected 'none', 'top_left' or 'bottom_right'; got '" + s + "'");
}

AttentionOptions options_of(const py::object& mask, const std::string& causal, int64_t window_left,
                            int64_t window_right, std::optional<double> scale, double dropout_p,
                            uint64_t dropout_seed, const std::string& path, const char* fn) {
  AttentionOptions o;
  o.mask = to_tensor(mask, fn, "attn_mask");
  o.causal = causal_of(causal, fn);
  o.window_left = window_left;
  o.window_right = window_right;
  o.scale = scale;
  o.dropout_p = dropout_p;
  o.dropout_seed = dropout_seed;
  o.path = path_of(path, fn);
  return o;
}

py::tuple forward(const py::object& q, const py::object& k, const py::object& v, const py::object& mask,
                  const std::string& causal, int64_t window_left, int64_t window_right,
                  std::optional<double> scale, double dropout_p, uint64_t dropout_seed, bool return_weights,
                  const std::string& path, bool bf16) {
  const char* fn = "mha.attention_forward";
  AttentionOptions o = options_of(mask, causal, window_left, window_right, scale, dropout_p, dropout_seed, path, fn);
  o.return_weights = return_weights;
  Tensor tq = to_tensor(q, fn, "query", bf16), tk = to_tensor(k, fn, "key", bf16), tv = to_tensor(v, fn, "value", bf16);
  AttentionOutput r;
  {
    py::gil_scoped_release nogil;
    r = attention_forward(tq, tk, tv, o);
  }
  return py::make_tuple(to_numpy(r.out), to_numpy(r.lse), to_numpy(r.weights), to_string(r.path));
}

py::tuple backward(const py::object& dout, const py::object& q, const py::object& k, const py::object& v,
                   const py::object& out, const py::object& lse, const py::object& mask, const std::string& causal,
                   int64_t window_left, int64_t window_right, std::optional<double> scale, double dropout_p,
                   uint64_t dropout_seed, const std::string& path, bool mask_grad, bool bf16,
                   const py::object& dweights) {
  const char* fn = "mha.attention_backward";
  AttentionOptions o = options_of(mask, causal, window_left, window_right, scale, dropout_p, dropout_seed, path, fn);
  Tensor tq = to_tensor(q, fn, "query", bf16), tk = to_tensor(k, fn, "key", bf16), tv = to_tensor(v, fn, "value", bf16);
  Tensor tdout = to_tensor(dout, fn, "grad_out", bf16), tdweights = to_tensor(dweights, fn, "grad_weights", bf16);
  AttentionOutput f;
  f.out = to_tensor(out, fn, "out", bf16);
  f.lse = to_tensor(lse, fn, "lse");
  AttentionGradients g;
  {
    py::gil_scoped_release nogil;
    g = attention_backward(tdout, tq, tk, tv, f, o, mask_grad, tdweights);
  }
  return py::make_tuple(to_numpy(g.dquery), to_numpy(g.dkey), to_numpy(g.dvalue), to_numpy(g.dmask));
}

}  // namespace

PYBIND11_MODULE(_mha, m) {
  m.doc() = "mha: multi-head attention in C++ (the extension under the mha package)";
  m.attr("__version__") = mha::version;
  // Typed errors: ValueError subclasses for bad arguments, RuntimeError for the rest.
  py::register_exception<ShapeError>(m, "ShapeError", PyExc_ValueError);
  py::register_exception<DtypeError>(m, "DtypeError", PyExc_ValueError);
  py::register_exception<ValueError>(m, "ArgumentError", PyExc_ValueError);
  py::register_exception<DeviceError>(m, "DeviceError", PyExc_RuntimeError);
  py::register_exception<StateError>(m, "StateError", PyExc_RuntimeError);
  py::register_exception<FormatError>(m, "FormatError", PyExc_RuntimeError);
  py::register_exception<NumericalError>(m, "NumericalError", PyExc_ArithmeticError);
  py::register_exception<MemoryError>(m, "MemoryError", PyExc_MemoryError);

  m.def("set_memory_limit", &set_memory_limit, py::arg("bytes"),
        "Caps the tensor memory mha holds at once (0: the machine's memory); a larger tensor raises MemoryError "
        "before anything is allocated.");
  m.def("memory_limit", &memory_limit, "The tensor memory limit in bytes.");
  m.def("set_score_memory_limit", &nn::set_score_memory_limit, py::arg("bytes"),
        "Bytes each attention call of an mha.nn layer in training may keep its scores in for the backward, which "
        "then skips recomputing Q·Kᵀ (same gradients); 256 MiB unless set, 0 keeps none.");
  m.def("score_memory_limit", &nn::score_memory_limit, "The per-call score memory limit in bytes.");
  m.def("active_memory", &active_memory, "Bytes of tensor memory mha holds now.");
  m.def("peak_memory", &peak_memory, "The most bytes of tensor memory mha has held at once since the last reset.");
  m.def("reset_peak_memory", &reset_peak_memory, "Makes the peak the memory held now.");
  m.def("attention_forward", &forward, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("attn_mask") = py::none(), py::arg("causal") = "none", py::arg("window_left") = -1,
        py::arg("window_right") = -1, py::arg("scale") = py::none(), py::arg("dropout_p") = 0.0,
        py::arg("dropout_seed") = 0, py::arg("return_weights") = false, py::arg("path") = "automatic",
        py::arg("bf16") = false,
        "Scaled dot-product attention on NumPy arrays -> (out, lse, weights or None, path that ran).");
  m.def("attention_backward", &backward, py::arg("grad_out"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("out"), py::arg("lse"), py::arg("attn_mask") = py::none(),
        py::arg("causal") = "none", py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("scale") = py::none(), py::arg("dropout_p") = 0.0, py::arg("dropout_seed") = 0,
        py::arg("path") = "automatic", py::arg("mask_grad") = false, py::arg("bf16") = false,
        py::arg("grad_weights") = py::none(),
        "Gradients of attention_forward -> (dquery, dkey, dvalue, dmask or None); grad_weights: the "
        "returned weights' gradient, if a loss used them.");
  mha::python::bind_layers(m);
  mha::python::bind_variants(m);
  mha::python::bind_checkpoints(m);
}
