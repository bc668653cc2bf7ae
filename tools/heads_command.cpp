// `mha heads`: each head's importance, entropy, confidence and positional
// label over a checkpoint's held-out data (train/heads.h), as a table and a
// layers × heads picture of the importances.
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "mha/errors.h"
#include "mha/train/checkpoint.h"
#include "mha/train/heads.h"
#include "mha/train/pruning.h"
#include "mha/viz/image.h"
#include "train_command.h"

namespace mha::tools {

namespace {

std::string label(const train::HeadStats& h) {
  std::string s;
  if (!h.positional) return s;
  s = "positional: ";  // appended: GCC 12 warns (-Wrestrict) on "…" + string
  s += h.pattern;
  if (h.pattern_share > 0) {  // a pattern of the input length: its own share (the columns are the fixed offset's)
    char share[32];
    std::snprintf(share, sizeof share, " (%.2f)", h.pattern_share);
    s += share;
  }
  return s;
}

}  // namespace

int run_heads(const std::string& checkpoint, const std::string& out, int64_t examples, int64_t batch,
              const train::LoadOptions& options, const std::string& html) {
  if (examples < 1) throw ValueError("[mha heads] --examples: expected >= 1; got " + std::to_string(examples));
  if (!out.empty() && std::filesystem::path(out).extension() != ".png")
    throw ValueError("[mha heads] --out: expected a file name ending in .png; got '" + out + "'");
  if (!html.empty() && attention_file_kind(html, "mha heads") != ".html")
    throw ValueError("[mha heads] --html: expected a file name ending in .html; got '" + html + "'");
  train::LoadedCheckpoint loaded = train::load_checkpoint(checkpoint, options);
  const int64_t nhead = loaded.info.model.nhead;
  const train::HeadReport report =
      train::head_report(*loaded.model, train::heldout_examples(loaded.info, 0, 0, examples), batch);
  std::printf("heads of %s (%s, task %s) over %lld held-out examples; importance: |dL/dgate| summed over batches, "
              "normalised per layer\n",
              checkpoint.c_str(), train::to_string(loaded.info.architecture).c_str(),
              train::to_string(loaded.info.task.task).c_str(), (long long)report.examples);
  std::printf("%-8s %5s %4s %10s %8s %10s %6s %6s  %s\n", "site", "layer", "head", "importance", "entropy",
              "confidence", "offset", "share", "label");
  std::vector<viz::Image> pictures;
  std::vector<std::string> titles;
  SiteScores scores;  // [site][layer][head id], NaN where pruned
  for (const train::SiteReport& site : report.sites) {
    const int64_t layers = int64_t(site.heads.size());
    std::vector<std::vector<double>>& by_id = scores[site.name];
    std::vector<std::string> rows, columns;
    for (int64_t l = 0; l < layers; ++l) {
      rows.push_back(std::to_string(l));  // layer numbers
      by_id.push_back(std::vector<double>(size_t(nhead), NAN));
      for (size_t h = 0; h < site.heads[size_t(l)].size(); ++h) {
        const train::HeadStats& s = site.heads[size_t(l)][h];
        const int64_t id = site.ids[size_t(l)][h];  // a pruned model's heads keep their ids
        by_id.back()[size_t(id)] = s.importance;
        const std::string offset = site.name == "cross" ? "-" : std::to_string(s.offset);
        std::printf("%-8s %5lld %4lld %10.3f %8.3f %10.3f %6s %6.2f  %s\n", site.name.c_str(), (long long)l,
                    (long long)id, s.importance, s.entropy, s.confidence, offset.c_str(), s.offset_share,
                    label(s).c_str());
      }
    }
    std::vector<double> values;
    for (const std::vector<double>& layer : by_id) values.insert(values.end(), layer.begin(), layer.end());
    for (int64_t h = 0; h < nhead; ++h) columns.push_back(std::to_string(h));  // head ids
    pictures.push_back(viz::value_grid(Tensor::from_values(values, {layers, nhead}), rows, columns));
    titles.push_back(site.name + " attention - head scores");  // the picture font has few letters
  }
  if (!out.empty()) {
    viz::save_png(out, pictures.size() == 1 ? pictures[0] : viz::stack_pictures(pictures, titles));
    std::printf("wrote %s: importance per layer (rows) and head (columns)\n", out.c_str());
  }
  if (!html.empty()) {  // the attention of the first held-out example, importance beside each head
    const train::Example e = train::heldout_examples(loaded.info, 0, 0, 1).at(0);
    const std::string title = "Heads of the " + train::to_string(loaded.info.task.task) + " model in " + checkpoint +
                              ": " + train::format_tokens(e.input) + " → " + train::format_tokens(e.output);
    for (const std::string& page : draw_attention(loaded, e.input, e.output, html, title, scores, "mha heads"))
      std::printf("wrote %s: the attention of one held-out example, each head's importance beside it\n", page.c_str());
  }
  return 0;
}

}  // namespace mha::tools
