// The groups of a job side by side (`rankscope groups`): which data-parallel group is off.
//
// A job with several data-parallel groups is stored per group under "JOB/GROUP"
// (common/job_name.h); each group's steps are joined and analysed on their own. This view puts
// the groups' recent steps together: per step the least consistent group (lowest mean pairwise
// cosine) and the groups with an outlier rank or a divergent replica, per group how often it was
// the least consistent, and a groups x steps picture of consistency for a terminal.
//
// Pure: no I/O; the CLI fetches the rows and prints the text.
#ifndef RANKSCOPE_TOOLS_CLI_GROUPS_VIEW_H_
#define RANKSCOPE_TOOLS_CLI_GROUPS_VIEW_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::cli {

// One group's recent steps (step_stats rows, any order).
struct GroupSteps {
  std::string group;  // the name after "JOB/" ("" for a job stored without groups)
  std::vector<v1::StepStats> steps;
};

struct GroupsView {
  struct Cell {
    double cosine = 0.0;  // the group's mean pairwise cosine at the step (NaN: not computable)
    bool outlier = false;
    bool divergent = false;
  };
  std::vector<std::string> groups;  // sorted
  std::vector<uint64_t> steps;      // ascending: the steps any group reported
  // cells[g][s] for groups[g] and steps[s]; absent when the group has no row for the step.
  std::vector<std::map<uint64_t, Cell>> cells;
  // By step: the index of the least consistent group (-1 when fewer than two groups have a
  // finite cosine at the step).
  std::vector<int> least_consistent;
  // By group: the steps it was the least consistent, had an outlier, had a divergent replica.
  std::vector<int> times_least_consistent;
  std::vector<int> steps_with_outlier;
  std::vector<int> steps_with_divergence;
};

GroupsView BuildGroupsView(std::vector<GroupSteps> groups);

// The view as text: a table per group (last step's cosine, outliers, divergence, how often the
// least consistent) and a groups x steps picture (one character per step: ' ' no row, 'X' a
// divergent replica, 'O' an outlier rank, else the cosine's rank among the groups at that step,
// '#' for the least consistent, '.' for the others), then the group named least consistent most
// often.
std::string RenderGroupsView(const std::string& job, const GroupsView& view);

}  // namespace rankscope::cli

#endif  // RANKSCOPE_TOOLS_CLI_GROUPS_VIEW_H_
