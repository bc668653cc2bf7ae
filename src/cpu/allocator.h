// Host memory for tensors: 64-byte aligned. Large blocks (1 MiB and up) are
// kept after they are freed, up to 256 MiB in all, and handed out again for
// the same rounded size: fresh pages cost a fault each (~2-20 µs on the
// development VM), which made repeated calls pay for their outputs' memory
// again and again. Off under AddressSanitizer, so that use-after-free is caught.
#pragma once

#include <cstddef>

namespace mha::cpu {

void* host_allocate(size_t bytes);
void host_free(void* ptr);

}  // namespace mha::cpu
