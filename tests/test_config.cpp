// Config validation: every error names the file and the dotted key.
#include <catch2/catch.hpp>
#ifdef EDGETRAIN_WITH_CUDA
#include "backends/cuda/cuda_device.h"
#endif

#include <filesystem>
#include <fstream>

#include "backends/backend.h"
#include "engine/config.h"
#include "engine/train/schedule.h"

using namespace et;
using nlohmann::json;

namespace {

json minimal() {
  return json::parse(R"({"model": {"name": "resnet20"}, "data": {"root": "/nonexistent/cifar"},
                         "train": {"epochs": 3}})");
}

std::string error_of(const json& j) {
  try {
    parse_config(j, "test.json");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::string temp_file(const std::string& name, const std::string& text) {
  const auto p = std::filesystem::temp_directory_path() / ("edgetrain_cfg_" + name);
  std::ofstream(p) << text;
  return p.string();
}

}  // namespace

TEST_CASE("a minimal config gets documented defaults", "[config]") {
  const Config c = parse_config(minimal(), "test.json");
  CHECK(c.model.name == "resnet20");
  CHECK(c.model.num_classes == 10);
  CHECK(c.train.batch_size == 128);
  CHECK(c.data.format == "image_folder");
  CHECK(c.train.epochs == 3);
  // The resolved config parses back to the same values.
  const Config again = parse_config(c.resolved(), "resolved.json");
  CHECK(again.resolved() == c.resolved());
}

TEST_CASE("unknown keys are errors with their dotted path", "[config]") {
  json j = minimal();
  j["train"]["lr_rate"] = 0.1;
  CHECK_THAT(error_of(j), Catch::Contains("train.lr_rate") && Catch::Contains("not a known key") &&
                              Catch::Contains("test.json"));
  j = minimal();
  j["train"]["schedule"] = {{"tpye", "cosine"}};
  CHECK_THAT(error_of(j), Catch::Contains("train.schedule.tpye"));
  j = minimal();
  j["optimiser"] = json::object();
  CHECK_THAT(error_of(j), Catch::Contains("'optimiser'"));
}

TEST_CASE("mistyped and out-of-range values name key and value", "[config]") {
  json j = minimal();
  j["train"]["lr"] = "fast";
  CHECK_THAT(error_of(j), Catch::Contains("train.lr") && Catch::Contains("a number"));
  j = minimal();
  j["train"]["batch_size"] = 0;
  CHECK_THAT(error_of(j), Catch::Contains("train.batch_size"));
  j = minimal();
  j["train"]["epochs"] = 2.5;
  CHECK_THAT(error_of(j), Catch::Contains("train.epochs") && Catch::Contains("integer"));
  j = minimal();
  j["model"]["name"] = "resnet21";
  CHECK_THAT(error_of(j), Catch::Contains("model.name") && Catch::Contains("resnet21") && Catch::Contains("resnet20"));
  j = minimal();
  j["data"]["format"] = "tfrecord";
  CHECK_THAT(error_of(j), Catch::Contains("data.format"));
  j = minimal();
  j["data"]["mean"] = {0.5, 0.5};
  CHECK_THAT(error_of(j), Catch::Contains("data.mean"));
  j = minimal();
  j["train"]["schedule"] = {{"type", "multistep"}, {"milestones", {10, 5}}};
  CHECK_THAT(error_of(j), Catch::Contains("milestones"));
  j = minimal();
  j["train"]["seed"] = -1;
  CHECK_THAT(error_of(j), Catch::Contains("train.seed"));
  j = minimal();
  j["memory"] = {{"stash", "bitmap_fp8"}};
  CHECK_THAT(error_of(j), Catch::Contains("memory.stash") && Catch::Contains("bitmap_fp16"));
  j = minimal();
  j["memory"] = {{"layers", {{"layer1.0.relu1", "zip"}}}};
  CHECK_THAT(error_of(j), Catch::Contains("memory.layers.layer1.0.relu1"));
  j = minimal();
  j["memory"] = {{"prune_threshold", 2}};
  CHECK_THAT(error_of(j), Catch::Contains("memory.prune_threshold"));
  j = minimal();
  j["data"].erase("root");
  CHECK_THAT(error_of(j), Catch::Contains("data.root"));
  for (const char* device : {"gpu", "cuda:", "cuda:x", "cuda:123456", "CPU"}) {
    j = minimal();
    j["train"]["device"] = device;
    CHECK_THAT(error_of(j), Catch::Contains("train.device") && Catch::Contains(device));
  }
}

TEST_CASE("train.device selects the backend, and one this build lacks is an error naming the key", "[config]") {
  json j = minimal();
  CHECK(parse_config(j, "test.json").train.device == "cpu");
  const std::unique_ptr<Backend> cpu = make_backend("cpu");
  CHECK(cpu->device() == Device::CPU);
  CHECK(cpu->memory().device() == Device::CPU);
  for (const char* device : {"cuda", "cuda:1"}) {
    j["train"]["device"] = device;
    const Config c = parse_config(j, "test.json");
    CHECK(c.train.device == device);
    CHECK(parse_config(c.resolved(), "resolved.json").train.device == device);
#ifndef EDGETRAIN_WITH_CUDA
    CHECK_THROWS_WITH(make_backend(c.train.device), Catch::Contains("train.device") && Catch::Contains(device) &&
                                                        Catch::Contains("-DEDGETRAIN_CUDA=ON"));
#else
    if (cuda_device_count() <= (device == std::string("cuda") ? 0 : 1))
      CHECK_THROWS_WITH(make_backend(c.train.device), Catch::Contains("train.device") && Catch::Contains(device));
    else
      CHECK(make_backend(c.train.device)->device() == Device::CUDA);
#endif
  }
  // train.cuda_graph = "auto" (the default): on for CUDA, off on the CPU, written back as "auto";
  // true on the CPU is an error naming the key.
  CHECK(parse_config(j, "t.json").train.cuda_graph);
  CHECK(parse_config(j, "t.json").resolved()["train"]["cuda_graph"] == "auto");
  j["train"]["device"] = "cpu";
  CHECK_FALSE(parse_config(j, "t.json").train.cuda_graph);
  j["train"]["cuda_graph"] = true;
  CHECK_THROWS_WITH(parse_config(j, "t.json"), Catch::Contains("train.cuda_graph") && Catch::Contains("cuda"));
  j["train"]["cuda_graph"] = "yes";
  CHECK_THROWS_WITH(parse_config(j, "t.json"), Catch::Contains("train.cuda_graph"));
  j["train"]["device"] = "cuda";
  j["train"]["cuda_graph"] = false;
  CHECK_FALSE(parse_config(j, "t.json").train.cuda_graph);
  j["train"].erase("cuda_graph");
  // fusion.enabled = true on CUDA: its element-wise stacks (FusionSpec::whole_tensors); an
  // explicit tile names its key when the model is planned.
  j["train"]["device"] = "cuda";
  j["fusion"] = {{"enabled", true}};
  const Config fused_cuda = parse_config(j, "t.json");
  CHECK(fused_cuda.model.fusion.enabled);
  CHECK(fused_cuda.model.fusion.whole_tensors);
  j["train"]["device"] = "cpu";
  CHECK_FALSE(parse_config(j, "t.json").model.fusion.whole_tensors);
  // fusion.enabled = "auto" (the default): off on CUDA, on on the CPU, written back as "auto"
  for (const json& setting : {json("auto"), json()}) {
    if (setting.is_null())
      j.erase("fusion");
    else
      j["fusion"] = {{"enabled", setting}};
    j["train"]["device"] = "cuda";
    const Config on_cuda = parse_config(j, "t.json");
    CHECK_FALSE(on_cuda.model.fusion.enabled);
    CHECK(on_cuda.model.fusion.automatic);
    j["train"]["device"] = "cpu";
    const Config on_cpu = parse_config(j, "t.json");
    CHECK(on_cpu.model.fusion.enabled);
    CHECK(on_cuda.resolved()["fusion"]["enabled"] == "auto");
    CHECK(parse_config(on_cpu.resolved(), "r.json").model.fusion.enabled);
  }
  j["fusion"] = {{"enabled", false}};
  CHECK_FALSE(parse_config(j, "t.json").model.fusion.enabled);
  j["fusion"] = {{"enabled", "yes"}};
  CHECK_THROWS_WITH(parse_config(j, "t.json"), Catch::Contains("fusion.enabled") && Catch::Contains("\"yes\""));
  // fusion.sweep1_in_reader: auto by default (the planner's cache rule), written back, or a boolean
  j["fusion"] = json::object();
  const Config sweep_auto = parse_config(j, "t.json");
  CHECK(sweep_auto.model.fusion.sweep1_in_reader_auto);
  CHECK(sweep_auto.resolved()["fusion"]["sweep1_in_reader"] == "auto");
  CHECK(parse_config(sweep_auto.resolved(), "r.json").model.fusion.sweep1_in_reader_auto);
  j["fusion"] = {{"sweep1_in_reader", true}};
  CHECK_FALSE(parse_config(j, "t.json").model.fusion.sweep1_in_reader_auto);
  CHECK(parse_config(j, "t.json").model.fusion.sweep1_in_reader);
  j["fusion"] = {{"sweep1_in_reader", false}};
  const Config no_sweep = parse_config(j, "t.json");
  CHECK_FALSE(no_sweep.model.fusion.sweep1_in_reader);
  CHECK_FALSE(no_sweep.model.fusion.sweep1_in_reader_auto);
  CHECK_FALSE(parse_config(no_sweep.resolved(), "r.json").model.fusion.sweep1_in_reader);
  j["fusion"] = {{"sweep1_in_reader", 1}};
  CHECK_THROWS_WITH(parse_config(j, "t.json"), Catch::Contains("fusion.sweep1_in_reader"));
  // fusion.fold_side_bn: on by default, written back, or off
  j["fusion"] = json::object();
  CHECK(parse_config(j, "t.json").model.fusion.fold_side_bn);
  j["fusion"] = {{"fold_side_bn", false}};
  const Config no_fold = parse_config(j, "t.json");
  CHECK_FALSE(no_fold.model.fusion.fold_side_bn);
  CHECK_FALSE(parse_config(no_fold.resolved(), "r.json").model.fusion.fold_side_bn);
  j["fusion"] = {{"fold_side_bn", "no"}};
  CHECK_THROWS_WITH(parse_config(j, "t.json"), Catch::Contains("fusion.fold_side_bn"));
  j["train"]["device"] = "cuda";
  j.erase("fusion");
  j["quant"] = {{"forward", "int4"}, {"backward", "luq_fp4"}};  // 4-bit training runs on CUDA
  CHECK(parse_config(j, "t.json").quant_options().any());
  j.erase("quant");
  j["memory"] = {{"budget_mb", 100}};  // a budget of the device's memory there (engine/budget.h)
  CHECK(parse_config(j, "t.json").memory.budget_mb == 100);
}

TEST_CASE("config files: malformed JSON, missing file, --set overrides", "[config]") {
  const std::string bad = temp_file("bad.json", "{\"model\": {\"name\": \"resnet20\",}");
  try {
    load_config(bad);
    FAIL("no error");
  } catch (const UserError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains(bad) && Catch::Contains("malformed JSON"));
  }
  CHECK_THROWS_WITH(load_config("/nonexistent/edgetrain.json"), Catch::Contains("/nonexistent/edgetrain.json"));

  const std::string good = temp_file("good.json", minimal().dump());
  const Config c = load_config(good, {"model.name=vgg16_bn", "train.lr=0.05", "train.schedule.milestones=[2]",
                                      "data.format=cifar10_binary"});
  CHECK(c.model.name == "vgg16_bn");
  CHECK(c.train.lr == Approx(0.05f));
  CHECK(c.train.schedule.milestones == std::vector<int>{2});
  CHECK(c.data.format == "cifar10_binary");
  CHECK_THROWS_WITH(load_config(good, {"train.lr"}), Catch::Contains("key=value"));
  CHECK_THROWS_WITH(load_config(good, {"train.momentun=0.5"}), Catch::Contains("train.momentun"));
  CHECK_THROWS_WITH(load_config(good, {"model.name.x=1"}), Catch::Contains("model.name"));
  std::filesystem::remove(bad);
  std::filesystem::remove(good);
}

