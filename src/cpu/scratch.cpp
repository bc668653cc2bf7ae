// Per-thread grow-only scratch (scratch.h).
#include "cpu/scratch.h"

#include <omp.h>

#include <new>
#include <string>

#include "mha/errors.h"

namespace mha::cpu {

namespace {

constexpr std::align_val_t kAlign{64};

struct Slots {
  void* data[int(ScratchSlot::count)] = {};
  int64_t bytes[int(ScratchSlot::count)] = {};
  ~Slots() {
    for (void* d : data) ::operator delete(d, kAlign);
  }
};

}  // namespace

void* thread_scratch_bytes(ScratchSlot slot, int64_t bytes) {
  thread_local Slots slots;
  const int s = int(slot);
  if (slots.bytes[s] < bytes) {
    ::operator delete(slots.data[s], kAlign);
    slots.data[s] = nullptr, slots.bytes[s] = 0;
    const size_t rounded = size_t((bytes + 63) / 64 * 64);
    void* p = ::operator new(rounded, kAlign, std::nothrow);
    if (!p)
      throw MemoryError("[mha::cpu::thread_scratch] bytes: expected an allocation the system grants; got a refusal of " +
                        std::to_string(rounded) + " bytes");
    slots.data[s] = p, slots.bytes[s] = bytes;
  }
  return slots.data[s];
}

// Slices a page and a cache line more than their bytes rounded up to pages
// apart: a stride of a power of two (a head's packed operands, 16 MiB, say)
// would put the same offset of every slice on the same L1 and L2 sets, which
// SMT siblings share; separate allocations never lined up like that.
PerThread per_thread_scratch(ScratchSlot slot, int64_t bytes) {
  const int64_t stride = bytes == 0 ? 0 : (bytes + 4095) / 4096 * 4096 + 4096 + 64;
  return {static_cast<char*>(thread_scratch_bytes(slot, stride * omp_get_max_threads())), stride};
}

void* own_slice(const PerThread& p) { return p.base + omp_get_thread_num() * p.stride; }

}  // namespace mha::cpu
