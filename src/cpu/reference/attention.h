// Reference (plain-loop) attention kernels for the CPU backend.
#pragma once

#include "mha/attention.h"

namespace mha {
struct AttentionParams;
}

namespace mha::cpu {

void reference_attention_forward(const AttentionParams& p, AttentionOutput& r);
void reference_attention_backward(const AttentionParams& p, const Tensor& dout, const AttentionOutput& fwd,
                                  AttentionGradients& g);

}  // namespace mha::cpu
