// data.channels / height / width / mean / std = "auto" (the default; docs/config.md, "Input shape
// and normalisation from the data"): what they resolve to, from the data set.
//  - cifar10_binary: 3x32x32.
//  - image_folder, from the headers of the training images (read_image_folder_headers):
//    channels 1 when every image is grayscale (with or without alpha), else 3 (grayscale images
//    are then replicated to RGB, as PIL's convert("RGB") does); height x width the size every
//    image has. Images of several sizes are an error naming two of them, unless data.resize is
//    stretch or center_crop: then the most common size (on a tie, the one met first in file order).
//  - mean / std: per channel, over the training images the run uses (after data.train_subset and
//    the resize rule, before augmentation), in pixel / 255 units; std is the population standard
//    deviation (divisor N = images x height x width). channel_stats() computes it exactly.
// The Trainer resolves them before it builds the model; the run's config.json holds the numbers.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/data/dataset.h"

namespace et {

// Per channel over every pixel of every image of `d`, in pixel / 255 units: the mean and the
// population standard deviation sqrt(sum (x - mean)^2 / N). The sums are exact 64/128-bit
// integers (the result does not depend on thread count or order), spread over OpenMP threads.
struct ChannelStats {
  std::vector<double> mean, std;
  int64_t pixels = 0;  // N, per channel
};
ChannelStats channel_stats(const Dataset& d);

// Fills cfg's auto channels / height / width from the data (above); nothing to do (and no file
// read) when none is auto. Returns a line saying what was chosen, empty when nothing was auto.
// `synthetic`: for commands that run on synthetic inputs (bench step, plan, memprofile
// --synthetic): a data root without the training split gives 3x32x32 and says so in the line.
std::string resolve_data_shape(Config& cfg, bool synthetic = false);

// Fills cfg's auto mean / std from `train`, the training images as the run uses them (after
// data.train_subset: training_images()); returns a line with the values and the time taken.
std::string resolve_data_stats(Config& cfg, const Dataset& train);

// `train` after data.train_subset, the images a run trains on (train itself when no subset).
std::shared_ptr<const Dataset> training_images(std::shared_ptr<const Dataset> train, const Config& cfg);

// --resume: every auto data key of `cfg` takes the value in the run's saved config.json (the
// numbers its start resolved), so the run keeps its input shape and normalisation whatever the
// data gives now. Returns the dotted keys it filled.
std::vector<std::string> adopt_saved_data(Config& cfg, const nlohmann::json& saved);

// A config with its data keys resolved: mean / std one value per channel; UserError otherwise.
void check_data_resolved(const Config& cfg);

}  // namespace et
