#include "engine/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "engine/check.h"
#include "memory/half.h"

namespace et {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The format's own limit on the header (it keeps a hostile length from allocating gigabytes).
constexpr uint64_t kMaxHeader = 100u << 20;

int64_t dtype_size(const std::string& d) {
  static const std::pair<const char*, int64_t> sizes[] = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2},
                                                          {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
                                                          {"U8", 1},  {"BOOL", 1}};
  for (const auto& [name, size] : sizes)
    if (d == name) return size;
  return 0;
}

bool pread_all(int fd, void* out, uint64_t n, uint64_t offset) {
  char* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, off_t(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= uint64_t(r);
    offset += uint64_t(r);
  }
  return true;
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  auto bad = [&](const std::string& why) { user_error("weights file '", path, "' is not valid safetensors: ", why); };
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) user_error("cannot open weights file '", path, "': ", std::strerror(errno));
  try {
    struct stat st;
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) bad("not a regular file");
    const uint64_t size = uint64_t(st.st_size);
    uint64_t hlen = 0;
    if (size < 8 || !pread_all(fd_, &hlen, 8, 0)) bad(fmt("the file has ", size, " bytes, too short for a header"));
    if (hlen > size - 8) bad(fmt("header length ", hlen, " exceeds the file (", size, " bytes: truncated?)"));
    if (hlen > kMaxHeader) bad(fmt("header length ", hlen, " exceeds the format's 100 MB limit"));
    std::string text(size_t(hlen), '\0');
    if (!pread_all(fd_, text.data(), hlen, 8)) bad("cannot read the header");
    json h;
    try {
      h = json::parse(text);
    } catch (const json::exception& e) {
      bad(std::string("unreadable header JSON: ") + e.what());
    }
    if (!h.is_object()) bad("the header is not a JSON object");
    data_start_ = 8 + hlen;
    const uint64_t data_size = size - data_start_;
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object()) bad("__metadata__ is not an object");
        for (auto m = it->begin(); m != it->end(); ++m)
          if (m->is_string()) metadata_[m.key()] = m->get<std::string>();
        continue;
      }
      const std::string& name = it.key();
      auto bad_tensor = [&](const std::string& why) { bad(fmt("tensor '", name, "': ", why)); };
      const json& t = *it;
      if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
        bad_tensor("needs dtype, shape and data_offsets");
      SafetensorsEntry e;
      e.name = name;
      if (!t["dtype"].is_string()) bad_tensor("dtype is not a string");
      e.dtype = t["dtype"].get<std::string>();
      const int64_t item = dtype_size(e.dtype);
      if (item == 0) bad_tensor("unknown dtype '" + e.dtype + "'");
      const json& shape = t["shape"];
      const json& offsets = t["data_offsets"];
      if (!shape.is_array() || shape.size() > 8) bad_tensor("shape must be an array of at most 8 sizes");
      // The element count is bounded by the file's size, so the products below cannot overflow.
      uint64_t bytes = uint64_t(item);
      for (const json& d : shape) {
        if (!d.is_number_unsigned()) bad_tensor("shape " + shape.dump() + " holds a non-size");
        const uint64_t v = d.get<uint64_t>();
        bytes = (v == 0 || bytes == 0) ? 0 : (bytes > data_size / v ? data_size + 1 : bytes * v);
        e.shape.push_back(int64_t(v));
      }
      if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
          !offsets[1].is_number_unsigned())
        bad_tensor("data_offsets must be [begin, end]");
      e.begin = offsets[0].get<uint64_t>();
      e.end = offsets[1].get<uint64_t>();
      if (e.begin > e.end || e.end > data_size)
        bad_tensor(fmt("data_offsets [", e.begin, ", ", e.end, "] lie outside the ", data_size,
                       " data bytes (truncated?)"));
      if (e.end - e.begin != bytes)
        bad_tensor(fmt("shape ", shape.dump(), " of ", e.dtype, " needs ", bytes, " bytes, data_offsets give ",
                       e.end - e.begin));
      entries_.push_back(std::move(e));
    }
    // Tensors must not share bytes (the format forbids it; it would make a polyglot file).
    std::vector<const SafetensorsEntry*> by_offset;
    for (const auto& e : entries_) by_offset.push_back(&e);
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
    for (size_t i = 1; i < by_offset.size(); ++i)
      if (by_offset[i]->begin < by_offset[i - 1]->end)
        bad(fmt("tensors '", by_offset[i - 1]->name, "' and '", by_offset[i]->name, "' overlap"));
    std::sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

void SafetensorsFile::read_f32(const SafetensorsEntry& e, float* out) const {
  const int64_t n = e.numel();
  auto read = [&](void* dst) {
    if (!pread_all(fd_, dst, e.end - e.begin, data_start_ + e.begin))
      user_error("weights file '", path_, "': cannot read tensor '", e.name, "' (file changed or unreadable)");
  };
  if (e.dtype == "F32") {
    read(out);
  } else if (e.dtype == "F16" || e.dtype == "BF16") {
    std::vector<uint16_t> h(static_cast<size_t>(n));
    read(h.data());
    (e.dtype == "F16" ? f16_to_f32 : bf16_to_f32)(h.data(), n, out);
  } else if (e.dtype == "F64") {
    std::vector<double> d(static_cast<size_t>(n));
    read(d.data());
    for (int64_t i = 0; i < n; ++i) out[i] = float(d[size_t(i)]);
  } else {
    user_error("weights file '", path_, "': tensor '", e.name, "' is ", e.dtype, ", a floating-point dtype is needed");
  }
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsOut>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    uint64_t n = 1;
    for (int64_t d : t.shape) n *= uint64_t(d);
    h[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + 4 * n}}};
    offset += 4 * n;
  }
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as the format advises

  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) user_error("cannot write '", path, "': ", std::strerror(errno));
  bool ok = true;
  auto put = [&](const void* p, uint64_t n) {
    const char* c = static_cast<const char*>(p);
    while (ok && n > 0) {
      const ssize_t w = ::write(fd, c, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) ok = false;
      else c += w, n -= uint64_t(w);
    }
  };
  const uint64_t hlen = header.size();
  put(&hlen, 8);
  put(header.data(), hlen);
  for (const auto& t : tensors) {
    uint64_t n = 1;
    for (int64_t d : t.shape) n *= uint64_t(d);
    put(t.data, 4 * n);
  }
  if (ok) ok = ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(tmp.c_str());
    user_error("cannot write '", path, "': ", std::strerror(err == 0 ? EIO : err));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    ::unlink(tmp.c_str());
    user_error("cannot write '", path, "': ", ec.message());
  }
}

}  // namespace et
