-- A rankscope database as the first release (schema_version 1, commit ee68240) wrote it:
-- its kCreateSchema verbatim, then one job with one step of two ranks.
-- sqlite_store_test.cc MigratesADatabaseOfTheFirstRelease opens it with this build.
CREATE TABLE IF NOT EXISTS jobs(
  job TEXT NOT NULL PRIMARY KEY,
  world_size INTEGER NOT NULL,
  sketch_dim INTEGER NOT NULL,
  sketch_seed INTEGER NOT NULL,  -- uint64 bit pattern
  first_seen REAL NOT NULL,
  last_seen REAL NOT NULL,
  last_step INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS rank_steps(
  job TEXT NOT NULL,
  step INTEGER NOT NULL,
  rank INTEGER NOT NULL,
  attempt INTEGER NOT NULL,
  join_size INTEGER NOT NULL,
  loss REAL,
  grad_norm REAL,
  grad_cosine REAL,
  loss_z REAL,
  grad_norm_z REAL,
  nonfinite INTEGER NOT NULL DEFAULT 0,
  reduced_grad_fingerprint INTEGER,  -- uint64 bit pattern
  param_fingerprint INTEGER,         -- uint64 bit pattern
  step_time_seconds REAL,
  received_at REAL NOT NULL,
  replica_ok INTEGER,                -- 1, 0, or NULL when no fingerprint was checked
  outlier_score REAL,
  step_time_z REAL,
  PRIMARY KEY(job, step, rank)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS step_stats(
  job TEXT NOT NULL,
  step INTEGER NOT NULL,
  attempt INTEGER NOT NULL,
  ranks INTEGER NOT NULL,
  world_size INTEGER NOT NULL,
  loss_mean REAL,
  loss_std REAL,
  loss_range REAL,
  grad_norm_mean REAL,
  grad_norm_std REAL,
  grad_norm_cv REAL,
  grad_cosine_mean REAL,
  missing_ranks TEXT NOT NULL DEFAULT '',
  timed_out INTEGER NOT NULL DEFAULT 0,
  completed_at REAL NOT NULL,
  grad_noise_scale REAL,
  replica_checked INTEGER NOT NULL DEFAULT 0,
  replica_divergent_ranks TEXT NOT NULL DEFAULT '',
  outlier_ranks TEXT NOT NULL DEFAULT '',
  PRIMARY KEY(job, step)) WITHOUT ROWID;
INSERT INTO jobs VALUES('old-job', 2, 64, 7, 1700000000.0, 1700000100.0, 41);
INSERT INTO step_stats(job, step, attempt, ranks, world_size, loss_mean, loss_std, loss_range,
  grad_norm_mean, grad_norm_std, grad_norm_cv, grad_cosine_mean, missing_ranks, timed_out,
  completed_at, grad_noise_scale, replica_checked, replica_divergent_ranks, outlier_ranks)
  VALUES('old-job', 41, 0, 2, 2, 1.5, 0.5, 1.0, 3.0, 1.0, 0.3333, 0.25, '', 0, 1700000100.0,
         NULL, 1, '', '1');
INSERT INTO rank_steps(job, step, rank, attempt, join_size, loss, grad_norm, grad_cosine,
  received_at) VALUES('old-job', 41, 0, 0, 2, 1.0, 2.0, 0.25, 1700000099.0);
INSERT INTO rank_steps(job, step, rank, attempt, join_size, loss, grad_norm, grad_cosine,
  received_at) VALUES('old-job', 41, 1, 0, 2, 2.0, 4.0, 0.25, 1700000099.5);
PRAGMA user_version = 1;
