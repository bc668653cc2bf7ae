// Tensors in the safetensors format: an 8-byte little-endian header length N,
// N bytes of JSON ({"name": {"dtype", "shape", "data_offsets"}, "__metadata__":
// {…}}), then the tensors' bytes, row-major, little-endian.
//
// Writing is atomic: a temporary file in the same folder is written, flushed
// to disk and renamed over the target, so a crash never leaves a half-written
// file under the final name. Reading checks everything before using it — the
// header's length and JSON, each dtype, shape and byte range against the file's
// size — and refuses a truncated or corrupt file with FormatError.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "mha/tensor.h"

namespace mha::io {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

SafetensorsFile load_safetensors(const std::string& path);

// Writes `bytes` to `path` atomically (temporary file, fsync, rename).
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace mha::io
