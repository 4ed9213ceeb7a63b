#!/usr/bin/env bash
# rankscope demo: a collector, a healthy simulated job and a faulty one, then what rankscope saw.
#
# usage: tools/demo.sh BUILD_DIR [--no-wait]
# Everything runs on 127.0.0.1 with free ports; state goes to BUILD_DIR/demo/. At the end the
# collector stays up, serving its web view, until Enter is pressed; only when stdin is a terminal
# and --no-wait (or RANKSCOPE_DEMO_NO_WAIT=1) is not given, so scripts and CI never wait.
set -euo pipefail
BUILD_DIR="$(cd "${1:?usage: tools/demo.sh BUILD_DIR [--no-wait]}" && pwd)"
NO_WAIT="${RANKSCOPE_DEMO_NO_WAIT:-0}"
[[ "${2:-}" == "--no-wait" ]] && NO_WAIT=1
BIN="$BUILD_DIR/bin"
PY="${RANKSCOPE_PYTHON:-python3}"  # ./run sets the project's environment
WORK="$BUILD_DIR/demo"
rm -rf "$WORK" && mkdir -p "$WORK"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
GRPC_PORT=$(free_port)
METRICS_PORT=$(free_port)
HTTP_PORT=$(free_port)
DB="$WORK/rankscope.db"

"$BIN/rankscope-collector" --grpc_address="127.0.0.1:$GRPC_PORT" \
  --metrics_address="127.0.0.1:$METRICS_PORT" --http_address="127.0.0.1:$HTTP_PORT" \
  --db_path="$DB" --step_timeout=2s \
  2>"$WORK/collector.log" &
COLLECTOR_PID=$!
cleanup() { kill -TERM "$COLLECTOR_PID" 2>/dev/null || true; wait "$COLLECTOR_PID" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 100); do grep -q "serving gRPC" "$WORK/collector.log" 2>/dev/null && break; sleep 0.1; done
grep -q "serving gRPC" "$WORK/collector.log" || { cat "$WORK/collector.log"; exit 1; }
echo "== collector on 127.0.0.1:$GRPC_PORT, metrics on http://127.0.0.1:$METRICS_PORT/metrics, db $DB"
echo "== web view: http://127.0.0.1:$HTTP_PORT/ (open it now to watch the jobs live)"

STEPS=${RANKSCOPE_DEMO_STEPS:-300}
echo "== two simulated 16-rank jobs, $STEPS steps each, 20 ms a step:"
echo "   demo-healthy: ranks agree (pairwise gradient cosine 0.9)"
echo "   demo-faulty:  rank 5 goes astray at step 150 (loss +1, grad norm x3, random direction),"
echo "                 rank 11 falls silent at step 200"
"$BIN/rankscope-loadgen" --collector="127.0.0.1:$GRPC_PORT" --job=demo-healthy --ranks=16 \
  --steps="$STEPS" --cosine=0.9 >"$WORK/healthy.out" 2>"$WORK/healthy.err" &
HEALTHY=$!
"$BIN/rankscope-loadgen" --collector="127.0.0.1:$GRPC_PORT" --job=demo-faulty --ranks=16 \
  --steps="$STEPS" --cosine=0.9 --outlier_rank=5 --outlier_from_step=150 \
  --silent_rank=11 --silent_from_step=200 --progress >"$WORK/faulty.out" 2>"$WORK/faulty.err" &
FAULTY=$!
while kill -0 "$FAULTY" 2>/dev/null; do
  printf '\r   progress: %s ' "$(tail -n1 "$WORK/faulty.err" 2>/dev/null | tr -d '\n')"
  sleep 1
done
wait "$HEALTHY"; wait "$FAULTY" || true
echo
cat "$WORK/healthy.out" "$WORK/faulty.out"

echo
echo "== rankscope jobs"
"$BIN/rankscope" --collector="127.0.0.1:$GRPC_PORT" jobs
echo
echo "== rankscope show --job=demo-faulty --once --limit=5"
"$BIN/rankscope" --collector="127.0.0.1:$GRPC_PORT" show --job=demo-faulty --once --limit=5

echo
echo "== what the averaged loss hides (from SQLite: means over step ranges)"
sqlite3 -header -column "$DB" "
  SELECT job,
         CASE WHEN step < 150 THEN 'steps 1-149' ELSE 'steps 150-$STEPS' END AS phase,
         printf('%.3f', AVG(loss_mean)) AS loss_mean,
         printf('%.4f', AVG(loss_std)) AS loss_std,
         printf('%.3f', AVG(grad_norm_cv)) AS grad_norm_cv,
         printf('%.3f', AVG(grad_cosine_mean)) AS direction_consistency,
         SUM(timed_out) AS steps_with_missing_ranks
  FROM step_stats GROUP BY job, phase ORDER BY job, phase;"
echo
echo "== the rank that disagrees (lowest mean consensus cosine after step 150, demo-faulty)"
sqlite3 -header -column "$DB" "
  SELECT rank, printf('%.3f', AVG(grad_cosine)) AS consensus_cosine,
         printf('%.2f', AVG(loss_z)) AS loss_z, printf('%.2f', AVG(grad_norm_z)) AS grad_norm_z
  FROM rank_steps WHERE job = 'demo-faulty' AND step >= 150 AND grad_cosine IS NOT NULL
  GROUP BY rank ORDER BY AVG(grad_cosine) ASC LIMIT 3;"
echo
echo "== missing ranks named by the collector (demo-faulty)"
sqlite3 "$DB" "SELECT 'rank(s) ' || missing_ranks || ' missing from ' || COUNT(*) || ' steps'
               FROM step_stats WHERE job = 'demo-faulty' AND missing_ranks != ''
               GROUP BY missing_ranks;"
echo
echo "== a few of the exported Prometheus series"
"$PY" - "$METRICS_PORT" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
keep = ("rankscope_grad_cosine_mean{", "rankscope_loss_std_max_window{", "rankscope_rank_missing{",
        "rankscope_reports_received_total ")
for line in text.splitlines():
    if line.startswith(keep):
        print("  " + line)
PY
echo
echo "demo done: state in $WORK (collector.log, rankscope.db)"
echo "== web view: http://127.0.0.1:$HTTP_PORT/  (jobs; http://127.0.0.1:$HTTP_PORT/job/demo-faulty"
echo "   shows the outlier rank 5 and the silent rank 11 in the rank x step heatmap)"
if [[ -t 0 && "$NO_WAIT" != 1 ]]; then
  read -r -p "   press Enter to stop the demo collector " _ || true
fi
