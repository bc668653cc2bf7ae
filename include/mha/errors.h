// Typed errors raised at the public boundary: every message reads
// "[mha::function] argument: expected ...; got ...".
#pragma once

#include <stdexcept>
#include <string>

namespace mha {

// A tensor's shape or rank does not fit the call.
struct ShapeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A tensor's element type is not one the call accepts.
struct DtypeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A scalar argument is out of range (dropout probability, scale, ...).
struct ValueError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// The call needs a device this build does not have ("not built with CUDA"),
// or mixes tensors from different devices.
struct DeviceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A file that is truncated, corrupt, or does not match what the caller expects.
struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A computation produced NaN or infinity where only a finite value can go on:
// a training step whose loss or gradient is not finite (training diverged).
struct NumericalError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A tensor larger than the memory limit (mha::set_memory_limit, or what the
// machine has), or an allocation the system refused: raised before any work.
struct MemoryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A collective or message between ranks failed (a peer ended, MPI reported
// an error), or ranks disagree on what they exchange.
struct CommunicationError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A call made in the wrong order (backward before forward, ...).
struct StateError : std::logic_error {
  using std::logic_error::logic_error;
};

}  // namespace mha
