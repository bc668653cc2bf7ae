// safetensors reading and writing (format and guarantees in safetensors.h).
#include "mha/io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

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

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw FormatError(std::string("[") + kLoad + "] " + path + ": " + what);
}

}  // namespace

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
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string data;
  for (const auto& [name, tensor] : tensors) {
    check_defined(tensor, kSave, name);
    if (name == "__metadata__" || header.contains(name))
      raise<ValueError>(kSave, "tensors", "unique names other than __metadata__", "'" + name + "' twice or reserved");
    const Tensor t = tensor.contiguous();
    const size_t begin = data.size(), bytes = size_t(t.numel() * dtype_size(t.dtype()));
    data.append(static_cast<const char*>(t.raw_data()), bytes);
    header[name] = {{"dtype", code_of(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {begin, begin + bytes}}};
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // align the data to 8 bytes
  std::string file(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char((n >> (8 * i)) & 0xff);
  file += json;
  file += data;
  write_file_atomically(path, file);
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw FormatError(std::string("[") + kLoad + "] " + path + ": cannot open");
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
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
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) corrupt(path, "__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) corrupt(path, "__metadata__ value of '" + k + "' is not a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    DType dtype;
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !dtype_of(entry["dtype"].get<std::string>(), dtype))
      corrupt(path, "tensor '" + name + "': missing or unsupported dtype");
    if (!entry.contains("shape") || !entry["shape"].is_array())
      corrupt(path, "tensor '" + name + "': missing shape");
    Shape shape;
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) corrupt(path, "tensor '" + name + "': shape holds a non-integer or negative size");
      shape.push_back(int64_t(d.get<uint64_t>()));
      if (shape.back() > (int64_t(1) << 40)) corrupt(path, "tensor '" + name + "': implausible size");
    }
    const auto& offsets = entry.contains("data_offsets") ? entry["data_offsets"] : nlohmann::json();
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
      corrupt(path, "tensor '" + name + "': data_offsets must be [begin, end]");
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    const uint64_t want = uint64_t(shape_numel(shape) * dtype_size(dtype));
    if (begin > end || end > data_size)
      corrupt(path, "tensor '" + name + "': bytes [" + std::to_string(begin) + ", " + std::to_string(end) +
                        ") lie outside the data (" + std::to_string(data_size) + " bytes; truncated file?)");
    if (end - begin != want)
      corrupt(path, "tensor '" + name + "': " + std::to_string(end - begin) + " bytes for shape " + shape_string(shape) +
                        " of " + to_string(dtype) + ", which needs " + std::to_string(want));
    ranges.push_back({begin, end});
    Tensor t = Tensor::empty(shape, dtype);
    std::memcpy(t.raw_data(), bytes.data() + data_begin + begin, size_t(want));
    if (dtype == DType::boolean)
      for (int64_t i = 0; i < t.numel(); ++i)
        if (uint8_t(bytes[data_begin + begin + size_t(i)]) > 1) corrupt(path, "tensor '" + name + "': bool byte not 0 or 1");
    out.tensors.emplace(name, t);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) corrupt(path, "tensor byte ranges overlap");
  return out;
}

}  // namespace mha::io
