#include "tools/cli/attach_handover.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tools/cli/cli_config.h"

namespace rankscope::cli {

int Attach(int argc, char** argv, int verb_index) {
  const std::string pydir = PythonDir();
  if (!PathExists(pydir + "/rankscope/attach.py")) {
    std::fprintf(stderr,
                 "rankscope: %s/rankscope/attach.py not found (attach needs the rankscope "
                 "Python package beside the binary, as the build lays it out)\n",
                 pydir.c_str());
    return 1;
  }
  const std::string interpreter = PythonInterpreter("");
  const char* python = interpreter.c_str();
  std::vector<char*> args = {const_cast<char*>(python), const_cast<char*>("-m"),
                             const_cast<char*>("rankscope.attach")};
  for (int i = 1; i < argc; ++i) {
    if (i != verb_index) args.push_back(argv[i]);
  }
  args.push_back(nullptr);
  const char* old = std::getenv("PYTHONPATH");
  const std::string pythonpath = old && *old ? pydir + ":" + old : pydir;
  setenv("PYTHONPATH", pythonpath.c_str(), 1);
  execv(python, args.data());
  std::fprintf(stderr, "rankscope: cannot run %s: %s\n", python, std::strerror(errno));
  return 127;
}

}  // namespace rankscope::cli
