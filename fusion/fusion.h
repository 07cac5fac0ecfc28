// The fusion planner (docs/fusion.md): finds the stacks of memory-bound layers after each BN
// (BN apply, ReLU, residual add, max / average pooling), sizes their tiles against the cache,
// counts the bytes they move fused and unfused, and rewrites the graph so each stack is one node
// (a FusedStackOp, fused_op.cpp) whose intermediate values are gone from the memory plan.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/fused_stack.h"
#include "engine/graph.h"
#include "engine/model_spec.h"

namespace et {
namespace fusion {

struct StackPlan {
  std::string name;          // the head BN's layer name (fusion.disable takes it)
  std::vector<int> nodes;    // members, head first, in graph order
  FusedStack stack;          // what the backend runs
  int input = -1, side = -1, output = -1;  // value ids: x, the Add's other operand (or x2), y
  // FusedStack::side_bn: the folded BN's node (a member), its output (the Add's operand, vanished)
  // and its input x2 (`side`).
  int side_bn_node = -1, side_bn_output = -1;
  // That BN's per-plane sums come from x2's producer (a conv's epilogue), as sums_from_producer.
  bool side_sums_from_producer = false;
  std::vector<int> vanished;               // intermediate values that leave the memory plan
  // A tile's working set: its channels' slabs of x and dz, and the plane scratch. Beyond the
  // cache the backward's second sweep re-reads x from memory.
  size_t tile_bytes = 0;
  size_t bytes_unfused = 0, bytes_fused = 0;  // moved per training step (forward + backward)
  bool fused = false;
  std::string why_not;       // when not fused
  // BN's per-plane sums come from x's producer (a conv's epilogue, or the fused stack before it,
  // fusion::takes_plane_sums), so the forward reads x once instead of twice.
  bool sums_from_producer = false;
  // BN's second backward sweep goes to the fused stack before it, which produced x for this stack
  // alone and reads its dy through the coefficients (FusedGrads::dx_coef), where the backend can
  // (Backend::fused_reads_dy_affine: BN -> ReLU -> stride-1 max-pool where lanes8.h builds: AVX2, AVX-512, NEON).
  bool sweep_to_producer = false;
  int producer_stack = -1;  // the index of the fused stack that produced x, if any
  // BN's first backward sweep done by the data gradient of y's first reader, a conv whose backward
  // comes after every other reader's (FusedGrads::dz_sums; Op::can_take_dz_sums,
  // Backend::fused_takes_dz_sums): BN -> ReLU, BN -> add -> ReLU, BN -> add on whole planes. The
  // conv does it where its input is computed by its readers from x (f32, in place), or is y in f32
  // with x held in place (OpContext::held_in_place), and its data-gradient kernel can; otherwise
  // the stack sweeps itself.
  bool sweep1_to_reader = false;
  int reader_node = -1;  // y's reader (a node of the graph planned), where sweep1_to_reader
  // A stack ending in an add and a ReLU writes y's bitmap in its forward (`<stack>.y_bits`) for the
  // first sweep's mask, the reader's or its own: planes of whole 64-bit words, whole planes in
  // memory order, not FusionSpec::whole_tensors.
  bool y_bits = false;
};

struct Plan {
  size_t cache_bytes = 0;
  std::string cache_source;  // "sysfs L2", "fusion.cache_kb", ...
  size_t llc_bytes = 0;      // the last-level cache (0: unknown, nothing streams)
  std::string llc_source;
  // dy read back from the last level costs about what it costs from memory,
  // so sweep 1 under fusion.sweep1_in_reader = auto goes to the readers whatever fits
  // (last_level_rereads_slowly; not where fusion.llc_kb is configured).
  bool llc_slow_reread = false;
  std::vector<StackPlan> stacks;
  size_t bytes_unfused = 0, bytes_fused = 0;  // over the fused stacks
};

// Cache sizes (cache_sizes.cpp): from sysfs, else the CPU's own report (x86 CPUID), else 0.
struct CacheSize {
  size_t bytes = 0;
  const char* source = "unknown";  // "sysfs", "CPUID" or "unknown"
  std::string note;                // why bytes is less than the report, if it is
};
CacheSize l2_cache();          // this core's L2 (cpu0's)
// cpu0's highest-level data or unified cache, at most kMaxLlcPerCpu for each CPU sharing it.
CacheSize last_level_cache();
// Whether a re-read from the last level costs about what one from memory does: Intel's server L3
// (a mesh of slices, non-inclusive; measured on a Xeon in session 55, ResNet-20's step 1.5-2 %
// faster with sweep 1 in the readers though x and y fit the share; a wash on the Xeons of sessions
// 37 and 42). AMD's L3 (the core complex's victim cache) gives dy back at cache speed: the reader's
// epilogue cost Zen 5 1.3-2.2 % there (session 49). Elsewhere (ARM) not assumed.
bool last_level_rereads_slowly();
constexpr size_t kMaxLlcPerCpu = size_t(16) << 20;
// Tests: where sysfs_caches looks (default /sys/devices/system/cpu/cpu0/cache).
void set_sysfs_cache_dir(const std::string& dir);
// One sub-leaf of CPUID leaf 4 (Intel) or 0x8000001D (AMD): type 0 none, 1 data, 2 instruction,
// 3 unified; bytes = ways * partitions * line * sets.
struct CpuidCache {
  int type = 0, level = 0;
  size_t bytes = 0;
  int sharing = 0;  // EAX[25:14] + 1: the logical CPUs that share it, at most
};
CpuidCache decode_cpuid_cache(uint32_t eax, uint32_t ebx, uint32_t ecx);
// AMD's CPUID 0x80000006: L2 (ECX) and L3 (EDX) sizes.
struct AmdCacheSizes {
  size_t l2 = 0, l3 = 0;
};
AmdCacheSizes decode_amd_l2_l3(uint32_t ecx, uint32_t edx);
// Finds and sizes the stacks of `g` (batch = its batch size). Throws UserError for bad settings
// (an explicit tile that does not fit, an unknown name in fusion.disable, a zero cache).
Plan plan(const Graph& g, const FusionSpec& spec);
// Rewrites `g`: each fused stack of `p` becomes one node (named after the stack), placed where its
// last member was; values keep their names, parameters their order, nodes their seeds.
void apply(Graph& g, const Plan& p);
// A table of the stacks for `edgetrain plan`.
std::string describe(const Graph& g, const Plan& p);

// The op a fused stack becomes (fused_op.cpp). Inputs: x, gamma, beta, running_mean, running_var
// [, side [, a folded side BN's gamma, beta, running_mean, running_var]] [, x's plane sums at input
// `sums_input`] [, x2's at `side_sums_input`]; aux: batch mean, invstd [, the side BN's] [, dz's
// plane sums from y's reader at aux `dz_sums_aux`] [, y's bitmap at aux `y_bits_aux`] [, y's
// plane sums].
std::unique_ptr<Op> make_fused_op(const FusedStack& s, std::vector<std::string> members, int sums_input = -1,
                                  int dz_sums_aux = -1, int y_bits_aux = -1, int side_sums_input = -1);
// Links the fused stack `reader` to the one before it, `producer` (StackPlan::sweep_to_producer):
// the reader writes its coefficients to its input `coef_input`, the producer's aux `coef_aux`.
void hand_sweep_on(Op& producer, Op& reader, const FusedStack& producer_stack, int coef_aux, int coef_input);
// Whether a stack walks its planes one by one in memory order (large planes, no channel slabs), so
// that per-plane sums fit its forward: it takes x's from x's producer (docs/fusion.md,
// "Statistics in the producer") and can write y's for the stack after it.
bool takes_plane_sums(const FusedStack& s);

}  // namespace fusion
}  // namespace et
