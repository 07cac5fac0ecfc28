// Checkpoints: parameters, BN running statistics, optimizer state and training progress in one
// file. Layout: magic "EDGETRN1", u64 header length, JSON header (model, epoch, step, seed,
// lr_factor, rollbacks and fp32_layers (absent in older files: 1, 0, none), and a table of tensors: name, role,
// shape), raw little-endian f32 data in table order, CRC-32 of all preceding bytes. Written to a
// temporary file, fsync'ed and renamed, so a crash never leaves a partial file under the real
// name. Loading validates everything before touching the model.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace et {

class Executor;

struct TrainProgress {
  std::string model;
  int epoch = -1;        // last completed epoch (0-based); -1 = none
  int64_t step = 0;      // optimizer steps taken
  uint64_t seed = 0;
  double best_test_acc = 0;
  // Divergence guard (train.on_divergence = rollback): the factor on the schedule's learning rate
  // and the rollbacks so far. Part of the training state, so a resumed run trains at the same rate.
  double lr_factor = 1.0;
  int rollbacks = 0;
  // Quantized layers a rollback raised to FP32 (forward and backward), in the order it did.
  std::vector<std::string> fp32_layers;
};

void save_checkpoint(const std::string& path, const Executor& ex, const TrainProgress& progress);
// Throws UserError (naming the file) if it is not a valid checkpoint of this model.
TrainProgress load_checkpoint(const std::string& path, Executor& ex, const std::string& model_name);
// The same from the file's bytes (`path` names it in messages); what the fuzzer drives.
TrainProgress load_checkpoint_bytes(const char* data, size_t size, const std::string& path, Executor& ex,
                                    const std::string& model_name);

// Replaces `path` with `text` (temporary file, fsync, rename): a crash leaves the old or the new
// content, never a mix. Throws UserError naming the file.
void write_file_durably(const std::string& path, const std::string& text);

// A new run that stopped with an error before it recorded anything (no checkpoint, metrics.jsonl
// absent or empty: no epoch, no divergence event) holds only what its start wrote (config.json,
// memory plans): `train` removes those, and the folder where it made it, so a run that could not
// start (out of device memory in its first step) leaves no half-written folder that the next
// `train --out` would refuse. Plain files only, in a folder the run had to itself. Returns
// whether it removed them.
bool discard_unstarted_run(const std::string& dir, bool remove_folder);

// A checkpoint's parameters and buffers by name, without a model to load them into (model.weights
// from a checkpoint, `edgetrain export`). Validated as load_checkpoint validates; the optimizer
// state is skipped.
struct CheckpointTensor {
  std::string name, role;  // role: "param" | "buffer"
  std::vector<int64_t> shape;
  std::vector<float> values;
};
std::vector<CheckpointTensor> read_checkpoint_tensors(const std::string& path, std::string* model_name);

uint32_t crc32_update(uint32_t crc, const void* data, size_t n);

}  // namespace et
