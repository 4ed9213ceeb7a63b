#include "tools/cli/help.h"

#include <string>

namespace rankscope::cli {

const char kUsage[] =
    "rankscope: look at and steer what a rankscope collector watches.\n"
    "\n"
    "usage:\n"
    "  rankscope [--collector=HOST:PORT] jobs\n"
    "  rankscope groups --job=J [--limit=N]\n"
    "  rankscope show --job=J [--once] [--limit=N] [--worst=N]\n"
    "  rankscope export --job=J --format=csv|json [--table=steps|ranks] [--db=PATH]\n"
    "  rankscope report --job=J -o report.png [--db=PATH]\n"
    "  rankscope ctl enable --job=J [--lead_steps=N]\n"
    "  rankscope ctl disable --job=J [--lead_steps=N]\n"
    "  rankscope ctl set --job=J [--every=N] [--sketch_dim=K] [--lead_steps=N]\n"
    "  rankscope attach --job=J [--collector=HOST:PORT] [--dormant] PID... | --all-local\n"
    "\n"
    "ctl changes are applied by every rank of the job at the same future step (the job's newest\n"
    "step + lead_steps), so the ranks' sketches stay comparable.\n"
    "\n"
    "--collector (default $RANKSCOPE_COLLECTOR, else 127.0.0.1:50051) may be a fleet's\n"
    "list, a:50051,b:50051,c:50051: jobs lists every shard's jobs, the other verbs go to the\n"
    "job's shard.";

const char* VerbHelp(const std::string& verb) {
  if (verb == "jobs") {
    return "rankscope [--collector=HOST:PORT] jobs\n\n"
           "Lists the jobs the collector knows: world size, sketch size, last step, connected\n"
           "ranks, state (active: a rank is connected; idle) and when a rank last reported.\n"
           "With a fleet's list (--collector=a:50051,b:50051,...), every shard's jobs, each\n"
           "with the collector that holds it (a shard that does not answer is named on stderr,\n"
           "exit 1).\n";
  }
  if (verb == "groups") {
    return "rankscope groups --job=J [--limit=N] [--collector=HOST:PORT]\n\n"
           "The data-parallel groups of job J (stored as J/GROUP) side by side over their newest\n"
           "N steps: per group its last cosine, the steps with an outlier rank or a divergent\n"
           "replica and how often it was the least consistent group (lowest mean pairwise\n"
           "cosine), and a groups x steps picture ('#' least consistent, 'O' outlier, 'X'\n"
           "divergent replica).\n";
  }
  if (verb == "show") {
    return "rankscope show --job=J [--once] [--limit=N] [--worst=N] [--collector=HOST:PORT]\n\n"
           "The newest N steps of job J (loss mean/std/range, gradient-norm mean and CV, mean\n"
           "pairwise cosine, gradient noise scale, ranks whose replica fingerprints diverged,\n"
           "outlier ranks, ranks whose sequential detector says drifting or slow, duplicate\n"
           "groups, missing ranks), then the --worst ranks of the newest step by outlier\n"
           "score (loss, norm, consensus cosine, loss z, step time and its z, replica check).\n"
           "Refreshes every 2 s until interrupted; --once prints once (for scripts).\n";
  }
  if (verb == "export") {
    return "rankscope export --job=J [--format=csv|json] [--table=steps|ranks|windows]\n"
           "                 [--db=PATH] [--first_step=N] [--last_step=N] [--max_rows=N]\n\n"
           "Writes job J's stored rows to stdout, oldest step first: csv of step_stats\n"
           "(--table=steps, the default), of rank_steps (--table=ranks) or of rank_windows\n"
           "(--table=windows: per rank and window of steps, min/mean/max of loss, gradient norm,\n"
           "consensus cosine and outlier score where the collector's retention pruned the full\n"
           "rank rows), or json with all ({\"steps\": [...], \"ranks\": [...], \"rank_windows\":\n"
           "[...], \"downsampled_before_step\": N}, uint64 values as decimal strings). A notice "
           "on\n"
           "stderr says when rank rows of the range were downsampled. Reads\n"
           "the running collector (--collector) or, with --db, a SQLite file directly (also one\n"
           "a running collector is writing). Lists inside a csv field are separated by ';'.\n";
  }
  if (verb == "report") {
    return "rankscope report --job=J -o report.png [--db=PATH] [--first_step=N] [--last_step=N]\n\n"
           "Plots job J over steps: loss mean with its dispersion (std band, range), gradient-\n"
           "norm CV, direction consistency (mean pairwise cosine) and replica checks, with the\n"
           "outlier ranks marked. Data come from the collector or, with --db, a SQLite file; the\n"
           "plot is drawn by PYTHON -m rankscope.report (matplotlib) from the package in\n"
           "<bin>/../python; PYTHON is --python, else $RANKSCOPE_PYTHON, else the build's\n"
           "(" RANKSCOPE_DEFAULT_PYTHON "). The format follows -o's extension (png, pdf, svg).\n";
  }
  if (verb == "ctl") {
    return "rankscope ctl enable|disable --job=J [--lead_steps=N]\n"
           "rankscope ctl set --job=J [--every=N] [--sketch_dim=K] [--lead_steps=N]\n\n"
           "Pushes a control message to every rank of job J, applied by all of them at the same\n"
           "future step (the job's newest step + lead_steps).\n";
  }
  return nullptr;
}

}  // namespace rankscope::cli
