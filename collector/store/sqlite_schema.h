// The SQLite schema of the store (documented in sqlite_store.h) and the setting up of a new
// connection: pragmas (busy timeout, WAL, synchronous, size cap), the schema version check
// (PRAGMA user_version), schema creation and migrations, and the one-time VACUUM that turns on
// incremental auto-vacuum. Private to the SQLite sink.
//
// Thread safety: each function runs once on a connection not yet shared.
#ifndef RANKSCOPE_COLLECTOR_STORE_SQLITE_SCHEMA_H_
#define RANKSCOPE_COLLECTOR_STORE_SQLITE_SCHEMA_H_

#include <string>

#include "absl/status/status.h"
#include "collector/store/sqlite_store.h"

struct sqlite3;

namespace rankscope::collector::sqlite {

// Opening a store's connection, in this order (SqliteStore::Open). Errors name `path` and are
// those documented on SqliteStore::Open; the caller closes `db` on failure.

// Every connection: extended result codes and options.busy_timeout.
void SetBusyTimeout(const StoreOptions& options, sqlite3* db);

// A read-only connection: checks that the file has the schema version this build reads
// (kFailedPrecondition for none, an older or a newer one).
absl::Status CheckSchemaVersion(const std::string& path, sqlite3* db);

// A read-write connection: WAL, synchronous, the size cap (max_page_count), incremental
// auto-vacuum and the WAL's size limit.
absl::Status SetWritePragmas(const std::string& path, const StoreOptions& options, sqlite3* db);

// A read-write connection: creates the schema on a new file or migrates an older one to
// SqliteStore::kSchemaVersion, in one write transaction (a newer one: kFailedPrecondition).
absl::Status CreateOrMigrateSchema(const std::string& path, sqlite3* db);

// A read-write connection, after CreateOrMigrateSchema: a file written before schema 5 has
// auto_vacuum=NONE, which only a VACUUM can change: it rewrites the whole file once (seconds per
// GB, the writer waits; readers keep reading), needs as much free disk as the file, and never
// runs again on this file. If the VACUUM fails (e.g. the disk is too full) it is logged and the
// store still works; the file just does not shrink when pruned. Errors: reading the pragma.
absl::Status EnableIncrementalVacuum(const std::string& path, sqlite3* db);

}  // namespace rankscope::collector::sqlite

#endif  // RANKSCOPE_COLLECTOR_STORE_SQLITE_SCHEMA_H_
