#include "tools/cli/groups_view.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rankscope::cli {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::StepStats Step(uint64_t step, double cosine, bool outlier = false, bool divergent = false) {
  v1::StepStats st;
  st.set_step(step);
  st.set_grad_cosine_mean(cosine);
  if (outlier) st.add_outlier_ranks(2);
  if (divergent) st.add_replica_divergent_ranks(1);
  return st;
}

TEST(GroupsViewTest, NamesTheLeastConsistentGroupPerStep) {
  std::vector<GroupSteps> groups(3);
  groups[0].group = "dp1";  // unsorted on purpose
  groups[0].steps = {Step(3, 0.10), Step(1, 0.40), Step(2, 0.05, /*outlier=*/true)};
  groups[1].group = "dp0";
  groups[1].steps = {Step(1, 0.30), Step(2, 0.50), Step(3, 0.60, false, /*divergent=*/true)};
  groups[2].group = "dp2";
  groups[2].steps = {Step(2, std::nan("")), Step(3, 0.70)};  // no row at step 1
  const GroupsView view = BuildGroupsView(groups);
  EXPECT_THAT(view.groups, ElementsAre("dp0", "dp1", "dp2"));
  EXPECT_THAT(view.steps, ElementsAre(1u, 2u, 3u));
  EXPECT_THAT(view.least_consistent, ElementsAre(0, 1, 1));  // NaN never counts as worst
  EXPECT_THAT(view.times_least_consistent, ElementsAre(1, 2, 0));
  EXPECT_THAT(view.steps_with_outlier, ElementsAre(0, 1, 0));
  EXPECT_THAT(view.steps_with_divergence, ElementsAre(1, 0, 0));

  const std::string text = RenderGroupsView("exp-42", view);
  EXPECT_THAT(text, HasSubstr("job exp-42: 3 groups, steps 1..3"));
  EXPECT_THAT(text, HasSubstr("dp0                      |#.X|"));
  EXPECT_THAT(text, HasSubstr("dp1                      |.O#|"));
  EXPECT_THAT(text, HasSubstr("dp2                      | ..|"));
  EXPECT_THAT(text, HasSubstr("least consistent group: dp1 (on 2 of 3 steps)"));
}

TEST(GroupsViewTest, OneGroupOrFiniteCosinesInOneGroupOnlyNameNoWorst) {
  std::vector<GroupSteps> groups(1);
  groups[0].steps = {Step(7, 0.2)};
  const GroupsView view = BuildGroupsView(groups);
  EXPECT_THAT(view.least_consistent, ElementsAre(-1));
  const std::string text = RenderGroupsView("solo", view);
  EXPECT_THAT(text, HasSubstr("(only group)"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("least consistent group:")));
  EXPECT_THAT(RenderGroupsView("none", BuildGroupsView({})), HasSubstr("job none: no groups"));
}

}  // namespace
}  // namespace rankscope::cli
