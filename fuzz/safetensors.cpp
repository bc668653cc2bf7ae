// Fuzzes the safetensors reader: any bytes are refused with FormatError or
// load; what loads writes back and loads again to the same tensors.
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz.h"
#include "mha/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  fuzz::refusals_allowed([&] {
    const io::SafetensorsFile f = io::parse_safetensors(bytes, "input");
    io::NamedTensors tensors(f.tensors.begin(), f.tensors.end());
    const io::SafetensorsFile again = io::parse_safetensors(io::serialize_safetensors(tensors, f.metadata), "again");
    if (again.metadata != f.metadata || again.tensors.size() != f.tensors.size() || again.checksummed != tensors.size())
      fuzz::finding("the round trip changed the metadata or the tensors");
    for (const auto& [name, t] : f.tensors) {
      const Tensor& u = again.tensors.at(name);
      if (u.shape() != t.shape() || u.dtype() != t.dtype() ||
          std::memcmp(u.raw_data(), t.raw_data(), size_t(t.numel()) * dtype_size(t.dtype())) != 0)
        fuzz::finding("tensor '" + name + "' changed in the round trip");
    }
  });
  return 0;
}
