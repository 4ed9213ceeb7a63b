// A position in a collector's log of stored steps (collector/pipeline/step_change_log.h), as the
// web API's ?changes= carries it. Pure: plain values and their text form.
#ifndef RANKSCOPE_COLLECTOR_MODEL_CHANGE_CURSOR_H_
#define RANKSCOPE_COLLECTOR_MODEL_CHANGE_CURSOR_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace rankscope::collector {

struct ChangeCursor {
  uint64_t instance = 0;
  uint64_t seq = 0;
  bool operator==(const ChangeCursor& o) const { return instance == o.instance && seq == o.seq; }
};

// "INSTANCE.SEQ" in lower-case hex and decimal ("9f3a0c1d2e4b5a67.1234").
std::string FormatChangeCursor(const ChangeCursor& cursor);
// The inverse of FormatChangeCursor; nullopt for anything else (at most 16 hex digits, a dot,
// at most 20 decimal digits, no sign, no spaces).
std::optional<ChangeCursor> ParseChangeCursor(absl::string_view text);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_MODEL_CHANGE_CURSOR_H_
