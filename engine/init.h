// Parameter and buffer initialisation: Kaiming normal (fan_out, ReLU gain) for conv weights,
// PyTorch's default uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) for linear weights and biases,
// BN gamma 1, beta 0, running mean 0, running var 1. Each tensor draws from its own generator
// seeded by (seed, name), so adding a layer does not change the others' initial values.
#pragma once
#include <cstdint>

namespace et {

class Executor;
void init_parameters(Executor& ex, uint64_t seed);

}  // namespace et