// Found by fuzz/fuzz_config.cpp: a --set value that is not JSON became a string with its bytes as
// given, and a byte that is not UTF-8 made nlohmann::json throw (uncaught) when the message or
// config.json was written: `--set train.lr=0.<0xB0>` ended the process.
TEST_CASE("a --set with bytes that are not UTF-8 is an error", "[config]") {
  const std::string cfg = R"({"model": {"name": "resnet8"}, "data": {"root": "d"}})";
  for (const std::string set : {"train.lr=0.\xB0", "data.root=/data/\xE9t\xE9", "memory.layers.\xFF=bitmap_fp16"})
    CHECK_THROWS_WITH(load_config_text(cfg, {set}, "c.json"), Catch::Contains("not valid UTF-8"));
  // ... and UTF-8 ones are fine, written back as given.
  CHECK(load_config_text(cfg, {"data.root=/données"}, "c.json").resolved()["data"]["root"] == "/données");
}

// Found by fuzz/fuzz_config.cpp: a number beyond double's range is not a parse error to
// nlohmann::json but an out_of_range exception, which escaped.
TEST_CASE("numbers beyond double's range are errors", "[config]") {
  const std::string big(400, '7');
  CHECK_THROWS_WITH(load_config_text(big, {}, "c.json"), Catch::Contains("c.json") && Catch::Contains("number overflow"));
  const std::string cfg = R"({"model": {"name": "resnet8"}, "train": {"lr": )" + big + "}}";
  CHECK_THROWS_WITH(load_config_text(cfg, {}, "c.json"), Catch::Contains("number overflow"));
  CHECK_THROWS_WITH(load_config_text(R"({"model": {"name": "resnet8"}, "data": {"root": "d"}})", {"train.lr=" + big}, "c.json"),
                    Catch::Contains("train.lr") && Catch::Contains("must be a number"));
}

