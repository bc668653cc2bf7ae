// The `mha` command-line program.
#include <exception>
#include <iostream>

#include <CLI/CLI.hpp>

#include "demo.h"
#include "mha/mha.h"

int main(int argc, char** argv) {
  CLI::App app{"mha: multi-head attention on the CPU"};
  app.set_version_flag("--version", std::string(mha::version));
  app.require_subcommand(1);

  mha::tools::DemoOptions demo;
  CLI::App* demo_cmd = app.add_subcommand("demo", "Self-attention over a short sentence; prints each head's weights");
  demo_cmd->add_option("--tokens", demo.tokens, "The tokens of the sentence")->capture_default_str();
  demo_cmd->add_option("--embed-dim", demo.embed_dim, "Model dimension")->capture_default_str();
  demo_cmd->add_option("--heads", demo.num_heads, "Number of heads")->capture_default_str();
  demo_cmd->add_option("--seed", demo.seed, "Random seed")->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  try {
    if (demo_cmd->parsed()) mha::tools::run_demo(demo, std::cout);
  } catch (const std::exception& e) {
    std::cerr << "mha: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
