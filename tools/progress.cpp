// `mha train`'s progress line, metrics.csv and summary.json.
#include "progress.h"

#include "mha/memory.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "mha/io/safetensors.h"

namespace mha::tools {

namespace {

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%d:%02d", int(s) / 60, int(s) % 60);
  return buf;
}

}  // namespace

std::string percent(double fraction) {
  // k/n times 1000 can land just below an integer (0.29 · 1000 = 289.99…97): nudge before the floor.
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", std::floor(fraction * 1000 + 1e-9) / 10);
  return buf;
}

ProgressReport::ProgressReport(const std::string& earlier_metrics) : tty_(isatty(fileno(stdout))) {
  if (earlier_metrics.empty()) metrics_ << "step,loss,token_accuracy,heldout_exact_match,tokens_per_second,elapsed_seconds\n";
  else metrics_ << earlier_metrics;
}

void ProgressReport::operator()(const train::TrainProgress& p) {
  metrics_ << p.step << ',' << p.loss << ',' << p.token_accuracy << ','
           << (p.heldout_exact_match >= 0 ? std::to_string(p.heldout_exact_match) : "") << ',' << p.tokens_per_second
           << ',' << p.elapsed_seconds << '\n';
  const double eta = p.elapsed_seconds / double(p.step) * double(p.steps - p.step);
  const std::string heldout =
      p.heldout_exact_match >= 0 ? "  held-out " + percent(p.heldout_exact_match) : "";
  char line[256];
  std::snprintf(line, sizeof line, "step %5lld/%lld  loss %.4f  token acc %5.1f%%  %7.0f tok/s  %s elapsed, ETA %s%s",
                (long long)p.step, (long long)p.steps, p.loss, 100 * p.token_accuracy, p.tokens_per_second,
                seconds_text(p.elapsed_seconds).c_str(), seconds_text(eta).c_str(), heldout.c_str());
  if (tty_) {
    std::printf("\r\033[K%s", line);
    if (p.heldout_exact_match >= 0) std::printf("\n");
    std::fflush(stdout);
  } else if (p.heldout_exact_match >= 0) {
    std::printf("%s\n", line);
    std::fflush(stdout);  // a pipe or file sees each line as it comes
  }
}

void write_summary(const std::string& dir, const std::string& task, const train::TrainResult& r, int64_t parameters,
                   double baseline) {
  std::ostringstream summary;
  summary << "{\n  \"task\": \"" << task << "\",\n  \"steps\": " << r.steps << ",\n  \"heldout_exact_match\": "
          << r.heldout_exact_match << ",\n  \"heldout_token_accuracy\": " << r.heldout_token_accuracy
          << ",\n  \"peak_tensor_bytes\": " << peak_memory() << ",\n  \"train_seconds\": " << r.train_seconds << ",\n  \"tokens_per_second\": "
          << r.tokens_per_second << (baseline >= 0 ? ",\n  \"heldout_majority_answer\": " + std::to_string(baseline) : "")
          << ",\n  \"final_loss\": " << r.final_loss << ",\n  \"parameters\": " << parameters
          << "\n}\n";
  io::write_file_atomically(dir + "/summary.json", summary.str());
}

}  // namespace mha::tools
