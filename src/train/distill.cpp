// Distillation losses and one distillation step (distill.h).
#include "mha/train/distill.h"

#include <algorithm>
#include <cmath>

#include "check.h"
#include "mha/nn/language_model.h"
#include "mha/nn/loss.h"

namespace mha::train {

namespace {

void check_float(const Tensor& t, const char* fn, const char* name) {
  check_defined(t, fn, name);
  if (t.dtype() != DType::float32 && t.dtype() != DType::float64)
    raise<DtypeError>(fn, name, "float32 or float64", to_string(t.dtype()));
}

// rows (B, L) bool as a vector of flags.
std::vector<bool> row_flags(const Tensor& rows, int64_t B, int64_t L, const char* fn) {
  check_defined(rows, fn, "rows");
  if (rows.dtype() != DType::boolean || rows.shape() != Shape{B, L})
    raise<ShapeError>(fn, "rows", "bool (B, L) = " + shape_string({B, L}), describe(rows));
  const std::vector<double> v = rows.to_vector();
  return {v.begin(), v.end()};
}

// into += t · factor.
void add_scaled(Tensor& into, const Tensor& t, double factor) {
  const std::vector<double> v = t.contiguous().to_vector();
  for (int64_t i = 0; i < into.numel(); ++i)
    if (into.dtype() == DType::float64) into.data<double>()[i] += v[size_t(i)] * factor;
    else into.data<float>()[i] += float(v[size_t(i)] * factor);
}

// The rows of a batch that hold a token (not padding), (B, L) bool.
Tensor token_rows(const Batch& b) {
  std::vector<bool> flags;
  for (int64_t id : b.ids) flags.push_back(id != kPad);
  return Tensor::from_bools(flags, {b.rows, b.length});
}

}  // namespace

LogitDistillation distillation_loss(const Tensor& student, const Tensor& teacher, const Tensor& targets, double T,
                                    double alpha, int64_t ignore_index) {
  const char* fn = "mha::train::distillation_loss";
  check_float(student, fn, "student_logits");
  check_float(teacher, fn, "teacher_logits");
  if (teacher.shape() != student.shape())
    raise<ShapeError>(fn, "teacher_logits", "the student's shape " + shape_string(student.shape()),
                      shape_string(teacher.shape()));
  if (!(T > 0 && std::isfinite(T))) raise<ValueError>(fn, "temperature", "finite and > 0", std::to_string(T));
  if (!(alpha >= 0 && alpha <= 1)) raise<ValueError>(fn, "alpha", "in [0, 1]", std::to_string(alpha));
  const nn::CrossEntropyResult ce = nn::cross_entropy(student, targets, {.ignore_index = ignore_index});
  LogitDistillation r{.ce = ce.loss, .count = ce.count, .correct = ce.correct};
  const int64_t V = student.size(-1), rows = student.numel() / V;
  const std::vector<double> s = student.contiguous().to_vector(), t = teacher.contiguous().to_vector();
  const std::vector<double> y = targets.contiguous().to_vector(), dce = ce.dlogits.contiguous().to_vector();
  std::vector<double> d(size_t(rows * V), 0.0), p(static_cast<size_t>(V)), q(static_cast<size_t>(V));
  const double R = double(std::max<int64_t>(ce.count, 1));
  // softmax(z / T) of one row into out, in float64; returns log Σ exp.
  const auto soft = [&](const double* z, std::vector<double>& out) {
    double m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, z[v] / T);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += out[size_t(v)] = std::exp(z[v] / T - m);
    for (double& x : out) x /= sum;
    return m + std::log(sum);
  };
  double kl = 0;
  for (int64_t row = 0; row < rows; ++row) {
    if (int64_t(y[size_t(row)]) == ignore_index) continue;
    const double *zs = &s[size_t(row * V)], *zt = &t[size_t(row * V)];
    const double ls = soft(zs, q), lt = soft(zt, p);
    for (int64_t v = 0; v < V; ++v) {
      const size_t i = size_t(v);
      // p log p − p log q with log p = zt/T − lt, log q = zs/T − ls (no log of 0).
      if (p[i] > 0) kl += p[i] * ((zt[v] / T - lt) - (zs[v] / T - ls));
      d[size_t(row * V + v)] = alpha * T * (q[i] - p[i]) / R;
    }
  }
  r.kd = kl / R;
  r.loss = alpha * T * T * r.kd + (1 - alpha) * ce.loss;
  for (size_t i = 0; i < d.size(); ++i) d[i] += (1 - alpha) * dce[i];
  r.dlogits = Tensor::from_values(d, student.shape(), student.dtype());
  return r;
}

