// The SQLite store's prepared statements, one set per connection, prepared by SqliteStore::Open:
// the transaction's (sqlite_transaction.h), the write path's (sqlite_store_write.cc) and the read
// path's (sqlite_store_read.cc). Private to the SQLite sink.
//
// Thread safety: used by the one thread that owns the connection.
#ifndef RANKSCOPE_COLLECTOR_STORE_SQLITE_STORE_STATEMENTS_H_
#define RANKSCOPE_COLLECTOR_STORE_SQLITE_STORE_STATEMENTS_H_

#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/statusor.h"
#include "collector/store/sqlite_statement.h"
#include "collector/store/sqlite_store.h"
#include "collector/store/sqlite_transaction.h"

namespace rankscope::collector {
namespace sqlite {

// The largest step the store holds (steps are stored as INTEGER, an int64).
inline constexpr int64_t kMaxStoredStep = std::numeric_limits<int64_t>::max();

// Upserts of the write path.
struct WriteStatements {
  // Errors name `path`.
  static absl::StatusOr<WriteStatements> Prepare(sqlite3* db, const std::string& path);

  Stmt upsert_job;
  Stmt upsert_rank_identity;
  Stmt upsert_rank;
  Stmt upsert_step;
};

// Queries of the read path.
struct ReadStatements {
  // Errors name `path`.
  static absl::StatusOr<ReadStatements> Prepare(sqlite3* db, const std::string& path);

  Stmt list_jobs;
  Stmt recent_steps;
  Stmt get_step;
  Stmt rank_rows;
  Stmt count_rank_rows;
  Stmt step_range;
  Stmt rank_rows_in_range;
  Stmt rank_series_in_range;
  Stmt rank_windows_in_range;
  Stmt downsampled_before;
};

}  // namespace sqlite

struct SqliteStore::Statements {
  sqlite::TransactionStatements transaction;
  sqlite::WriteStatements write;
  sqlite::ReadStatements read;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_STORE_SQLITE_STORE_STATEMENTS_H_
