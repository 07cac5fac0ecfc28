#include "engine/train/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/executor.h"
#include "engine/host_view.h"

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

// Makes a rename into the folder of `path` durable.
void sync_parent_dir(const std::string& path) {
  const std::string dir = fs::path(path).parent_path().empty() ? "." : fs::path(path).parent_path().string();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
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
  h["fp32_layers"] = pr.fp32_layers;
  json table = json::array();
  for (const Entry& e : entries) table.push_back({{"name", e.name}, {"role", e.role}, {"shape", shape_json(e.t.shape)}});
  h["tensors"] = table;
  const std::string header = h.dump();

  // Written beside `path` and renamed over it only when complete and on disk: a failure or a
  // kill at any moment leaves the previous checkpoint as it was.
  const std::string tmp = path + ".tmp";
  auto fail = [&](int err) {
    ::unlink(tmp.c_str());
    user_error("cannot write checkpoint '", path, "' (via '", tmp, "'): ", std::strerror(err),
               fs::exists(path) ? "; the previous checkpoint is unchanged" : "");
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(errno);
  uint32_t crc = 0;
  int err = 0;  // errno of the first failed call
  auto put = [&](const void* p, size_t n) {
    crc = crc32_update(crc, p, n);
    const char* c = static_cast<const char*>(p);
    while (err == 0 && n > 0) {
      const ssize_t w = ::write(fd, c, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        err = w < 0 ? errno : EIO;
        break;
      }
      c += w;
      n -= size_t(w);
    }
  };
  const uint64_t hlen = header.size();
  put(kMagic, sizeof(kMagic));
  put(&hlen, sizeof(hlen));
  put(header.data(), header.size());
  for (const Entry& e : entries) {
    const HostView v(ex.backend(), e.t, HostView::Read);
    put(v.data(), e.t.nbytes());
  }
  const uint32_t final_crc = crc;
  put(&final_crc, sizeof(final_crc));
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) fail(err);
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    ::unlink(tmp.c_str());
    user_error("cannot rename checkpoint to '", path, "': ", ec.message());
  }
  sync_parent_dir(path);
}

void write_file_durably(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) user_error("cannot write '", tmp, "': ", std::strerror(errno));
  // A short write is continued: its retry reports the reason (EFBIG past ulimit -f, ENOSPC).
  int err = 0;
  for (size_t done = 0; done < text.size();) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      err = w < 0 ? errno : EIO;
      break;
    }
    done += size_t(w);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  std::error_code ec;
  if (err == 0) fs::rename(tmp, path, ec);
  if (err != 0 || ec) {
    ::unlink(tmp.c_str());
    user_error("cannot write '", path, "': ", err != 0 ? std::strerror(err) : ec.message());
  }
  sync_parent_dir(path);
}

bool discard_unstarted_run(const std::string& dir_name, bool remove_folder) {
  const fs::path dir(dir_name);
  std::error_code ec;
  if (fs::exists(dir / "checkpoint_last.ckpt", ec) || ec) return false;
  const fs::path metrics = dir / "metrics.jsonl";
  if (fs::exists(metrics, ec) && fs::file_size(metrics, ec) > 0) return false;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file(ec)) return false;
    files.push_back(e.path());
  }
  if (ec) return false;
  for (const fs::path& f : files)
    if (!fs::remove(f, ec)) return false;
  if (remove_folder) fs::remove(dir, ec);
  return true;
}


namespace {

// A checkpoint's bytes, mapped read-only from the page cache instead of copied into the heap: a
// load adds the file's clean pages (which the kernel may drop and re-read under pressure) beside
// the parameters, no anonymous copy. The growing vector it replaces raised the USS by 1.8 times
// the file (both buffers of the last doubling): 135 MB for VGG-11's 74 MB, on a device where the
// model's own memory is the budget. (Checkpoints are replaced by rename, never rewritten in place,
// so the mapped file cannot shrink under a load: save_checkpoint writes a new inode.)
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) user_error("cannot open checkpoint '", path, "': ", std::strerror(errno));
    struct stat st {};
    const bool stat_ok = ::fstat(fd, &st) == 0;
    const int err = errno;
    if (!stat_ok || !S_ISREG(st.st_mode)) {
      ::close(fd);
      user_error("cannot read checkpoint '", path, "': ", stat_ok ? "not a regular file" : std::strerror(err));
    }
    size_ = size_t(st.st_size);
    if (size_ > 0) {  // an empty file maps to nothing; the header check reports it as too short
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      const int map_err = errno;
      ::close(fd);
      if (p == MAP_FAILED) user_error("cannot read checkpoint '", path, "': ", std::strerror(map_err));
      data_ = static_cast<const char*>(p);
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<char*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const char* data() const { return data_ ? data_ : ""; }
  size_t size() const { return size_; }

 private:
  const char* data_ = nullptr;
  size_t size_ = 0;
};

// Magic, CRC and header of a checkpoint's bytes; the header JSON and where the data starts.
json checked_header(const char* data, size_t size, const std::string& path, size_t* data_start) {
  auto bad = [&](const std::string& why) { user_error("checkpoint '", path, "' is not valid: ", why); };
  if (size < sizeof(kMagic) + 8 + 4 || std::memcmp(data, kMagic, sizeof(kMagic)) != 0)
    bad("not an edgetrain checkpoint (bad magic or too short)");
  uint32_t stored_crc;
  std::memcpy(&stored_crc, data + size - 4, 4);
  if (crc32_update(0, data, size - 4) != stored_crc) bad("checksum mismatch (truncated or corrupt)");
  uint64_t hlen;
  std::memcpy(&hlen, data + 8, 8);
  if (hlen > size - 20) bad("header length out of range");
  json h;
  try {
    h = json::parse(data + 16, data + 16 + hlen);
  } catch (const json::exception& e) {
    bad(std::string("unreadable header: ") + e.what());
  }
  if (!h.is_object()) bad("the header is not a JSON object");
  *data_start = 16 + size_t(hlen);
  return h;
}

}  // namespace

