// `edgetrain export`: a trained checkpoint's weights for other tools. safetensors: parameters and
// BN buffers by their PyTorch names (scripts/convert_pytorch.py --to-pytorch turns the file into a
// state_dict; model.weights reads it back).
#include <cstdio>
#include <filesystem>

#include "apps/commands.h"
#include "engine/check.h"
#include "engine/io/safetensors.h"
#include "engine/train/checkpoint.h"

namespace et::app {
namespace fs = std::filesystem;

int cmd_export(const ExportArgs& a) {
  if (fs::exists(a.out)) user_error("'", a.out, "' exists; choose another --out");
  std::string model;
  const std::vector<CheckpointTensor> tensors = read_checkpoint_tensors(a.checkpoint, &model);
  std::vector<SafetensorsOut> out;
  for (const CheckpointTensor& t : tensors) out.push_back({t.name, t.shape, t.values.data()});
  write_safetensors(a.out, out, {{"format", "pt"}, {"producer", "edgetrain"}, {"model", model}});
  std::printf("exported %zu tensors of %s from %s to %s\n", out.size(), model.c_str(), a.checkpoint.c_str(),
              a.out.c_str());
  return 0;
}

}  // namespace et::app
