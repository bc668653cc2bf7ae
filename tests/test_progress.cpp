// `mha train`'s progress line: a score short of perfect never reads 100%.
#include <gtest/gtest.h>

#include "progress.h"

using mha::tools::percent;

TEST(Progress, PercentRoundsDownToOneDecimal) {
  EXPECT_EQ(percent(1.0), "100.0%");
  EXPECT_EQ(percent(0.9996), "99.9%");
  EXPECT_EQ(percent(255.0 / 256), "99.6%");
  EXPECT_EQ(percent(0.29), "29.0%");  // 0.29 · 1000 is 289.99…97 in double
  EXPECT_EQ(percent(1.0 / 256), "0.3%");
  EXPECT_EQ(percent(0.0), "0.0%");
  for (int n : {7, 100, 256, 1000, 4096})
    for (int k = 0; k < n; ++k) EXPECT_NE(percent(double(k) / n), "100.0%") << k << "/" << n;
}

TEST(Progress, TheLineShowsAHeldOutScoreShortOfPerfectAsItIs) {
  mha::tools::ProgressReport report;
  testing::internal::CaptureStdout();
  report({.step = 10, .steps = 20, .loss = 0.1, .token_accuracy = 0.999, .tokens_per_second = 1000,
          .elapsed_seconds = 1, .heldout_exact_match = 255.0 / 256});
  const std::string line = testing::internal::GetCapturedStdout();
  EXPECT_NE(line.find("held-out 99.6%"), std::string::npos) << line;
}
