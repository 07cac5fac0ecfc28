// Official CIFAR-10 binary version (cifar-10-binary.tar.gz): each batch file is a run of 3073-byte
// records, 1 label byte then 1024 R, 1024 G, 1024 B bytes (row-major 32x32), i.e. already CHW.
#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/check.h"
#include "engine/data/dataset.h"

namespace et {
namespace fs = std::filesystem;

namespace {

constexpr int kSide = 32, kChannels = 3, kClasses = 10;
constexpr int64_t kImage = int64_t(kChannels) * kSide * kSide;  // 3072
constexpr int64_t kRecord = 1 + kImage;                          // 3073

const char* const kBuiltinClasses[kClasses] = {"airplane", "automobile", "bird",  "cat",  "deer",
                                               "dog",      "frog",       "horse", "ship", "truck"};

std::vector<std::string> batch_files(Split split) {
  if (split == Split::Test) return {"test_batch.bin"};
  std::vector<std::string> names;
  for (int i = 1; i <= 5; ++i) names.push_back("data_batch_" + std::to_string(i) + ".bin");
  return names;
}

// The folder holding the batches: root itself, or the tarball's cifar-10-batches-bin/ inside it.
fs::path find_batch_dir(const fs::path& root, const std::string& first) {
  if (!fs::is_directory(root)) user_error("CIFAR-10 data root ", root.string(), " is not a folder");
  if (fs::exists(root / first)) return root;
  const fs::path nested = root / "cifar-10-batches-bin";
  if (fs::exists(nested / first)) return nested;
  user_error("missing CIFAR-10 batch file ", (root / first).string(), " (also looked in ", nested.string(),
             "); expected the official binary version: data_batch_1..5.bin, test_batch.bin");
}

// batches.meta.txt: one class name a line (the official file ends with blank lines).
std::vector<std::string> read_class_names(const fs::path& dir) {
  const fs::path meta = dir / "batches.meta.txt";
  if (!fs::exists(meta)) return {std::begin(kBuiltinClasses), std::end(kBuiltinClasses)};
  std::ifstream in(meta);
  if (!in) user_error("cannot open ", meta.string());
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);) {
    const size_t b = line.find_first_not_of(" \t\r");
    if (b == std::string::npos) continue;
    names.push_back(line.substr(b, line.find_last_not_of(" \t\r") + 1 - b));
  }
  if (names.size() != size_t(kClasses))
    user_error(meta.string(), ": expected ", kClasses, " class names (one a line), found ", names.size());
  return names;
}

}  // namespace

Dataset load_cifar10_binary(const std::string& root, Split split) {
  const std::vector<std::string> names = batch_files(split);
  const fs::path dir = find_batch_dir(root, names.front());

  // Check every file before allocating: a truncated download should fail fast and name the file.
  std::vector<int64_t> records;
  for (const std::string& name : names) {
    const fs::path p = dir / name;
    if (!fs::is_regular_file(p)) user_error("missing CIFAR-10 batch file ", p.string());
    const int64_t bytes = int64_t(fs::file_size(p));
    if (bytes == 0 || bytes % kRecord != 0)
      user_error(p.string(), ": size ", bytes, " bytes is not a positive multiple of the ", kRecord,
                 "-byte record (1 label + 3072 pixels); expected ", (bytes / kRecord + 1) * kRecord,
                 " bytes for ", bytes / kRecord + 1, " records: the file is truncated or not a CIFAR-10 binary batch");
    records.push_back(bytes / kRecord);
  }

  Dataset d;
  d.channels = kChannels;
  d.height = d.width = kSide;
  for (int64_t r : records) d.size += r;
  d.pixels.resize(size_t(d.size * kImage));
  d.labels.resize(size_t(d.size));
  d.classes = read_class_names(dir);
  d.source = dir.string();

  std::vector<uint8_t> buf;
  int64_t at = 0;  // image index across files
  for (size_t f = 0; f < names.size(); ++f) {
    const fs::path p = dir / names[f];
    buf.resize(size_t(records[f] * kRecord));
    std::ifstream in(p, std::ios::binary);
    if (!in.read(reinterpret_cast<char*>(buf.data()), std::streamsize(buf.size())))
      user_error("cannot read ", p.string());
    for (int64_t r = 0; r < records[f]; ++r, ++at) {
      const uint8_t* rec = buf.data() + r * kRecord;
      if (rec[0] >= kClasses)
        user_error(p.string(), ": record ", r, " (byte offset ", r * kRecord, ") has label ", int(rec[0]),
                   ", CIFAR-10 labels are 0..", kClasses - 1);
      d.labels[size_t(at)] = rec[0];
      std::memcpy(d.pixels.data() + at * kImage, rec + 1, size_t(kImage));
    }
  }
  return d;
}

}  // namespace et
