// Exceptions and OpenMP regions. An exception may not leave the structured
// block of an OpenMP construct: g++ and clang wrap each block in a handler
// that calls std::terminate. A kernel whose region can throw (its scratch, a
// std::vector, a product that grows the calling thread's buffers: each an
// allocation the system may refuse) runs the region's work through a
// RegionErrors. The first exception is kept, the work after it is skipped on
// every thread, and the caller rethrows it once the region has ended, on its
// own thread, where it can travel to the public boundary:
//
//   RegionErrors errors;
//   #pragma omp parallel for
//   for (int64_t i = 0; i < n; ++i) errors.run([&] { ... });
//   errors.rethrow();
//
// Regions of the form parallel { per-thread buffers; omp for } allocate the
// buffers through run() too, and still reach the `omp for` on every thread
// (a thread that skips a worksharing construct would hang the others at its
// barrier); their iterations then see failed() and are skipped.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>

namespace mha::cpu {

class RegionErrors {
 public:
  template <class F>
  void run(F&& work) noexcept {
    if (failed()) return;
    try {
      work();
    } catch (...) {
      keep(std::current_exception());
    }
  }

  bool failed() const noexcept { return failed_.load(std::memory_order_relaxed); }

  // After the region: throws the kept exception; a std::bad_alloc as an
  // mha::MemoryError, the error the library gives for any refused allocation.
  void rethrow() const;

 private:
  void keep(std::exception_ptr e) noexcept;

  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr first_;
};

}  // namespace mha::cpu