TEST_CASE("every shipped config parses", "[config]") {
  for (const char* name : {"resnet20_cifar10", "resnet20_cifar10_short", "vgg16_bn_cifar10", "resnet18_cifar10",
                           "mobilenetv2_cifar10", "resnet20_cifar10_luq", "vgg16_bn_cifar10_luq",
                           "resnet20_cifar10_luq_smp2_fnt"}) {
    INFO(name);
    const Config c = load_config(std::string(EDGETRAIN_SOURCE_DIR) + "/configs/" + name + ".json");
    CHECK(c.train.epochs >= 1);
  }
  CHECK(load_config(std::string(EDGETRAIN_SOURCE_DIR) + "/configs/resnet20_cifar10_short.json").train.epochs <= 30);
}

TEST_CASE("learning-rate schedules", "[config]") {
  TrainConfig t;
  t.lr = 0.1f;
  t.epochs = 10;
  t.schedule.type = "multistep";
  t.schedule.milestones = {5, 8};
  CHECK(learning_rate(t, 0) == Approx(0.1));
  CHECK(learning_rate(t, 4.99) == Approx(0.1));
  CHECK(learning_rate(t, 5) == Approx(0.01));
  CHECK(learning_rate(t, 9) == Approx(0.001));
  t.schedule.warmup_epochs = 2;
  CHECK(learning_rate(t, 0) == Approx(0.01));
  CHECK(learning_rate(t, 1) == Approx(0.055));
  t.schedule = ScheduleConfig{};
  t.schedule.type = "cosine";
  CHECK(learning_rate(t, 0) == Approx(0.1));
  CHECK(learning_rate(t, 5) == Approx(0.05));
  CHECK(learning_rate(t, 10) == Approx(0.0).margin(1e-7));
  t.schedule.type = "onecycle";
  t.schedule.pct_start = 0.3f;
  t.schedule.div_factor = 10;
  t.schedule.final_div_factor = 100;
  CHECK(learning_rate(t, 0) == Approx(0.01));
  CHECK(learning_rate(t, 3) == Approx(0.1));
  CHECK(learning_rate(t, 10) == Approx(0.0001));
  CHECK(learning_rate(t, 6) < 0.1);
}

