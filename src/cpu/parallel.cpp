// The first exception of a region, kept for the calling thread (parallel.h).
#include "cpu/parallel.h"

#include <new>

#include "mha/errors.h"

namespace mha::cpu {

void RegionErrors::keep(std::exception_ptr e) noexcept {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!first_) first_ = std::move(e);
  failed_.store(true, std::memory_order_relaxed);
}

void RegionErrors::rethrow() const {
  if (!first_) return;
  try {
    std::rethrow_exception(first_);
  } catch (const std::bad_alloc&) {
    throw MemoryError(
        "[mha::cpu] working memory of a kernel: expected an allocation the system grants; got a refusal "
        "(std::bad_alloc) inside a parallel region");
  }
}

}  // namespace mha::cpu
