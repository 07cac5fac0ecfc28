// The CUDA emulator (tests/cuda_emu): the backend converts halves with its own bit arithmetic.
#pragma once
#include "cuda_runtime.h"
