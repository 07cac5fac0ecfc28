// The trainer's side of the divergence guard (engine/train/divergence.h, docs/config.md
// train.on_divergence): describing a diverged step, and stopping or rolling back.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>

#include "engine/init.h"
#include "engine/train/trainer.h"
#include "engine/train/weights.h"

namespace et {
namespace fs = std::filesystem;
using json = nlohmann::json;

bool Trainer::diverged(DivergenceCause cause, int64_t batch, const NonFiniteError* thrown, bool have_loss, float lr) {
  Divergence& d = divergence_;
  d = Divergence{};
  d.cause = cause;
  d.step = state_.step;
  d.bound = cfg_.train.divergence_loss;
  d.loss_known = have_loss;
  if (have_loss) d.loss = executor_->loss();
  if (thrown) d.detail = thrown->what();
  // The SGD step has overwritten the parameters, so only its gradients can tell; otherwise the
  // step runs again with a check after every node.
  if (cause == DivergenceCause::NonFiniteUpdate) locate_in_update(*executor_, lr, d);
  else locate_in_step(*executor_, batch, d);
  return false;
}

std::string Trainer::layer_to_raise(const Divergence& d) const {
  const Graph& g = graph_;
  int at = -1;
  for (int n = 0; n < g.num_nodes() && at < 0; ++n)
    if (g.node(n).name == d.layer) at = n;
  if (at < 0) return "";
  auto quantized = [&](int n) {
    return executor_->layer_quant(n).on() && std::find(state_.fp32_layers.begin(), state_.fp32_layers.end(),
                                                       g.node(n).name) == state_.fp32_layers.end();
  };
  if (quantized(at)) return g.node(at).name;
  // Not a quantized layer itself (a BN, a ReLU, the loss): the nearest quantized one whose result
  // it took in, which ran just before it: in the forward the one before it in node order, in the
  // backward (the gradient flows back) the one after it.
  const bool backward = d.where.find("in the backward") != std::string::npos;
  for (int n = backward ? at + 1 : at - 1; n >= 0 && n < g.num_nodes(); n += backward ? 1 : -1)
    if (quantized(n)) return g.node(n).name;
  return "";
}

void Trainer::append_metrics(const std::string& out_dir, const json& record) const {
  // On disk before anything that depends on it (the epoch's checkpoint) is written.
  const std::string metrics = (fs::path(out_dir) / "metrics.jsonl").string();
  const std::string line = record.dump() + "\n";
  const int fd = ::open(metrics.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) user_error("cannot append to '", metrics, "': ", std::strerror(errno));
  const ssize_t w = ::write(fd, line.data(), line.size());
  int err = w < 0 ? errno : w != ssize_t(line.size()) ? EIO : 0;
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  if (err != 0) user_error("cannot append to '", metrics, "': ", std::strerror(err));
}

int Trainer::handle_divergence(int epoch, const std::string& out_dir, Progress& progress) {
  const Divergence& d = divergence_;
  const TrainConfig& t = cfg_.train;
  const fs::path ckpt = fs::path(out_dir) / "checkpoint_last.ckpt";
  // A checkpoint is written after every epoch, so the last one is from the epoch before this one
  // (or the one resumed from); none means the divergence came in the run's first epoch.
  const bool have_ckpt = state_.epoch >= 0;
  const std::string what = fmt("training diverged at step ", d.step, " (epoch ", epoch + 1, ", batch ", divergence_batch_,
                               " of ", divergence_batches_, "): ", d.describe());
  // NaN and inf losses become null (JSON has no such numbers).
  json ev = {{"event", "divergence"},
             {"epoch", epoch + 1},  // kept on --resume like the epoch records: by epoch
             {"step", d.step},
             {"batch", divergence_batch_},
             {"cause", divergence_cause_name(d.cause)},
             {"loss", d.loss_known ? json(d.loss) : json(nullptr)},
             {"layer", d.layer.empty() ? json(nullptr) : json(d.layer)},
             {"where", d.where},
             {"lr_factor", state_.lr_factor},
             {"rollbacks", state_.rollbacks}};
  const bool rollback = t.on_divergence == "rollback";
  const bool give_up = rollback && state_.rollbacks >= t.divergence_max_rollbacks;
  if (!rollback || give_up) {
    ev["action"] = give_up ? "give_up" : "stop";
    append_metrics(out_dir, ev);
    const std::string kept =
        have_ckpt ? fmt("the last good checkpoint '", ckpt.string(), "' (after epoch ", state_.epoch + 1, ") is kept")
                  : std::string("there is no checkpoint yet (the run diverged in its first epoch)");
    if (give_up)
      user_error(what, ". Giving up after ", state_.rollbacks, " rollbacks (train.divergence_max_rollbacks = ",
                 t.divergence_max_rollbacks, ", learning rate x", state_.lr_factor, "); ", kept, ": lower train.lr");
    user_error(what, ". Stopped (train.on_divergence = stop); ", kept,
               ": lower train.lr, or continue with --resume --set train.on_divergence=rollback");
  }

  // Roll back: the last checkpoint's state, or the initial one (re-initialised from the seed,
  // which is what the run started from), at a lower learning rate from then on.
  const double factor = state_.lr_factor * double(t.divergence_lr_factor);
  const int rollbacks = state_.rollbacks + 1;
  if (have_ckpt) {
    const TrainProgress p = load_checkpoint(ckpt.string(), *executor_, cfg_.model.name);
    state_.epoch = p.epoch;
    state_.step = p.step;
    state_.best_test_acc = p.best_test_acc;
  } else {
    init_parameters(*executor_, cfg_.train.seed);
    if (!cfg_.weights.empty()) load_weights(cfg_.weights, *executor_);
    state_.epoch = -1;
    state_.step = 0;
    state_.best_test_acc = 0;
  }
  state_.lr_factor = factor;
  state_.rollbacks = rollbacks;
  // 4-bit training: the quantized layer where it diverged trains in FP32 from then on (the next
  // enter_phase re-plans the executor with it), saved in the checkpoints like the factor.
  const std::string raise = layer_to_raise(d);
  if (!raise.empty()) state_.fp32_layers.push_back(raise);
  ev["action"] = "rollback";
  ev["lr_factor"] = factor;
  ev["rollbacks"] = rollbacks;
  ev["resume_epoch"] = state_.epoch + 2;
  ev["fp32_layer"] = raise.empty() ? json(nullptr) : json(raise);
  append_metrics(out_dir, ev);
  progress.line(fmt(what, ". Rolled back to ",
                    have_ckpt ? fmt("the checkpoint after epoch ", state_.epoch + 1) : std::string("the initial state"),
                    " (rollback ", rollbacks, " of at most ", t.divergence_max_rollbacks, "): learning rate x", factor,
                    " of the schedule from epoch ", state_.epoch + 2, " on",
                    raise.empty() ? std::string() : fmt("; layer '", raise, "' trains in FP32 from now on")));
  return state_.epoch;
}

}  // namespace et