double attention_transfer(const Tensor& student, const Tensor& teacher, const Tensor& rows, Tensor* dstudent) {
  const char* fn = "mha::train::attention_transfer";
  check_float(student, fn, "student");
  check_float(teacher, fn, "teacher");
  if (student.dim() != 4 || teacher.dim() != 4 || teacher.size(0) != student.size(0) ||
      teacher.size(2) != student.size(2) || teacher.size(3) != student.size(3))
    raise<ShapeError>(fn, "teacher", "(B, H, L, S) weights with the student's B, L, S " + shape_string(student.shape()),
                      shape_string(teacher.shape()));
  const int64_t B = student.size(0), Hs = student.size(1), Ht = teacher.size(1), L = student.size(2), S = student.size(3);
  const std::vector<bool> use = row_flags(rows, B, L, fn);
  const std::vector<double> a = student.contiguous().to_vector(), b = teacher.contiguous().to_vector();
  // Head pairs: h against h, or each model's mean over its heads (one pair).
  const bool paired = Hs == Ht;
  const int64_t pairs = paired ? Hs : 1;
  int64_t R = 0;
  for (bool u : use) R += u;
  std::vector<double> d(a.size(), 0.0), q(static_cast<size_t>(S)), p(static_cast<size_t>(S));
  double total = 0;
  if (R == 0 || pairs == 0 || Ht == 0) {
    if (dstudent) *dstudent = Tensor::zeros(student.shape(), student.dtype());
    return 0.0;
  }
  const double scale = 1.0 / double(R * pairs);
  for (int64_t n = 0; n < B; ++n)
    for (int64_t i = 0; i < L; ++i) {
      if (!use[size_t(n * L + i)]) continue;
      for (int64_t pair = 0; pair < pairs; ++pair) {
        std::fill(q.begin(), q.end(), 0.0), std::fill(p.begin(), p.end(), 0.0);
        const auto add_rows = [&](const std::vector<double>& w, int64_t H, std::vector<double>& out) {
          const int64_t first = paired ? pair : 0, last = paired ? pair + 1 : H;
          for (int64_t h = first; h < last; ++h)
            for (int64_t j = 0; j < S; ++j) out[size_t(j)] += w[size_t(((n * H + h) * L + i) * S + j)] / double(last - first);
        };
        add_rows(a, Hs, q);
        add_rows(b, Ht, p);
        for (int64_t j = 0; j < S; ++j) {
          const double pj = p[size_t(j)], qj = std::max(q[size_t(j)], 1e-12);
          if (pj <= 0) continue;
          total += scale * pj * (std::log(pj) - std::log(qj));
          // ∂/∂q_j of −p_j log q_j, spread over the student's heads of this pair.
          const int64_t first = paired ? pair : 0, last = paired ? pair + 1 : Hs;
          for (int64_t h = first; h < last; ++h)
            d[size_t(((n * Hs + h) * L + i) * S + j)] -= scale * pj / qj / double(last - first);
        }
      }
    }
  if (dstudent) *dstudent = Tensor::from_values(d, student.shape(), student.dtype());
  return total;
}

double hidden_transfer(const Tensor& hs_in, const Tensor& ht_in, const Tensor& w_in, const Tensor& rows, Tensor* dhidden,
                       Tensor* dprojection) {
  const char* fn = "mha::train::hidden_transfer";
  check_float(hs_in, fn, "student_hidden");
  check_float(ht_in, fn, "teacher_hidden");
  check_float(w_in, fn, "projection");
  if (hs_in.dim() != 3 || ht_in.dim() != 3 || ht_in.size(0) != hs_in.size(0) || ht_in.size(1) != hs_in.size(1))
    raise<ShapeError>(fn, "teacher_hidden", "(B, L, Dt) with the student's B, L " + shape_string(hs_in.shape()),
                      shape_string(ht_in.shape()));
  const int64_t B = hs_in.size(0), L = hs_in.size(1), Ds = hs_in.size(2), Dt = ht_in.size(2);
  if (w_in.shape() != Shape{Dt, Ds})
    raise<ShapeError>(fn, "projection", "(Dt, Ds) = " + shape_string({Dt, Ds}), shape_string(w_in.shape()));
  const std::vector<bool> use = row_flags(rows, B, L, fn);
  const std::vector<double> hs = hs_in.contiguous().to_vector(), ht = ht_in.contiguous().to_vector(),
                            w = w_in.contiguous().to_vector();
  int64_t R = 0;
  for (bool u : use) R += u;
  std::vector<double> dh(hs.size(), 0.0), dw(w.size(), 0.0);
  double total = 0;
  const double scale = R > 0 ? 1.0 / double(R * Dt) : 0.0;
  for (int64_t r = 0; r < B * L; ++r) {
    if (!use[size_t(r)]) continue;
    const double* x = &hs[size_t(r * Ds)];
    for (int64_t o = 0; o < Dt; ++o) {
      double y = 0;
      for (int64_t k = 0; k < Ds; ++k) y += w[size_t(o * Ds + k)] * x[k];
      const double diff = y - ht[size_t(r * Dt + o)];
      total += scale * diff * diff;
      const double g = 2 * scale * diff;  // ∂/∂y
      for (int64_t k = 0; k < Ds; ++k) {
        dh[size_t(r * Ds + k)] += g * w[size_t(o * Ds + k)];
        dw[size_t(o * Ds + k)] += g * x[k];
      }
    }
  }
  if (dhidden) *dhidden = Tensor::from_values(dh, hs_in.shape(), hs_in.dtype());
  if (dprojection) *dprojection = Tensor::from_values(dw, w_in.shape(), w_in.dtype());
  return total;
}

