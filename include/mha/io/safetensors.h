// Tensors in the safetensors format: an 8-byte little-endian header length N,
// N bytes of JSON ({"name": {"dtype", "shape", "data_offsets"}, "__metadata__":
// {…}}), then the tensors' bytes, row-major, little-endian.
//
// Writing is atomic: a temporary file in the same folder is written, flushed
// to disk and renamed over the target, so a crash never leaves a half-written
// file under the final name. Reading checks everything before using it — the
// header's length and JSON, each dtype, shape and byte range against the file's
// size — and refuses a truncated or corrupt file with FormatError.
//
// Checksums: the writer records each tensor's CRC-32 (zlib's, the same as
// Python's zlib.crc32) of its bytes in the metadata, under "crc32:" + the
// tensor's name, as 8 lower-case hex digits. The reader verifies every one
// before using the tensor: a changed byte is refused with FormatError naming
// the file and the tensor. Files from other tools carry none and load as
// before (SafetensorsFile::checksummed counts the verified tensors); a file in
// which some tensors carry one and others do not is refused. CRC-32 rather
// than xxHash: 3.7 GB/s here against XXH3's 7 (memcpy's speed), i.e. 80 ms
// more on a 300 MB training state, and no new dependency; any tool can check it.
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
// The file's bytes, in memory.
std::string serialize_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;  // without the checksums
  size_t checksummed = 0;                       // tensors whose CRC-32 was verified
};

// The metadata key prefix of the checksums; the writer refuses metadata keys
// that start with it.
inline constexpr const char* kChecksumPrefix = "crc32:";
std::string checksum_key(const std::string& tensor);
// zlib's CRC-32 of `bytes` bytes, continuing from `crc`.
uint32_t crc32_of(const void* data, size_t bytes, uint32_t crc = 0);

SafetensorsFile load_safetensors(const std::string& path);
// The same from the file's bytes in memory; `path` names them in messages.
SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& path);

// Writes `bytes` to `path` atomically (temporary file, fsync, rename).
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace mha::io
