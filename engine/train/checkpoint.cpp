#include "engine/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/executor.h"

namespace et {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr char kMagic[8] = {'E', 'D', 'G', 'E', 'T', 'R', 'N', '1'};

struct Entry {
  std::string name, role;
  Tensor t;
};

// Every tensor a checkpoint holds, in a fixed order: params, the trained ones' momentum, buffers.
std::vector<Entry> checkpoint_entries(const Executor& ex) {
  std::vector<Entry> out;
  const Graph& g = ex.graph();
  for (int p : g.params()) out.push_back({g.value(p).name, "param", ex.value(p)});
  for (int p : ex.params()) out.push_back({g.value(p).name, "momentum", ex.opt_slot(p, 0)});
  for (int b : g.buffers()) out.push_back({g.value(b).name, "buffer", ex.value(b)});
  return out;
}

json shape_json(const Shape& s) {
  json a = json::array();
  for (int i = 0; i < s.ndim; ++i) a.push_back(s.d[i]);
  return a;
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* data, size_t n) {
  static const auto table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void save_checkpoint(const std::string& path, const Executor& ex, const TrainProgress& pr) {
  const auto entries = checkpoint_entries(ex);
  json h;
  h["format"] = "edgetrain-checkpoint";
  h["version"] = 1;
  h["model"] = pr.model;
  h["epoch"] = pr.epoch;
  h["step"] = pr.step;
  h["seed"] = pr.seed;
  h["best_test_acc"] = pr.best_test_acc;
  h["lr_factor"] = pr.lr_factor;
  h["rollbacks"] = pr.rollbacks;
  json table = json::array();
  for (const Entry& e : entries) table.push_back({{"name", e.name}, {"role", e.role}, {"shape", shape_json(e.t.shape)}});
  h["tensors"] = table;
  const std::string header = h.dump();

  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) user_error("cannot write checkpoint '", tmp, "': ", std::strerror(errno));
  uint32_t crc = 0;
  bool ok = true;
  auto put = [&](const void* p, size_t n) {
    crc = crc32_update(crc, p, n);
    const char* c = static_cast<const char*>(p);
    while (ok && n > 0) {
      const ssize_t w = ::write(fd, c, n);
      if (w <= 0) { ok = false; break; }
      c += w;
      n -= size_t(w);
    }
  };
  const uint64_t hlen = header.size();
  put(kMagic, sizeof(kMagic));
  put(&hlen, sizeof(hlen));
  put(header.data(), header.size());
  for (const Entry& e : entries) put(e.t.data, e.t.nbytes());
  const uint32_t final_crc = crc;
  put(&final_crc, sizeof(final_crc));
  if (ok) ok = ::fsync(fd) == 0;
  const int saved_errno = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(tmp.c_str());
    user_error("cannot write checkpoint '", tmp, "': ", std::strerror(saved_errno));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    ::unlink(tmp.c_str());
    user_error("cannot rename checkpoint to '", path, "': ", ec.message());
  }
  // Make the rename itself durable.
  const std::string dir = fs::path(path).parent_path().empty() ? "." : fs::path(path).parent_path().string();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

namespace {

// A checkpoint file read whole and checked: magic, CRC, header JSON.
struct CheckpointFile {
  std::vector<char> bytes;
  json header;
  size_t data_start = 0;
};

CheckpointFile read_checkpoint_file(const std::string& path) {
  CheckpointFile f;
  std::ifstream in(path, std::ios::binary);
  if (!in) user_error("cannot open checkpoint '", path, "'");
  f.bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  const std::vector<char>& bytes = f.bytes;
  auto bad = [&](const std::string& why) { user_error("checkpoint '", path, "' is not valid: ", why); };
  if (bytes.size() < sizeof(kMagic) + 8 + 4 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    bad("not an edgetrain checkpoint (bad magic or too short)");
  uint32_t stored_crc;
  std::memcpy(&stored_crc, bytes.data() + bytes.size() - 4, 4);
  if (crc32_update(0, bytes.data(), bytes.size() - 4) != stored_crc) bad("checksum mismatch (truncated or corrupt)");
  uint64_t hlen;
  std::memcpy(&hlen, bytes.data() + 8, 8);
  if (hlen > bytes.size() - 20) bad("header length out of range");
  try {
    f.header = json::parse(std::string(bytes.data() + 16, size_t(hlen)));
  } catch (const json::exception& e) {
    bad(std::string("unreadable header: ") + e.what());
  }
  if (!f.header.is_object()) bad("the header is not a JSON object");
  f.data_start = 16 + size_t(hlen);
  return f;
}

}  // namespace

TrainProgress load_checkpoint(const std::string& path, Executor& ex, const std::string& model_name) {
  CheckpointFile f = read_checkpoint_file(path);
  const std::vector<char>& bytes = f.bytes;
  const json& h = f.header;
  auto bad = [&](const std::string& why) { user_error("checkpoint '", path, "' is not valid: ", why); };
  TrainProgress pr;
  try {
    pr.model = h.at("model").get<std::string>();
    pr.epoch = h.at("epoch").get<int>();
    pr.step = h.at("step").get<int64_t>();
    pr.seed = h.at("seed").get<uint64_t>();
    pr.best_test_acc = h.value("best_test_acc", 0.0);
    pr.lr_factor = h.value("lr_factor", 1.0);
    pr.rollbacks = h.value("rollbacks", 0);
  } catch (const json::exception& e) {
    bad(std::string("header field missing: ") + e.what());
  }
  if (!(pr.lr_factor > 0 && pr.lr_factor <= 1) || pr.rollbacks < 0)
    bad(fmt("lr_factor ", pr.lr_factor, " / rollbacks ", pr.rollbacks, " out of range"));
  if (pr.model != model_name)
    user_error("checkpoint '", path, "' is for model '", pr.model, "', but the config builds '", model_name, "'");
  const auto entries = checkpoint_entries(ex);
  const json& table = h["tensors"];
  if (!table.is_array() || table.size() != entries.size())
    bad(fmt("holds ", table.is_array() ? table.size() : 0, " tensors, the model has ", entries.size()));
  size_t offset = f.data_start;
  for (size_t i = 0; i < entries.size(); ++i) {
    const json& t = table[i];
    const Entry& e = entries[i];
    if (t.value("name", "") != e.name || t.value("role", "") != e.role || t.value("shape", json()) != shape_json(e.t.shape))
      bad(fmt("tensor ", i, " is ", t.dump(), ", the model expects ", e.role, " '", e.name, "' of shape ",
              e.t.shape.str()));
    offset += e.t.nbytes();
  }
  if (offset + 4 != bytes.size()) bad("data size does not match the tensor table");
  // Everything checked: now copy.
  offset = f.data_start;
  for (const Entry& e : entries) {
    std::memcpy(e.t.data, bytes.data() + offset, e.t.nbytes());
    offset += e.t.nbytes();
  }
  return pr;
}

std::vector<CheckpointTensor> read_checkpoint_tensors(const std::string& path, std::string* model_name) {
  CheckpointFile f = read_checkpoint_file(path);
  auto bad = [&](const std::string& why) { user_error("checkpoint '", path, "' is not valid: ", why); };
  const json& table = f.header.contains("tensors") ? f.header["tensors"] : json();
  if (!table.is_array()) bad("no tensor table");
  if (model_name) *model_name = f.header.value("model", "");
  std::vector<CheckpointTensor> out;
  size_t offset = f.data_start;
  const size_t data_end = f.bytes.size() - 4;
  for (const json& t : table) {
    CheckpointTensor ct;
    try {
      ct.name = t.at("name").get<std::string>();
      ct.role = t.at("role").get<std::string>();
      ct.shape = t.at("shape").get<std::vector<int64_t>>();
    } catch (const json::exception& e) {
      bad(std::string("tensor table entry ") + t.dump() + ": " + e.what());
    }
    // Element count, saturating at what the file can hold (a hostile shape cannot overflow it).
    const size_t avail = (data_end - offset) / 4;
    size_t n = 1;
    for (int64_t d : ct.shape) {
      if (d < 0) bad("tensor '" + ct.name + "' has a negative size");
      n = (d == 0 || n == 0) ? 0 : (n > avail / size_t(d) ? avail + 1 : n * size_t(d));
    }
    if (n > avail) bad("tensor '" + ct.name + "' exceeds the file");
    if (ct.role == "param" || ct.role == "buffer") {
      ct.values.resize(n);
      std::memcpy(ct.values.data(), f.bytes.data() + offset, n * 4);
      out.push_back(std::move(ct));
    }
    offset += n * 4;
  }
  if (offset != data_end) bad("data size does not match the tensor table");
  return out;
}

}  // namespace et