TEST_CASE("memory.recompute_stack_outputs: auto or a boolean, not with recompute segments or a budget", "[config]") {
  json j = minimal();
  j["memory"]["recompute_stack_outputs"] = true;
  CHECK(error_of(j).empty());
  CHECK(parse_config(j, "test.json").stash_options(false).recompute_stack_outputs);
  j["memory"]["checkpoint_every"] = 2;
  const std::string e = error_of(j);
  CHECK_THAT(e, Catch::Contains("memory.recompute_stack_outputs") && Catch::Contains("checkpoint_every"));
  j["memory"].erase("checkpoint_every");
  j["fusion"]["enabled"] = false;
  CHECK_THAT(error_of(j), Catch::Contains("fusion.enabled") && Catch::Contains("recompute_stack_outputs"));
  j.erase("fusion");
  j["memory"]["recompute_stack_outputs"] = "yes";
  CHECK_THAT(error_of(j), Catch::Contains("memory.recompute_stack_outputs"));
  // auto (the default): on where it combines, off with segments, a budget, pruning or fusion off.
  for (bool explicit_auto : {false, true}) {
    json a = minimal();
    if (explicit_auto) a["memory"]["recompute_stack_outputs"] = "auto";
    CHECK(parse_config(a, "test.json").stash_options(false).recompute_stack_outputs);
    json b = a;
    b["memory"]["checkpoint_every"] = 2;
    CHECK_FALSE(parse_config(b, "test.json").stash_options(false).recompute_stack_outputs);
    b = a;
    b["memory"]["prune_threshold"] = 0.01;
    CHECK_FALSE(parse_config(b, "test.json").stash_options(false).recompute_stack_outputs);
    b = a;
    b["fusion"]["enabled"] = false;
    CHECK_FALSE(parse_config(b, "test.json").stash_options(false).recompute_stack_outputs);
    b = a;
    b["memory"]["budget_mb"] = 300;
    CHECK_FALSE(parse_config(b, "test.json").stash_options(false).recompute_stack_outputs);
  }
  json f = minimal();
  f["memory"]["recompute_stack_outputs"] = false;
  CHECK_FALSE(parse_config(f, "test.json").stash_options(false).recompute_stack_outputs);
}
