"""The `rankscope` CLI (real binary) against a real collector and its real SQLite file.

A job of 8 simulated ranks (the real agent library, through tools/loadgen) runs 40 steps with
rank 5 an outlier from step 20 and rank 3's replica fingerprints diverging from step 30; every
verb's output is checked against what SQLite holds.
"""

import csv
import io
import json
import subprocess

import pytest

from conftest import BUILD_DIR, CLI_BIN, Collector, run_loadgen

JOB = "cli-a"
STEPS, RANKS, OUTLIER, DIVERGENT = 40, 8, 5, 3


def cli(*args, collector=None, check=True, timeout=60):
    if not CLI_BIN.exists():
        pytest.skip(f"{CLI_BIN} not built")
    argv = [str(CLI_BIN)]
    if collector is not None:
        argv.append(f"--collector={collector.address}")
    out = subprocess.run(argv + list(args), capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"rankscope {' '.join(args)}: {out.stdout}{out.stderr}"
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    c = Collector(tmp_path_factory.mktemp("cli")).start()
    try:
        run_loadgen(
            c,
            JOB,
            RANKS,
            STEPS,
            f"--outlier_rank={OUTLIER}",
            "--outlier_from_step=20",
            "--outlier_loss_shift=5",
            f"--divergent_rank={DIVERGENT}",
            "--divergent_from_step=30",
            "--param_check_every=10",
        )
        # loadgen exits after every report is acked, i.e. committed.
        assert len(c.step_rows(JOB)) == STEPS
        yield c
    finally:
        if c.proc is not None:
            c.stop()


def stored_steps(c):
    cols = (
        "step",
        "loss_mean",
        "loss_std",
        "grad_norm_cv",
        "grad_cosine_mean",
        "grad_noise_scale",
        "replica_divergent_ranks",
        "outlier_ranks",
    )
    rows = c.query(f"SELECT {', '.join(cols)} FROM step_stats WHERE job = ? ORDER BY step", (JOB,))
    return [dict(zip(cols, r)) for r in rows]


def same(a: str, b) -> bool:
    if b is None:
        return a in ("", "nan")
    return float(a) == float(b)


def test_help_on_every_verb():
    for verb in ("jobs", "show", "export", "report", "ctl"):
        out = cli(verb, "--help")
        first = out.stdout.splitlines()[0].split()
        assert first[0] == "rankscope" and verb in first, out.stdout
    assert "--format=csv|json" in cli("export", "--help").stdout
    assert "-o report.png" in cli("report", "-h").stdout


@pytest.mark.parametrize(
    "binary,flags",
    [
        ("rankscope", ("--collector", "--job", "--format", "--auth_token_file")),
        (
            "rankscope-collector",
            (
                "--grpc_address",
                "--metrics_address",
                "--db_path",
                "--max_streams",
                "--hello_timeout",
                "--http_address",
                "--http_threads",
                "--http_request_timeout",
            ),
        ),
        ("rankscope-loadgen", ("--collector", "--ranks", "--groups", "--outlier_rank")),
    ],
)
def test_help_exits_zero_and_lists_only_the_binarys_own_flags(binary, flags):
    """Issue 12.9: `--help` exits 0 (scripts check it) and shows the binary's own flags, without
    the source paths absl prints ("Flags from /path/to/main.cc") or the libraries' flags."""
    path = BUILD_DIR / "bin" / binary
    if not path.exists():
        pytest.skip(f"{path} not built")
    for arg in ("--help", "-h", "--helpshort"):
        out = subprocess.run([str(path), arg], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{binary} {arg}: {out.returncode} {out.stderr}"
        for flag in flags:
            assert f"  {flag} (default " in out.stdout, (flag, out.stdout)
        assert "Flags from" not in out.stdout, out.stdout
        assert ".cc" not in out.stdout, out.stdout
        assert "--flagfile" not in out.stdout and "--fromenv" not in out.stdout, out.stdout


def test_jobs_lists_the_job(job):
    out = cli("jobs", collector=job).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith(JOB + " "))
    fields = line.split()
    assert fields[1] == str(RANKS) and fields[3] == str(STEPS)


def test_show_once_has_the_steps_and_the_worst_ranks(job):
    out = cli("show", f"--job={JOB}", "--once", "--limit=5", "--worst=3", collector=job).stdout
    lines = out.splitlines()
    assert lines[0] == f"job {JOB}: 5 steps (newest first)"
    header = lines[1].split()
    assert header[:3] == ["STEP", "RANKS", "LOSS_MEAN"]
    assert "DIVERGENT" in header and "OUTLIERS" in header
    rows = [ln.split() for ln in lines[2:7]]
    assert [int(r[0]) for r in rows] == list(range(STEPS, STEPS - 5, -1))
    div_col, out_col = header.index("DIVERGENT"), header.index("OUTLIERS")
    stored = {s["step"]: s for s in stored_steps(job)}
    for r in rows:
        s = stored[int(r[0])]
        assert r[div_col] == (s["replica_divergent_ranks"] or "ok")
        assert r[out_col] == (s["outlier_ranks"] or "-")
    assert str(DIVERGENT) in rows[0][div_col].split(",")
    assert str(OUTLIER) in rows[0][out_col].split(",")
    i = lines.index(f"worst ranks of step {STEPS} (by outlier score):")
    worst = [ln.split() for ln in lines[i + 2 : i + 5]]
    assert len(worst) == 3 and worst[0][0] == str(OUTLIER)
    scores = [float(w[1]) for w in worst]
    assert scores == sorted(scores, reverse=True)
    db = {
        r[0]: r[1]
        for r in job.query(
            "SELECT rank, outlier_score FROM rank_steps WHERE job = ? AND step = ?", (JOB, STEPS)
        )
    }
    assert max(db, key=db.get) == OUTLIER
    replica = {int(w[0]): w[-1] for w in worst}
    for rank, verdict in replica.items():
        assert verdict == ("DIVERGED" if rank == DIVERGENT else "ok")


def test_export_csv_of_steps_matches_sqlite_from_the_collector_and_the_file(job):
    stored = stored_steps(job)
    for source in ([], [f"--db={job.db_path}"]):
        out = cli("export", f"--job={JOB}", "--format=csv", *source, collector=job).stdout
        rows = list(csv.DictReader(io.StringIO(out)))
        assert [int(r["step"]) for r in rows] == [s["step"] for s in stored]
        for r, s in zip(rows, stored):
            for col in (
                "loss_mean",
                "loss_std",
                "grad_norm_cv",
                "grad_cosine_mean",
                "grad_noise_scale",
            ):
                assert same(r[col], s[col]), (source, r["step"], col, r[col], s[col])
            assert r["replica_divergent_ranks"] == (s["replica_divergent_ranks"] or "").replace(
                ",", ";"
            )
            assert r["outlier_ranks"] == (s["outlier_ranks"] or "").replace(",", ";")
            assert r["ranks"] == str(RANKS) and r["world_size"] == str(RANKS)


def test_export_csv_of_ranks_matches_sqlite(job):
    stored = job.query(
        "SELECT step, rank, loss, outlier_score, replica_ok, param_fingerprint, "
        "step_time_z FROM rank_steps WHERE job = ? ORDER BY step, rank",
        (JOB,),
    )
    assert len(stored) == STEPS * RANKS
    for source in ([], [f"--db={job.db_path}"]):
        out = cli(
            "export", f"--job={JOB}", "--format=csv", "--table=ranks", *source, collector=job
        ).stdout
        rows = list(csv.DictReader(io.StringIO(out)))
        assert len(rows) == len(stored)
        for r, (step, rank, loss, score, ok, pfp, tz) in zip(rows, stored):
            assert (int(r["step"]), int(r["rank"])) == (step, rank)
            assert float(r["loss"]) == loss
            assert same(r["outlier_score"], score) and same(r["step_time_z"], tz)
            assert r["replica_ok"] == ("" if ok is None else str(ok))
            # SQLite holds the uint64 bit pattern as int64.
            assert r["param_fingerprint"] == ("" if pfp is None else str(pfp & (2**64 - 1)))
    diverged = {(int(r["step"]), int(r["rank"])) for r in rows if r["replica_ok"] == "0"}
    assert (STEPS, DIVERGENT) in diverged and all(rk == DIVERGENT for _, rk in diverged)


def test_export_json_is_the_same_from_the_collector_and_the_file(job):
    a = json.loads(cli("export", f"--job={JOB}", "--format=json", collector=job).stdout)
    b = json.loads(
        cli("export", f"--job={JOB}", "--format=json", f"--db={job.db_path}", collector=job).stdout
    )
    assert a == b
    assert len(a["steps"]) == STEPS and len(a["ranks"]) == STEPS * RANKS
    # Small pages (3 step rows, or 1 step of rank rows, a request) give the same export.
    paged = json.loads(
        cli("export", f"--job={JOB}", "--format=json", "--page_rows=3", collector=job).stdout
    )
    assert paged == a
    last = a["steps"][-1]
    assert int(last["step"]) == STEPS
    assert DIVERGENT in last["replica_divergent_ranks"] and OUTLIER in last["outlier_ranks"]
    part = json.loads(
        cli(
            "export",
            f"--job={JOB}",
            "--format=json",
            "--first_step=10",
            "--last_step=12",
            collector=job,
        ).stdout
    )
    assert [int(s["step"]) for s in part["steps"]] == [10, 11, 12]
    assert len(part["ranks"]) == 3 * RANKS


def test_report_writes_a_png_from_the_collector_and_the_file(job, tmp_path):
    for i, source in enumerate(([], [f"--db={job.db_path}"])):
        png = tmp_path / f"report{i}.png"
        cli("report", f"--job={JOB}", "-o", str(png), *source, collector=job, timeout=120)
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_errors_are_clear(job, tmp_path):
    out = cli("export", "--job=nope", "--format=csv", collector=job, check=False)
    assert out.returncode == 1 and "no steps stored for job nope" in out.stderr
    out = cli("export", f"--job={JOB}", "--format=xml", collector=job, check=False)
    assert out.returncode == 2 and "--format must be csv or json" in out.stderr
    out = cli("report", f"--job={JOB}", collector=job, check=False)
    assert out.returncode == 2 and "-o" in out.stderr
    out = cli("export", f"--job={JOB}", f"--db={tmp_path / 'missing.db'}", check=False)
    assert out.returncode == 1 and "missing.db" in out.stderr
    dead = Collector.__new__(Collector)
    dead.host, dead.port = "127.0.0.1", 1
    out = cli("show", f"--job={JOB}", "--once", "--timeout=2s", collector=dead, check=False)
    assert out.returncode == 1 and "collector unreachable" in out.stderr
