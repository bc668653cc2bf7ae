// Heads by id per attention site, and iterative pruning (pruning.h).
#include "mha/train/pruning.h"

#include <algorithm>
#include <cmath>

#include "check.h"
#include "mha/errors.h"

namespace mha::train {

namespace {

constexpr const char* kSites = "self (decoder-only and encoder models), or encoder, decoder, cross (encoder-decoder)";

nn::EncoderDecoderModel* encoder_decoder(TaskModel& model) {
  auto* ed = dynamic_cast<EncoderDecoder*>(&model);
  return ed ? &ed->model() : nullptr;
}

template <class Stack>
HeadLists stack_ids(const Stack& stack, bool cross = false) {
  HeadLists out;
  for (size_t l = 0; l < stack.layers.size(); ++l) out.push_back(stack.head_ids(int64_t(l), cross));
  return out;
}

void check_site(TaskModel& model, const std::string& site, const char* fn) {
  const bool ed = encoder_decoder(model) != nullptr;
  if (ed ? (site == "encoder" || site == "decoder" || site == "cross") : site == "self") return;
  raise<ValueError>(fn, "site", std::string(ed ? "encoder, decoder or cross" : "self") + " (" + kSites + ")", site);
}

// Lists where some layer has fewer than nhead heads; empty otherwise.
HeadLists explicit_or_empty(const HeadLists& lists, int64_t nhead) {
  for (const std::vector<int64_t>& ids : lists)
    if (int64_t(ids.size()) != nhead) return lists;
  return {};
}

}  // namespace

HeadLists head_ids(TaskModel& model, const std::string& site) {
  check_site(model, site, "mha::train::head_ids");
  if (nn::EncoderDecoderModel* ed = encoder_decoder(model))
    return site == "encoder" ? stack_ids(ed->encoder) : stack_ids(ed->decoder, site == "cross");
  return stack_ids(language_model(model)->transformer);
}

void prune_heads(TaskModel& model, const std::string& site, int64_t layer, const std::vector<int64_t>& ids) {
  check_site(model, site, "mha::train::prune_heads");
  if (nn::EncoderDecoderModel* ed = encoder_decoder(model))
    ed->prune_heads(site == "encoder" ? nn::Site::encoder : site == "decoder" ? nn::Site::decoder : nn::Site::cross,
                    layer, ids);
  else
    language_model(model)->prune_heads(layer, ids);
  model.release_activations();
}

void record_heads(TaskModel& model, Checkpoint& info) {
  const int64_t nhead = info.model.nhead;
  if (encoder_decoder(model)) {
    info.model.heads = explicit_or_empty(head_ids(model, "decoder"), nhead);
    info.encoder_heads = explicit_or_empty(head_ids(model, "encoder"), nhead);
    info.cross_heads = explicit_or_empty(head_ids(model, "cross"), nhead);
    return;
  }
  info.model.heads = explicit_or_empty(head_ids(model, "self"), nhead);
}

int64_t count_heads(TaskModel& model) {
  int64_t n = 0;
  for (const AttentionSite& site : attention_sites(model))
    for (const std::vector<int64_t>& ids : head_ids(model, site.name)) n += int64_t(ids.size());
  return n;
}

std::vector<Tensor> weights_by_id(const std::vector<Tensor>& weights, const HeadLists& ids, int64_t nhead) {
  std::vector<Tensor> out;
  for (size_t l = 0; l < weights.size(); ++l)
    out.push_back(l < ids.size() && weights[l].dim() == 3 ? nn::heads_by_id(weights[l], 0, ids[l], nhead, NAN)
                                                          : weights[l]);
  return out;
}

std::vector<PrunedHead> prune_model(TaskModel& model, const std::vector<Example>& examples, const PruneConfig& c) {
  const char* fn = "mha::train::prune_model";
  const int64_t total = count_heads(model);
  if (c.heads < 0 || c.heads > total)
    raise<ValueError>(fn, "heads", "in [0, " + std::to_string(total) + "] (the model's heads)", std::to_string(c.heads));
  if (c.iterations < 1) raise<ValueError>(fn, "iterations", ">= 1", std::to_string(c.iterations));
  if (!c.random && examples.empty()) raise<ValueError>(fn, "examples", "at least one (to score the heads)", "none");
  Generator gen(c.seed);
  std::vector<PrunedHead> pruned;
  for (int64_t it = 1; it <= c.iterations; ++it) {
    const int64_t target = int64_t(std::llround(double(c.heads) * double(it) / double(c.iterations)));
    if (target <= int64_t(pruned.size())) continue;
    // Every head still there with its score (0 at random), in site, layer, id order.
    std::vector<PrunedHead> candidates;
    const std::vector<SiteReport> scores =
        c.random ? std::vector<SiteReport>{} : head_report(model, examples, c.batch).sites;
    const std::vector<AttentionSite> sites = attention_sites(model);
    for (size_t s = 0; s < sites.size(); ++s) {
      const HeadLists ids = head_ids(model, sites[s].name);
      for (size_t l = 0; l < ids.size(); ++l)
        for (size_t h = 0; h < ids[l].size(); ++h)
          candidates.push_back({sites[s].name, int64_t(l), ids[l][h],
                                c.random ? 0.0 : scores[s].heads[l][h].importance, it});
    }
    if (c.random) {
      for (size_t i = candidates.size(); i > 1; --i) std::swap(candidates[i - 1], candidates[gen.next_u64() % i]);
    } else {
      std::stable_sort(candidates.begin(), candidates.end(),
                       [](const PrunedHead& a, const PrunedHead& b) { return a.importance < b.importance; });
    }
    candidates.resize(size_t(target) - pruned.size());
    pruned.insert(pruned.end(), candidates.begin(), candidates.end());
    // One prune_heads call per layer.
    std::sort(candidates.begin(), candidates.end(), [](const PrunedHead& a, const PrunedHead& b) {
      return std::tie(a.site, a.layer, a.id) < std::tie(b.site, b.layer, b.id);
    });
    for (size_t i = 0; i < candidates.size();) {
      size_t j = i;
      std::vector<int64_t> ids;
      for (; j < candidates.size() && candidates[j].site == candidates[i].site && candidates[j].layer == candidates[i].layer; ++j)
        ids.push_back(candidates[j].id);
      prune_heads(model, candidates[i].site, candidates[i].layer, ids);
      i = j;
    }
  }
  return pruned;
}

}  // namespace mha::train
