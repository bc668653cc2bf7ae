// Embedding: gather rows forward, scatter-add rows backward (in index order,
// so repeated ids sum the same way on any thread count).
#include "mha/nn/embedding.h"

#include <algorithm>
#include <cstring>

#include "nn/layer_util.h"

namespace mha::nn {

namespace {
constexpr const char* kCtor = "mha::nn::Embedding";
constexpr const char* kForward = "mha::nn::Embedding::forward";
constexpr const char* kBackward = "mha::nn::Embedding::backward";
}  // namespace

Embedding::Embedding(const EmbeddingConfig& c, Generator& gen) : config_(c) {
  if (c.num_embeddings <= 0) raise<ValueError>(kCtor, "num_embeddings", "> 0", std::to_string(c.num_embeddings));
  if (c.embedding_dim <= 0) raise<ValueError>(kCtor, "embedding_dim", "> 0", std::to_string(c.embedding_dim));
  if (c.padding_idx && (*c.padding_idx < 0 || *c.padding_idx >= c.num_embeddings))
    raise<ValueError>(kCtor, "padding_idx", "in [0, " + std::to_string(c.num_embeddings) + ")",
                      std::to_string(*c.padding_idx));
  check_layer_dtype(c.dtype, kCtor);
  weight = randn({c.num_embeddings, c.embedding_dim}, gen, 0.0, 1.0, c.dtype);
  if (c.padding_idx) weight.select(0, *c.padding_idx).fill_(0.0);
  weight_grad = Tensor::zeros(weight.shape(), c.dtype);
}

Tensor Embedding::forward(const Tensor& ids_in) {
  check_defined(ids_in, kForward, "ids");
  if (ids_in.dtype() != DType::int64) raise<DtypeError>(kForward, "ids", "int64", to_string(ids_in.dtype()));
  const Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel(), D = config_.embedding_dim, V = config_.num_embeddings;
  const int64_t* id = ids.data<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (id[i] < 0 || id[i] >= V)
      raise<ValueError>(kForward, "ids", "values in [0, " + std::to_string(V) + ")",
                        std::to_string(id[i]) + " at flat index " + std::to_string(i));
  Shape shape = ids.shape();
  shape.push_back(D);
  Tensor out = Tensor::empty(shape, config_.dtype);
  const size_t row_bytes = size_t(D * dtype_size(config_.dtype));
  const char* table = static_cast<const char*>(weight.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + size_t(i) * row_bytes, table + size_t(id[i]) * row_bytes, row_bytes);
  saved_ids_ = ids;
  return out;
}

void Embedding::backward(const Tensor& dy) { backward(dy, saved_ids_); }

void Embedding::backward(const Tensor& dy_in, const Tensor& ids_in) {
  if (ids_in.defined() && ids_in.dtype() != DType::int64) raise<DtypeError>(kBackward, "ids", "int64", to_string(ids_in.dtype()));
  Shape want = ids_in.defined() ? ids_in.shape() : Shape{};
  want.push_back(config_.embedding_dim);
  check_backward(ids_in, dy_in, want, config_.dtype, kBackward);
  const Tensor dy = dy_in.contiguous(), ids = ids_in.contiguous();
  const int64_t D = config_.embedding_dim, V = config_.num_embeddings;
  const int64_t* id = ids.data<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    if (id[i] < 0 || id[i] >= V)
      raise<ValueError>(kBackward, "ids", "values in [0, " + std::to_string(V) + ")", std::to_string(id[i]));
  dispatch_float(config_.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* g = dy.data<T>();
    T* w = weight_grad.data<T>();
    // Columns in blocks on the threads, every row in order within a block:
    // each sum is the same whatever the thread count.
    constexpr int64_t kColumns = 64;
    const int64_t n = ids.numel(), blocks = (D + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(dynamic, 1) if (n * D >= (int64_t(1) << 16) && blocks > 1)
    for (int64_t c = 0; c < blocks; ++c) {
      const int64_t d0 = c * kColumns, d1 = std::min(D, d0 + kColumns);
      for (int64_t i = 0; i < n; ++i) {
        if (config_.padding_idx && id[i] == *config_.padding_idx) continue;
        for (int64_t d = d0; d < d1; ++d) w[id[i] * D + d] += g[i * D + d];
      }
    }
  });
}

}  // namespace mha::nn
