// Task generators: inputs drawn from Philox streams, held-out examples kept
// in a set so that training never sees them.
#include "mha/train/tasks.h"

#include <algorithm>
#include <optional>

#include "check.h"

namespace mha::train {

namespace {

int64_t uniform_int(Generator& gen, int64_t lo, int64_t hi) {  // inclusive
  const double u = gen.next_uniform();
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

// A ListOps expression of exactly `budget` tokens appended to `out`. A digit
// is one token and an operator with k operands 2 + Σ their tokens, so a
// budget of 2 has no expression: the operands' budgets are each 1 or >= 3.
// k is drawn in [2, max_args]; what the k digits leave is shared among
// randomly chosen nested operands (each taking 2 more, then random shares);
// a leftover of 1 becomes one more digit. At max_depth the operands are
// digits only.
void listops_expression(int64_t budget, int64_t depth, const TaskConfig& c, Generator& gen, std::vector<int64_t>& out) {
  if (budget == 1) {
    out.push_back(uniform_int(gen, 0, 9));
    return;
  }
  out.push_back(kMax + uniform_int(gen, 0, 3));
  const int64_t inner = budget - 2;
  int64_t k = depth + 1 >= c.max_depth ? inner : std::min(inner, uniform_int(gen, 2, c.max_args));
  int64_t extra = inner - k;
  if (extra == 1) ++k, extra = 0;
  std::vector<int64_t> budgets(size_t(k), 1);
  if (extra > 0) {
    const int64_t nested = uniform_int(gen, 1, std::min(k, extra / 2));
    std::vector<int64_t> which(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) which[size_t(i)] = i;
    for (int64_t i = 0; i < nested; ++i) std::swap(which[size_t(i)], which[size_t(uniform_int(gen, i, k - 1))]);
    extra -= 2 * nested;
    for (int64_t i = 0; i < nested; ++i) budgets[size_t(which[size_t(i)])] += 2;
    // The rest in random shares: cut points drawn in [0, extra].
    std::vector<int64_t> cuts{0, extra};
    for (int64_t i = 1; i < nested; ++i) cuts.push_back(uniform_int(gen, 0, extra));
    std::sort(cuts.begin(), cuts.end());
    for (int64_t i = 0; i < nested; ++i) budgets[size_t(which[size_t(i)])] += cuts[size_t(i + 1)] - cuts[size_t(i)];
  }
  for (int64_t b : budgets) listops_expression(b, depth + 1, c, gen, out);
  out.push_back(kClose);
}

}  // namespace

int64_t evaluate_listops(const std::vector<int64_t>& tokens) {
  const char* fn = "mha::train::evaluate_listops";
  std::vector<std::vector<int64_t>> stack;  // operands so far of each open operator
  std::vector<int64_t> ops;
  std::optional<int64_t> result;
  for (int64_t t : tokens) {
    if (result) raise<ValueError>(fn, "tokens", "one expression", "tokens after its end");
    if (t >= kMax && t <= kSumMod) {
      ops.push_back(t);
      stack.emplace_back();
      continue;
    }
    int64_t value = t;
    if (t == kClose) {
      if (ops.empty() || stack.back().empty()) raise<ValueError>(fn, "tokens", "']' closing an operator with operands", "a stray ']'");
      std::vector<int64_t> v = std::move(stack.back());
      stack.pop_back();
      std::sort(v.begin(), v.end());
      const size_t n = v.size();
      int64_t sum = 0;
      for (int64_t x : v) sum += x;
      value = ops.back() == kMax ? v.back() : ops.back() == kMin ? v.front()
            : ops.back() == kMed ? (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2)
                                 : sum % 10;
      ops.pop_back();
    } else if (t < 0 || t > 9) {
      raise<ValueError>(fn, "tokens", "digits, operators and ']'", "token " + std::to_string(t));
    }
    if (stack.empty()) result = value;
    else stack.back().push_back(value);
  }
  if (!result) raise<ValueError>(fn, "tokens", "a complete expression", "an unclosed one");
  return *result;
}

Task parse_task(const std::string& name) {
  if (name == "copy") return Task::copy;
  if (name == "reverse") return Task::reverse;
  if (name == "sort") return Task::sort;
  if (name == "add") return Task::add;
  if (name == "listops") return Task::listops;
  raise<ValueError>("mha::train::parse_task", "task", "copy, reverse, sort, add or listops", "'" + name + "'");
}

std::string to_string(Task task) {
  switch (task) {
    case Task::copy: return "copy";
    case Task::reverse: return "reverse";
    case Task::sort: return "sort";
    case Task::add: return "add";
    case Task::listops: return "listops";
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
  if (c.task == Task::listops && c.max_args < 2) raise<ValueError>(fn, "max_args", ">= 2", std::to_string(c.max_args));
  if (c.task == Task::listops && c.max_depth < 1) raise<ValueError>(fn, "max_depth", ">= 1", std::to_string(c.max_depth));
  Generator gen(seed ^ 0x5eedf00dULL);
  for (int64_t tries = 0; int64_t(heldout_.size()) < c.heldout && tries < 100 * c.heldout; ++tries) {
    Example e = draw(gen);
    if (heldout_keys_.insert(key_of(e)).second) heldout_.push_back(std::move(e));
  }
}

Example TaskData::draw(Generator& gen) const {
  Example e;
  if (config_.task == Task::listops) {
    int64_t length = uniform_int(gen, config_.min_length, config_.max_length);
    if (length == 2) length = 3;  // no expression has 2 tokens
    listops_expression(length, 0, config_, gen, e.input);
    e.output = {evaluate_listops(e.input)};
    return e;
  }
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

int64_t max_sequence(const TaskConfig& c) {
  if (c.task == Task::add) return 1 + (2 * c.digits + 1) + 1 + (c.digits + 1) + 1;
  if (c.task == Task::listops) return 3 + std::max<int64_t>(c.max_length, 3) + 1;
  return 3 + 2 * c.max_length;
}

int64_t output_length(const TaskConfig& c, const std::vector<int64_t>& input) {
  switch (c.task) {
    case Task::add: return c.reversed_sum ? c.digits + 1 : -1;
    case Task::listops: return 1;
    default: return int64_t(input.size());
  }
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

Batch make_encoder_batch(const std::vector<Example>& examples, int64_t multiple) {
  if (multiple < 1) raise<ValueError>("mha::train::make_encoder_batch", "multiple", ">= 1", std::to_string(multiple));
  Batch b;
  b.rows = int64_t(examples.size());
  for (const Example& e : examples) b.length = std::max<int64_t>(b.length, int64_t(e.input.size() + e.output.size()) + 2);
  b.length = (b.length + multiple - 1) / multiple * multiple;
  b.ids.assign(size_t(b.rows * b.length), kPad);
  b.targets.assign(size_t(b.rows * b.length), -100);
  for (int64_t r = 0; r < b.rows; ++r) {
    const Example& e = examples[size_t(r)];
    auto row = b.ids.begin() + r * b.length;
    *row = kBos;
    std::copy(e.input.begin(), e.input.end(), row + 1);
    const int64_t first_output = int64_t(e.input.size()) + 2;
    row[first_output - 1] = kSep;
    std::fill(row + first_output, row + first_output + int64_t(e.output.size()), kMask);
    std::copy(e.output.begin(), e.output.end(), b.targets.begin() + r * b.length + first_output);
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

namespace {
// Names of the tokens after the digits, in id order (PAD shows as "_").
constexpr const char* kTokenNames[] = {"_", "<s>", "=", "+", "</s>", "?", "[MAX", "[MIN", "[MED", "[SM", "]"};
}  // namespace

std::string format_tokens(const std::vector<int64_t>& tokens) {
  std::string s;
  for (int64_t t : tokens) {
    if (!s.empty()) s += ' ';
    s += t >= 0 && t < 10 ? std::string(1, char('0' + t)) : t >= 10 && t < kVocab ? kTokenNames[t - 10] : "_";
  }
  return s;
}

std::vector<int64_t> parse_tokens(const std::string& text, const char* fn) {
  std::vector<int64_t> tokens;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == ' ' || c == ',') {
      ++i;
    } else if (c >= '0' && c <= '9') {
      tokens.push_back(c - '0'), ++i;
    } else if (c == '+' || c == ']') {
      tokens.push_back(c == '+' ? kPlus : kClose), ++i;
    } else {
      bool found = false;
      for (int64_t op = kMax; op <= kSumMod && !found; ++op) {
        const std::string name = kTokenNames[op - 10];
        if (text.compare(i, name.size(), name) == 0) tokens.push_back(op), i += name.size(), found = true;
      }
      if (!found) {
        std::string got(1, '\'');  // built by appending: g++ 12 warns (-Wrestrict) on "'" + substr
        got.append(text, i, 8).push_back('\'');
        raise<ValueError>(fn, "input", "digits, '+', [MAX, [MIN, [MED, [SM and ']' separated by spaces", got);
      }
    }
  }
  if (tokens.empty()) raise<ValueError>(fn, "input", "at least one token", "none");
  return tokens;
}

}  // namespace mha::train
