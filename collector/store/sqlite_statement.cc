#include "collector/store/sqlite_statement.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rankscope::collector::sqlite {

absl::StatusCode CodeFor(int rc) {
  switch (rc & 0xff) {
    case SQLITE_FULL:
    case SQLITE_NOMEM:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_IOERR:
    case SQLITE_CANTOPEN:
    case SQLITE_PROTOCOL:
      return absl::StatusCode::kUnavailable;
    case SQLITE_READONLY:
    case SQLITE_PERM:
    case SQLITE_AUTH:
      return absl::StatusCode::kPermissionDenied;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::StatusCode::kDataLoss;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status SqlStatus(int rc, absl::string_view path, absl::string_view what, sqlite3* db) {
  return absl::Status(CodeFor(rc), absl::StrFormat("sqlite_store %s: %s: %s [sqlite code %d]", path,
                                                   what, sqlite3_errmsg(db), rc));
}

std::string Quote(absl::string_view job) { return absl::StrCat("'", absl::CHexEscape(job), "'"); }

double ToUnixSecondsReal(absl::Time t) {
  if (t == absl::InfiniteFuture()) return std::numeric_limits<double>::infinity();
  if (t == absl::InfinitePast()) return -std::numeric_limits<double>::infinity();
  return static_cast<double>(absl::ToUnixMicros(t)) / 1e6;
}

absl::Time FromUnixSecondsReal(double seconds) {
  if (std::isnan(seconds)) return absl::UnixEpoch();
  const double micros = std::round(seconds * 1e6);
  constexpr double kTwoTo63 = 9223372036854775808.0;  // the first value an int64 cannot hold
  if (micros >= kTwoTo63) return absl::InfiniteFuture();
  if (micros <= -kTwoTo63) return absl::InfinitePast();
  return absl::FromUnixMicros(static_cast<int64_t>(micros));
}

absl::Status PreparePersistent(sqlite3* db, const std::string& path,
                               std::initializer_list<std::pair<Stmt*, const char*>> statements) {
  for (const auto& [stmt, sql] : statements) {
    sqlite3_stmt* raw = nullptr;
    const int rc = sqlite3_prepare_v3(db, sql, -1, SQLITE_PREPARE_PERSISTENT, &raw, nullptr);
    stmt->reset(raw);
    if (rc != SQLITE_OK) return SqlStatus(rc, path, absl::StrCat("prepare ", sql), db);
  }
  return absl::OkStatus();
}

int StepToDone(sqlite3_stmt* stmt) {
  int rc = sqlite3_step(stmt);
  while (rc == SQLITE_ROW) rc = sqlite3_step(stmt);
  return rc;
}

Binder& Binder::Double(double value) {
  return std::isnan(value) ? Null() : Check(sqlite3_bind_double(stmt_, index_, value));
}

std::string ColumnText(sqlite3_stmt* stmt, int col) {
  const auto* text = reinterpret_cast<const char*>(sqlite3_column_text(stmt, col));
  if (text == nullptr) return std::string();
  return std::string(text, static_cast<size_t>(sqlite3_column_bytes(stmt, col)));
}

std::vector<float> ColumnFloats(sqlite3_stmt* stmt, int col) {
  const void* blob = sqlite3_column_blob(stmt, col);
  const size_t bytes = static_cast<size_t>(sqlite3_column_bytes(stmt, col));
  std::vector<float> out;
  if (blob == nullptr || bytes % sizeof(float) != 0) return out;
  out.resize(bytes / sizeof(float));
  std::memcpy(out.data(), blob, bytes);
  return out;
}

bool IsNull(sqlite3_stmt* stmt, int col) { return sqlite3_column_type(stmt, col) == SQLITE_NULL; }

int64_t ColumnInt(sqlite3_stmt* stmt, int col) { return sqlite3_column_int64(stmt, col); }

uint32_t ColumnU32(sqlite3_stmt* stmt, int col) {
  return static_cast<uint32_t>(sqlite3_column_int64(stmt, col));
}

uint64_t ColumnBits(sqlite3_stmt* stmt, int col) {
  return static_cast<uint64_t>(sqlite3_column_int64(stmt, col));
}

std::optional<uint64_t> ColumnOptionalBits(sqlite3_stmt* stmt, int col) {
  if (IsNull(stmt, col)) return std::nullopt;
  return ColumnBits(stmt, col);
}

double ColumnDouble(sqlite3_stmt* stmt, int col) {
  if (IsNull(stmt, col)) return std::numeric_limits<double>::quiet_NaN();
  return sqlite3_column_double(stmt, col);
}

std::optional<double> ColumnOptionalDouble(sqlite3_stmt* stmt, int col) {
  if (IsNull(stmt, col)) return std::nullopt;
  return sqlite3_column_double(stmt, col);
}

absl::Time ColumnTime(sqlite3_stmt* stmt, int col) {
  return FromUnixSecondsReal(sqlite3_column_double(stmt, col));
}

}  // namespace rankscope::collector::sqlite
