// Head importance, entropy, confidence and positional labels (heads.h).
#include "mha/train/heads.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "mha/errors.h"
#include "check.h"
#include "mha/nn/loss.h"
#include "mha/train/pruning.h"

namespace mha::train {

namespace {

template <class Stack>
std::vector<nn::MultiheadAttention*> self_attentions(Stack& stack) {
  std::vector<nn::MultiheadAttention*> out;
  for (auto& layer : stack.layers) out.push_back(&layer->self_attn);
  return out;
}

// Adds each head's |∂L/∂gate| of the last backward to `sums` and zeroes the gate gradients.
void collect(std::vector<AttentionSite>& sites, std::vector<std::vector<std::vector<double>>>& sums) {
  for (size_t s = 0; s < sites.size(); ++s)
    for (size_t l = 0; l < sites[s].layers.size(); ++l) {
      nn::MultiheadAttention& m = *sites[s].layers[l];
      const std::vector<double> g = m.head_gate_grad().to_vector();
      for (size_t h = 0; h < g.size(); ++h) sums[s][l][h] += std::abs(g[h]);
      m.zero_head_gate_grad();
    }
}

// Entropy, confidence and offsets of one example's weights (H, queries, keys), added to the layer's sums.
// Per example too, over the rows that predict the answer, keyed by the input length n: the share at
// offset d keyed d − n, and at i + j = c keyed c − 2n (a pattern fixed once the length is known:
// copy's offset, reverse's mirror).
struct LayerSums {
  explicit LayerSums(size_t H)
      : entropy(H), confidence(H), rows(H), offset_weight(H), offset_rows(H), relative(H), mirror(H) {}
  std::vector<double> entropy, confidence, rows;
  std::vector<std::map<int64_t, double>> offset_weight;
  std::vector<std::map<int64_t, int64_t>> offset_rows;
  std::vector<std::map<int64_t, std::pair<double, int64_t>>> relative, mirror;  // key → (Σ share, examples)
  int64_t examples = 0;
};

// This example's share of each offset (line i − j = d) or each anti-diagonal (i + j = c) of head h:
// the mean weight on it over rows [first, last) that have a key on it, for lines at least a quarter of
// those rows have.
std::map<int64_t, double> line_shares(const double* w, int64_t Lk, int64_t first, int64_t last, bool anti) {
  std::map<int64_t, std::pair<double, int64_t>> sums;
  for (int64_t i = first; i < last; ++i)
    for (int64_t j = 0; j < Lk; ++j) {
      auto& s = sums[anti ? i + j : i - j];
      s.first += w[i * Lk + j], ++s.second;
    }
  std::map<int64_t, double> out;
  for (const auto& [line, s] : sums)
    if (double(s.second) >= 0.25 * double(last - first)) out[line] = s.first / double(s.second);
  return out;
}

// The rows that predict the answer: from the separator on, one per output token (BOS input SEP
// output: the separator predicts the first); every row where the queries hold no separator.
std::pair<int64_t, int64_t> answer_rows(const AttentionView& view, const Example& e) {
  const auto sep = std::find(view.queries.begin(), view.queries.end(), kSep);
  const int64_t L = int64_t(view.queries.size());
  if (sep == view.queries.end()) return {0, L};
  const int64_t first = int64_t(sep - view.queries.begin());
  return {first, std::min(L, first + int64_t(e.output.size()))};
}

void add_weights(const Tensor& weights, bool self, int64_t input_length, std::pair<int64_t, int64_t> rows,
                 LayerSums& sums) {
  const int64_t H = weights.size(0), Lq = weights.size(1), Lk = weights.size(2);
  const std::vector<double> w = weights.contiguous().to_vector();
  ++sums.examples;
  for (int64_t h = 0; h < H && self && rows.second > rows.first; ++h)
    for (bool anti : {false, true})
      for (const auto& [line, share] : line_shares(&w[size_t(h * Lq * Lk)], Lk, rows.first, rows.second, anti)) {
        auto& s = (anti ? sums.mirror : sums.relative)[size_t(h)][line - (anti ? 2 : 1) * input_length];
        s.first += share, ++s.second;
      }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < Lq; ++i) {
      const double* row = &w[size_t((h * Lq + i) * Lk)];
      double entropy = 0, top = 0;
      for (int64_t j = 0; j < Lk; ++j) {
        if (row[j] > 0) entropy -= row[j] * std::log(row[j]);
        top = std::max(top, row[j]);
        if (self) sums.offset_weight[size_t(h)][i - j] += row[j];
      }
      sums.entropy[size_t(h)] += entropy, sums.confidence[size_t(h)] += top, sums.rows[size_t(h)] += 1;
      if (self)  // every offset this row could have put weight on
        for (int64_t j = 0; j < Lk; ++j) ++sums.offset_rows[size_t(h)][i - j];
    }
}

}  // namespace

