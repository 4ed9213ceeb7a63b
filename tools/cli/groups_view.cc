#include "tools/cli/groups_view.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rankscope::cli {

GroupsView BuildGroupsView(std::vector<GroupSteps> groups) {
  std::sort(groups.begin(), groups.end(),
            [](const GroupSteps& a, const GroupSteps& b) { return a.group < b.group; });
  GroupsView view;
  std::vector<uint64_t> steps;
  for (const GroupSteps& g : groups) {
    view.groups.push_back(g.group);
    std::map<uint64_t, GroupsView::Cell>& cells = view.cells.emplace_back();
    for (const v1::StepStats& st : g.steps) {
      GroupsView::Cell& cell = cells[st.step()];
      cell.cosine = st.grad_cosine_mean();
      cell.outlier = st.outlier_ranks_size() > 0;
      cell.divergent = st.replica_divergent_ranks_size() > 0;
      steps.push_back(st.step());
    }
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  view.steps = std::move(steps);
  const size_t n = view.groups.size();
  view.times_least_consistent.assign(n, 0);
  view.steps_with_outlier.assign(n, 0);
  view.steps_with_divergence.assign(n, 0);
  for (uint64_t step : view.steps) {
    int worst = -1;
    int finite = 0;
    for (size_t g = 0; g < n; ++g) {
      auto it = view.cells[g].find(step);
      if (it == view.cells[g].end()) continue;
      view.steps_with_outlier[g] += it->second.outlier ? 1 : 0;
      view.steps_with_divergence[g] += it->second.divergent ? 1 : 0;
      if (std::isnan(it->second.cosine)) continue;
      ++finite;
      if (worst < 0 || it->second.cosine < view.cells[worst].at(step).cosine) {
        worst = static_cast<int>(g);
      }
    }
    if (finite < 2) worst = -1;
    view.least_consistent.push_back(worst);
    if (worst >= 0) ++view.times_least_consistent[worst];
  }
  return view;
}

std::string RenderGroupsView(const std::string& job, const GroupsView& view) {
  std::string out;
  if (view.groups.empty()) return absl::StrCat("job ", job, ": no groups\n");
  absl::StrAppendFormat(&out, "job %s: %d groups, steps %d..%d\n", job, view.groups.size(),
                        view.steps.empty() ? 0 : view.steps.front(),
                        view.steps.empty() ? 0 : view.steps.back());
  absl::StrAppendFormat(&out, "%-24s %10s %8s %10s %10s %16s\n", "GROUP", "LAST_STEP", "COSINE",
                        "OUTLIERS", "DIVERGED", "LEAST_CONSISTENT");
  for (size_t g = 0; g < view.groups.size(); ++g) {
    const auto& cells = view.cells[g];
    const bool any = !cells.empty();
    const uint64_t last = any ? cells.rbegin()->first : 0;
    const double cosine = any ? cells.rbegin()->second.cosine : std::nan("");
    absl::StrAppendFormat(
        &out, "%-24s %10s %8s %10d %10d %16d\n",
        view.groups[g].empty() ? "(only group)" : view.groups[g], any ? absl::StrCat(last) : "-",
        std::isnan(cosine) ? "nan" : absl::StrFormat("%.3f", cosine), view.steps_with_outlier[g],
        view.steps_with_divergence[g], view.times_least_consistent[g]);
  }
  out +=
      "\nconsistency by step ('#' least consistent group, 'O' outlier rank, 'X' divergent "
      "replica, ' ' no row):\n";
  for (size_t g = 0; g < view.groups.size(); ++g) {
    std::string row;
    for (size_t s = 0; s < view.steps.size(); ++s) {
      auto it = view.cells[g].find(view.steps[s]);
      if (it == view.cells[g].end()) {
        row += ' ';
      } else if (it->second.divergent) {
        row += 'X';
      } else if (it->second.outlier) {
        row += 'O';
      } else {
        row += view.least_consistent[s] == static_cast<int>(g) ? '#' : '.';
      }
    }
    absl::StrAppendFormat(&out, "%-24s |%s|\n",
                          view.groups[g].empty() ? "(only group)" : view.groups[g], row);
  }
  const auto most =
      std::max_element(view.times_least_consistent.begin(), view.times_least_consistent.end());
  if (view.groups.size() > 1 && *most > 0) {
    absl::StrAppendFormat(&out, "\nleast consistent group: %s (on %d of %d steps)\n",
                          view.groups[most - view.times_least_consistent.begin()], *most,
                          view.steps.size());
  }
  return out;
}

}  // namespace rankscope::cli
