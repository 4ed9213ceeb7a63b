#include "collector/store/sqlite_transaction.h"

#include <sqlite3.h>

#include <utility>

namespace rankscope::collector::sqlite {

absl::StatusOr<TransactionStatements> TransactionStatements::Prepare(sqlite3* db,
                                                                     const std::string& path) {
  TransactionStatements statements;
  if (absl::Status s = PreparePersistent(db, path,
                                         {{&statements.begin, "BEGIN IMMEDIATE"},
                                          {&statements.commit, "COMMIT"},
                                          {&statements.rollback, "ROLLBACK"}});
      !s.ok()) {
    return s;
  }
  return statements;
}

absl::StatusOr<WriteTransaction> WriteTransaction::Begin(sqlite3* db, const std::string& path,
                                                         const TransactionStatements& statements) {
  ScopedReset reset(statements.begin.get());
  const int rc = StepToDone(statements.begin.get());
  if (rc != SQLITE_DONE) return SqlStatus(rc, path, "BEGIN IMMEDIATE", db);
  return WriteTransaction(db, path, statements);
}

WriteTransaction::WriteTransaction(WriteTransaction&& other) noexcept
    : db_(std::exchange(other.db_, nullptr)), path_(other.path_), statements_(other.statements_) {}

WriteTransaction::~WriteTransaction() {
  // SQLite may already have rolled the transaction back itself (e.g. on SQLITE_FULL).
  if (db_ == nullptr || sqlite3_get_autocommit(db_) != 0) return;
  ScopedReset reset(statements_->rollback.get());
  StepToDone(statements_->rollback.get());
}

absl::Status WriteTransaction::Commit() {
  ScopedReset reset(statements_->commit.get());
  const int rc = StepToDone(statements_->commit.get());
  if (rc != SQLITE_DONE) return SqlStatus(rc, *path_, "COMMIT", db_);
  db_ = nullptr;
  return absl::OkStatus();
}

absl::Status InWriteTransaction(sqlite3* db, const std::string& path,
                                const TransactionStatements& statements,
                                absl::FunctionRef<absl::Status()> body) {
  absl::StatusOr<WriteTransaction> transaction = WriteTransaction::Begin(db, path, statements);
  if (!transaction.ok()) return transaction.status();
  if (absl::Status status = body(); !status.ok()) return status;
  return transaction->Commit();
}

}  // namespace rankscope::collector::sqlite
