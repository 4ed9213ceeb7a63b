// The SQLite schema of the store (documented in sqlite_store.h) and the configuration of a new
// connection: pragmas (busy timeout, WAL, synchronous, size cap), schema creation, the schema
// version check (PRAGMA user_version) and migrations. Private to the SQLite sink.
//
// Thread safety: ConfigureConnection runs once on a connection not yet shared.
#ifndef RANKSCOPE_COLLECTOR_STORE_SQLITE_SCHEMA_H_
#define RANKSCOPE_COLLECTOR_STORE_SQLITE_SCHEMA_H_

#include <string>

#include "absl/status/status.h"
#include "collector/store/sqlite_store.h"

struct sqlite3;

namespace rankscope::collector::sqlite {

// Sets the connection's pragmas and creates (or checks) the schema; a read-only connection only
// checks that the file has a schema this build can read. Errors name `path` and are those
// documented on SqliteStore::Open; the caller closes `db` on failure.
absl::Status ConfigureConnection(const std::string& path, const StoreOptions& options, sqlite3* db);

}  // namespace rankscope::collector::sqlite

#endif  // RANKSCOPE_COLLECTOR_STORE_SQLITE_SCHEMA_H_
