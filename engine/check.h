// Two kinds of errors (docs/architecture.md, "Errors"):
//  - programmer errors: ET_CHECK aborts with file:line and the failed condition;
//  - user errors (config, data, checkpoint, command line, out of memory): throw et::UserError,
//    which reaches main() and becomes a clear message and a non-zero exit. Library code never exits.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace et {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A non-finite value found inside a training step (a quantizer's input or gradient): the run
// diverged. The trainer's divergence guard (engine/train/divergence.h) catches it to stop or roll
// back; elsewhere it is a UserError like any other.
struct NonFiniteError : UserError {
  NonFiniteError(const std::string& message, std::string layer_name, bool in_forward = false)
      : UserError(message), layer(std::move(layer_name)), forward(in_forward) {}
  std::string layer;  // the node that found it
  // Found by the forward, though thrown after it (4-bit scales in the backend's memory report at
  // the pass's end): the loss is not the step's to report.
  bool forward;
};

[[noreturn]] inline void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr, "edgetrain: internal error at %s:%d: check `%s` failed%s%s\n", file, line, cond,
               msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

// Builds a message from stream-able pieces: fmt("layer ", name, " needs ", n, " bytes").
// (An array expansion rather than a C++17 fold: .cu files include this header as C++14.)
template <typename... Args>
std::string fmt(const Args&... args) {
  std::ostringstream os;
  using expand = int[];
  (void)expand{0, ((void)(os << args), 0)...};
  return os.str();
}

template <typename... Args>
[[noreturn]] void user_error(const Args&... args) {
  throw UserError(fmt(args...));
}

}  // namespace et

// ET_CHECK(cond) or ET_CHECK(cond, message pieces...). The trailing "" gives the variadic part at
// least one argument: C++14 (what .cu files get) has no __VA_OPT__.
#define ET_CHECK(...) ET_CHECK_IMPL_(__VA_ARGS__, "")
#define ET_CHECK_IMPL_(cond, ...)                                                              \
  do {                                                                                         \
    if (!(cond)) ::et::check_failed(__FILE__, __LINE__, #cond, ::et::fmt(__VA_ARGS__));        \
  } while (0)
