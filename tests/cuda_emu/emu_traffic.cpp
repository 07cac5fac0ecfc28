// The CUDA emulator's memory traffic count (EDGETRAIN_CUDA_EMU_TRAFFIC=<file>, in the race
// checker's build: scripts/cuda_emu.sh with RACES=1, or scripts/cuda_traffic.sh). A GPU serves a
// warp's memory instruction as a whole: its 32 lanes' addresses in device memory become 32-byte
// sectors, and the instruction costs one sector transfer per distinct sector, however few of its
// bytes the lanes use; in shared memory, lanes that hit one of the 32 banks (4-byte words) at
// different words wait for each other. The emulator runs one thread at a time, but the
// instrumentation (emu_races.cpp) sees every access with its place in the kernel, so a warp's
// instruction is found again as the accesses its lanes make at one place for the k-th time
// (between two barriers or not: a lane's k-th pass through a place is the warp's k-th). This
// counts, for every place of every kernel, the warp instructions, the bytes their lanes asked for,
// the sectors (device memory) or bank wavefronts (shared) they took, and the fewest they could
// have taken for the same distinct bytes; and, for each kernel, the distinct sectors each launch
// read and wrote, which is what it must move to or from DRAM at least (every sector once).
// It writes the counts at exit, appended to the file as one write: lines of tab-separated fields,
//   K kernel launches blocks_min blocks_max threads_max dram_read_bytes dram_write_bytes
//   P kernel kind requests lane_accesses bytes units ideal_units place
// (kind: load, store, atomic, shared_load, shared_store, shared_atomic; units: sectors or
// wavefronts), for scripts/cuda_traffic.py to sum. It does not check races meanwhile.
// A lane's accesses that do not line up with the others' are counted as if they did: where lanes
// of a warp take different paths through a place a different number of times (a branch that loads
// once on one side and four times on the other, in a loop), later passes pair up accesses a GPU
// would not issue together, and the sectors come out too many. The count is a model of the GPU's,
// good for a kernel's layout, not a measurement.
#include "emu_internal.h"

#include <cstdio>
#include <cstdlib>

