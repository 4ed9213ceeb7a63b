// The store's one way to run a write transaction: BEGIN IMMEDIATE, then COMMIT, or ROLLBACK on
// every other path. Private to the SQLite sink (the store's writes, retention, the schema).
//
// Thread safety: used by the one thread that owns the connection.
#ifndef RANKSCOPE_COLLECTOR_STORE_SQLITE_TRANSACTION_H_
#define RANKSCOPE_COLLECTOR_STORE_SQLITE_TRANSACTION_H_

#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "collector/store/sqlite_statement.h"

struct sqlite3;

namespace rankscope::collector::sqlite {

// BEGIN IMMEDIATE, COMMIT and ROLLBACK, prepared once per connection.
struct TransactionStatements {
  // Errors name `path`.
  static absl::StatusOr<TransactionStatements> Prepare(sqlite3* db, const std::string& path);

  Stmt begin;
  Stmt commit;
  Stmt rollback;
};

// An open write transaction (BEGIN IMMEDIATE: the write lock is taken at once, so a busy file
// fails here, not halfway through). Commit() ends it; a transaction destroyed uncommitted rolls
// back, unless SQLite already rolled it back itself (e.g. on SQLITE_FULL).
class WriteTransaction {
 public:
  // Errors name `path`: kUnavailable when another connection holds the write lock past the
  // busy timeout (retry later), others as SqlStatus.
  static absl::StatusOr<WriteTransaction> Begin(sqlite3* db, const std::string& path,
                                                const TransactionStatements& statements);

  WriteTransaction(WriteTransaction&& other) noexcept;
  WriteTransaction& operator=(WriteTransaction&&) = delete;
  WriteTransaction(const WriteTransaction&) = delete;
  WriteTransaction& operator=(const WriteTransaction&) = delete;
  ~WriteTransaction();

  // COMMIT. On an error the transaction is rolled back (by the destructor).
  absl::Status Commit();

 private:
  WriteTransaction(sqlite3* db, const std::string& path, const TransactionStatements& statements)
      : db_(db), path_(&path), statements_(&statements) {}

  sqlite3* db_;  // null once committed or moved from
  const std::string* path_;
  const TransactionStatements* statements_;
};

// Runs `body` in a WriteTransaction: commits if it returns OK, else rolls back and returns its
// error.
absl::Status InWriteTransaction(sqlite3* db, const std::string& path,
                                const TransactionStatements& statements,
                                absl::FunctionRef<absl::Status()> body);

}  // namespace rankscope::collector::sqlite

#endif  // RANKSCOPE_COLLECTOR_STORE_SQLITE_TRANSACTION_H_
