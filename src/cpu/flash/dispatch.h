// The fused attention path: instruction-set choice, packing, threads.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "attention_params.h"
#include "cpu/flash/flash.h"

namespace mha::cpu {

enum class Isa : uint8_t { scalar, avx2, avx512 };

std::string to_string(Isa isa);
// The instruction sets this CPU runs, scalar first.
std::vector<Isa> supported_isas();
// The one in use: the best supported, unless MHA_ISA=scalar|avx2|avx512 in
// the environment or force_isa() chose another.
Isa active_isa();
// Tests and benchmarks: run every later call on `isa` (nullopt: back to the
// default). Throws DeviceError when the CPU does not support it.
void force_isa(std::optional<Isa> isa);

// Both return whether every result is finite (an lse of -inf, a fully masked
// row, counts as finite), checked on each tile as it is written, while it is
// in cache; false sends the call to the reference path (cpu/backend.cpp).
bool flash_attention_forward(const AttentionParams& p, AttentionOutput& r);
bool flash_attention_backward(const AttentionParams& p, const Tensor& dout, const AttentionOutput& fwd,
                              AttentionGradients& g);

}  // namespace mha::cpu
