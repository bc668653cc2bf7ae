// The whole public API.
#pragma once

#include "mha/attention.h"
#include "mha/dtype.h"
#include "mha/errors.h"
#include "mha/nn/activation.h"
#include "mha/nn/dropout.h"
#include "mha/nn/embedding.h"
#include "mha/nn/layer_norm.h"
#include "mha/nn/linear.h"
#include "mha/nn/loss.h"
#include "mha/nn/module.h"
#include "mha/nn/multihead_attention.h"
#include "mha/nn/transformer.h"
#include "mha/optim.h"
#include "mha/random.h"
#include "mha/tensor.h"
#include "mha/version.h"
