// Toy sequence tasks with generated data and a held-out split that never
// overlaps the training stream:
//   copy     x1 … xn      → x1 … xn
//   reverse  x1 … xn      → xn … x1
//   sort     x1 … xn      → the digits in ascending order
//   add      a + b        → the digits of a + b (a, b with 1 … digits digits)
// A sequence for the decoder-only model is  BOS input SEP output EOS, padded
// with PAD; the model is trained to predict each token after SEP. An
// encoder–decoder reads the input as its source and BOS output as its
// target, and is trained to predict output EOS.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "mha/random.h"

namespace mha::train {

enum class Task { copy, reverse, sort, add };

Task parse_task(const std::string& name);  // ValueError for an unknown name
std::string to_string(Task task);

struct TaskConfig {
  Task task = Task::copy;
  int64_t min_length = 10;  // copy/reverse/sort input lengths
  int64_t max_length = 20;
  int64_t digits = 3;       // add: operand digits (at most)
  // add: operands zero-padded to `digits`, the sum written least significant
  // digit first and zero-padded to digits + 1 ("042+917=" → "9590" for 959):
  // each output digit then depends only on digits already seen and the carry
  // just written. false: plain "42+917" → "959", most significant first.
  bool reversed_sum = true;
  int64_t heldout = 256;    // held-out examples
};

// Token ids: 0-9 digits, then PAD, BOS, SEP, PLUS, EOS.
inline constexpr int64_t kPad = 10, kBos = 11, kSep = 12, kPlus = 13, kEos = 14, kVocab = 15;

struct Example {
  std::vector<int64_t> input, output;
};

class TaskData {
 public:
  TaskData(const TaskConfig& config, uint64_t seed);

  const TaskConfig& config() const { return config_; }
  const std::vector<Example>& heldout() const { return heldout_; }
  // A training example never in the held-out set.
  Example sample(Generator& gen) const;
  // Longest BOS + input + SEP + output + EOS.
  int64_t max_sequence() const;
  bool in_heldout(const Example& e) const;

 private:
  TaskConfig config_;
  std::vector<Example> heldout_;
  std::unordered_set<std::string> heldout_keys_;
  Example draw(Generator& gen) const;
};

// Batch tensors for training: ids (B, T) and targets (B, T) with target[t] =
// ids[t+1] on output positions and -100 elsewhere.
struct Batch {
  std::vector<int64_t> ids, targets;
  int64_t rows = 0, length = 0;
  std::vector<int64_t> source;  // encoder–decoder: the inputs (B, S), padded with PAD
  int64_t source_length = 0;
};
Batch make_batch(const std::vector<Example>& examples);
// For an encoder–decoder: source (B, S) = the inputs, ids (B, T) = BOS
// output, targets (B, T) = output EOS; padding is PAD in source and ids, -100
// in targets.
Batch make_seq2seq_batch(const std::vector<Example>& examples);

// Token ids as an int64 tensor (rows, length).
Tensor token_tensor(const std::vector<int64_t>& ids, int64_t rows, int64_t length);

std::string format_tokens(const std::vector<int64_t>& tokens);  // "3 1 4 + 1 5"

}  // namespace mha::train
