// Bindings of the layers (nn::MultiheadAttention, TransformerEncoderLayer,
// TransformerDecoderLayer) in a form that a torch.autograd.Function can use.
#pragma once

#include <pybind11/pybind11.h>

namespace mha::python {

void bind_layers(pybind11::module_& m);

}  // namespace mha::python
