#include "collector/analysis/outlier_scale.h"

#include <cmath>
#include <limits>
#include <vector>

namespace rankscope::collector {

void OutlierScaleWindow::Push(const SignalScales& scales) {
  ring_[next_] = scales;
  next_ = (next_ + 1) % kOutlierScaleWindowSteps;
  if (count_ < kOutlierScaleWindowSteps) ++count_;
}

SignalScales OutlierScaleWindow::Floor() const {
  auto floor_of = [&](double SignalScales::*field) {
    std::vector<double> v;
    v.reserve(count_);
    for (size_t i = 0; i < count_; ++i) {
      const double x = ring_[i].*field;
      if (std::isfinite(x)) v.push_back(x);
    }
    return v.size() < kOutlierScaleMinSteps ? std::numeric_limits<double>::quiet_NaN()
                                            : FiniteMedian(v);
  };
  return {floor_of(&SignalScales::loss), floor_of(&SignalScales::grad_norm),
          floor_of(&SignalScales::cosine)};
}

}  // namespace rankscope::collector
