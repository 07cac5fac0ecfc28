// The planning state Executor::plan()'s passes share (executor_plan.cpp, executor_layout.cpp, executor_quant.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/executor.h"
#include "memory/planner.h"

namespace et {

// A buffer planned by lifetime, with what it becomes once placed.
struct Executor::PlannedBuffer {
  enum class Role : uint8_t {
    Data,       // an activation or aux value (data_)
    Grad,       // an activation gradient, shared by its in-place group (grads_)
    Unpack,     // the f32 decode buffer of a compressed save (SavedValue::unpack)
    Recompute,  // a recomputed segment's copy of an activation (recompute_data_)
    Extra,      // asked for by another pass, which binds it itself from `offset`
  };
  BufferRequest request;  // bytes and lifetime on the time line
  int value = -1;         // the value it serves (the out-of-memory message names its layer)
  Role role = Role::Data;
  size_t offset = 0;      // in the arena; set by plan_layout
};

// Planning state several passes share. Per-value vectors are indexed by value id, per-node ones
// by node index.
struct Executor::PlanState {
  int nv = 0, nn = 0;
  int64_t max_batch = 0;

  // plan_saves: who saves what, and what the stash will hold.
  std::vector<int> first_saver, last_saver;  // per value: node, or -1 if nothing saves it
  std::vector<uint8_t> full;                 // per value: some saver needs every element
  std::vector<uint8_t> mask_read;            // per value: some saver reads only its > 0 mask
  std::vector<int> seg_of;                   // per node: its recompute segment, or -1
  std::vector<uint8_t> recomputed;           // per value: produced and used inside a segment only
  std::vector<uint8_t> rewritten;            // per value: written again by a segment's rerun
  std::vector<SavedValue> saved;             // what the stash will hold, by value id
  std::vector<int> saved_index;              // per value: index into `saved`, or -1
  // plan_code_saves (bitmap_int4): values the stash keeps as a quantized layer's INT4 codes, and
  // the node whose forward computes the codes it pushes (else -1).
  std::vector<uint8_t> codes;
  std::vector<int> code_pusher;

  // plan_forward_by_readers: per value, the last forward node that reads it through a value its
  // readers compute from it (a stack's input x, read by the convs after the stack), or -1.
  std::vector<int> read_through;

  // plan_decode_buffers: saved values some reader needs decoded to f32 (an unpack buffer), and
  // the latest and earliest savers in forward order that read the decoded f32 (-1: none): the
  // buffer lives from the first's backward to the second's. Savers that read the stored form (a
  // fused stack's mask from the bitmap) do not extend it.
  std::vector<uint8_t> needs_unpack;
  std::vector<int> decode_from, decode_until;

  // plan_time_line: backward and recompute times of each node (forward of node n is at n).
  std::vector<int> bwd_t, rec_t;  // rec_t -1: not rerun
  int t_end = 0;                  // one past the last step

  // plan_layout.
  size_t persistent = 0;                                   // params, grads, slots, buffers, inputs
  std::vector<size_t> data_offset, grad_offset, slot_offset;  // per value, persistent ones
  std::vector<int> grad_parent;  // per value: the value whose gradient buffer it shares, or -1
  std::vector<PlannedBuffer> buffers;
  size_t workspace_offset = 0;

  void add_saver(int id, int n, bool is_full) {
    if (first_saver[size_t(id)] < 0 || n < first_saver[size_t(id)]) first_saver[size_t(id)] = n;
    last_saver[size_t(id)] = std::max(last_saver[size_t(id)], n);
    full[size_t(id)] |= is_full;
  }
  SavedValue* saved_of(int id) {
    const int i = saved_index[size_t(id)];
    return i >= 0 ? &saved[size_t(i)] : nullptr;
  }
  int grad_root(int id) const {
    while (grad_parent[size_t(id)] >= 0) id = grad_parent[size_t(id)];
    return id;
  }
};

}  // namespace et
