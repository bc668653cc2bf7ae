// Each Python layer object holds a prototype C++ layer (its configuration).
// forward(params, inputs…) runs on a shallow copy of the prototype whose
// parameters are views of the caller's arrays, and returns that copy as a
// state object: it holds what backward needs, so one layer can be called
// several times before any backward (shared weights, recurrence), and
// state.backward(dy) returns the inputs' and the parameters' gradients.
#include "layers.h"

#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "convert.h"
#include "mha/errors.h"
#include "mha/nn/multihead_attention.h"
#include "mha/nn/transformer.h"

namespace mha::python {

namespace {

using nn::MultiheadAttention;
using nn::TransformerDecoderLayer;
using nn::TransformerEncoderLayer;

// Distinct dropout streams for the generators inside one layer.
Generator stream(uint64_t seed, uint64_t k) { return Generator(seed + k * 0x9E3779B97F4A7C15ull); }

void reseed(MultiheadAttention& m, uint64_t seed) { m.dropout_generator() = stream(seed, 0); }
void reseed(TransformerEncoderLayer& l, uint64_t seed) {
  reseed(l.self_attn, seed);
  l.dropout.generator() = stream(seed, 1);
  l.dropout1.generator() = stream(seed, 2);
  l.dropout2.generator() = stream(seed, 3);
}
void reseed(TransformerDecoderLayer& l, uint64_t seed) {
  reseed(l.self_attn, seed);
  l.multihead_attn.dropout_generator() = stream(seed, 4);
  l.dropout.generator() = stream(seed, 1);
  l.dropout1.generator() = stream(seed, 2);
  l.dropout2.generator() = stream(seed, 3);
  l.dropout3.generator() = stream(seed, 5);
}

// A copy of `proto` whose parameters view `params` (in named_parameters order).
template <class M>
std::shared_ptr<M> bound_copy(const M& proto, const py::sequence& params, bool training, uint64_t seed,
                              const char* fn) {
  auto m = std::make_shared<M>(proto);
  auto named = m->named_parameters();
  if (params.size() != named.size())
    throw ValueError(std::string("[") + fn + "] params: expected " + std::to_string(named.size()) +
                     " parameters; got " + std::to_string(params.size()));
  for (size_t i = 0; i < named.size(); ++i) {
    Tensor t = to_tensor(params[i], fn, named[i].name.c_str());
    if (t.shape() != named[i].value->shape())
      throw ShapeError(std::string("[") + fn + "] " + named[i].name + ": expected shape " +
                       shape_string(named[i].value->shape()) + "; got " + shape_string(t.shape()));
    if (t.dtype() != named[i].value->dtype())
      throw DtypeError(std::string("[") + fn + "] " + named[i].name + ": expected " +
                       to_string(named[i].value->dtype()) + "; got " + to_string(t.dtype()));
    *named[i].value = t.contiguous();
  }
  m->train(training);
  reseed(*m, seed);
  return m;
}

template <class M>
void zero_grads(M& m) {
  for (auto& p : m.named_parameters()) *p.grad = Tensor::zeros(p.value->shape(), p.value->dtype());
}

template <class M>
py::list grads_of(M& m) {
  py::list out;
  for (auto& p : m.named_parameters()) out.append(to_numpy(*p.grad));
  return out;
}

template <class M>
py::list names_of(const M& proto) {
  M m(proto);
  py::list out;
  for (auto& p : m.named_parameters()) out.append(p.name);
  return out;
}

DType dtype_of(bool float64) { return float64 ? DType::float64 : DType::float32; }

nn::Activation activation_of(const std::string& s, const char* fn) {
  if (s == "relu") return nn::Activation::relu;
  if (s == "gelu") return nn::Activation::gelu;
  throw ValueError(std::string("[") + fn + "] activation: expected 'relu' or 'gelu'; got '" + s + "'");
}

// The attention of a MultiheadAttention: None or "full", a kind's name, or a
// dict {"kind": name, field: value, …} with the fields of nn::AttentionVariant.
nn::AttentionVariant variant_of(const py::object& spec, const char* fn) {
  nn::AttentionVariant a;
  if (spec.is_none()) return a;
  if (py::isinstance<py::str>(spec)) {
    a.kind = nn::parse_attention_kind(spec.cast<std::string>());
    nn::check_attention_variant(a, fn);
    return a;
  }
  if (!py::isinstance<py::dict>(spec))
    throw ValueError(std::string("[") + fn + "] attention: expected None, a kind's name or a dict with 'kind'; got " +
                     std::string(py::str(spec.get_type())));
  const py::dict d = spec.cast<py::dict>();
  if (!d.contains("kind")) throw ValueError(std::string("[") + fn + "] attention: expected a dict with 'kind'; got none");
  a.kind = nn::parse_attention_kind(d["kind"].cast<std::string>());
  int64_t* fields[] = {&a.window, &a.block, &a.local_blocks, &a.stride_blocks, &a.global_blocks, &a.window_blocks,
                       &a.random_blocks, &a.features, &a.redraw_every, &a.projected, &a.max_length, &a.buckets,
                       &a.hashes, &a.chunk, &a.axial_width};
  const char* names[] = {"window", "block", "local_blocks", "stride_blocks", "global_blocks", "window_blocks",
                         "random_blocks", "features", "redraw_every", "projected", "max_length", "buckets",
                         "hashes", "chunk", "axial_width"};
  for (auto item : d) {
    const std::string key = item.first.cast<std::string>();
    if (key == "kind") continue;
    if (key == "seed") {
      a.seed = item.second.cast<uint64_t>();
      continue;
    }
    bool known = false;
    for (size_t i = 0; i < std::size(names); ++i)
      if (key == names[i]) *fields[i] = item.second.cast<int64_t>(), known = true;
    if (!known) {
      std::string all = "seed";
      for (const char* n : names) all += std::string(", ") + n;
      throw ValueError(std::string("[") + fn + "] attention: expected the fields kind, " + all + "; got '" + key + "'");
    }
  }
  nn::check_attention_variant(a, fn);
  return a;
}

py::dict variant_dict(const nn::AttentionVariant& a) {
  py::dict d;
  d["kind"] = nn::to_string(a.kind);
  d["window"] = a.window, d["block"] = a.block, d["local_blocks"] = a.local_blocks, d["stride_blocks"] = a.stride_blocks;
  d["global_blocks"] = a.global_blocks, d["window_blocks"] = a.window_blocks, d["random_blocks"] = a.random_blocks;
  d["features"] = a.features, d["redraw_every"] = a.redraw_every, d["projected"] = a.projected;
  d["max_length"] = a.max_length, d["buckets"] = a.buckets, d["hashes"] = a.hashes, d["chunk"] = a.chunk;
  d["axial_width"] = a.axial_width, d["seed"] = a.seed;
  return d;
}

// Performer's features for this forward: draw feature_step / redraw_every of
// the module's feature seed (the Python module counts its training forwards).
void set_feature_draw(MultiheadAttention& m, uint64_t feature_seed, uint64_t feature_step) {
  for (nn::NamedGenerator& g : m.named_generators())
    if (g.name == "feature_generator") g.generator->set_state(feature_seed, feature_step);
}

struct MhaState {
  std::shared_ptr<MultiheadAttention> m;
  bool self = false;  // one tensor as query, key and value: backward returns its one gradient
};
struct EncoderState {
  std::shared_ptr<TransformerEncoderLayer> m;
};
struct DecoderState {
  std::shared_ptr<TransformerDecoderLayer> m;
};

void bind_mha(py::module_& m) {
  py::class_<MhaState>(m, "MultiheadAttentionState")
      .def(
          "backward",
          // py::tuple named: pybind11 3 types each make_tuple by its elements.
          [](MhaState& s, const py::object& dout, const py::object& dweights) -> py::tuple {
            const char* fn = "mha.MultiheadAttention.backward";
            Tensor dy = to_tensor(dout, fn, "grad_output"), dw = to_tensor(dweights, fn, "grad_weights");
            nn::MultiheadAttentionInputGradients g;
            zero_grads(*s.m);
            {
              py::gil_scoped_release nogil;
              g = s.m->backward(dy, dw, s.self);
            }
            if (s.self) return py::make_tuple(to_numpy(g.dquery), grads_of(*s.m));
            return py::make_tuple(to_numpy(g.dquery), to_numpy(g.dkey), to_numpy(g.dvalue), grads_of(*s.m));
          },
          py::arg("grad_output"), py::arg("grad_weights") = py::none());

  py::class_<MultiheadAttention, std::shared_ptr<MultiheadAttention>>(m, "MultiheadAttention")
      .def(py::init([](int64_t embed_dim, int64_t num_heads, double dropout, bool bias, bool add_bias_kv,
                       bool add_zero_attn, int64_t kdim, int64_t vdim, bool batch_first, bool float64,
                       const py::object& attention, int64_t head_dim) {
             nn::MultiheadAttentionConfig c{.embed_dim = embed_dim, .num_heads = num_heads, .head_dim = head_dim,
                                            .dropout = dropout,
                                            .bias = bias, .add_bias_kv = add_bias_kv,
                                            .add_zero_attn = add_zero_attn, .kdim = kdim, .vdim = vdim,
                                            .batch_first = batch_first, .dtype = dtype_of(float64)};
             c.attention = variant_of(attention, "mha.nn.MultiheadAttention");
             Generator gen(0);
             return std::make_shared<MultiheadAttention>(c, gen);
           }),
           py::arg("embed_dim"), py::arg("num_heads"), py::arg("dropout") = 0.0, py::arg("bias") = true,
           py::arg("add_bias_kv") = false, py::arg("add_zero_attn") = false, py::arg("kdim") = 0,
           py::arg("vdim") = 0, py::arg("batch_first") = false, py::arg("float64") = false,
           py::arg("attention") = py::none(), py::arg("head_dim") = 0)
      .def("parameter_names", [](const MultiheadAttention& p) { return names_of(p); })
      .def("attention", [](const MultiheadAttention& p) { return variant_dict(p.config().attention); },
           "The attention variant, every field as a dict.")
      .def(
          "forward",
          [](const MultiheadAttention& proto, const py::sequence& params, const py::object& query,
             const py::object& key, const py::object& value, const py::object& key_padding_mask,
             bool need_weights, const py::object& attn_mask, bool average_attn_weights, bool is_causal,
             bool training, uint64_t seed, uint64_t feature_seed, uint64_t feature_step) {
            const char* fn = "mha.MultiheadAttention.forward";
            MhaState s{bound_copy(proto, params, training, seed, fn)};
            set_feature_draw(*s.m, feature_seed, feature_step);
            // Variants other than full and window compute no weight matrix: none is returned.
            need_weights = need_weights && proto.config().attention.computes_weights();
            // key and value None: self-attention on query, whose one gradient backward returns.
            s.self = key.is_none() && value.is_none();
            const Tensor q = to_tensor(query, fn, "query");
            const Tensor k = s.self ? q : to_tensor(key, fn, "key"), v = s.self ? q : to_tensor(value, fn, "value");
            const nn::MultiheadAttentionInputs in{.key_padding_mask = to_tensor(key_padding_mask, fn, "key_padding_mask"),
                                                  .need_weights = need_weights,
                                                  .attn_mask = to_tensor(attn_mask, fn, "attn_mask"),
                                                  .average_attn_weights = average_attn_weights,
                                                  .is_causal = is_causal};
            nn::MultiheadAttentionOutput out;
            {
              py::gil_scoped_release nogil;
              out = s.m->forward(q, k, v, in);
            }
            return py::make_tuple(to_numpy(out.output), to_numpy(out.weights), s);
          },
          py::arg("params"), py::arg("query"), py::arg("key") = py::none(), py::arg("value") = py::none(),
          py::arg("key_padding_mask") = py::none(), py::arg("need_weights") = true,
          py::arg("attn_mask") = py::none(), py::arg("average_attn_weights") = true,
          py::arg("is_causal") = false, py::arg("training") = false, py::arg("seed") = 0,
          py::arg("feature_seed") = 0, py::arg("feature_step") = 0);
}

nn::TransformerEncoderLayerConfig layer_config(int64_t d_model, int64_t nhead, int64_t dim_feedforward,
                                               double dropout, const std::string& activation,
                                               double layer_norm_eps, bool batch_first, bool norm_first,
                                               bool float64, const char* fn, int64_t self_heads,
                                               int64_t cross_heads) {
  return {.d_model = d_model, .nhead = nhead, .dim_feedforward = dim_feedforward, .dropout = dropout,
          .activation = activation_of(activation, fn), .layer_norm_eps = layer_norm_eps,
          .batch_first = batch_first, .norm_first = norm_first, .dtype = dtype_of(float64),
          .self_heads = self_heads, .cross_heads = cross_heads};
}

template <class Layer, class Cls>
void def_layer_init(Cls& cls, const char* fn) {
  cls.def(py::init([fn](int64_t d_model, int64_t nhead, int64_t dim_feedforward, double dropout,
                        const std::string& activation, double layer_norm_eps, bool batch_first, bool norm_first,
                        bool float64, int64_t self_heads, int64_t cross_heads) {
            Generator gen(0);
            return std::make_shared<Layer>(layer_config(d_model, nhead, dim_feedforward, dropout, activation,
                                                        layer_norm_eps, batch_first, norm_first, float64, fn,
                                                        self_heads, cross_heads),
                                           gen);
          }),
          py::arg("d_model"), py::arg("nhead"), py::arg("dim_feedforward") = 2048, py::arg("dropout") = 0.1,
          py::arg("activation") = "relu", py::arg("layer_norm_eps") = 1e-5, py::arg("batch_first") = false,
          py::arg("norm_first") = false, py::arg("float64") = false, py::arg("self_heads") = -1,
          py::arg("cross_heads") = -1)
      .def("parameter_names", [](const Layer& p) { return names_of(p); });
}

void bind_encoder(py::module_& m) {
  py::class_<EncoderState>(m, "TransformerEncoderLayerState")
      .def("backward", [](EncoderState& s, const py::object& dout) {
        Tensor dy = to_tensor(dout, "mha.TransformerEncoderLayer.backward", "grad_output");
        Tensor dsrc;
        zero_grads(*s.m);
        {
          py::gil_scoped_release nogil;
          dsrc = s.m->backward(dy);
        }
        return py::make_tuple(to_numpy(dsrc), grads_of(*s.m));
      });
  py::class_<TransformerEncoderLayer, std::shared_ptr<TransformerEncoderLayer>> cls(m, "TransformerEncoderLayer");
  def_layer_init<TransformerEncoderLayer>(cls, "mha.TransformerEncoderLayer");
  cls.def(
      "forward",
      [](const TransformerEncoderLayer& proto, const py::sequence& params, const py::object& src,
         const py::object& src_mask, const py::object& src_key_padding_mask, bool is_causal, bool training,
         uint64_t seed) {
        const char* fn = "mha.TransformerEncoderLayer.forward";
        EncoderState s{bound_copy(proto, params, training, seed, fn)};
        Tensor x = to_tensor(src, fn, "src");
        const nn::EncoderInputs in{.src_mask = to_tensor(src_mask, fn, "src_mask"),
                                   .src_key_padding_mask = to_tensor(src_key_padding_mask, fn, "src_key_padding_mask"),
                                   .is_causal = is_causal};
        Tensor y;
        {
          py::gil_scoped_release nogil;
          y = s.m->forward(x, in);
        }
        return py::make_tuple(to_numpy(y), s);
      },
      py::arg("params"), py::arg("src"), py::arg("src_mask") = py::none(),
      py::arg("src_key_padding_mask") = py::none(), py::arg("is_causal") = false, py::arg("training") = false,
      py::arg("seed") = 0);
}

void bind_decoder(py::module_& m) {
  py::class_<DecoderState>(m, "TransformerDecoderLayerState")
      .def("backward", [](DecoderState& s, const py::object& dout) {
        Tensor dy = to_tensor(dout, "mha.TransformerDecoderLayer.backward", "grad_output");
        nn::DecoderGradients g;
        zero_grads(*s.m);
        {
          py::gil_scoped_release nogil;
          g = s.m->backward(dy);
        }
        return py::make_tuple(to_numpy(g.dtgt), to_numpy(g.dmemory), grads_of(*s.m));
      });
  py::class_<TransformerDecoderLayer, std::shared_ptr<TransformerDecoderLayer>> cls(m, "TransformerDecoderLayer");
  def_layer_init<TransformerDecoderLayer>(cls, "mha.TransformerDecoderLayer");
  cls.def(
      "forward",
      [](const TransformerDecoderLayer& proto, const py::sequence& params, const py::object& tgt,
         const py::object& memory, const py::object& tgt_mask, const py::object& memory_mask,
         const py::object& tgt_key_padding_mask, const py::object& memory_key_padding_mask, bool tgt_is_causal,
         bool memory_is_causal, bool training, uint64_t seed) {
        const char* fn = "mha.TransformerDecoderLayer.forward";
        DecoderState s{bound_copy(proto, params, training, seed, fn)};
        Tensor t = to_tensor(tgt, fn, "tgt"), mem = to_tensor(memory, fn, "memory");
        const nn::DecoderInputs in{
            .tgt_mask = to_tensor(tgt_mask, fn, "tgt_mask"),
            .memory_mask = to_tensor(memory_mask, fn, "memory_mask"),
            .tgt_key_padding_mask = to_tensor(tgt_key_padding_mask, fn, "tgt_key_padding_mask"),
            .memory_key_padding_mask = to_tensor(memory_key_padding_mask, fn, "memory_key_padding_mask"),
            .tgt_is_causal = tgt_is_causal,
            .memory_is_causal = memory_is_causal};
        Tensor y;
        {
          py::gil_scoped_release nogil;
          y = s.m->forward(t, mem, in);
        }
        return py::make_tuple(to_numpy(y), s);
      },
      py::arg("params"), py::arg("tgt"), py::arg("memory"), py::arg("tgt_mask") = py::none(),
      py::arg("memory_mask") = py::none(), py::arg("tgt_key_padding_mask") = py::none(),
      py::arg("memory_key_padding_mask") = py::none(), py::arg("tgt_is_causal") = false,
      py::arg("memory_is_causal") = false, py::arg("training") = false, py::arg("seed") = 0);
}

}  // namespace

void bind_layers(py::module_& m) {
  bind_mha(m);
  bind_encoder(m);
  bind_decoder(m);
}

}  // namespace mha::python
