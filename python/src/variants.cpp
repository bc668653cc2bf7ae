// Bindings of the efficient variants (mha/variants.h) for mha.functional.
//
// Each *_forward takes NumPy arrays and returns (outputs..., call), where call
// is a VariantCall that holds the inputs, the options and the forward's
// results (the arrays are viewed, not copied; the views keep them alive), and
// whose backward(grad_out) returns the inputs' gradients. A
// torch.autograd.Function keeps the call between its forward and backward.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <vector>

#include "convert.h"
#include "variants.h"
#include "mha/variants.h"

namespace py = pybind11;

namespace mha::python {

namespace {

// One variant call's forward, kept for its backward.
struct VariantCall {
  std::string name;
  bool bf16 = false;
  std::function<std::vector<Tensor>(const Tensor& dout)> backward;
};

py::tuple gradients(const VariantCall& call, const py::object& dout) {
  const Tensor d = to_tensor(dout, (call.name + ".backward").c_str(), "grad_out", call.bf16);
  std::vector<Tensor> g;
  {
    py::gil_scoped_release nogil;
    g = call.backward(d);
  }
  py::tuple out(g.size());
  for (size_t i = 0; i < g.size(); ++i) out[i] = to_numpy(g[i]);
  return out;
}

// Runs f without the GIL (the inputs are views that the caller keeps alive).
template <class F>
auto released(F&& f) {
  py::gil_scoped_release nogil;
  return f();
}

struct Inputs {
  Tensor q, k, v;
};

Inputs inputs(const char* fn, const py::object& q, const py::object& k, const py::object& v, bool bf16) {
  return {to_tensor(q, fn, "query", bf16), k.is_none() ? Tensor{} : to_tensor(k, fn, "key", bf16),
          to_tensor(v, fn, "value", bf16)};
}

py::tuple block_sparse(const py::object& q, const py::object& k, const py::object& v, const BlockSparseLayout& layout,
                       bool causal, std::optional<double> scale, bool bf16) {
  const char* fn = "mha.functional.block_sparse_attention";
  const Inputs x = inputs(fn, q, k, v, bf16);
  const BlockSparseOptions o{layout, causal, scale};
  const BlockSparseOutput f = released([&] { return block_sparse_attention_forward(x.q, x.k, x.v, o); });
  VariantCall call{fn, bf16, [x, o, f](const Tensor& dout) {
                     const AttentionGradients g = block_sparse_attention_backward(dout, x.q, x.k, x.v, f, o);
                     return std::vector<Tensor>{g.dquery, g.dkey, g.dvalue};
                   }};
  return py::make_tuple(to_numpy(f.out), to_numpy(f.lse), std::move(call));
}

py::tuple linear(const py::object& q, const py::object& k, const py::object& v, bool causal, bool bf16) {
  const char* fn = "mha.functional.linear_attention";
  const Inputs x = inputs(fn, q, k, v, bf16);
  const LinearAttentionOptions o{causal};
  const LinearAttentionOutput f = released([&] { return linear_attention_forward(x.q, x.k, x.v, o); });
  VariantCall call{fn, bf16, [x, o, f](const Tensor& dout) {
                     const AttentionGradients g = linear_attention_backward(dout, x.q, x.k, x.v, f, o);
                     return std::vector<Tensor>{g.dquery, g.dkey, g.dvalue};
                   }};
  return py::make_tuple(to_numpy(f.out), to_numpy(f.normalizer), std::move(call));
}

py::tuple performer(const py::object& q, const py::object& k, const py::object& v, const py::object& features,
                    bool causal, std::optional<double> scale, bool bf16) {
  const char* fn = "mha.functional.performer_attention";
  const Inputs x = inputs(fn, q, k, v, bf16);
  const PerformerOptions o{to_tensor(features, fn, "features", bf16), causal, scale};
  const LinearAttentionOutput f = released([&] { return performer_attention_forward(x.q, x.k, x.v, o); });
  VariantCall call{fn, bf16, [x, o, f](const Tensor& dout) {
                     const AttentionGradients g = performer_attention_backward(dout, x.q, x.k, x.v, f, o);
                     return std::vector<Tensor>{g.dquery, g.dkey, g.dvalue};
                   }};
  return py::make_tuple(to_numpy(f.out), to_numpy(f.normalizer), std::move(call));
}

py::tuple linformer(const py::object& q, const py::object& k, const py::object& v, const py::object& key_projection,
                    const py::object& value_projection, std::optional<double> scale, const std::string& path, bool bf16) {
  const char* fn = "mha.functional.linformer_attention";
  const Inputs x = inputs(fn, q, k, v, bf16);
  LinformerOptions o{to_tensor(key_projection, fn, "key_projection", bf16),
                     to_tensor(value_projection, fn, "value_projection", bf16), scale};
  o.path = path_of(path, fn);
  const LinformerOutput f = released([&] { return linformer_attention_forward(x.q, x.k, x.v, o); });
  VariantCall call{fn, bf16, [x, o, f](const Tensor& dout) {
                     const LinformerGradients g = linformer_attention_backward(dout, x.q, x.k, x.v, f, o);
                     return std::vector<Tensor>{g.dquery, g.dkey, g.dvalue, g.dkey_projection, g.dvalue_projection};
                   }};
  return py::make_tuple(to_numpy(f.out), to_numpy(f.lse), std::move(call));
}

LshOptions lsh_options(int64_t buckets, int64_t hashes, int64_t chunk, uint64_t seed, bool causal,
                       std::optional<double> scale) {
  return {buckets, hashes, chunk, seed, causal, scale};
}

py::tuple lsh(const py::object& q, const py::object& v, int64_t buckets, int64_t hashes, int64_t chunk, uint64_t seed,
              bool causal, std::optional<double> scale, bool bf16) {
  const char* fn = "mha.functional.lsh_attention";
  const Inputs x = inputs(fn, q, py::none(), v, bf16);
  const LshOptions o = lsh_options(buckets, hashes, chunk, seed, causal, scale);
  const LshOutput f = released([&] { return lsh_attention_forward(x.q, x.v, o); });
  VariantCall call{fn, bf16, [x, o, f](const Tensor& dout) {
                     const LshGradients g = lsh_attention_backward(dout, x.q, x.v, f, o);
                     return std::vector<Tensor>{g.dquery, g.dvalue};
                   }};
  return py::make_tuple(to_numpy(f.out), to_numpy(f.lse), std::move(call));
}

py::tuple axial(const py::object& q, const py::object& k, const py::object& v, std::optional<double> scale,
                const std::string& path, bool bf16) {
  const char* fn = "mha.functional.axial_attention";
  const Inputs x = inputs(fn, q, k, v, bf16);
  AxialOptions o{scale};
  o.path = path_of(path, fn);
  const AxialOutput f = released([&] { return axial_attention_forward(x.q, x.k, x.v, o); });
  VariantCall call{fn, bf16, [x, o, f](const Tensor& dout) {
                     const AttentionGradients g = axial_attention_backward(dout, x.q, x.k, x.v, f, o);
                     return std::vector<Tensor>{g.dquery, g.dkey, g.dvalue};
                   }};
  return py::make_tuple(to_numpy(f.out), std::move(call));
}

DType dtype_named(const std::string& name, const char* fn) {
  if (name == "float32") return DType::float32;
  if (name == "float64") return DType::float64;
  throw ValueError(std::string("[") + fn + "] dtype: expected 'float32' or 'float64'; got '" + name + "'");
}

}  // namespace

void bind_variants(py::module_& m) {
  py::class_<VariantCall>(m, "VariantCall", "One variant call's forward, kept for its backward.")
      .def("backward", &gradients, py::arg("grad_out"), "The gradients of the call's inputs, in their order.");

  py::class_<BlockSparseLayout>(m, "BlockSparseLayout",
                                "Which key blocks each query block attends to (compressed rows).")
      .def_readonly("block", &BlockSparseLayout::block)
      .def_readonly("query_blocks", &BlockSparseLayout::query_blocks)
      .def_readonly("key_blocks", &BlockSparseLayout::key_blocks)
      .def_readonly("row_begin", &BlockSparseLayout::row_begin)
      .def_readonly("key_block", &BlockSparseLayout::key_block)
      .def_property_readonly("nonzero_blocks", &BlockSparseLayout::nonzero_blocks)
      .def("__repr__", [](const BlockSparseLayout& l) {
        return "BlockSparseLayout(block=" + std::to_string(l.block) + ", query_blocks=" + std::to_string(l.query_blocks) +
               ", key_blocks=" + std::to_string(l.key_blocks) + ", nonzero_blocks=" + std::to_string(l.nonzero_blocks()) + ")";
      });
  m.def(
      "strided_layout",
      [](int64_t length, int64_t block, int64_t local_blocks, int64_t stride_blocks, bool causal) {
        return strided_layout(length, {block, local_blocks, stride_blocks}, causal);
      },
      py::arg("length"), py::arg("block") = 64, py::arg("local_blocks") = 2, py::arg("stride_blocks") = 8,
      py::arg("causal") = false);
  m.def(
      "bigbird_layout",
      [](int64_t length, int64_t block, int64_t global_blocks, int64_t window_blocks, int64_t random_blocks,
         uint64_t seed, bool causal) {
        return bigbird_layout(length, {block, global_blocks, window_blocks, random_blocks, seed}, causal);
      },
      py::arg("length"), py::arg("block") = 64, py::arg("global_blocks") = 1, py::arg("window_blocks") = 1,
      py::arg("random_blocks") = 2, py::arg("seed") = 0, py::arg("causal") = false);
  m.def(
      "block_sparse_mask",
      [](const BlockSparseLayout& layout, int64_t L, int64_t S, bool causal) {
        return to_numpy(block_sparse_mask(layout, L, S, causal));
      },
      py::arg("layout"), py::arg("L"), py::arg("S"), py::arg("causal") = false);
  m.def(
      "performer_features",
      [](int64_t features, int64_t head_dim, uint64_t seed, const std::string& dtype, bool orthogonal) {
        return to_numpy(performer_features(features, head_dim, seed, dtype_named(dtype, "mha.functional.performer_features"),
                                           orthogonal));
      },
      py::arg("features"), py::arg("head_dim"), py::arg("seed") = 0, py::arg("dtype") = "float32",
      py::arg("orthogonal") = true);
  m.def(
      "linformer_projection",
      [](int64_t k, int64_t length, uint64_t seed, const std::string& dtype) {
        return to_numpy(linformer_projection(k, length, seed, dtype_named(dtype, "mha.functional.linformer_projection")));
      },
      py::arg("k"), py::arg("length"), py::arg("seed") = 0, py::arg("dtype") = "float32");
  m.def(
      "lsh_buckets",
      [](const py::object& q, int64_t buckets, int64_t hashes, int64_t chunk, uint64_t seed) {
        const Tensor t = to_tensor(q, "mha.functional.lsh_buckets", "query");
        return to_numpy(lsh_buckets(t, lsh_options(buckets, hashes, chunk, seed, false, std::nullopt)));
      },
      py::arg("query"), py::arg("buckets") = 8, py::arg("hashes") = 1, py::arg("chunk") = 64, py::arg("seed") = 0);

  m.def("block_sparse_forward", &block_sparse, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("layout"),
        py::arg("causal"), py::arg("scale"), py::arg("bf16") = false);
  m.def("linear_forward", &linear, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("causal"),
        py::arg("bf16") = false);
  m.def("performer_forward", &performer, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("features"),
        py::arg("causal"), py::arg("scale"), py::arg("bf16") = false);
  m.def("linformer_forward", &linformer, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("key_projection"),
        py::arg("value_projection"), py::arg("scale"), py::arg("path"), py::arg("bf16") = false);
  m.def("lsh_forward", &lsh, py::arg("query"), py::arg("value"), py::arg("buckets"), py::arg("hashes"), py::arg("chunk"),
        py::arg("seed"), py::arg("causal"), py::arg("scale"), py::arg("bf16") = false);
  m.def("axial_forward", &axial, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("scale"), py::arg("path"),
        py::arg("bf16") = false);
}

}  // namespace mha::python
