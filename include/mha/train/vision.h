// Training a VisionTransformer to classify the 8×8 digits: AdamW, warm-up
// then cosine decay, clipping, ±1-pixel shifts as augmentation; held-out
// accuracy as the metric (TrainResult::heldout_exact_match holds it).
#pragma once

#include <functional>

#include "mha/nn/vision_transformer.h"
#include "mha/train/digits.h"
#include "mha/train/trainer.h"

namespace mha::train {

// Fraction of `images` whose argmax logit is the label (eval mode, batches of 256).
double classification_accuracy(nn::VisionTransformer& model, const DigitImages& images);

// TrainConfig's steps, batch_size, lr, min_lr, warmup, clip, weight_decay,
// seed, eval_every, max_seconds and stop_when_perfect apply; tokens count
// image patches (plus the class token).
TrainResult train_digits(nn::VisionTransformer& model, const DigitSplit& data, const TrainConfig& config,
                         const std::function<void(const TrainProgress&)>& on_progress = {});

}  // namespace mha::train
