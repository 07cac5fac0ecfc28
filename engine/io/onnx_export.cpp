// ONNX export (engine/io/onnx_export.h): loads the ONNX module (engine/io/onnx_module.h) on first
// use, lets it build and check the model, and writes the bytes it returns. No ONNX or protobuf here.
#include "engine/io/onnx_export.h"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <filesystem>

#include "engine/check.h"
#include "engine/io/onnx_module.h"
#include "engine/train/checkpoint.h"

namespace et {
namespace {
namespace fs = std::filesystem;

#ifdef EDGETRAIN_WITH_ONNX
constexpr const char* kModuleName = "libedgetrain_onnx.so";

struct Module {
  onnx_module::BuildFn build = nullptr;
  onnx_module::CheckFn check = nullptr;
};

// Beside the running binary (a build or install folder), else where this build put it (the test
// binaries in build/tests/).
std::string module_path() {
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    const fs::path beside = fs::path(std::string(exe, size_t(n))).parent_path() / kModuleName;
    std::error_code ec;
    if (fs::exists(beside, ec)) return beside.string();
  }
  return EDGETRAIN_ONNX_MODULE_PATH;
}

// Loaded once and kept for the process's life; a failure is reported on every call.
const Module& module(const std::string& for_path) {
  static std::string error;
  static const Module m = [] {
    Module r;
    const std::string path = module_path();
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* why = ::dlerror();
      error = fmt("cannot load the ONNX exporter '", path, "': ", why ? why : "unknown error",
                  " (rebuild edgetrain; the module needs Debian's libonnx1 and libprotobuf32)");
      return r;
    }
    const auto abi = reinterpret_cast<onnx_module::AbiFn>(::dlsym(h, onnx_module::kAbiSymbol));
    if (!abi || abi() != onnx_module::kAbi) {
      error = fmt("the ONNX exporter '", path, "' is from another build of edgetrain (rebuild it)");
      return r;
    }
    r.build = reinterpret_cast<onnx_module::BuildFn>(::dlsym(h, onnx_module::kBuildSymbol));
    r.check = reinterpret_cast<onnx_module::CheckFn>(::dlsym(h, onnx_module::kCheckSymbol));
    if (!r.build || !r.check) error = fmt("the ONNX exporter '", path, "' lacks its entry points (rebuild edgetrain)");
    return r;
  }();
  if (!error.empty()) user_error("cannot write '", for_path, "': ", error);
  return m;
}
#endif

}  // namespace

#ifdef EDGETRAIN_WITH_ONNX

bool onnx_export_available() { return true; }

OnnxExportReport export_onnx(const Graph& g, const std::function<Tensor(int)>& value, const OnnxExportOptions& o,
                             const std::string& path) {
  const Module& m = module(path);
  onnx_module::BuildArgs args;
  args.graph = &g;
  args.value = &value;
  args.options = &o;
  args.path = &path;
  onnx_module::BuildResult r;
  m.build(&args, &r);
  if (!r.error.empty()) throw UserError(r.error);
  write_file_durably(path, r.bytes);  // temporary file, fsync, rename
  r.report.bytes = r.bytes.size();
  return r.report;
}

std::string check_onnx_file(const std::string& path) {
  std::string error;
  try {
    module(path).check(path.c_str(), &error);
  } catch (const UserError& e) {
    return e.what();
  }
  return error;
}

#else

bool onnx_export_available() { return false; }

OnnxExportReport export_onnx(const Graph&, const std::function<Tensor(int)>&, const OnnxExportOptions&,
                             const std::string& path) {
  user_error("cannot write '", path, "': this edgetrain was built without ONNX support (CMake option EDGETRAIN_ONNX ",
             "off, or Debian's libonnx-dev and libprotobuf-dev not found: scripts/setup.sh installs them, then rebuild)");
}

std::string check_onnx_file(const std::string& path) { return "built without ONNX support"; }

#endif

}  // namespace et
