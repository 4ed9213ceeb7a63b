// Helpers over SQLite's C API shared by the store and its schema: prepared-statement ownership,
// binding parameters, stepping, reading columns, and mapping SQLite result codes to absl codes.
// Private to the SQLite sink (collector/store/sqlite_store.cc, collector/store/sqlite_schema.cc).
//
// Conventions (the file format documented in sqlite_store.h): times are Unix seconds as REAL with
// microsecond precision (+/-Inf for InfiniteFuture/InfinitePast); NaN is bound as NULL and a NULL
// required double reads back as NaN; a uint64 is stored as the int64 with the same 64 bits.
//
// Thread safety: stateless functions; a Binder, a ScopedReset and a Stmt are used by the one
// thread that owns their connection.
#ifndef RANKSCOPE_COLLECTOR_STORE_SQLITE_STATEMENT_H_
#define RANKSCOPE_COLLECTOR_STORE_SQLITE_STATEMENT_H_

#include <sqlite3.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rankscope::collector::sqlite {

struct StmtDeleter {
  void operator()(sqlite3_stmt* stmt) const { sqlite3_finalize(stmt); }
};
// An owned prepared statement, finalized on destruction (before its connection is closed).
using Stmt = std::unique_ptr<sqlite3_stmt, StmtDeleter>;

// Resets a statement and clears its bindings when a use of it ends, however it ends, so the
// next use starts clean and no read transaction is left open by an unfinished SELECT.
class ScopedReset {
 public:
  explicit ScopedReset(sqlite3_stmt* stmt) : stmt_(stmt) {}
  ~ScopedReset() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  ScopedReset(const ScopedReset&) = delete;
  ScopedReset& operator=(const ScopedReset&) = delete;

 private:
  sqlite3_stmt* stmt_;
};

// The absl code for SQLite result code `rc` (primary or extended): ResourceExhausted for a full
// disk or no memory; Unavailable for busy, locked, I/O errors, cannot open; PermissionDenied for
// read-only, permission and authorization errors; DataLoss for a corrupt file or not a database;
// Internal otherwise.
absl::StatusCode CodeFor(int rc);

// "sqlite_store <path>: <what>: <SQLite's message of db> [sqlite code <rc>]" with CodeFor(rc).
// Build it before anything else touches the connection's error message.
absl::Status SqlStatus(int rc, absl::string_view path, absl::string_view what, sqlite3* db);

// Job names come from the network: quote them escaped in messages.
std::string Quote(absl::string_view job);

// Unix seconds with microsecond precision: at today's ~1.7e9 s a double's ulp is ~0.24 us, so
// rounding back to whole microseconds recovers the value exactly.
double ToUnixSecondsReal(absl::Time t);
absl::Time FromUnixSecondsReal(double seconds);

// Prepares each (statement, SQL) pair with SQLITE_PREPARE_PERSISTENT (kept for the connection's
// life). An error names `path` and the SQL; statements prepared before it stay prepared.
absl::Status PreparePersistent(sqlite3* db, const std::string& path,
                               std::initializer_list<std::pair<Stmt*, const char*>> statements);

// Steps `stmt` (bound, no result rows) to completion. Returns SQLITE_DONE or the error code;
// the caller builds the Status before anything else touches the connection's error message.
int StepToDone(sqlite3_stmt* stmt);

// Binds parameters ?1, ?2, ... in order and keeps the first error. Text is bound without a
// copy (SQLITE_STATIC): it must outlive the statement's step.
class Binder {
 public:
  explicit Binder(sqlite3_stmt* stmt) : stmt_(stmt) {}

  Binder& Text(absl::string_view text) {
    // A null data() would bind SQL NULL; an empty string_view is the empty string.
    return Check(sqlite3_bind_text(stmt_, index_, text.data() != nullptr ? text.data() : "",
                                   static_cast<int>(text.size()), SQLITE_STATIC));
  }
  Binder& Int(int64_t value) { return Check(sqlite3_bind_int64(stmt_, index_, value)); }
  // A uint64 is stored as the int64 with the same bits.
  Binder& Bits(uint64_t value) { return Int(static_cast<int64_t>(value)); }
  Binder& Bits(const std::optional<uint64_t>& value) {
    return value.has_value() ? Bits(*value) : Null();
  }
  // NaN becomes NULL; +/-Inf is stored as REAL +/-Inf.
  Binder& Double(double value);
  Binder& Double(const std::optional<double>& value) {
    return value.has_value() ? Double(*value) : Null();
  }
  Binder& Time(absl::Time t) {
    return Check(sqlite3_bind_double(stmt_, index_, ToUnixSecondsReal(t)));
  }
  Binder& OptionalBool(const std::optional<bool>& value) {
    return value.has_value() ? Int(*value ? 1 : 0) : Null();
  }
  Binder& Null() { return Check(sqlite3_bind_null(stmt_, index_)); }
  // float32 values as a BLOB of 4 bytes each (the host's byte order: little-endian on every
  // supported machine); none becomes NULL.
  Binder& Floats(const std::vector<float>& values) {
    if (values.empty()) return Null();
    return Check(sqlite3_bind_blob(stmt_, index_, values.data(),
                                   static_cast<int>(values.size() * sizeof(float)), SQLITE_STATIC));
  }

  // SQLITE_OK, or the first binding's error (SQLITE_TOOBIG for a huge string).
  int rc() const { return rc_; }

 private:
  Binder& Check(int rc) {
    if (rc_ == SQLITE_OK) rc_ = rc;
    ++index_;
    return *this;
  }
  sqlite3_stmt* stmt_;
  int index_ = 1;
  int rc_ = SQLITE_OK;
};

// --- Reading columns. Indexes are 0-based, as in sqlite3_column_*. ---------------------------

std::string ColumnText(sqlite3_stmt* stmt, int col);
// A BLOB of float32 values (Binder::Floats); NULL or a length not a multiple of 4 reads empty.
std::vector<float> ColumnFloats(sqlite3_stmt* stmt, int col);
bool IsNull(sqlite3_stmt* stmt, int col);
int64_t ColumnInt(sqlite3_stmt* stmt, int col);
uint32_t ColumnU32(sqlite3_stmt* stmt, int col);
uint64_t ColumnBits(sqlite3_stmt* stmt, int col);
std::optional<uint64_t> ColumnOptionalBits(sqlite3_stmt* stmt, int col);
// NULL reads as NaN.
double ColumnDouble(sqlite3_stmt* stmt, int col);
// NULL reads as nullopt.
std::optional<double> ColumnOptionalDouble(sqlite3_stmt* stmt, int col);
absl::Time ColumnTime(sqlite3_stmt* stmt, int col);

}  // namespace rankscope::collector::sqlite

#endif  // RANKSCOPE_COLLECTOR_STORE_SQLITE_STATEMENT_H_
