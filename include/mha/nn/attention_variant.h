// Which attention a MultiheadAttention computes for each head: exact softmax
// attention (full), or one of the efficient variants of mha/variants.h. One
// switch, MultiheadAttentionConfig::attention, reaches every layer (the
// Transformer layers apply it to their self-attention; cross-attention stays
// full) and `mha train --attention KIND`.
//
//   kind       cost per head       causal  what it needs
//   full       O(L·S·E)            yes     (everything: masks, weights, dropout, KV cache)
//   window     O(L·window·E)       yes     as full; keys within ±window (causal: the window before)
//   strided    O(L·√L·E)           yes     L = S; Sparse Transformer's blocks (block, local, stride)
//   bigbird    O(L·E)              yes     L = S; global + window + seeded random blocks
//   linear     O(L·E²)             yes     elu(x)+1 features
//   performer  O(L·m·E)            yes     m positive orthogonal random features, redrawn
//   linformer  O((L + S)·k·E)      no      S ≤ max_length; learned k × max_length projections
//   lsh        O(hashes·L·chunk·E) yes     self-attention (keys = normalised queries: Wk unused)
//   axial      O(L·(L/w + w)·E)    no      L = S, a multiple of axial_width w: rows of w positions
//
// Variants other than full and window compute no weight matrix: they refuse
// need_weights, attn_mask, key_padding_mask and attn_bias (so T5-relative and
// ALiBi positions, which are biases, need full or window; sinusoidal, learned
// and RoPE work with all), bf16_mixed precision and KV-cache decoding, and
// they have no attention dropout (a MultiheadAttention refuses dropout > 0
// with them; a Transformer layer then keeps only its residual and
// feed-forward dropouts).
#pragma once

#include <cstdint>
#include <string>

namespace mha::nn {

enum class AttentionKind { full, window, strided, bigbird, linear, performer, linformer, lsh, axial };

AttentionKind parse_attention_kind(const std::string& name);  // ValueError for an unknown name
std::string to_string(AttentionKind kind);
// "full", "window", … in enum order, comma-separated (for help texts).
std::string attention_kind_names();

struct AttentionVariant {
  AttentionKind kind = AttentionKind::full;
  int64_t window = 64;             // window: keys j with |i - j| <= window (causal: i - window <= j <= i)
  int64_t block = 32;              // strided, bigbird: positions per block
  int64_t local_blocks = 2;        // strided: the band of |I - J| < local_blocks blocks
  int64_t stride_blocks = 4;       // strided: and every stride_blocks-th block
  int64_t global_blocks = 1;       // bigbird
  int64_t window_blocks = 1;       // bigbird: neighbours on each side
  int64_t random_blocks = 1;       // bigbird
  int64_t features = 64;           // performer: random features m
  int64_t redraw_every = 100;      // performer: training forwards per feature draw (0: one draw, kept)
  int64_t projected = 64;          // linformer: k
  int64_t max_length = 512;        // linformer: the longest key sequence (projections are k × max_length)
  int64_t buckets = 0;             // lsh: 0 = ceil(L / chunk) rounded up to even, at least 2
  int64_t hashes = 2;              // lsh: rounds
  int64_t chunk = 32;              // lsh: chunk length in the sorted order
  int64_t axial_width = 16;        // axial: positions per row
  uint64_t seed = 0;               // bigbird's random blocks, lsh's rotations

  bool computes_weights() const { return kind == AttentionKind::full || kind == AttentionKind::window; }
  bool supports_causal() const { return kind != AttentionKind::linformer && kind != AttentionKind::axial; }
  // A sequence fed to this attention must have a multiple of this many positions.
  int64_t length_multiple() const { return kind == AttentionKind::axial ? axial_width : 1; }
};

// Typed errors (ValueError naming `fn` and the field) for a setting out of range.
void check_attention_variant(const AttentionVariant& variant, const char* fn);
// "linear", "window 64", "lsh 2 hashes, chunk 32, buckets auto", … for logs and tables.
std::string describe(const AttentionVariant& variant);

}  // namespace mha::nn
