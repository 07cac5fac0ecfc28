// The interface between edgetrain and its ONNX module, libedgetrain_onnx.so (engine/io/onnx_module.cpp),
// the only code that includes and links ONNX and protobuf. engine/io/onnx_export.cpp loads the module
// with dlopen on the first export, so no other run of edgetrain maps those libraries (linked into the
// binary, they cost every process about 3 MB of USS, and libonnx1 / libprotobuf32 would be needed to
// start it at all). Both sides are built from the same tree with the same compiler: C++ types cross.
// The module needs nothing of edgetrain's library (inline header code only; it is linked with
// --no-undefined), and no exception crosses: failures come back as a message.
#pragma once
#include <functional>
#include <string>

#include "engine/io/onnx_export.h"

namespace et::onnx_module {

// Bumped whenever the structs below or the semantics of the entry points change.
constexpr int kAbi = 1;

struct BuildArgs {
  const Graph* graph = nullptr;
  const std::function<Tensor(int)>* value = nullptr;
  const OnnxExportOptions* options = nullptr;
  const std::string* path = nullptr;  // the file to be written (named in messages)
};

struct BuildResult {
  std::string bytes;   // the serialised, checked ModelProto
  std::string error;   // non-empty: why there is none (a complete message)
  OnnxExportReport report;
};

// Symbols the module exports (extern "C", so dlsym finds them by these names).
constexpr const char* kAbiSymbol = "edgetrain_onnx_abi";           // int ()
constexpr const char* kBuildSymbol = "edgetrain_onnx_build";       // void (const BuildArgs*, BuildResult*)
constexpr const char* kCheckSymbol = "edgetrain_onnx_check_file";  // void (const char* path, std::string* error)
using AbiFn = int (*)();
using BuildFn = void (*)(const BuildArgs*, BuildResult*);
using CheckFn = void (*)(const char*, std::string*);

}  // namespace et::onnx_module
