// This machine's cache sizes, for the planner's tiles (L2) and streaming stores (the last level):
// Linux's sysfs first (what the kernel, and so a container or VM, is told), else what the CPU
// reports itself (x86: CPUID leaf 4 on Intel, 0x8000001D or 0x80000006 on AMD), else unknown (0).
// Some VMs expose no cache directories in sysfs at all (a Zen 5 cloud host, session 40): the
// planner then fell back to a fixed 1 MiB and streamed nothing.
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "fusion/fusion.h"

namespace et {
namespace fusion {

namespace {

std::string g_sysfs_dir = "/sys/devices/system/cpu/cpu0/cache";

struct Cache {
  int level = 0;
  size_t bytes = 0;
  int sharing = 0;  // the CPUs that share it (0: not said)
};

// The CPUs a sysfs shared_cpu_list names ("0-1", "0,2,4-7"); 0 if it cannot be read.
int count_cpu_list(const std::string& list) {
  int n = 0;
  size_t i = 0;
  while (i < list.size()) {
    size_t end = list.find(',', i);
    if (end == std::string::npos) end = list.size();
    const std::string part = list.substr(i, end - i);
    try {
      const size_t dash = part.find('-');
      const int lo = std::stoi(part.substr(0, dash));
      const int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
      if (hi < lo) return 0;
      n += hi - lo + 1;
    } catch (...) {
      return 0;
    }
    i = end + 1;
  }
  return n;
}

// cpu0's data or unified caches from sysfs.
std::vector<Cache> sysfs_caches() {
  std::vector<Cache> caches;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = g_sysfs_dir + "/index" + std::to_string(i) + "/";
    std::ifstream level(dir + "level"), type(dir + "type"), size(dir + "size");
    int lv = 0;
    std::string ty, sz;
    if (!(level >> lv) || !(type >> ty) || !(size >> sz)) continue;
    if (ty == "Instruction" || sz.empty()) continue;
    size_t mult = 1;
    if (sz.back() == 'K') mult = 1024;
    if (sz.back() == 'M') mult = 1024 * 1024;
    std::ifstream shared(dir + "shared_cpu_list");
    std::string list;
    const int sharing = shared >> list ? count_cpu_list(list) : 0;
    try {
      caches.push_back({lv, size_t(std::stoull(sz)) * mult, sharing});
    } catch (...) {
    }
  }
  return caches;
}

// The data and unified caches the CPU reports (empty where it reports none, or off x86).
std::vector<Cache> cpuid_caches() {
  std::vector<Cache> caches;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  const unsigned max_basic = __get_cpuid_max(0, nullptr), max_ext = __get_cpuid_max(0x80000000u, nullptr);
  // Leaf 4 (Intel) or 0x8000001D (AMD, with topology extensions): one sub-leaf per cache, the
  // same register layout, until a sub-leaf of type 0.
  auto walk = [&](unsigned leaf) {
    for (unsigned i = 0; i < 16; ++i) {
      __cpuid_count(leaf, i, a, b, c, d);
      const CpuidCache k = decode_cpuid_cache(a, b, c);
      if (k.type == 0) break;
      if (k.type == 1 || k.type == 3) caches.push_back({k.level, k.bytes, k.sharing});
    }
  };
  if (max_basic >= 4) walk(4);
  if (caches.empty() && max_ext >= 0x8000001Du) {
    __cpuid(0x80000001u, a, b, c, d);
    if (c & (1u << 22)) walk(0x8000001Du);  // TOPOEXT
  }
  if (caches.empty() && max_ext >= 0x80000006u) {  // AMD's older report: L2 and L3 sizes alone
    __cpuid(0x80000006u, a, b, c, d);
    const AmdCacheSizes s = decode_amd_l2_l3(c, d);
    if (s.l2) caches.push_back({2, s.l2});
    if (s.l3) caches.push_back({3, s.l3});
  }
#endif
  return caches;
}

size_t level_bytes(const std::vector<Cache>& caches, int level) {
  for (const Cache& k : caches)
    if (k.level == level) return k.bytes;
  return 0;
}

const Cache* top_level(const std::vector<Cache>& caches) {
  const Cache* top = nullptr;
  for (const Cache& k : caches)
    if (!top || k.level > top->level) top = &k;
  return top && top->bytes ? top : nullptr;
}

// The last level as this process can count on it: no CPU made has more than kMaxLlcPerCpu of it
// to each core that shares it (AMD's stacked-cache parts: 96 MiB over 8 cores), so a larger share
// is a virtual machine's view of a socket it shares with CPUs it is not shown (a 2-vCPU Xeon
// slice told of the socket's 260 MiB, session 44), and each CPU shown counts for kMaxLlcPerCpu.
CacheSize last_level_share(const Cache& k, const char* where) {
  CacheSize c;
  c.bytes = k.bytes;
  c.source = where;
  if (k.sharing > 0 && k.bytes > size_t(k.sharing) * kMaxLlcPerCpu) {
    c.bytes = size_t(k.sharing) * kMaxLlcPerCpu;
    c.note = std::to_string(k.bytes >> 20) + " MiB shared by the " + std::to_string(k.sharing) +
             " CPUs shown, counted as " + std::to_string(kMaxLlcPerCpu >> 20) + " MiB a CPU";
  }
  return c;
}

}  // namespace

CpuidCache decode_cpuid_cache(uint32_t eax, uint32_t ebx, uint32_t ecx) {
  CpuidCache k;
  k.type = int(eax & 0x1F);  // 0 none, 1 data, 2 instruction, 3 unified
  k.level = int((eax >> 5) & 0x7);
  const size_t ways = ((ebx >> 22) & 0x3FF) + 1, partitions = ((ebx >> 12) & 0x3FF) + 1, line = (ebx & 0xFFF) + 1;
  k.bytes = k.type == 0 ? 0 : ways * partitions * line * (size_t(ecx) + 1);
  k.sharing = k.type == 0 ? 0 : int((eax >> 14) & 0xFFF) + 1;  // logical CPUs that share it, at most
  return k;
}

AmdCacheSizes decode_amd_l2_l3(uint32_t ecx, uint32_t edx) {
  AmdCacheSizes s;
  s.l2 = size_t(ecx >> 16) * 1024;           // ECX[31:16]: KiB
  s.l3 = size_t(edx >> 18) * 512 * 1024;     // EDX[31:18]: units of 512 KiB
  return s;
}

CacheSize l2_cache() {
  if (const size_t b = level_bytes(sysfs_caches(), 2)) return {b, "sysfs", {}};
  if (const size_t b = level_bytes(cpuid_caches(), 2)) return {b, "CPUID", {}};
  return {0, "unknown", {}};
}

CacheSize last_level_cache() {
  const std::vector<Cache> sys = sysfs_caches();
  if (const Cache* k = top_level(sys)) return last_level_share(*k, "sysfs");
  const std::vector<Cache> cpu = cpuid_caches();
  if (const Cache* k = top_level(cpu)) return last_level_share(*k, "CPUID");
  return {0, "unknown", {}};
}

bool last_level_rereads_slowly() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  __cpuid(0, a, b, c, d);  // the vendor string
  return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "Genu" "ineI" "ntel"
#else
  return false;
#endif
}

void set_sysfs_cache_dir(const std::string& dir) { g_sysfs_dir = dir; }

}  // namespace fusion
}  // namespace et