#if defined(EDGETRAIN_CUDA_EMU_RACES)
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace emu {
namespace {

const char* traffic_file() {
  static const char* file = [] {
    const char* f = std::getenv("EDGETRAIN_CUDA_EMU_TRAFFIC");
    return f && *f ? f : nullptr;
  }();
  return file;
}

const char* const kKindNames[] = {"load", "store", "atomic", "shared_load", "shared_store", "shared_atomic"};

// One warp instruction: its lanes' accesses, each an address and its bytes.
struct Request {
  std::vector<std::pair<uintptr_t, uint32_t>> accesses;
};

struct RequestKey {
  uintptr_t place;
  uint32_t warp, pass;
  uint8_t kind;
  bool operator==(const RequestKey& o) const {
    return place == o.place && warp == o.warp && pass == o.pass && kind == o.kind;
  }
};
struct RequestHash {
  size_t operator()(const RequestKey& k) const {
    return std::hash<uint64_t>()(uint64_t(k.place) * 0x9E3779B97F4A7C15ull ^ (uint64_t(k.pass) << 13) ^
                                 (uint64_t(k.warp) << 3) ^ k.kind);
  }
};

// What one place of one kernel added up to, over its launches.
struct Site {
  uint64_t requests = 0, lanes = 0, bytes = 0, units = 0, ideal = 0;
};
struct KernelTotals {
  uint64_t launches = 0, blocks_min = ~uint64_t(0), blocks_max = 0, threads_max = 0;
  uint64_t dram_read = 0, dram_write = 0;
};

struct Traffic {
  // The running block: each lane's passes through each place, and the warp instructions.
  std::unordered_map<uint64_t, uint32_t> passes;  // (place << 10 | thread) -> passes so far
  std::unordered_map<RequestKey, Request, RequestHash> requests;
  // The running launch: the distinct sectors it read and wrote.
  std::unordered_set<uint64_t> read_sectors, written_sectors;
  // (kernel, place, kind) -> counts; kernel -> totals.
  std::map<std::tuple<std::string, uintptr_t, int>, Site> sites;
  std::map<std::string, KernelTotals> kernels;
};
Traffic* traffic = nullptr;

// A warp instruction's cost and the least it could cost for the distinct bytes its lanes touch:
// in device memory, sectors (32 bytes); in shared memory, wavefronts (one word from each of the 32
// banks of 4 bytes each; lanes that read one word share it).
struct Cost {
  uint64_t units, ideal;
};
Cost cost(Request& r, bool shared) {
  const uint64_t unit = shared ? 4 : 32;
  std::vector<uint64_t> units;
  uint64_t distinct_bytes = 0, end = 0;
  std::sort(r.accesses.begin(), r.accesses.end());
  for (const auto& a : r.accesses) {
    const uint64_t first = std::max<uint64_t>(a.first, end), last = a.first + a.second;
    if (last > first) distinct_bytes += last - first;
    end = std::max<uint64_t>(end, last);
    for (uint64_t u = a.first / unit; u <= (last - 1) / unit; ++u) units.push_back(u);
  }
  std::sort(units.begin(), units.end());
  units.erase(std::unique(units.begin(), units.end()), units.end());
  if (!shared) return {units.size(), (distinct_bytes + 31) / 32};
  uint32_t per_bank[32] = {};
  uint64_t most = 0;
  for (uint64_t w : units) most = std::max<uint64_t>(most, ++per_bank[w % 32]);
  return {most, (units.size() + 31) / 32};
}

bool is_address(const std::string& line) { return line.rfind("0x", 0) == 0; }

// "file:line" from addr2line's location line of a frame, without directories.
std::string frame_text(std::string location) {
  const size_t slash = location.rfind('/');
  if (slash != std::string::npos) location = location.substr(slash + 1);
  const size_t note = location.find(" (");  // "(discriminator n)"
  if (note != std::string::npos) location = location.substr(0, note);
  return location;
}

// "file:line <- caller's file:line" for each place (where the access was inlined into), by one
// addr2line a binary.
std::map<uintptr_t, std::string> name_places(const std::vector<uintptr_t>& places) {
  std::map<uintptr_t, std::string> names;
  std::map<std::string, std::vector<std::pair<uintptr_t, uintptr_t>>> by_binary;  // file -> (place, offset)
  for (uintptr_t p : places) {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(p), &info) || !info.dli_fname) {
      names[p] = "unknown";
      continue;
    }
    by_binary[info.dli_fname].push_back({p, p - 1 - uintptr_t(info.dli_fbase)});
  }
  for (const auto& b : by_binary) {
    std::string cmd = "addr2line -a -f -C -i -e '" + b.first + "'";
    for (const auto& po : b.second) {
      char hex[32];
      std::snprintf(hex, sizeof(hex), " %#lx", (unsigned long)po.second);
      cmd += hex;
    }
    cmd += " 2>/dev/null";
    FILE* f = popen(cmd.c_str(), "r");
    if (!f) continue;
    // Output: "0x<offset>" then (function, file:line) pairs, innermost first, for each address.
    std::vector<std::string> lines;
    char line[1024];
    while (std::fgets(line, sizeof(line), f)) {
      std::string l(line);
      while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
      lines.push_back(l);
    }
    pclose(f);
    size_t i = 0;
    for (const auto& po : b.second) {
      while (i < lines.size() && !is_address(lines[i])) ++i;
      if (i == lines.size()) break;
      std::string name;
      ++i;
      for (int frame = 0; i + 1 < lines.size() && !is_address(lines[i]); i += 2, ++frame)
        if (frame < 2) name += (frame ? " <- " : "") + frame_text(lines[i + 1]);
      names[po.first] = name.empty() ? "unknown" : name;
    }
  }
  return names;
}

