// The attention page: the template (src/viz/attention_page.html, compiled in)
// with its title HTML-escaped and its data embedded as script-safe JSON.
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>

#include "mha/io/safetensors.h"
#include "mha/viz/html.h"
#include "viz/attention_page.h"
#include "viz/common.h"

namespace mha::viz {

namespace {

constexpr double kScale = 1e4;  // weights are stored rounded to 4 decimals

std::string html_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// JSON that can stand inside <script>…</script>: '<', '>' and '&' occur only
// inside strings, where \u003c, \u003e and \u0026 mean the same, so no
// "</script>" or "<!--" can end the block early. Bytes that are not UTF-8
// become U+FFFD.
std::string script_safe_json(const nlohmann::json& value) {
  const std::string json = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string out;
  for (char c : json) {
    if (c == '<') out += "\\u003c";
    else if (c == '>') out += "\\u003e";
    else if (c == '&') out += "\\u0026";
    else out += c;
  }
  return out;
}

// Replaces each {{name}} in `page` by its value, left to right, never looking
// into what it inserted; a marker without a value is kept as it is.
std::string fill(std::string_view page, const std::map<std::string, std::string>& values) {
  std::string out;
  size_t pos = 0;
  for (size_t open; (open = page.find("{{", pos)) != std::string_view::npos;) {
    out.append(page.substr(pos, open - pos));
    pos = open + 2;
    const size_t close = page.find("}}", pos);
    const auto it = close == std::string_view::npos ? values.end() : values.find(std::string(page.substr(pos, close - pos)));
    if (it == values.end()) {
      out += "{{";
      continue;
    }
    out += it->second;
    pos = close + 2;
  }
  out.append(page.substr(pos));
  return out;
}

}  // namespace

std::string attention_html(const std::vector<Tensor>& weights, const std::vector<std::string>& query_tokens,
                           const std::vector<std::string>& key_tokens, const std::string& title,
                           const HeadNotes& notes) {
  const int64_t L = int64_t(query_tokens.size()), S = int64_t(key_tokens.size());
  const char* fn = "mha::viz::attention_html";
  if (L < 1) raise<ShapeError>(fn, "query_tokens", "at least one token", "none");
  if (S < 1) raise<ShapeError>(fn, "key_tokens", "at least one token", "none");
  const int64_t heads = check_attention_weights(fn, weights, L, S);
  nlohmann::json layers = nlohmann::json::array();
  for (const Tensor& layer : weights) {
    const std::vector<double> w = layer.to_vector();  // (H, L, S)
    nlohmann::json head_list = nlohmann::json::array();
    for (int64_t h = 0; h < heads; ++h) {
      nlohmann::json rows = nlohmann::json::array();
      for (int64_t i = 0; i < L; ++i) {
        nlohmann::json row = nlohmann::json::array();
        for (int64_t j = 0; j < S; ++j) {
          const double v = w[size_t((h * L + i) * S + j)];
          if (std::isfinite(v)) row.push_back(std::round(v * kScale) / kScale);
          else row.push_back(nullptr);
        }
        rows.push_back(std::move(row));
      }
      head_list.push_back(std::move(rows));
    }
    layers.push_back(std::move(head_list));
  }
  for (const auto& [name, size] : {std::pair{"notes.present", notes.present.size()}, {"notes.importance", notes.importance.size()}})
    if (size != 0 && size != weights.size())
      raise<ShapeError>(fn, name, "one entry per layer (" + std::to_string(weights.size()) + ") or none", std::to_string(size));
  nlohmann::json importance = nullptr;
  if (!notes.importance.empty()) {
    importance = nlohmann::json::array();
    for (const std::vector<double>& layer : notes.importance) {
      if (int64_t(layer.size()) != heads)
        raise<ShapeError>(fn, "notes.importance", "one value per head (" + std::to_string(heads) + ")",
                          std::to_string(layer.size()));
      nlohmann::json row = nlohmann::json::array();
      for (double v : layer) row.push_back(std::isfinite(v) ? nlohmann::json(std::round(v * kScale) / kScale) : nullptr);
      importance.push_back(std::move(row));
    }
  }
  for (const std::vector<int64_t>& ids : notes.present)
    for (int64_t id : ids)
      if (id < 0 || id >= heads)
        raise<ShapeError>(fn, "notes.present", "head ids in [0, " + std::to_string(heads) + ")", std::to_string(id));
  const nlohmann::json data = {{"title", title},
                               {"query_tokens", query_tokens},
                               {"key_tokens", key_tokens},
                               {"colours", kColourAnchors},
                               {"weights", std::move(layers)},
                               {"present", notes.present.empty() ? nlohmann::json(nullptr) : nlohmann::json(notes.present)},
                               {"importance", std::move(importance)}};
  return fill(kAttentionPage, {{"title", html_escape(title)}, {"data", script_safe_json(data)}});
}

void save_attention_html(const std::string& path, const std::vector<Tensor>& weights,
                         const std::vector<std::string>& query_tokens, const std::vector<std::string>& key_tokens,
                         const std::string& title, const HeadNotes& notes) {
  io::write_file_atomically(path, attention_html(weights, query_tokens, key_tokens, title, notes));
}

}  // namespace mha::viz
