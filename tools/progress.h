// What `mha train` shows and writes while it trains: a live progress line on
// a terminal (plain lines at each evaluation otherwise), the rows of
// metrics.csv, and summary.json.
#pragma once

#include <sstream>
#include <string>

#include "mha/train/trainer.h"

namespace mha::tools {

// A fraction as a percentage with one decimal, rounded down: a score short of
// perfect never reads "100.0%" (0.9996 reads 99.9%).
std::string percent(double fraction);

class ProgressReport {
 public:
  // earlier_metrics: the metrics.csv of a run being resumed ("" for a new run).
  explicit ProgressReport(const std::string& earlier_metrics = "");
  void operator()(const train::TrainProgress& p);
  std::string metrics_csv() const { return metrics_.str(); }

 private:
  bool tty_;
  std::ostringstream metrics_;
};

// DIR/summary.json: task, steps, heldout_exact_match, train_seconds,
// tokens_per_second, final_loss, parameters.
// baseline >= 0: also "heldout_majority_answer", the held-out exact match of always
// giving the most common answer (one-token tasks: ListOps).
void write_summary(const std::string& dir, const std::string& task, const train::TrainResult& r, int64_t parameters,
                   double baseline = -1);

}  // namespace mha::tools
