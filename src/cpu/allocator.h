// Host memory for tensors: 64-byte aligned. Blocks of 64 KiB and up are
// kept after they are freed and handed out again for any request of their
// size class (four an octave, so up to 25% over what is asked;
// allocator.cpp): fresh pages cost a fault each (~2-20 µs on the development
// VM), which made repeated calls pay for their outputs' memory again and
// again. The idle blocks kept hold at most the most bytes ever in use at once
// (256 MiB at least), so a training step whose activations outgrow 256 MiB
// still finds all of them again; past that the least recently freed go first.
// A request the cache cannot serve frees idle blocks first, oldest first, until
// what the process holds (in use, idle and the new block) is at most a quarter
// over the most ever in use: idle blocks of sizes no longer asked for do not
// stay beside fresh ones.
// Blocks with a huge_page_extent start on 2 MiB boundaries, that much of
// them asked to be transparent huge pages (allocator.cpp).
// Off under AddressSanitizer, so that use-after-free is caught.
#pragma once

#include <cstddef>

// Defined in a build under AddressSanitizer: g++ says so with
// __SANITIZE_ADDRESS__, clang 14 (the sanitizer build of scripts/test.sh)
// only through __has_feature, and testing the first alone left the cache on
// there, freed tensors handed out again unseen.
#if defined(__SANITIZE_ADDRESS__)
#define MHA_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MHA_ADDRESS_SANITIZER 1
#endif
#endif

namespace mha::cpu {

#if defined(MHA_ADDRESS_SANITIZER)
inline constexpr bool kHostBlockCache = false;
#else
inline constexpr bool kHostBlockCache = true;
#endif

void* host_allocate(size_t bytes);
void host_free(void* ptr);

// The bytes from a block's start asked to be huge pages for a request of
// `used` bytes: its whole 2 MiB pages, and the last, partial one too where
// `used` fills 15/16 of it; 0 below that (no huge pages, 64-byte alignment).
size_t huge_page_extent(size_t used);

// Bytes of the blocks handed out and not yet freed (cached idle blocks do not
// count): what the tensors alive hold, for memory measurements. The peak is
// the most in use since the last reset_host_bytes_peak().
size_t host_bytes_in_use();
size_t host_bytes_peak();
void reset_host_bytes_peak();

// Blocks of 64 KiB and up taken from the system since the process began
// (the cache's misses; every such request where kHostBlockCache is false). A
// training step whose shapes came before takes none.
size_t host_blocks_made();

}  // namespace mha::cpu
