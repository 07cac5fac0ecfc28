// The CUDA emulator's one source transform (tests/cuda_emu, docs/cuda-log.md "The CUDA emulator"):
// copies a .cu file, rewriting each kernel launch `NAME<<<CONFIG>>>(ARGS)` into
// `(::emu::launch("NAME", [](auto... a_) { NAME(a_...); }, CONFIG))(ARGS)`, which a C++ compiler
// takes. NAME may carry template arguments (`int_gemm_kernel<true, 16, 1>`); a kernel template whose
// arguments are deduced from ARGS is deduced in the lambda, from the same argument types. Comments,
// string and character literals are copied as they are. A `#line 1 "source"` first keeps the
// compiler's messages on the original file.
//
//   rewrite_launches IN.cu OUT.cpp
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

namespace {

bool ident_char(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

// The start of the launched expression that ends right before `end`: identifiers, `::` and
// balanced template argument lists, e.g. `ns::kernel<T, 4>`.
size_t kernel_name_start(const std::string& s, size_t end) {
  size_t i = end;
  for (;;) {
    while (i > 0 && s[i - 1] == ' ') --i;
    if (i > 0 && s[i - 1] == '>') {  // template arguments: back to the matching '<'
      int depth = 0;
      size_t j = i;
      while (j > 0) {
        --j;
        if (s[j] == '>') ++depth;
        else if (s[j] == '<' && --depth == 0) break;
      }
      i = j;
      while (i > 0 && s[i - 1] == ' ') --i;
    }
    const size_t id_end = i;
    while (i > 0 && ident_char(s[i - 1])) --i;
    if (i == id_end) return std::string::npos;
    if (i >= 2 && s[i - 1] == ':' && s[i - 2] == ':') {
      i -= 2;
      continue;
    }
    return i;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN.cu OUT.cpp\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "%s: cannot read\n", argv[1]);
    return 1;
  }
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string s = buf.str();
  std::string out = "#line 1 \"" + std::string(argv[1]) + "\"\n";
  size_t copied = 0, i = 0;
  int launches = 0;
  while (i < s.size()) {
    if (s.compare(i, 2, "//") == 0) {
      i = s.find('\n', i);
      if (i == std::string::npos) i = s.size();
      continue;
    }
    if (s.compare(i, 2, "/*") == 0) {
      i = s.find("*/", i + 2);
      i = i == std::string::npos ? s.size() : i + 2;
      continue;
    }
    if (s[i] == '"' || s[i] == '\'') {
      const char q = s[i++];
      while (i < s.size() && s[i] != q) i += s[i] == '\\' ? 2 : 1;
      ++i;
      continue;
    }
    if (s.compare(i, 3, "<<<") != 0) {
      ++i;
      continue;
    }
    const size_t name_begin = kernel_name_start(s, i);
    const size_t config_end = s.find(">>>", i + 3);
    size_t open = config_end == std::string::npos ? config_end : s.find_first_not_of(" \n", config_end + 3);
    if (name_begin == std::string::npos || name_begin < copied || open == std::string::npos || s[open] != '(') {
      std::fprintf(stderr, "%s: a launch at offset %zu that this rewriter does not understand\n", argv[1], i);
      return 1;
    }
    std::string name = s.substr(name_begin, i - name_begin);
    while (!name.empty() && name.back() == ' ') name.pop_back();
    const std::string config = s.substr(i + 3, config_end - i - 3);
    out += s.substr(copied, name_begin - copied);
    // Newlines of the config stay, so later lines keep their numbers.
    out += "(::emu::launch(\"" + name + "\", [](auto... a_) { " + name + "(a_...); }, " + config + "))";
    copied = i = config_end + 3;
    ++launches;
  }
  out += s.substr(copied);
  std::ofstream o(argv[2], std::ios::binary);
  o << out;
  if (!o) {
    std::fprintf(stderr, "%s: cannot write\n", argv[2]);
    return 1;
  }
  return 0;
}