void write_counts() {
  std::vector<uintptr_t> places;
  for (const auto& s : traffic->sites) places.push_back(std::get<1>(s.first));
  std::sort(places.begin(), places.end());
  places.erase(std::unique(places.begin(), places.end()), places.end());
  const auto names = name_places(places);
  std::string out;
  char buf[512];
  for (const auto& k : traffic->kernels) {
    const KernelTotals& t = k.second;
    std::snprintf(buf, sizeof(buf), "K\t%s\t%llu\t%llu\t%llu\t%llu\t%llu\t%llu\n", k.first.c_str(),
                  (unsigned long long)t.launches, (unsigned long long)t.blocks_min,
                  (unsigned long long)t.blocks_max, (unsigned long long)t.threads_max,
                  (unsigned long long)t.dram_read, (unsigned long long)t.dram_write);
    out += buf;
  }
  for (const auto& s : traffic->sites) {
    const Site& v = s.second;
    std::snprintf(buf, sizeof(buf), "P\t%s\t%s\t%llu\t%llu\t%llu\t%llu\t%llu\t", std::get<0>(s.first).c_str(),
                  kKindNames[std::get<2>(s.first)], (unsigned long long)v.requests, (unsigned long long)v.lanes,
                  (unsigned long long)v.bytes, (unsigned long long)v.units, (unsigned long long)v.ideal);
    out += buf + names.at(std::get<1>(s.first)) + "\n";
  }
  const int fd = open(traffic_file(), O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0 || write(fd, out.data(), out.size()) != ssize_t(out.size()))
    std::fprintf(stderr, "CUDA emulator: could not append to EDGETRAIN_CUDA_EMU_TRAFFIC=%s\n", traffic_file());
  if (fd >= 0) close(fd);
}

}  // namespace

bool traffic_on() {
  if (!traffic_file()) return false;
  if (!traffic) {
    traffic = new Traffic;
    std::atexit(write_counts);
  }
  return true;
}

void traffic_access(const ThreadAt& t, uintptr_t a, size_t bytes, int kind, bool shared, const void* place) {
  const uintptr_t at = uintptr_t(place);
  if (shared) kind += 3;
  uint32_t& pass = traffic->passes[uint64_t(at) << 10 | t.thread];
  traffic->requests[RequestKey{at, t.thread / 32, pass++, uint8_t(kind)}].accesses.push_back({a, uint32_t(bytes)});
  if (shared) return;
  for (uint64_t u = a / 32, last = (a + bytes - 1) / 32; u <= last; ++u) {
    if (kind == 0 || kind == 2) traffic->read_sectors.insert(u);
    if (kind == 1 || kind == 2) traffic->written_sectors.insert(u);
  }
}

void traffic_block_done(const char* kernel) {
  if (!traffic) return;
  for (auto& kv : traffic->requests) {
    Request& r = kv.second;
    const Cost c = cost(r, kv.first.kind >= 3);
    Site& s = traffic->sites[std::make_tuple(std::string(kernel), kv.first.place, int(kv.first.kind))];
    ++s.requests;
    s.lanes += r.accesses.size();
    for (const auto& a : r.accesses) s.bytes += a.second;
    s.units += c.units;
    s.ideal += c.ideal;
  }
  traffic->requests.clear();
  traffic->passes.clear();
}

void traffic_launch_done(const char* kernel, uint64_t blocks, uint64_t threads) {
  if (!traffic) return;
  KernelTotals& k = traffic->kernels[kernel];
  ++k.launches;
  k.blocks_min = std::min(k.blocks_min, blocks);
  k.blocks_max = std::max(k.blocks_max, blocks);
  k.threads_max = std::max(k.threads_max, threads);
  k.dram_read += traffic->read_sectors.size() * 32;
  k.dram_write += traffic->written_sectors.size() * 32;
  traffic->read_sectors.clear();
  traffic->written_sectors.clear();
}

}  // namespace emu

#else

namespace emu {
bool traffic_on() {
  if (std::getenv("EDGETRAIN_CUDA_EMU_TRAFFIC"))
    report_fault("EDGETRAIN_CUDA_EMU_TRAFFIC counts the accesses the race checker's instrumentation sees: it needs "
                 "that build (scripts/cuda_emu.sh with RACES=1)");
  return false;
}
void traffic_access(const ThreadAt&, uintptr_t, size_t, int, bool, const void*) {}
void traffic_block_done(const char*) {}
void traffic_launch_done(const char*, uint64_t, uint64_t) {}
}  // namespace emu

#endif