TrainProgress load_checkpoint_bytes(const char* data, size_t size, const std::string& path, Executor& ex,
                                    const std::string& model_name) {
  auto bad = [&](const std::string& why) { user_error("checkpoint '", path, "' is not valid: ", why); };
  size_t data_start = 0;
  const json h = checked_header(data, size, path, &data_start);
  // Numbers are checked for kind and range before conversion (a double out of int's range would
  // be undefined behaviour to convert).
  auto integer = [&](const char* key, int64_t lo, int64_t hi) -> int64_t {
    const auto it = h.find(key);
    if (it == h.end() || !it->is_number_integer()) bad(fmt("header field '", key, "' is missing or not an integer"));
    if (it->is_number_unsigned() ? it->get<uint64_t>() > uint64_t(hi) : (it->get<int64_t>() < lo || it->get<int64_t>() > hi))
      bad(fmt("header field '", key, "' = ", it->dump(), " is out of range"));
    return it->get<int64_t>();
  };
  auto number = [&](const char* key, double fallback) -> double {
    const auto it = h.find(key);
    if (it == h.end()) return fallback;
    if (!it->is_number()) bad(fmt("header field '", key, "' is not a number"));
    return it->get<double>();
  };
  TrainProgress pr;
  const auto model = h.find("model");
  if (model == h.end() || !model->is_string()) bad("header field 'model' is missing or not a string");
  pr.model = model->get<std::string>();
  pr.epoch = int(integer("epoch", -1, 1 << 30));
  pr.step = integer("step", 0, INT64_MAX);
  const auto seed = h.find("seed");
  if (seed == h.end() || !seed->is_number_unsigned()) bad("header field 'seed' is missing or not an unsigned integer");
  pr.seed = seed->get<uint64_t>();
  pr.best_test_acc = number("best_test_acc", 0.0);
  pr.lr_factor = number("lr_factor", 1.0);
  pr.rollbacks = h.contains("rollbacks") ? int(integer("rollbacks", 0, 1 << 30)) : 0;
  if (!(pr.lr_factor > 0 && pr.lr_factor <= 1)) bad(fmt("lr_factor ", pr.lr_factor, " out of range"));
  if (const auto layers = h.find("fp32_layers"); layers != h.end()) {
    if (!layers->is_array()) bad("header field 'fp32_layers' is not an array");
    for (const json& l : *layers) {
      bool known = false;
      for (int n = 0; l.is_string() && n < ex.graph().num_nodes() && !known; ++n)
        known = ex.graph().node(n).name == l.get<std::string>() && ex.graph().node(n).op->op_class() == OpClass::Compute;
      if (!known) bad(fmt("header field 'fp32_layers' holds ", l.dump(), ", not a conv / linear layer of the model"));
      pr.fp32_layers.push_back(l.get<std::string>());
    }
  }
  if (pr.model != model_name)
    user_error("checkpoint '", path, "' is for model '", pr.model, "', but the config builds '", model_name, "'");
  const auto entries = checkpoint_entries(ex);
  const auto table = h.find("tensors");
  if (table == h.end() || !table->is_array() || table->size() != entries.size())
    bad(fmt("holds ", table != h.end() && table->is_array() ? table->size() : 0, " tensors, the model has ",
            entries.size()));
  size_t offset = data_start;
  for (size_t i = 0; i < entries.size(); ++i) {
    const json& t = (*table)[i];
    const Entry& e = entries[i];
    const bool same = t.is_object() && t.value("name", json()) == e.name && t.value("role", json()) == e.role &&
                      t.value("shape", json()) == shape_json(e.t.shape);
    if (!same)
      bad(fmt("tensor ", i, " is ", t.dump().substr(0, 200), ", the model expects ", e.role, " '", e.name,
              "' of shape ", e.t.shape.str()));
    offset += e.t.nbytes();
  }
  if (offset + 4 != size) bad("data size does not match the tensor table");
  // Everything checked: now copy.
  offset = data_start;
  for (const Entry& e : entries) {
    Tensor t = e.t;
    ex.backend().copy_from_host(data + offset, t);
    offset += e.t.nbytes();
  }
  return pr;
}

TrainProgress load_checkpoint(const std::string& path, Executor& ex, const std::string& model_name) {
  const MappedFile bytes(path);
  return load_checkpoint_bytes(bytes.data(), bytes.size(), path, ex, model_name);
}

std::vector<CheckpointTensor> read_checkpoint_tensors(const std::string& path, std::string* model_name) {
  const MappedFile bytes(path);
  auto bad = [&](const std::string& why) { user_error("checkpoint '", path, "' is not valid: ", why); };
  size_t offset = 0;
  const json h = checked_header(bytes.data(), bytes.size(), path, &offset);
  const auto table = h.find("tensors");
  if (table == h.end() || !table->is_array()) bad("no tensor table");
  if (model_name) *model_name = h.value("model", json("")).is_string() ? h.value("model", "") : "";
  std::vector<CheckpointTensor> out;
  const size_t data_end = bytes.size() - 4;
  for (const json& t : *table) {
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
      std::memcpy(ct.values.data(), bytes.data() + offset, n * 4);
      out.push_back(std::move(ct));
    }
    offset += n * 4;
  }
  if (offset != data_end) bad("data size does not match the tensor table");
  return out;
}

}  // namespace et
