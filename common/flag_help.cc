#include "common/flag_help.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/version.h"

namespace rankscope {
namespace {

// "…/rankscope/collector/main.cc" -> "collector/main.cc": the path below the source tree.
std::string ShortFileName(absl::string_view path) {
  for (absl::string_view top : {"/agent/", "/collector/", "/common/", "/tools/", "/bench/"}) {
    const size_t pos = path.rfind(top);
    if (pos != absl::string_view::npos) return std::string(path.substr(pos + 1));
  }
  const size_t slash = path.rfind('/');
  return std::string(slash == absl::string_view::npos ? path : path.substr(slash + 1));
}

}  // namespace

std::string FlagHelpText(absl::string_view main_file) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), main_file)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const absl::CommandLineFlag* a, const absl::CommandLineFlag* b) {
              return a->Name() < b->Name();
            });
  std::string out = absl::StrCat(absl::ProgramUsageMessage(), "\n\nFlags:\n");
  for (const absl::CommandLineFlag* flag : flags) {
    const std::string def = flag->DefaultValue();
    absl::StrAppend(&out, "  --", flag->Name(), " (default ", def.empty() ? "\"\"" : def,
                    ")\n      ", flag->Help(), "\n");
  }
  absl::StrAppend(&out, "\n--helpfull lists every flag, including the libraries'.\n");
  return out;
}

void HandleHelpFlag(int argc, char** argv, absl::string_view main_file) {
  absl::FlagsUsageConfig config;
  config.normalize_filename = [](absl::string_view f) { return ShortFileName(f); };
  absl::SetFlagsUsageConfig(config);
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-help" || arg == "--helpshort" || arg == "-h") {
      const std::string text = FlagHelpText(main_file);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
      std::exit(0);
    }
    if (arg == "--version" || arg == "-version") {
      const char* slash = std::strrchr(argv[0], '/');
      std::printf("%s %s\n", slash != nullptr ? slash + 1 : argv[0], RANKSCOPE_VERSION);
      std::fflush(stdout);
      std::exit(0);
    }
    if (arg == "--") return;
  }
}

}  // namespace rankscope
