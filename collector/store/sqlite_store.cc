// SqliteStore's connection: Open (the connection set up, the statements prepared), and the
// transaction every write runs in. The write path is sqlite_store_write.cc, the read path
// sqlite_store_read.cc, the storage lifecycle sqlite_retention.cc.
#include "collector/store/sqlite_store.h"

#include <sqlite3.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "collector/store/sqlite_schema.h"
#include "collector/store/sqlite_statement.h"
#include "collector/store/sqlite_store_statements.h"
#include "collector/store/sqlite_transaction.h"

namespace rankscope::collector {
namespace {

using sqlite::CodeFor;

// Makes a new connection ready for the store (sqlite_schema.h, in its order): a read-only one
// checks the schema version; a read-write one sets its pragmas, creates or migrates the schema
// and, once per old file, turns on incremental auto-vacuum.
absl::Status SetUpConnection(const std::string& path, const StoreOptions& options, sqlite3* db) {
  sqlite::SetBusyTimeout(options, db);
  if (options.read_only) return sqlite::CheckSchemaVersion(path, db);
  if (absl::Status s = sqlite::SetWritePragmas(path, options, db); !s.ok()) return s;
  if (absl::Status s = sqlite::CreateOrMigrateSchema(path, db); !s.ok()) return s;
  return sqlite::EnableIncrementalVacuum(path, db);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SqliteStore>> SqliteStore::Open(const std::string& path) {
  return Open(path, StoreOptions());
}

absl::StatusOr<std::unique_ptr<SqliteStore>> SqliteStore::Open(const std::string& path,
                                                               const StoreOptions& options) {
  sqlite3* db = nullptr;
  // NOMUTEX: a SqliteStore is thread-compatible, its owner serializes calls.
  const int flags =
      (options.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
      SQLITE_OPEN_NOMUTEX;
  int rc = sqlite3_open_v2(path.c_str(), &db, flags, nullptr);
  if (rc != SQLITE_OK) {
    absl::Status status(CodeFor(rc),
                        absl::StrFormat("sqlite_store %s: open: %s [sqlite code %d]", path,
                                        db ? sqlite3_errmsg(db) : sqlite3_errstr(rc), rc));
    sqlite3_close(db);
    return status;
  }
  if (absl::Status s = SetUpConnection(path, options, db); !s.ok()) {
    sqlite3_close(db);
    return s;
  }
  // From here the store owns `db` and closes it on every path.
  std::unique_ptr<SqliteStore> store(new SqliteStore(path, db));
  absl::StatusOr<sqlite::TransactionStatements> transaction =
      sqlite::TransactionStatements::Prepare(db, path);
  if (!transaction.ok()) return transaction.status();
  store->stmts_->transaction = *std::move(transaction);
  absl::StatusOr<sqlite::WriteStatements> write = sqlite::WriteStatements::Prepare(db, path);
  if (!write.ok()) return write.status();
  store->stmts_->write = *std::move(write);
  absl::StatusOr<sqlite::ReadStatements> read = sqlite::ReadStatements::Prepare(db, path);
  if (!read.ok()) return read.status();
  store->stmts_->read = *std::move(read);
  return store;
}

SqliteStore::SqliteStore(std::string path, sqlite3* db)
    : path_(std::move(path)), db_(db), stmts_(std::make_unique<Statements>()) {}

SqliteStore::~SqliteStore() {
  stmts_.reset();  // statements are finalized before their connection is closed
  sqlite3_close(db_);
}

absl::Status SqliteStore::SqlError(int rc, absl::string_view what) const {
  return sqlite::SqlStatus(rc, path_, what, db_);
}

absl::Status SqliteStore::InTransaction(absl::FunctionRef<absl::Status()> body) {
  return sqlite::InWriteTransaction(db_, path_, stmts_->transaction, body);
}

}  // namespace rankscope::collector
