// The attach verb, handed over to Python before absl parses the command line.
#ifndef RANKSCOPE_TOOLS_CLI_ATTACH_HANDOVER_H_
#define RANKSCOPE_TOOLS_CLI_ATTACH_HANDOVER_H_

namespace rankscope::cli {

// `rankscope attach ...`: execs PYTHON -m rankscope.attach (PythonInterpreter(""), the package in
// PythonDir()) with every argument but argv[verb_index] ("attach"), in order. attach has its own
// flags (--dormant, --all-local, PIDs), so main hands over before absl parses anything. Returns
// only on failure, with the exit code: 1 when the package is missing, 127 when exec fails.
int Attach(int argc, char** argv, int verb_index);

}  // namespace rankscope::cli

#endif  // RANKSCOPE_TOOLS_CLI_ATTACH_HANDOVER_H_
