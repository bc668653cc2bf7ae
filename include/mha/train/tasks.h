// Toy sequence tasks with generated data and a held-out split that never
// overlaps the training stream:
//   copy     x1 … xn      → x1 … xn
//   reverse  x1 … xn      → xn … x1
//   sort     x1 … xn      → the digits in ascending order
//   add      a + b        → the digits of a + b (a, b with 1 … digits digits)
//   listops  [MAX 3 [MIN 4 7 ] 1 ]  → 4: a nested expression of MAX, MIN,
//            MED (median; the lower middle's and upper middle's mean,
//            rounded down, for an even count) and SM (sum mod 10) over
//            digits, min_length … max_length tokens long; the answer is one
//            digit (the Long Range Arena's ListOps, generated)
// A sequence for the decoder-only model is  BOS input SEP output EOS, padded
// with PAD; the model is trained to predict each token after SEP. An
// encoder–decoder reads the input as its source and BOS output as its
// target, and is trained to predict output EOS. A (bidirectional) encoder
// reads BOS input SEP MASK … MASK, one MASK per output token, and predicts
// the output at the MASK positions in one pass (make_encoder_batch).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "mha/random.h"

namespace mha::train {

enum class Task { copy, reverse, sort, add, listops };

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
  int64_t max_args = 5;     // listops: most operands of one operator (>= 2)
  int64_t max_depth = 8;    // listops: deepest nesting of operators (>= 1)
};

// Token ids: 0-9 digits, then PAD, BOS, SEP, PLUS, EOS, MASK (an encoder's
// output slot), and ListOps' operators [MAX [MIN [MED [SM and the closing ].
inline constexpr int64_t kPad = 10, kBos = 11, kSep = 12, kPlus = 13, kEos = 14, kMask = 15, kMax = 16, kMin = 17,
                         kMed = 18, kSumMod = 19, kClose = 20, kVocab = 21;

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
  bool in_heldout(const Example& e) const;

 private:
  TaskConfig config_;
  std::vector<Example> heldout_;
  std::unordered_set<std::string> heldout_keys_;
  Example draw(Generator& gen) const;
};

// Longest BOS + input + SEP + output + EOS of the task's examples.
int64_t max_sequence(const TaskConfig& config);
// The output's length for `input`, where the task fixes it (-1 for plain add).
int64_t output_length(const TaskConfig& config, const std::vector<int64_t>& input);

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
// For a bidirectional encoder: ids (B, T) = BOS input SEP MASK×|output|, PAD
// after it, T a multiple of `multiple`; targets (B, T) = the output at the
// MASK positions, -100 elsewhere.
Batch make_encoder_batch(const std::vector<Example>& examples, int64_t multiple = 1);

// The value of a ListOps expression (tokens as above); ValueError when it is
// not one well-formed expression.
int64_t evaluate_listops(const std::vector<int64_t>& tokens);

// Token ids as an int64 tensor (rows, length).
Tensor token_tensor(const std::vector<int64_t>& ids, int64_t rows, int64_t length);

std::string format_tokens(const std::vector<int64_t>& tokens);  // "3 1 4 + 1 5", "[MAX 3 [MIN 4 7 ] 1 ]"
// The inverse for typed inputs: digits, '+', and ListOps' [MAX [MIN [MED [SM ]
// (separated by spaces or commas); ValueError naming `fn` for anything else.
std::vector<int64_t> parse_tokens(const std::string& text, const char* fn);

}  // namespace mha::train
