// Fuzzes the web view's request parsing (collector/web/web_api.h ParseApiRequest) with fuzzer bytes
// as the URL: the bytes before the first '?' are the path after "/api/v1", the rest the query
// string. Checks, from web_api.h and query_checks.h:
//  - the only errors are InvalidArgument and NotFound, with messages of at most 512 bytes that
//    never echo the request (no 9-byte run of it with a byte our messages never hold);
//  - an accepted steps/ranks request names a valid job key (IsValidGroupKey), has
//    first <= last when it gives both, steps <= INT64_MAX, since only without first and below
//    INT64_MAX and last, and a rank only for ranks;
//  - ResolveWindow gives first <= last whatever the job's newest step;
//  - AppendJsonString writes one string literal without raw control characters, '<', '>' or '&'.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "collector/web/web_api.h"
#include "common/job_name.h"
#include "tests/fuzz/fuzz_check.h"

namespace rankscope::fuzz {
namespace {

using collector::ApiRequest;

// True iff no 9-byte run of `input` that holds a byte our messages never contain ('=', '&',
// '%', a control or non-ASCII byte) appears in `message`: the message does not echo the request.
bool EchoesNothingLong(absl::string_view input, absl::string_view message) {
  auto foreign = [](char ch) {
    const unsigned char c = static_cast<unsigned char>(ch);
    return c == '=' || c == '&' || c == '%' || c < 0x20 || c >= 0x7f;
  };
  for (size_t i = 0; i + 9 <= input.size(); ++i) {
    const absl::string_view run = input.substr(i, 9);
    bool has_foreign = false;
    for (char c : run) has_foreign |= foreign(c);
    if (has_foreign && absl::StrContains(message, run)) return false;
  }
  return true;
}

}  // namespace
}  // namespace rankscope::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rankscope;
  using namespace rankscope::fuzz;
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t q = input.find('?');
  const absl::string_view path = input.substr(0, q);
  const absl::string_view query = q == absl::string_view::npos ? "" : input.substr(q + 1);

  auto request = collector::ParseApiRequest(path, query);
  if (!request.ok()) {
    const absl::StatusCode code = request.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound);
    FUZZ_CHECK(request.status().message().size() <= 512);
    FUZZ_CHECK(EchoesNothingLong(query, request.status().message()));
  } else {
    constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (request->route == ApiRequest::Route::kJobs) {
      FUZZ_CHECK(request->job.empty());
    } else {
      FUZZ_CHECK(IsValidGroupKey(request->job));
    }
    if (request->first.has_value()) FUZZ_CHECK(*request->first <= kMax);
    if (request->last.has_value()) FUZZ_CHECK(*request->last <= kMax);
    if (request->first.has_value() && request->last.has_value()) {
      FUZZ_CHECK(*request->first <= *request->last);
    }
    if (request->since.has_value()) {
      FUZZ_CHECK(!request->first.has_value() && *request->since < kMax);
      if (request->last.has_value()) FUZZ_CHECK(*request->since < *request->last);
    }
    if (request->rank.has_value()) FUZZ_CHECK(request->route == ApiRequest::Route::kRanks);
    for (uint64_t newest : {uint64_t{0}, uint64_t{7}, kMax}) {
      const collector::StepWindow w = collector::ResolveWindow(*request, newest, 120);
      FUZZ_CHECK(w.first <= w.last);
    }
  }

  std::string json;
  collector::AppendJsonString(input, &json);
  FUZZ_CHECK(json.size() >= 2 && json.front() == '"' && json.back() == '"');
  for (size_t i = 1; i + 1 < json.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(json[i]);
    FUZZ_CHECK(c >= 0x20 && c != '<' && c != '>' && c != '&');
    if (c == '"') FUZZ_CHECK(json[i - 1] == '\\');
  }
  return 0;
}
