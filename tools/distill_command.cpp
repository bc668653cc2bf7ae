// `mha distill`: what `mha train` adds when a teacher teaches the student
// (train/distill.h): the teacher, the hidden-transfer projection and its
// moments (distill.safetensors beside the student's checkpoint), distill.json.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "distill_command.h"
#include "mha/errors.h"
#include "mha/io/safetensors.h"
#include "mha/random.h"
#include "progress.h"

namespace mha::tools {

namespace {

constexpr const char* kFn = "mha distill";

std::string save_id_of(const std::string& dir) {
  std::ifstream in(dir + "/config.json");
  const nlohmann::json c = nlohmann::json::parse(in, nullptr, false);
  return c.is_object() ? c.value("save_id", "") : "";
}

}  // namespace

TeacherRun::TeacherRun(const std::string& dir, const train::DistillConfig& config)
    : teacher_dir(dir), settings(config), teacher(train::load_checkpoint(dir)), save_id(save_id_of(dir)) {
  teacher.model->eval();
}

void TeacherRun::check_student(train::TaskModel& student, const train::Checkpoint& info) {
  if (info.task.task != teacher.info.task.task || info.task.min_length != teacher.info.task.min_length ||
      info.task.max_length != teacher.info.task.max_length || info.task.digits != teacher.info.task.digits)
    throw ValueError(std::string("[") + kFn + "] teacher: expected one trained on the student's task (" +
                     train::to_string(info.task.task) + ", lengths " + std::to_string(info.task.min_length) + "-" +
                     std::to_string(info.task.max_length) + "); got a teacher of " +
                     train::to_string(teacher.info.task.task) + ", lengths " +
                     std::to_string(teacher.info.task.min_length) + "-" + std::to_string(teacher.info.task.max_length));
  train::check_distillation(student, *teacher.model, info.model.vocab_size, teacher.info.model.vocab_size, settings,
                            kFn);
  if (settings.hidden_weight > 0) {
    // W (D_teacher, D_student): the identity where the widths agree, else small random.
    const int64_t Dt = teacher.info.model.d_model, Ds = info.model.d_model;
    Generator gen(0x5eedull ^ uint64_t(Dt * 131 + Ds));
    projection = randn({Dt, Ds}, gen, 0.0, 1.0 / std::sqrt(double(Ds)), info.model.dtype);
    if (Dt == Ds)
      for (int64_t o = 0; o < Dt; ++o)
        for (int64_t k = 0; k < Ds; ++k) projection.set_item({o, k}, double(o == k));
    projection_grad = Tensor::zeros({Dt, Ds}, info.model.dtype);
  }
}

std::vector<nn::NamedParameter> TeacherRun::extra() {
  if (!projection.defined()) return {};
  return {{"distill.projection", &projection, &projection_grad}};
}

train::GradientFn TeacherRun::gradients(train::TaskModel& student) {
  return train::Distiller{student, *teacher.model, settings, projection.defined() ? &projection : nullptr,
                          projection.defined() ? &projection_grad : nullptr};
}

void TeacherRun::resume(const std::string& dir, train::TaskModel& student, const train::Checkpoint& student_info,
                        train::TrainState& state) {
  std::ifstream in(dir + "/distill.json");
  const nlohmann::json d = nlohmann::json::parse(in, nullptr, false);
  if (!d.is_object())
    throw ValueError(std::string("[") + kFn + "] --resume: expected a folder written by mha distill (" + dir +
                     "/distill.json); got none");
  settings = {.temperature = d.at("temperature"), .alpha = d.at("alpha"), .attention_weight = d.at("attention_weight"),
              .hidden_weight = d.at("hidden_weight")};
  check_student(student, student_info);
  if (d.value("teacher_save_id", "") != save_id)
    throw ValueError(std::string("[") + kFn + "] --teacher: expected the teacher the run started with (" +
                     d.value("teacher", "?") + ", save " + d.value("teacher_save_id", "?") + "); got " + teacher_dir +
                     ", save " + save_id);
  if (!projection.defined()) return;
  const io::SafetensorsFile f = io::load_safetensors(dir + "/distill.safetensors");
  for (const char* name : {"projection", "exp_avg.projection", "exp_avg_sq.projection"})
    if (!f.tensors.count(name) || f.tensors.at(name).shape() != projection.shape())
      throw ValueError(std::string("[") + kFn + "] " + dir + "/distill.safetensors: expected " + name + " " +
                       shape_string(projection.shape()) + "; got none of that shape");
  projection.copy_(f.tensors.at("projection"));
  state.exp_avg.push_back(f.tensors.at("exp_avg.projection"));
  state.exp_avg_sq.push_back(f.tensors.at("exp_avg_sq.projection"));
}

train::TrainState TeacherRun::save(const std::string& dir, const train::TrainState& s) {
  train::TrainState student = s;
  if (projection.defined()) {
    student.exp_avg.pop_back(), student.exp_avg_sq.pop_back();
    io::save_safetensors(dir + "/distill.safetensors",
                         {{"projection", projection}, {"exp_avg.projection", s.exp_avg.back()},
                          {"exp_avg_sq.projection", s.exp_avg_sq.back()}},
                         {{"format", "mha-distill-state"}});
  }
  const nlohmann::json d = {{"teacher", teacher_dir}, {"teacher_save_id", save_id},
                            {"temperature", settings.temperature}, {"alpha", settings.alpha},
                            {"attention_weight", settings.attention_weight}, {"hidden_weight", settings.hidden_weight}};
  io::write_file_atomically(dir + "/distill.json", d.dump(2) + "\n");
  return student;
}

std::string TeacherRun::describe(int64_t student_parameters, double heldout) const {
  int64_t n = 0;
  for (const nn::NamedParameter& p : teacher.model->named_parameters()) n += p.value->numel();
  char line[512], attention[64] = "", hidden[64] = "";
  if (settings.attention_weight > 0)
    std::snprintf(attention, sizeof attention, ", attention transfer x%g", settings.attention_weight);
  if (settings.hidden_weight > 0) std::snprintf(hidden, sizeof hidden, ", hidden transfer x%g", settings.hidden_weight);
  std::snprintf(line, sizeof line,
                "mha distill: teacher %s (%lld parameters, held-out exact match %s); student %.2fx its parameters; "
                "temperature %g, alpha %g%s%s",
                teacher_dir.c_str(), (long long)n, percent(heldout).c_str(), double(student_parameters) / double(n),
                settings.temperature, settings.alpha, attention, hidden);
  return line;
}

}  // namespace mha::tools
