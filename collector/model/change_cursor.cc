#include "collector/model/change_cursor.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rankscope::collector {

std::string FormatChangeCursor(const ChangeCursor& cursor) {
  return absl::StrCat(absl::Hex(cursor.instance), ".", cursor.seq);
}

std::optional<ChangeCursor> ParseChangeCursor(absl::string_view text) {
  const size_t dot = text.find('.');
  if (dot == absl::string_view::npos) return std::nullopt;
  const absl::string_view hex = text.substr(0, dot), dec = text.substr(dot + 1);
  if (hex.empty() || hex.size() > 16 || dec.empty() || dec.size() > 20) return std::nullopt;
  if (!std::all_of(hex.begin(), hex.end(),
                   [](char c) { return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f'); })) {
    return std::nullopt;
  }
  if (!std::all_of(dec.begin(), dec.end(), [](char c) { return absl::ascii_isdigit(c); })) {
    return std::nullopt;
  }
  ChangeCursor cursor;
  if (!absl::SimpleHexAtoi(hex, &cursor.instance) || !absl::SimpleAtoi(dec, &cursor.seq)) {
    return std::nullopt;
  }
  return cursor;
}

}  // namespace rankscope::collector
