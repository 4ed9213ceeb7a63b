#include "backoff.h"

#include <algorithm>
#include <random>

namespace rankscope::internal {

Backoff::Backoff(absl::Duration initial, absl::Duration max, uint64_t seed)
    : initial_(initial), max_(std::max(initial, max)), gen_(std::seed_seq{seed}) {}

absl::Duration Backoff::Next() {
  absl::Duration base = initial_;
  for (int i = 0; i < attempts_ && base < max_; ++i) base *= 2;
  base = std::min(base, max_);
  if (attempts_ < 64) ++attempts_;
  const double fraction = absl::Uniform(gen_, 0.5, 1.0);
  return base * fraction;
}

}  // namespace rankscope::internal
