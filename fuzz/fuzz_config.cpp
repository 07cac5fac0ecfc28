// The config parser: JSON text, then NUL-separated `--set` overrides (dotted.key=value).
// Bad input must be a UserError; a config that parses must survive the round trip the run folder
// relies on (--resume compares config.json, written from resolved(), with the resolved config).
#include <cstdio>
#include <cstdlib>

#include "engine/check.h"
#include "engine/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  size_t z = in.find('\0');
  const std::string text = in.substr(0, z);
  std::vector<std::string> sets;
  while (z != std::string::npos) {
    const size_t next = in.find('\0', z + 1);
    sets.push_back(in.substr(z + 1, next == std::string::npos ? std::string::npos : next - z - 1));
    z = next;
  }
  et::Config cfg;
  try {
    cfg = et::load_config_text(text, sets, "fuzz.json");
  } catch (const et::UserError&) {
    return 0;
  }
  cfg.stash_options();
  cfg.quant_options();
  const nlohmann::json resolved = cfg.resolved();
  const std::string dumped = resolved.dump(2);
  et::Config again;
  try {
    again = et::parse_config(nlohmann::json::parse(dumped), "config.json");
  } catch (const et::UserError& e) {
    std::fprintf(stderr, "a parsed config's resolved() does not parse again: %s\n%s\n", e.what(), dumped.c_str());
    std::abort();
  }
  if (again.resolved() != resolved) {
    std::fprintf(stderr, "resolved() changes on a round trip:\n%s\n%s\n", dumped.c_str(), again.resolved().dump(2).c_str());
    std::abort();
  }
  return 0;
}