std::vector<AttentionSite> attention_sites(TaskModel& model) {
  if (auto* d = dynamic_cast<DecoderOnly*>(&model)) return {{"self", self_attentions(d->model().transformer)}};
  if (auto* e = dynamic_cast<EncoderOnly*>(&model)) return {{"self", self_attentions(e->model().transformer)}};
  auto& ed = dynamic_cast<EncoderDecoder&>(model);
  AttentionSite cross{"cross", {}};
  for (auto& layer : ed.model().decoder.layers) cross.layers.push_back(&layer->multihead_attn);
  return {{"encoder", self_attentions(ed.model().encoder)}, {"decoder", self_attentions(ed.model().decoder)}, cross};
}

HeadReport head_report(TaskModel& model, const std::vector<Example>& examples, int64_t batch) {
  const char* fn = "mha::train::head_report";
  if (examples.empty()) raise<ValueError>(fn, "examples", "at least one", "none");
  if (batch < 1) raise<ValueError>(fn, "batch", ">= 1", std::to_string(batch));
  std::vector<AttentionSite> sites = attention_sites(model);
  std::vector<std::vector<std::vector<double>>> importance(sites.size());
  for (size_t s = 0; s < sites.size(); ++s)
    for (nn::MultiheadAttention* m : sites[s].layers) {
      const int64_t H = m->config().num_heads;
      m->set_head_gates(Tensor::full({H}, 1.0, m->config().dtype));
      importance[s].push_back(std::vector<double>(size_t(H), 0.0));
    }
  model.eval();
  {
    // However the batches end: the gates cleared, no gradient left behind.
    struct Restore {
      TaskModel& model;
      std::vector<AttentionSite>& sites;
      ~Restore() {
        for (AttentionSite& site : sites)
          for (nn::MultiheadAttention* m : site.layers) m->set_head_gates({});
        model.zero_grad();
        model.release_activations();
      }
    } restore{model, sites};
    for (size_t first = 0; first < examples.size(); first += size_t(batch)) {
      const std::vector<Example> part(examples.begin() + int64_t(first),
                                      examples.begin() + int64_t(std::min(examples.size(), first + size_t(batch))));
      const Batch b = model.make_batch(part);
      const Tensor logits = model.forward(b);
      const nn::CrossEntropyResult loss = nn::cross_entropy(logits, token_tensor(b.targets, b.rows, b.length));
      model.backward(loss.dlogits);
      collect(sites, importance);
    }
  }

  // The attention of each example, by site name.
  std::map<std::string, std::vector<LayerSums>> weights;
  for (const Example& e : examples)
    for (const AttentionView& view : model.attention(e.input, e.output)) {
      std::vector<LayerSums>& layers = weights[view.short_name];
      for (size_t l = 0; l < view.weights.size(); ++l) {
        if (layers.size() <= l) layers.emplace_back(size_t(view.weights[l].size(0)));
        add_weights(view.weights[l], view.short_name != "cross", int64_t(e.input.size()), answer_rows(view, e),
                    layers[l]);
      }
    }

  HeadReport report;
  report.examples = int64_t(examples.size());
  for (size_t s = 0; s < sites.size(); ++s) {
    SiteReport site{sites[s].name, {}, head_ids(model, sites[s].name)};
    const auto found = weights.find(sites[s].name);
    for (size_t l = 0; l < importance[s].size(); ++l) {
      const std::vector<double>& imp = importance[s][l];
      double norm = 0;
      for (double x : imp) norm += x * x;
      norm = std::sqrt(norm);
      std::vector<HeadStats> heads(imp.size());
      for (size_t h = 0; h < imp.size(); ++h) {
        HeadStats& st = heads[h];
        st.importance = norm > 0 ? imp[h] / norm : 0.0;
        if (found == weights.end() || found->second.size() <= l) continue;
        const LayerSums& w = found->second[l];
        if (h >= w.rows.size() || w.rows[h] == 0) continue;  // a view with fewer heads, or no rows
        st.entropy = w.entropy[h] / w.rows[h], st.confidence = w.confidence[h] / w.rows[h];
        for (const auto& [offset, total] : w.offset_weight[h]) {
          const double share = total / double(w.offset_rows[h].at(offset));
          // Offsets few rows can have (the longest reach) are left out: at least a quarter of the rows.
          if (double(w.offset_rows[h].at(offset)) < 0.25 * w.rows[h]) continue;
          if (share > st.offset_share) st.offset_share = share, st.offset = offset;
        }
        st.positional = st.offset_share >= 0.9;
        if (st.positional) {
          st.pattern = st.offset == 0 ? "itself" : st.offset == 1 ? "previous token" : "offset " + std::to_string(st.offset);
          continue;
        }
        // Patterns fixed per input length n, over every example (the mean of their shares).
        for (bool anti : {false, true})
          for (const auto& [key, sum] : (anti ? w.mirror : w.relative)[h]) {
            if (sum.second < w.examples || st.positional) continue;
            const double share = sum.first / double(sum.second);
            if (share < 0.9) continue;
            st.positional = true, st.pattern_share = share;
            const std::string k = (key < 0 ? " - " : " + ") + std::to_string(std::abs(key));
            st.pattern = anti ? "mirror: i + j = 2n" + k : "offset n" + k;
            if (key == 0) st.pattern = anti ? "mirror: i + j = 2n" : "offset n";
          }
      }
      site.heads.push_back(std::move(heads));
    }
    report.sites.push_back(std::move(site));
  }
  return report;
}

}  // namespace mha::train
