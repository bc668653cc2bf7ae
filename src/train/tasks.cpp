// Task generators: inputs drawn from Philox streams, held-out examples kept
// in a set so that training never sees them.
#include "mha/train/tasks.h"

#include <algorithm>

#include "check.h"

namespace mha::train {

namespace {

int64_t uniform_int(Generator& gen, int64_t lo, int64_t hi) {  // inclusive
  const double u = rand_uniform({1}, gen, 0.0, 1.0, DType::float64).item({0});
  return lo + std::min<int64_t>(hi - lo, int64_t(u * double(hi - lo + 1)));
}

std::string key_of(const Example& e) {
  std::string k;
  for (int64_t t : e.input) k.push_back(char('a' + t));
  return k;
}

// The decimal digits of v, most significant first, zero-padded to `width`.
std::vector<int64_t> digits_of(int64_t v, int64_t width = 0) {
  std::vector<int64_t> d;
  do {
    d.push_back(v % 10);
    v /= 10;
  } while (v > 0 || int64_t(d.size()) < width);
  std::reverse(d.begin(), d.end());
  return d;
}

}  // namespace

Task parse_task(const std::string& name) {
  if (name == "copy") return Task::copy;
  if (name == "reverse") return Task::reverse;
  if (name == "sort") return Task::sort;
  if (name == "add") return Task::add;
  raise<ValueError>("mha::train::parse_task", "task", "copy, reverse, sort or add", "'" + name + "'");
}

std::string to_string(Task task) {
  switch (task) {
    case Task::copy: return "copy";
    case Task::reverse: return "reverse";
    case Task::sort: return "sort";
    case Task::add: return "add";
  }
  return "?";
}

TaskData::TaskData(const TaskConfig& c, uint64_t seed) : config_(c) {
  const char* fn = "mha::train::TaskData";
  if (c.min_length < 1 || c.max_length < c.min_length)
    raise<ValueError>(fn, "min_length, max_length", "1 <= min_length <= max_length",
                      std::to_string(c.min_length) + ", " + std::to_string(c.max_length));
  if (c.digits < 1 || c.digits > 9) raise<ValueError>(fn, "digits", "in [1, 9]", std::to_string(c.digits));
  if (c.heldout < 1) raise<ValueError>(fn, "heldout", ">= 1", std::to_string(c.heldout));
  Generator gen(seed ^ 0x5eedf00dULL);
  for (int64_t tries = 0; int64_t(heldout_.size()) < c.heldout && tries < 100 * c.heldout; ++tries) {
    Example e = draw(gen);
    if (heldout_keys_.insert(key_of(e)).second) heldout_.push_back(std::move(e));
  }
}

Example TaskData::draw(Generator& gen) const {
  Example e;
  if (config_.task == Task::add) {
    const int64_t hi = [&] {
      int64_t v = 1;
      for (int64_t i = 0; i < config_.digits; ++i) v *= 10;
      return v - 1;
    }();
    const int64_t a = uniform_int(gen, 0, hi), b = uniform_int(gen, 0, hi);
    const int64_t width = config_.reversed_sum ? config_.digits : 0;
    e.input = digits_of(a, width);
    e.input.push_back(kPlus);
    for (int64_t d : digits_of(b, width)) e.input.push_back(d);
    e.output = digits_of(a + b, config_.reversed_sum ? width + 1 : 0);
    if (config_.reversed_sum) std::reverse(e.output.begin(), e.output.end());
    return e;
  }
  const int64_t n = uniform_int(gen, config_.min_length, config_.max_length);
  for (int64_t i = 0; i < n; ++i) e.input.push_back(uniform_int(gen, 0, 9));
  e.output = e.input;
  if (config_.task == Task::reverse) std::reverse(e.output.begin(), e.output.end());
  if (config_.task == Task::sort) std::sort(e.output.begin(), e.output.end());
  return e;
}

bool TaskData::in_heldout(const Example& e) const { return heldout_keys_.count(key_of(e)) > 0; }

Example TaskData::sample(Generator& gen) const {
  while (true) {
    Example e = draw(gen);
    if (!in_heldout(e)) return e;
  }
}

int64_t TaskData::max_sequence() const {
  if (config_.task == Task::add) return 1 + (2 * config_.digits + 1) + 1 + (config_.digits + 1) + 1;
  return 3 + 2 * config_.max_length;
}

Batch make_batch(const std::vector<Example>& examples) {
  Batch b;
  b.rows = int64_t(examples.size());
  for (const Example& e : examples) b.length = std::max<int64_t>(b.length, int64_t(e.input.size() + e.output.size()) + 3);
  b.ids.assign(size_t(b.rows * b.length), kPad);
  b.targets.assign(size_t(b.rows * b.length), -100);
  for (int64_t r = 0; r < b.rows; ++r) {
    const Example& e = examples[size_t(r)];
    std::vector<int64_t> seq{kBos};
    seq.insert(seq.end(), e.input.begin(), e.input.end());
    seq.push_back(kSep);
    const int64_t first_output = int64_t(seq.size());
    seq.insert(seq.end(), e.output.begin(), e.output.end());
    seq.push_back(kEos);
    for (int64_t t = 0; t < int64_t(seq.size()); ++t) b.ids[size_t(r * b.length + t)] = seq[size_t(t)];
    // Position t predicts token t+1: the output tokens are predicted from SEP onward.
    for (int64_t t = first_output - 1; t + 1 < int64_t(seq.size()); ++t)
      b.targets[size_t(r * b.length + t)] = seq[size_t(t + 1)];
  }
  return b;
}

Batch make_seq2seq_batch(const std::vector<Example>& examples) {
  Batch b;
  b.rows = int64_t(examples.size());
  for (const Example& e : examples) {
    b.source_length = std::max<int64_t>(b.source_length, int64_t(e.input.size()));
    b.length = std::max<int64_t>(b.length, int64_t(e.output.size()) + 1);
  }
  b.source.assign(size_t(b.rows * b.source_length), kPad);
  b.ids.assign(size_t(b.rows * b.length), kPad);
  b.targets.assign(size_t(b.rows * b.length), -100);
  for (int64_t r = 0; r < b.rows; ++r) {
    const Example& e = examples[size_t(r)];
    std::copy(e.input.begin(), e.input.end(), b.source.begin() + r * b.source_length);
    b.ids[size_t(r * b.length)] = kBos;
    std::copy(e.output.begin(), e.output.end(), b.ids.begin() + r * b.length + 1);
    std::copy(e.output.begin(), e.output.end(), b.targets.begin() + r * b.length);
    b.targets[size_t(r * b.length) + e.output.size()] = kEos;
  }
  return b;
}

Tensor token_tensor(const std::vector<int64_t>& ids, int64_t rows, int64_t length) {
  if (int64_t(ids.size()) != rows * length)
    raise<ValueError>("mha::train::token_tensor", "ids", std::to_string(rows * length) + " ids (rows · length)",
                      std::to_string(ids.size()));
  Tensor t = Tensor::empty({rows, length}, DType::int64);
  std::copy(ids.begin(), ids.end(), t.data<int64_t>());
  return t;
}

std::string format_tokens(const std::vector<int64_t>& tokens) {
  std::string s;
  for (int64_t t : tokens) {
    if (!s.empty()) s += ' ';
    s += t < 10 ? std::string(1, char('0' + t)) : t == kPlus ? "+" : t == kSep ? "=" : t == kBos ? "<s>" : t == kEos ? "</s>" : "_";
  }
  return s;
}

}  // namespace mha::train
