#include "common/sketch_dim.h"

#include "gtest/gtest.h"

namespace rankscope {
namespace {

TEST(SketchDimTest, NeverRetunedIsTheBaseAtEveryStep) {
  constexpr SketchDimSchedule s{1024};
  static_assert(SketchDimAtStep(s, 0) == 1024);
  EXPECT_EQ(SketchDimAtStep(s, ~uint64_t{0}), 1024u);
  EXPECT_TRUE(SketchDimAccepted(s, 1024));
  EXPECT_FALSE(SketchDimAccepted(s, 0));  // retuned_dim 0 means "none", not a length
  EXPECT_FALSE(SketchDimAccepted(s, 512));
}

TEST(SketchDimTest, RetunedFromItsApplyStepOn) {
  constexpr SketchDimSchedule s{1024, 256, 100};
  EXPECT_EQ(SketchDimAtStep(s, 0), 1024u);
  EXPECT_EQ(SketchDimAtStep(s, 99), 1024u);
  EXPECT_EQ(SketchDimAtStep(s, 100), 256u);
  EXPECT_EQ(SketchDimAtStep(s, 5000), 256u);
}

TEST(SketchDimTest, BothDimsAreAcceptedAroundTheSwitch) {
  // Ranks switch at an agreed step >= apply_at_step, late ranks later still: both lengths are
  // consistent with the schedule on either side of apply_at_step.
  constexpr SketchDimSchedule s{1024, 256, 100};
  EXPECT_TRUE(SketchDimAccepted(s, 1024));
  EXPECT_TRUE(SketchDimAccepted(s, 256));
  EXPECT_FALSE(SketchDimAccepted(s, 512));
  EXPECT_FALSE(SketchDimAccepted(s, uint64_t{1024} << 32));  // no truncation to 32 bits
}

}  // namespace
}  // namespace rankscope
