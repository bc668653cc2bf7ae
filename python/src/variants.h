// Bindings of the efficient variants (block sparse, linear, Performer,
// Linformer, LSH, axial) for mha.functional: forward on NumPy arrays, and a
// call object whose backward gives the inputs' gradients.
#pragma once

#include <pybind11/pybind11.h>

namespace mha::python {

void bind_variants(pybind11::module_& m);

}  // namespace mha::python
