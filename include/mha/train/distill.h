// Knowledge distillation: a student learns from a trained teacher's outputs
// (Hinton, Vinyals and Dean 2015), optionally from its last layer's attention
// (MiniLM, Wang et al. 2020) and its hidden states (TinyBERT, Jiao et al. 2020).
//
// Over the R target rows of a batch (those with a label; the others ignored),
//   p = softmax(z_teacher / T),  q = softmax(z_student / T),
//   L = α·T²·(1/R)·Σ_rows KL(p ‖ q) + (1 − α)·CE(z_student, y)
//       + β_a·KL_attention + β_h·MSE_hidden
//   ∂L/∂z_student = α·T·(q − p)/R + (1 − α)·(softmax(z_student) − onehot(y))/R
// (T² keeps the soft targets' gradient on the scale of the hard ones' as T
// grows). KL_attention: the mean over query rows (every non-padding row) of
// KL(A_teacher ‖ A_student) of the last layer's self-attention, head by head
// when the counts agree, else of each model's mean over its heads. MSE_hidden:
// the mean over the R rows and the teacher's width of (h_teacher − W h_student)²,
// W (D_teacher, D_student) learned with the student (the identity at the start
// when the widths agree). The teacher runs in eval mode, without gradients.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "mha/tensor.h"
#include "mha/train/trainer.h"

namespace mha::train {

struct DistillConfig {
  double temperature = 1.0;       // T > 0 (T = 2 slowed students on addition: docs/compression.md)
  double alpha = 0.5;             // in [0, 1]: the soft targets' share
  double attention_weight = 0.0;  // β_a ≥ 0 (0: no attention transfer)
  double hidden_weight = 0.0;     // β_h ≥ 0 (0: no hidden transfer)
};

struct LogitDistillation {
  double loss = 0, kd = 0, ce = 0;  // loss = α·T²·kd + (1 − α)·ce
  Tensor dlogits;                   // ∂loss/∂student logits
  int64_t count = 0, correct = 0;   // target rows, the student's right argmaxes
};
// student and teacher logits (…, V), targets (…) int64 with ignore_index.
LogitDistillation distillation_loss(const Tensor& student_logits, const Tensor& teacher_logits, const Tensor& targets,
                                    double temperature, double alpha, int64_t ignore_index = -100);

// KL(teacher ‖ student) of attention weights (B, Hs, L, S) against (B, Ht, L, S)
// over the query rows where rows (B, L) bool is true: its value and, into
// *dstudent, its gradient with respect to the student's weights.
double attention_transfer(const Tensor& student, const Tensor& teacher, const Tensor& rows, Tensor* dstudent);

// MSE(h_teacher, h_student Wᵀ) over the rows (B, L) marked true: its value and
// the gradients into *dhidden (B, L, Ds) and *dprojection (Dt, Ds).
double hidden_transfer(const Tensor& student_hidden, const Tensor& teacher_hidden, const Tensor& projection,
                       const Tensor& rows, Tensor* dhidden, Tensor* dprojection);

// One distillation step's gradients (train()'s GradientFn): the student's
// and, with hidden transfer, the projection's (*projection_grad, added).
// Decoder-only and encoder models (student and teacher of one architecture).
struct Distiller {
  TaskModel& student;
  TaskModel& teacher;
  DistillConfig config;
  Tensor* projection = nullptr;       // W, with hidden transfer
  Tensor* projection_grad = nullptr;  // its gradient
  StepLoss operator()(const std::vector<Example>& examples, int64_t micro_batch) const;
};

// Refuses a teacher and a student that cannot be distilled (another
// architecture than decoder or encoder, or than each other; another
// vocabulary) and a config out of range: ValueError naming `fn`.
void check_distillation(TaskModel& student, TaskModel& teacher, int64_t student_vocab, int64_t teacher_vocab,
                        const DistillConfig& config, const char* fn);

}  // namespace mha::train
