// Fuzzes the checkpoint config: any text is refused with FormatError or
// parses; the model a parsed config describes is built or refused with a
// typed error (a memory limit keeps huge models quick to refuse).
#include <cstdint>
#include <string>

#include "fuzz.h"
#include "mha/memory.h"
#include "mha/random.h"
#include "mha/train/checkpoint.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  mha::set_memory_limit(int64_t(64) << 20);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::refusals_allowed([&] {
    const train::Checkpoint info = train::parse_checkpoint_config(text, "config.json");
    // Models past 2^22 parameters take long to initialise, not to refuse: skip those.
    const nn::LanguageModelConfig& m = info.model;
    const double width = double(m.d_model) * double(m.d_model + m.dim_feedforward + m.vocab_size);
    if (width * double(m.num_layers + info.num_encoder_layers + 1) > double(1 << 22)) return;
    Generator gen(0);
    train::make_task_model(info.architecture, info.model, info.num_encoder_layers, gen);
  });
  return 0;
}