void check_distillation(TaskModel& student, TaskModel& teacher, int64_t student_vocab, int64_t teacher_vocab,
                        const DistillConfig& c, const char* fn) {
  for (auto [model, name] : {std::pair{&student, "student"}, {&teacher, "teacher"}})
    if (!language_model(*model))
      raise<ValueError>(fn, name, "a decoder-only or encoder model", to_string(model->architecture()));
  if (student.architecture() != teacher.architecture())
    raise<ValueError>(fn, "student", "the teacher's architecture, " + to_string(teacher.architecture()),
                      to_string(student.architecture()));
  if (student_vocab != teacher_vocab)
    raise<ValueError>(fn, "teacher", "the student's vocabulary of " + std::to_string(student_vocab) + " tokens",
                      std::to_string(teacher_vocab) + " tokens");
  if (!(c.temperature > 0 && std::isfinite(c.temperature)))
    raise<ValueError>(fn, "temperature", "finite and > 0", std::to_string(c.temperature));
  if (!(c.alpha >= 0 && c.alpha <= 1)) raise<ValueError>(fn, "alpha", "in [0, 1]", std::to_string(c.alpha));
  if (!(c.attention_weight >= 0)) raise<ValueError>(fn, "attention_weight", ">= 0", std::to_string(c.attention_weight));
  if (!(c.hidden_weight >= 0)) raise<ValueError>(fn, "hidden_weight", ">= 0", std::to_string(c.hidden_weight));
}

StepLoss Distiller::operator()(const std::vector<Example>& examples, int64_t micro) const {
  nn::LanguageModel &s = *language_model(student), &t = *language_model(teacher);
  const bool attend = config.attention_weight > 0, hide = config.hidden_weight > 0;
  int64_t total = 0;
  const std::vector<Batch> batches = micro_batches(student, examples, micro, total);
  StepLoss r;
  student.zero_grad();
  for (const Batch& b : batches) {
    const Tensor ids = token_tensor(b.ids, b.rows, b.length), targets = token_tensor(b.targets, b.rows, b.length);
    const Tensor teacher_logits = t.forward(ids, attend).clone();
    const Tensor teacher_weights = attend ? t.attention_weights().back() : Tensor();
    const Tensor teacher_hidden = t.last_hidden();
    t.release_activations();
    const Tensor logits = s.forward(ids, attend);
    LogitDistillation ld = distillation_loss(logits, teacher_logits, targets, config.temperature, config.alpha);
    const double share = total ? double(ld.count) / double(total) : 0.0;
    double loss = ld.loss;
    const Tensor rows = token_rows(b);
    std::vector<Tensor> dweights;
    if (attend) {
      Tensor d;
      loss += config.attention_weight * attention_transfer(s.attention_weights().back(), teacher_weights, rows, &d);
      dweights.assign(s.attention_weights().size(), Tensor());
      scale_gradient(d, config.attention_weight * share);
      dweights.back() = d;
    }
    Tensor dhidden;
    if (hide) {
      Tensor dh, dw;
      loss += config.hidden_weight * hidden_transfer(s.last_hidden(), teacher_hidden, *projection, rows, &dh, &dw);
      scale_gradient(dh, config.hidden_weight * share);
      dhidden = dh;
      add_scaled(*projection_grad, dw, config.hidden_weight * share);
    }
    scale_gradient(ld.dlogits, share);
    s.backward(ld.dlogits, dhidden, dweights);
    r.loss += loss * share, r.count += ld.count, r.correct += ld.correct, r.tokens += b.rows * b.length;
  }
  return r;
}

}  // namespace mha::train
