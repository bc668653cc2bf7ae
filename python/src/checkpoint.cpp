// Trained checkpoints for mha.load: a token model (decoder, encoder-decoder,
// encoder) or a Vision Transformer, loaded and verified by the C++ loaders
// and run on NumPy arrays. A model keeps its activations between calls, so
// calls on one model from several Python threads take turns on its mutex
// (with the GIL released, other Python threads run meanwhile).
#include "checkpoint.h"

#include <pybind11/stl.h>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "convert.h"
#include "mha/errors.h"
#include "mha/train/checkpoint.h"
#include "mha/train/heads.h"
#include "mha/train/pruning.h"
#include "mha/train/trainer.h"

namespace mha::python {

namespace {

struct TokenModel {
  train::LoadedCheckpoint loaded;
  std::mutex mutex;
};

struct VisionModel {
  train::LoadedVisionCheckpoint loaded;
  std::mutex mutex;
};

// f() on the model, the GIL released and the model's mutex held.
template <class F>
auto on_model(std::mutex& mutex, F&& f) {
  py::gil_scoped_release nogil;
  std::lock_guard lock(mutex);
  return f();
}

// A model loaded (and verified) by `loader` with the GIL released.
template <class Model, auto loader>
std::unique_ptr<Model> load(const std::string& path, bool allow_non_finite) {
  auto model = std::make_unique<Model>();
  py::gil_scoped_release nogil;
  model->loaded = loader(path, {.allow_non_finite = allow_non_finite});
  return model;
}

py::list arrays(const std::vector<Tensor>& tensors) {
  py::list out;
  for (const Tensor& t : tensors) out.append(to_numpy(t));
  return out;
}

py::object token_forward(TokenModel& m, const py::object& ids, const py::object& target) {
  const char* fn = "mha.load(...).forward";
  const Tensor tids = to_tensor(ids, fn, "tokens"), ttarget = to_tensor(target, fn, "target");
  nn::Module& network = m.loaded.model->network();
  Tensor logits;
  if (auto* lm = dynamic_cast<nn::LanguageModel*>(&network)) {
    if (ttarget.defined())
      throw ValueError(std::string("[") + fn + "] target: expected None for a " +
                       train::to_string(m.loaded.info.architecture) + " model (only an encoder-decoder reads one)");
    logits = on_model(m.mutex, [&] { return lm->forward(tids).clone(); });
  } else {
    auto& ed = dynamic_cast<nn::EncoderDecoderModel&>(network);
    if (!ttarget.defined())
      throw ValueError(std::string("[") + fn + "] target: expected the decoder's tokens (B, T) for an "
                       "encoder-decoder model; got None");
    logits = on_model(m.mutex, [&] { return ed.forward(tids, ttarget).clone(); });
  }
  return to_numpy(logits);
}

std::vector<int64_t> token_answer(TokenModel& m, const std::vector<int64_t>& input, int64_t max_new) {
  if (max_new <= 0) max_new = 2 * int64_t(input.size()) + 2;
  return on_model(m.mutex, [&] { return train::answer(m.loaded, input, max_new, "mha.load(...).generate"); });
}

// Every attention of the model over input → output: [{name, short_name, weights: [(nhead, queries, keys) per
// layer, by head id: a pruned head's plane NaN], queries, keys}].
py::list token_attention(TokenModel& m, const std::vector<int64_t>& input, const std::vector<int64_t>& output) {
  std::vector<train::AttentionView> views = on_model(m.mutex, [&] {
    std::vector<train::AttentionView> v = m.loaded.model->attention(input, output);
    for (train::AttentionView& view : v) {
      view.weights = train::weights_by_id(view.weights, train::head_ids(*m.loaded.model, view.short_name),
                                          m.loaded.info.model.nhead);
      for (Tensor& w : view.weights) w = w.clone();
    }
    return v;
  });
  py::list out;
  for (const train::AttentionView& v : views) {
    py::dict d;
    d["name"] = v.name;
    d["short_name"] = v.short_name;
    d["weights"] = arrays(v.weights);
    d["queries"] = v.queries;
    d["keys"] = v.keys;
    out.append(d);
  }
  return out;
}

// Held-out exact match and token accuracy on the task's held-out split, at
// other input lengths when given (length generalisation).
py::dict token_evaluate(TokenModel& m, int64_t min_length, int64_t max_length) {
  const auto [e, count] = on_model(m.mutex, [&] {
    const std::vector<train::Example> heldout = train::heldout_examples(m.loaded.info, min_length, max_length);
    return std::pair{train::evaluate(*m.loaded.model, heldout), heldout.size()};
  });
  py::dict d;
  d["exact_match"] = e.exact_match;
  d["token_accuracy"] = e.token_accuracy;
  d["examples"] = count;
  return d;
}

// The head report (train/heads.h) over up to `examples` held-out examples: per
// attention site, (layers, nhead) arrays of each statistic by head id (a
// pruned head's: NaN, offset 0, not positional) and the ids each layer has.
py::list token_heads(TokenModel& m, int64_t examples, int64_t batch) {
  if (examples < 1) throw ValueError("[mha.load(...).heads] examples: expected >= 1; got " + std::to_string(examples));
  const train::HeadReport report = on_model(m.mutex, [&] {
    return train::head_report(*m.loaded.model, train::heldout_examples(m.loaded.info, 0, 0, examples), batch);
  });
  py::list out;
  const int64_t heads = m.loaded.info.model.nhead;
  for (const train::SiteReport& site : report.sites) {
    const int64_t layers = int64_t(site.heads.size());
    const size_t cells = size_t(layers * heads);
    std::vector<double> importance(cells, NAN), entropy(cells, NAN), confidence(cells, NAN), share(cells, NAN);
    std::vector<double> offset(cells, 0.0), positional(cells, 0.0);
    std::vector<std::vector<std::string>> pattern(static_cast<size_t>(layers), std::vector<std::string>(static_cast<size_t>(heads)));
    for (size_t l = 0; l < site.heads.size(); ++l)
      for (size_t j = 0; j < site.heads[l].size(); ++j) {
        const train::HeadStats& h = site.heads[l][j];
        const size_t at = l * size_t(heads) + size_t(site.ids[l][j]);
        importance[at] = h.importance, entropy[at] = h.entropy, confidence[at] = h.confidence;
        share[at] = h.offset_share, offset[at] = double(h.offset), positional[at] = h.positional;
        pattern[l][size_t(site.ids[l][j])] = h.pattern;
      }
    py::dict d;
    d["name"] = site.name;
    d["heads"] = site.ids;
    d["pattern"] = pattern;
    const auto grid = [&](const std::vector<double>& v, DType dtype) {
      return to_numpy(Tensor::from_values(v, {layers, heads}).to(dtype));
    };
    d["importance"] = grid(importance, DType::float64);
    d["entropy"] = grid(entropy, DType::float64);
    d["confidence"] = grid(confidence, DType::float64);
    d["offset"] = grid(offset, DType::int64);
    d["offset_share"] = grid(share, DType::float64);
    d["positional"] = grid(positional, DType::boolean);
    out.append(d);
  }
  return out;
}

py::object vision_forward(VisionModel& m, const py::object& images) {
  const Tensor t = to_tensor(images, "mha.load(...).forward", "images");
  return to_numpy(on_model(m.mutex, [&] { return m.loaded.model->forward(t).clone(); }));
}

// Each layer's attention (B, H, tokens, tokens), tokens = the class token and the patches.
py::list vision_attention(VisionModel& m, const py::object& images) {
  const Tensor t = to_tensor(images, "mha.load(...).attention", "images");
  return arrays(on_model(m.mutex, [&] {
    m.loaded.model->forward(t, true);
    std::vector<Tensor> w;
    for (const Tensor& layer : m.loaded.model->attention_weights()) {
      if (!layer.defined())
        throw ValueError("[mha.load(...).attention] model: expected one whose attention forms weights (full or "
                         "window); got " + nn::to_string(m.loaded.info.model.attention.kind) + " attention");
      w.push_back(layer.clone());
    }
    return w;
  }));
}

}  // namespace

void bind_checkpoints(py::module_& m) {
  m.def("checkpoint_architecture", &train::checkpoint_architecture, py::arg("path"),
        "'decoder', 'encoder-decoder', 'encoder' or 'vision': what the checkpoint folder holds.");
  m.def("parse_tokens", [](const std::string& text) { return train::parse_tokens(text, "mha.load(...).tokens"); },
        py::arg("text"), "The toy tasks' token ids of a text such as '3 1 4 + 1 5'.");
  m.def("format_tokens", &train::format_tokens, py::arg("tokens"), "The text of token ids.");

  py::class_<TokenModel>(m, "TokenModel")
      .def_property_readonly("config", [](const TokenModel& t) { return train::config_json(t.loaded.info); })
      .def_property_readonly("checksummed", [](const TokenModel& t) { return t.loaded.checksummed; })
      .def("forward", &token_forward, py::arg("tokens"), py::arg("target") = py::none())
      .def("answer", &token_answer, py::arg("input"), py::arg("max_new") = 0)
      .def("attention", &token_attention, py::arg("input"), py::arg("output"))
      .def("evaluate", &token_evaluate, py::arg("min_length") = 0, py::arg("max_length") = 0)
      .def("heads", &token_heads, py::arg("examples") = 256, py::arg("batch") = 32);
  m.def("load_token_model", &load<TokenModel, train::load_checkpoint>, py::arg("path"),
        py::arg("allow_non_finite") = false);

  py::class_<VisionModel>(m, "VisionModel")
      .def_property_readonly("config", [](const VisionModel& v) { return train::config_json(v.loaded.info); })
      .def_property_readonly("checksummed", [](const VisionModel& v) { return v.loaded.checksummed; })
      .def("forward", &vision_forward, py::arg("images"))
      .def("attention", &vision_attention, py::arg("images"));
  m.def("load_vision_model", &load<VisionModel, train::load_vision_checkpoint>, py::arg("path"),
        py::arg("allow_non_finite") = false);
}

}  // namespace mha::python
