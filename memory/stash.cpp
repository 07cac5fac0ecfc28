#include "memory/stash.h"

#include <algorithm>

namespace et {

void DenseStash::reset(int num_values) {
  saved_.assign(size_t(num_values), Tensor{});
  refs_.assign(size_t(num_values), 0);
}

void DenseStash::clear() {
  std::fill(saved_.begin(), saved_.end(), Tensor{});
  std::fill(refs_.begin(), refs_.end(), 0);
}

void DenseStash::push(int value_id, SaveKind, const Tensor& t) {
  if (refs_[size_t(value_id)]++ == 0) saved_[size_t(value_id)] = t;
}

Tensor DenseStash::get(int value_id) const {
  ET_CHECK(refs_[size_t(value_id)] > 0, "value ", value_id, " read from the stash but not saved");
  return saved_[size_t(value_id)];
}

MaskView DenseStash::get_mask(int value_id) const {
  MaskView m;
  m.dense = get(value_id);
  m.numel = m.dense.numel();
  return m;
}

void DenseStash::pop(int value_id) {
  ET_CHECK(refs_[size_t(value_id)] > 0, "value ", value_id, " popped but not saved");
  if (--refs_[size_t(value_id)] == 0) saved_[size_t(value_id)] = Tensor{};
}

}  // namespace et
