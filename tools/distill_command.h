// What `mha distill` adds to `mha train` (train_command.cpp runs both): the
// teacher and what distilling from it trains and saves beside the student.
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include "mha/train/checkpoint.h"
#include "mha/train/distill.h"

namespace mha::tools {

struct TeacherRun {
  // Loads the teacher (eval mode) from its checkpoint folder.
  TeacherRun(const std::string& dir, const train::DistillConfig& config);
  // Refuses a student of another task, architecture or vocabulary (typed
  // errors), then makes the hidden-transfer projection when asked for.
  void check_student(train::TaskModel& student, const train::Checkpoint& student_info);
  // The projection as a parameter trained beside the student (none without hidden transfer).
  std::vector<nn::NamedParameter> extra();
  train::GradientFn gradients(train::TaskModel& student);
  // --resume: distill.json's settings (the same teacher required), the
  // student checked against the teacher, and the projection with its
  // moments, appended to the state's.
  void resume(const std::string& dir, train::TaskModel& student, const train::Checkpoint& student_info,
              train::TrainState& state);
  // Writes distill.json (and distill.safetensors: the projection, its
  // moments) into dir; returns the student's part of the state.
  train::TrainState save(const std::string& dir, const train::TrainState& state);
  std::string describe(int64_t student_parameters, double teacher_heldout) const;

  std::string teacher_dir;
  train::DistillConfig settings;
  train::LoadedCheckpoint teacher;
  std::string save_id;
  Tensor projection, projection_grad;
};

}  // namespace mha::tools
