// Internal to the config parser (engine/config.cpp, engine/config_sections.cpp): the JSON object
// reader that names every key it reports, and one parser per config section.
#pragma once
#include <limits>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/check.h"
#include "engine/config.h"

namespace et {
namespace config_detail {

using json = nlohmann::json;

// Reads one JSON object, remembering which keys were consumed so leftovers can be reported.
class ObjectReader {
 public:
  ObjectReader(const json& j, std::string path, const std::string& source) : j_(j), path_(std::move(path)), source_(source) {
    if (!j_.is_object()) fail(path_.empty() ? "the top level" : path_, "must be an object");
  }

  template <typename T>
  void get(const char* key, T& out) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) return;
    read(*it, full(key), out);
  }

  // An object of string values (per-layer settings): {"layer1.0.relu1": "bitmap_fp16", ...}
  void get_string_map(const char* key, std::vector<std::pair<std::string, std::string>>& out) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end()) return;
    if (!it->is_object()) type_error(*it, full(key), "an object of \"layer\": \"value\" pairs");
    out.clear();
    for (auto e = it->begin(); e != it->end(); ++e) {
      if (!e->is_string()) type_error(*e, full(key) + "." + e.key(), "a string");
      out.emplace_back(e.key(), e->get<std::string>());
    }
  }

  // A key that may be "auto", which it is when absent: returns true then, else reads `out`.
  template <typename T>
  bool get_or_auto(const char* key, T& out, const char* want) {
    seen_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end() || (it->is_string() && it->get<std::string>() == "auto")) return true;
    if (it->is_string()) type_error(*it, full(key), (std::string("\"auto\" or ") + want).c_str());
    read(*it, full(key), out);
    return false;
  }

  ObjectReader child(const char* key) {
    seen_.insert(key);
    static const json empty = json::object();
    auto it = j_.find(key);
    return ObjectReader(it == j_.end() ? empty : *it, full(key), source_);
  }

  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (!seen_.count(it.key())) fail(full(it.key()), "is not a known key");
  }

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    user_error(source_, ": config key '", key, "' ", what);
  }
  std::string full(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

 private:
  void type_error(const json& v, const std::string& key, const char* want) const {
    fail(key, std::string("must be ") + want + ", got " + v.dump(-1, ' ', false, json::error_handler_t::replace));
  }
  void read(const json& v, const std::string& key, bool& out) const {
    if (!v.is_boolean()) type_error(v, key, "true or false");
    out = v.get<bool>();
  }
  void read(const json& v, const std::string& key, std::string& out) const {
    if (!v.is_string()) type_error(v, key, "a string");
    out = v.get<std::string>();
  }
  void read(const json& v, const std::string& key, json& out) const { out = v; }
  void read(const json& v, const std::string& key, float& out) const {
    if (!v.is_number()) type_error(v, key, "a number");
    out = v.get<float>();
  }
  template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  void read(const json& v, const std::string& key, I& out) const {
    if (!v.is_number_integer()) type_error(v, key, "an integer");
    if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      if (u > uint64_t(std::numeric_limits<I>::max())) type_error(v, key, "a smaller integer");
      out = I(u);
      return;
    }
    const auto s = v.get<int64_t>();
    if (s < int64_t(std::numeric_limits<I>::min()) || (s > 0 && uint64_t(s) > uint64_t(std::numeric_limits<I>::max())))
      type_error(v, key, std::is_signed_v<I> ? "an integer in range" : "a non-negative integer");
    out = I(s);
  }
  template <typename T>
  void read(const json& v, const std::string& key, std::vector<T>& out) const {
    if (!v.is_array()) type_error(v, key, "an array");
    out.clear();
    for (size_t i = 0; i < v.size(); ++i) {
      T x{};
      read(v[i], key + "[" + std::to_string(i) + "]", x);
      out.push_back(x);
    }
  }

  const json& j_;
  std::string path_;
  const std::string& source_;
  std::set<std::string> seen_;
};

template <typename T>
inline void require(bool ok, const ObjectReader& r, const char* key, const T& value, const char* what) {
  if (!ok) r.fail(r.full(key), fmt("= ", value, ": ", what));
}


// Each reads its section of `top` into `c`, checks it, and fails naming the key; in this order
// (later sections' defaults and checks read earlier ones).
void parse_model(ObjectReader& top, Config& c);
void parse_data(ObjectReader& top, Config& c, const std::string& source);
void parse_train(ObjectReader& top, Config& c);
void parse_memory(ObjectReader& top, Config& c);
void parse_fusion(ObjectReader& top, Config& c);
void parse_finetune(ObjectReader& top, Config& c);
void parse_quant(ObjectReader& top, Config& c);

}  // namespace config_detail
}  // namespace et
