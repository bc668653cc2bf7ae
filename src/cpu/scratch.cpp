// Per-thread grow-only scratch (scratch.h).
#include "cpu/scratch.h"

#include <cstdlib>
#include <new>

namespace mha::cpu {

namespace {

struct Slots {
  void* data[int(ScratchSlot::count)] = {};
  int64_t bytes[int(ScratchSlot::count)] = {};
  ~Slots() {
    for (void* d : data) std::free(d);
  }
};

}  // namespace

void* thread_scratch_bytes(ScratchSlot slot, int64_t bytes) {
  thread_local Slots slots;
  const int s = int(slot);
  if (slots.bytes[s] < bytes) {
    std::free(slots.data[s]);
    slots.data[s] = std::aligned_alloc(64, size_t((bytes + 63) / 64 * 64));
    if (!slots.data[s]) {
      slots.bytes[s] = 0;
      throw std::bad_alloc();
    }
    slots.bytes[s] = bytes;
  }
  return slots.data[s];
}

}  // namespace mha::cpu
