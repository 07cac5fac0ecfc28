#include "engine/data/dataset.h"

#include "engine/check.h"

namespace et {

const char* split_name(Split split) { return split == Split::Train ? "train" : "test"; }

Dataset load_dataset(const std::string& format, const std::string& root, Split split,
                     const ImageFolderOptions& opt) {
  if (format == "cifar10_binary") return load_cifar10_binary(root, split);
  if (format == "image_folder") return load_image_folder(root, split, opt);
  user_error("unknown data format \"", format, "\" (expected \"image_folder\" or \"cifar10_binary\")");
}

}  // namespace et
