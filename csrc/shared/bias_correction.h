// Bias corrections of Adam and LAMB, per tensor (its step count), on double:
//   bc1 = 1 - beta1^step,  bc2 = 1 - beta2^step     (both 1 without bias correction)
//   Adam's step size lr/bc1 and 1/sqrt(bc2): the update is p - (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
// LAMB folds them into its own numbers (lamb_math.h).
#pragma once

#include "host_device.h"
#include "primitives.h"

#include <math.h>

namespace fused_optim {

struct BiasCorrection {
  double bc1 = 1.0, bc2 = 1.0;
};

// step: the step count after this step's increment (1 on the first step).
FUSED_OPTIM_HD BiasCorrection bias_correction(double beta1, double beta2, double step, bool enabled) {
  if (!enabled) return {};
  return {1.0 - pow(beta1, step), 1.0 - pow(beta2, step)};
}

struct AdamStep {
  double step_size;     // lr/bc1
  double inv_bc2_sqrt;  // 1/sqrt(bc2)
};

FUSED_OPTIM_HD AdamStep adam_step(double lr, const BiasCorrection& bc) { return {lr / bc.bc1, 1.0 / sqrt_of(bc.bc2)}; }

}  // namespace fused_optim
