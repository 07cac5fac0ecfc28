// A whole data split decoded once into memory (uint8 CHW images + int32 labels), and the readers
// that produce it: the official CIFAR-10 binary batches and an image-folder tree read with stb_image.
// Every problem with the files on disk is an et::UserError naming the file and what is wrong.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace et {

enum class Split { Train, Test };
const char* split_name(Split split);  // "train" / "test"

struct Dataset {
  int64_t size = 0;  // number of images
  int channels = 0, height = 0, width = 0;
  std::vector<uint8_t> pixels;       // [size, channels, height, width], each image CHW
  std::vector<int32_t> labels;       // [size]
  std::vector<std::string> classes;  // class names in label order
  std::string source;                // path it was read from, for messages

  int64_t image_elems() const { return int64_t(channels) * height * width; }
  const uint8_t* image(int64_t i) const { return pixels.data() + i * image_elems(); }
};

// root/data_batch_1..5.bin (train) or root/test_batch.bin (test), also found under
// root/cifar-10-batches-bin/. Record: 1 label byte, then the R, G and B 32x32 planes (already CHW).
// Class names from batches.meta.txt next to the batches if present, else the built-in CIFAR-10 list.
Dataset load_cifar10_binary(const std::string& root, Split split);

struct ImageFolderOptions {
  int channels = 3, height = 32, width = 32;  // what the model wants (channels 1 or 3)
  // "none": an image of another size is an error naming the file and both sizes;
  // "stretch": bilinear resize to height x width (aspect ratio not kept);
  // "center_crop": bilinear scale so the image covers height x width, then crop the centre.
  std::string resize = "none";
  // Channel rule, always applied: alpha is dropped (gray+alpha, RGBA); gray is replicated to 3
  // channels when channels == 3; colour becomes ITU-R BT.601 luma when channels == 1.
};

// root/{train,test}/<class>/*.{jpg,jpeg,png,bmp} (extension case-insensitive, other files and
// dot-folders ignored). Label = index of the class folder among root/train's class folders sorted
// byte-wise, for both splits (a test class folder unknown to train is an error). Files are taken
// in byte-wise sorted order; decoding runs on several threads, the result does not depend on them.
Dataset load_image_folder(const std::string& root, Split split, const ImageFolderOptions& opt);

// One image file's bytes decoded as load_image_folder does each file (channel rule, resize), into
// out [opt.channels, opt.height, opt.width]; `path` names it in errors (UserError). An image header
// claiming more than 2^26 pixels, or more than its file could hold, is an error before decoding.
void decode_image(const uint8_t* bytes, size_t size, const std::string& path, const ImageFolderOptions& opt,
                  uint8_t* out);

// An image file's header: its size, and its channels as stored: 1 gray, 2 gray + alpha, 3 colour,
// 4 colour + alpha (a PNG palette counts as colour; stb_image reads BMP as 3 or 4).
struct ImageHeader {
  int width = 0, height = 0, channels = 0;
};
struct FolderHeaders {
  std::string dir;                  // root/<split>
  std::vector<std::string> files;   // the files load_image_folder reads, in its order
  std::vector<ImageHeader> headers;  // [files.size()]
};
// Reads only the headers of the images load_image_folder(root, split, ...) would decode, with
// the same checks and errors (each names its file), on several threads. What data.channels /
// height / width = auto look at (engine/data/auto.h).
FolderHeaders read_image_folder_headers(const std::string& root, Split split);

// `n` images of `d` chosen by a seeded shuffle (std::mt19937_64(seed)), kept in their original
// order; all of them if n >= d.size. What data.train_subset / test_subset select.
std::shared_ptr<const Dataset> subset_dataset(const Dataset& d, int64_t n, uint64_t seed);

// format: "cifar10_binary" or "image_folder" (opt only matters for image_folder).
Dataset load_dataset(const std::string& format, const std::string& root, Split split,
                     const ImageFolderOptions& opt);

}  // namespace et
