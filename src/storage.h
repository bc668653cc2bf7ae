// Storage: one allocation on one device, freed by its backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "backend.h"

namespace mha {

// Adds to the counters of mha/memory.h (negative: freed).
void track_memory(int64_t bytes);

// The bytes of a contiguous tensor of `shape`; MemoryError when they overflow
// or would take the tensor memory past memory_limit() (mha/memory.h).
size_t checked_bytes(const Shape& shape, DType dtype, const char* fn);

class Storage {
 public:
  Storage(size_t bytes, Device device, const char* fn)
      : bytes_(bytes), device_(device), ptr_(backend_for(device, fn).allocate(bytes, fn)) {
    track_memory(int64_t(bytes));
  }
  // Memory owned by someone else (Tensor::from_blob): `owner` (may be null)
  // is released with the storage; nothing is freed here.
  Storage(void* ptr, size_t bytes, Device device, std::shared_ptr<void> owner)
      : bytes_(bytes), device_(device), ptr_(ptr), borrowed_(true), owner_(std::move(owner)) {}
  ~Storage() {
    if (borrowed_) return;
    backend_for(device_, "mha::Storage").deallocate(ptr_);
    track_memory(-int64_t(bytes_));
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  size_t bytes_;
  Device device_;
  void* ptr_;
  bool borrowed_ = false;
  std::shared_ptr<void> owner_;
};

}  // namespace mha
