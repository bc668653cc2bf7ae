// Bindings of trained checkpoints (token models and Vision Transformers) for
// mha.load: the model's forward, answers, attention weights and config.
#pragma once

#include <pybind11/pybind11.h>

namespace mha::python {

void bind_checkpoints(pybind11::module_& m);

}  // namespace mha::python
