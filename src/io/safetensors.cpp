// safetensors reading and writing (format and guarantees in safetensors.h).
#include "mha/io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include "check.h"

namespace mha::io {

namespace {

constexpr const char* kSave = "mha::io::save_safetensors";
constexpr const char* kLoad = "mha::io::load_safetensors";
constexpr uint64_t kMaxHeader = 100u << 20;  // as the reference implementation: 100 MB

const char* code_of(DType t) {
  switch (t) {
    case DType::float32: return "F32";
    case DType::float64: return "F64";
    case DType::bfloat16: return "BF16";
    case DType::boolean: return "BOOL";
    case DType::int64: return "I64";
  }
  return "?";
}

bool dtype_of(const std::string& code, DType& out) {
  for (DType t : {DType::float32, DType::float64, DType::bfloat16, DType::boolean, DType::int64})
    if (code == code_of(t)) return out = t, true;
  return false;
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", unsigned(v));
  return buf;
}

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw FormatError(std::string("[") + kLoad + "] " + path + ": " + what);
}

}  // namespace

uint32_t crc32_of(const void* data, size_t bytes, uint32_t crc) {
  return uint32_t(crc32_z(crc, static_cast<const Bytef*>(data), bytes));
}

std::string checksum_key(const std::string& tensor) { return std::string(kChecksumPrefix) + tensor; }

void write_file_atomically(const std::string& path, const std::string& bytes) {
  const char* fn = "mha::io::write_file_atomically";
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw FormatError(std::string("[") + fn + "] " + tmp + ": cannot create: " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      throw FormatError(std::string("[") + fn + "] " + tmp + ": write failed: " + why);
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw FormatError(std::string("[") + fn + "] " + tmp + ": cannot flush to disk");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw FormatError(std::string("[") + fn + "] " + path + ": cannot rename into place: " + std::strerror(errno));
  }
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  write_file_atomically(path, serialize_safetensors(tensors, metadata));
}

std::string serialize_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::map<std::string, std::string> meta = metadata;
  for (const auto& [key, value] : metadata)
    if (key.rfind(kChecksumPrefix, 0) == 0)
      raise<ValueError>(kSave, "metadata", std::string("keys that do not start with '") + kChecksumPrefix + "' (reserved)",
                        "'" + key + "'");
  std::string data;
  for (const auto& [name, tensor] : tensors) {
    check_defined(tensor, kSave, name);
    if (name == "__metadata__" || header.contains(name))
      raise<ValueError>(kSave, "tensors", "unique names other than __metadata__", "'" + name + "' twice or reserved");
    const Tensor t = tensor.contiguous();
    const size_t begin = data.size(), bytes = size_t(t.numel() * dtype_size(t.dtype()));
    data.append(static_cast<const char*>(t.raw_data()), bytes);
    meta[checksum_key(name)] = hex32(crc32_of(t.raw_data(), bytes));
    header[name] = {{"dtype", code_of(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {begin, begin + bytes}}};
  }
  header["__metadata__"] = meta;
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // align the data to 8 bytes
  std::string file(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char((n >> (8 * i)) & 0xff);
  file += json;
  file += data;
  return file;
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw FormatError(std::string("[") + kLoad + "] " + path + ": cannot open");
  return parse_safetensors(std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>()), path);
}

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& path) {
  if (bytes.size() < 8) corrupt(path, "expected at least 8 bytes (the header length); got " + std::to_string(bytes.size()));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  if (n > kMaxHeader || n > bytes.size() - 8)
    corrupt(path, "header length " + std::to_string(n) + " exceeds the file (" + std::to_string(bytes.size()) + " bytes)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + long(n));
  } catch (const nlohmann::json::exception& e) {
    corrupt(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) corrupt(path, "header is not a JSON object");
  const size_t data_begin = 8 + size_t(n), data_size = bytes.size() - data_begin;
  SafetensorsFile out;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  if (auto meta = header.find("__metadata__"); meta != header.end()) {
    if (!meta->is_object()) corrupt(path, "__metadata__ is not an object");
    for (const auto& [k, v] : meta->items()) {
      if (!v.is_string()) corrupt(path, "__metadata__ value of '" + k + "' is not a string");
      out.metadata[k] = v.get<std::string>();
    }
  }
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    DType dtype;
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !dtype_of(entry["dtype"].get<std::string>(), dtype))
      corrupt(path, "tensor '" + name + "': missing or unsupported dtype");
    if (!entry.contains("shape") || !entry["shape"].is_array())
      corrupt(path, "tensor '" + name + "': missing shape");
    Shape shape;
    uint64_t want = dtype_size(dtype);  // bytes; the product is checked, as a crafted shape can overflow it
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) corrupt(path, "tensor '" + name + "': shape holds a non-integer or negative size");
      shape.push_back(int64_t(d.get<uint64_t>()));
      if (shape.back() > (int64_t(1) << 40) || __builtin_mul_overflow(want, uint64_t(shape.back()), &want) ||
          want > (uint64_t(1) << 48))
        corrupt(path, "tensor '" + name + "': implausible size");
    }
    const auto& offsets = entry.contains("data_offsets") ? entry["data_offsets"] : nlohmann::json();
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
      corrupt(path, "tensor '" + name + "': data_offsets must be [begin, end]");
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size)
      corrupt(path, "tensor '" + name + "': bytes [" + std::to_string(begin) + ", " + std::to_string(end) +
                        ") lie outside the data (" + std::to_string(data_size) + " bytes; truncated file?)");
    if (end - begin != want)
      corrupt(path, "tensor '" + name + "': " + std::to_string(end - begin) + " bytes for shape " + shape_string(shape) +
                        " of " + to_string(dtype) + ", which needs " + std::to_string(want));
    ranges.push_back({begin, end});
    const char* raw = bytes.data() + data_begin + begin;
    if (auto sum = out.metadata.find(checksum_key(name)); sum != out.metadata.end()) {
      const std::string computed = hex32(crc32_of(raw, size_t(want)));
      if (sum->second != computed)
        corrupt(path, "tensor '" + name + "': CRC-32 of its bytes is " + computed + "; the file recorded " +
                          sum->second + " (the data changed after it was written)");
      ++out.checksummed;
    }
    Tensor t = Tensor::empty(shape, dtype);
    std::memcpy(t.raw_data(), raw, size_t(want));
    if (dtype == DType::boolean)
      for (int64_t i = 0; i < t.numel(); ++i)
        if (uint8_t(bytes[data_begin + begin + size_t(i)]) > 1) corrupt(path, "tensor '" + name + "': bool byte not 0 or 1");
    out.tensors.emplace(name, t);
  }
  for (const auto& [key, value] : out.metadata)
    if (key.rfind(kChecksumPrefix, 0) == 0 && !out.tensors.count(key.substr(std::strlen(kChecksumPrefix))))
      corrupt(path, "metadata '" + key + "' records the checksum of a tensor that the file does not hold");
  if (out.checksummed != 0 && out.checksummed != out.tensors.size())
    corrupt(path, std::to_string(out.tensors.size() - out.checksummed) + " of " + std::to_string(out.tensors.size()) +
                      " tensors carry no checksum, the others do");
  for (auto it = out.metadata.begin(); it != out.metadata.end();)
    it = it->first.rfind(kChecksumPrefix, 0) == 0 ? out.metadata.erase(it) : std::next(it);
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) corrupt(path, "tensor byte ranges overlap");
  return out;
}

}  // namespace mha::io
