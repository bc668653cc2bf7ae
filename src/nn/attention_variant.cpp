// Attention kinds by name, their settings' checks and descriptions.
#include "mha/nn/attention_variant.h"

#include "nn/layer_util.h"

namespace mha::nn {

namespace {
constexpr const char* kKindNames[] = {"full",      "window",    "strided", "bigbird", "linear",
                                      "performer", "linformer", "lsh",     "axial"};
}  // namespace

AttentionKind parse_attention_kind(const std::string& name) {
  for (size_t i = 0; i < std::size(kKindNames); ++i)
    if (name == kKindNames[i]) return AttentionKind(i);
  raise<ValueError>("mha::nn::parse_attention_kind", "name", "one of " + attention_kind_names(), "'" + name + "'");
}

std::string to_string(AttentionKind kind) { return kKindNames[size_t(kind)]; }

std::string attention_kind_names() {
  std::string out;
  for (const char* name : kKindNames) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

void check_attention_variant(const AttentionVariant& a, const char* fn) {
  auto at_least = [&](int64_t value, int64_t low, const char* field) {
    if (value < low)
      raise<ValueError>(fn, std::string("attention.") + field, ">= " + std::to_string(low), std::to_string(value));
  };
  switch (a.kind) {
    case AttentionKind::full: break;
    case AttentionKind::window: at_least(a.window, 0, "window"); break;
    case AttentionKind::strided:
      at_least(a.block, 1, "block");
      at_least(a.local_blocks, 1, "local_blocks");
      at_least(a.stride_blocks, 1, "stride_blocks");
      break;
    case AttentionKind::bigbird:
      at_least(a.block, 1, "block");
      at_least(a.global_blocks, 0, "global_blocks");
      at_least(a.window_blocks, 0, "window_blocks");
      at_least(a.random_blocks, 0, "random_blocks");
      break;
    case AttentionKind::linear: break;
    case AttentionKind::performer:
      at_least(a.features, 1, "features");
      at_least(a.redraw_every, 0, "redraw_every");
      break;
    case AttentionKind::linformer:
      at_least(a.projected, 1, "projected");
      at_least(a.max_length, 1, "max_length");
      break;
    case AttentionKind::lsh:
      at_least(a.hashes, 1, "hashes");
      at_least(a.chunk, 1, "chunk");
      if (a.buckets != 0 && a.buckets != 1 && (a.buckets < 2 || a.buckets % 2 != 0))
        raise<ValueError>(fn, "attention.buckets", "0 (automatic), 1, or an even number >= 2", std::to_string(a.buckets));
      break;
    case AttentionKind::axial: at_least(a.axial_width, 1, "axial_width"); break;
  }
}

std::string describe(const AttentionVariant& a) {
  const std::string name = to_string(a.kind);
  auto n = [](int64_t x) { return std::to_string(x); };
  switch (a.kind) {
    case AttentionKind::window: return name + " " + n(a.window);
    case AttentionKind::strided:
      return name + " block " + n(a.block) + ", local " + n(a.local_blocks) + ", stride " + n(a.stride_blocks);
    case AttentionKind::bigbird:
      return name + " block " + n(a.block) + ", global " + n(a.global_blocks) + ", window " + n(a.window_blocks) +
             ", random " + n(a.random_blocks);
    case AttentionKind::performer:
      return name + " " + n(a.features) + " features, redraw every " + n(a.redraw_every);
    case AttentionKind::linformer: return name + " k " + n(a.projected) + ", max length " + n(a.max_length);
    case AttentionKind::lsh:
      return name + " " + n(a.hashes) + " hashes, chunk " + n(a.chunk) + ", buckets " +
             (a.buckets == 0 ? std::string("auto") : n(a.buckets));
    case AttentionKind::axial: return name + " width " + n(a.axial_width);
    default: return name;
  }
}

}  // namespace mha::nn
