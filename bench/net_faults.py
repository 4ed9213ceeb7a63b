#!/usr/bin/env python3
"""Network faults between the ranks' host and the collector's, at full length (run by hand, as
root; results in docs/reliability.md "Network faults").

Two real DDP ranks (gloo, the real shim; tests/python/netfault_ranks.py) in one network namespace,
the real collector in another, joined through this namespace by veth links and the fault proxy
(tests/python/fault_proxy.py, netns.py). One run trains through these phases, each --phase
seconds unless said:

    clean         nothing wrong (the step-time reference)
    partition     the ranks' link down for --partition seconds (30), then healed
    latency       500 ms added each way
    throttle      64 KiB/s each way
    blackhole     every connection reset, reconnects accepted and never answered (60 s at
                  least); healed by passing again *without* resetting them: the agents must
                  notice by themselves (keepalive)
    reset         every connection reset mid-stream, --phase seconds
    half-open     every connection frozen (no FIN, no answer): both sides must notice by
                  keepalive; new connections pass
    long          (with --long SECONDS, e.g. 600) a partition that long: the agents' buffers
                  overflow, drops are counted by the agents and exported by the collector
    after         clean again until everything buffered is stored

For each phase it prints the ranks' median step time over the clean phase's (a ratio, measured by
the ranks), and at the end: steps trained, rows stored, reports dropped (the agents' count and the
collector's rankscope_agent_dropped_reports_total), duplicate rows (0), the peak RSS of each rank
process and of the collector. Then, with --half-open N, a second measurement: N connections that
completed the HTTP/2 preface are frozen half-open at the collector (through a second proxy); the
collector's RSS is sampled until its keepalive closed them all.

    sudo .venv/bin/python bench/net_faults.py --build build                  # ~6 minutes
    sudo .venv/bin/python bench/net_faults.py --build build --long 600 --half-open 4000
"""

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "python"))


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def descendants(pid: int) -> list:
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):  # gone meanwhile
                continue
            if int(fields[1]) == pid:
                kids.append(int(p.name))
    return kids + [g for k in kids for g in descendants(k)]


# Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
# runs, the table it prints; the measured pieces are functions of their own.
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=str(REPO / "build"))
    ap.add_argument("--phase", type=float, default=30.0, help="seconds of each phase")
    ap.add_argument("--partition", type=float, default=30.0)
    ap.add_argument("--long", type=float, default=0.0, help="seconds of the long partition")
    ap.add_argument("--half-open", type=int, default=0, help="half-open connections to make")
    ap.add_argument(
        "--queue",
        type=int,
        default=8192,
        help="the agents' queue_capacity: the buffer horizon in steps (the shim's default, 1,024, "
        "lasts 13 s at this bench's ~80 steps a second, minutes at real step rates)",
    )
    ap.add_argument("--json", default="", help="write the results here too")
    a = ap.parse_args()
    os.environ["RANKSCOPE_BUILD_DIR"] = str(Path(a.build).resolve())

    import netns
    from conftest import Collector, child_pythonpath, parse_metric
    from fault_proxy import FaultProxy

    reason = netns.unavailable_reason()
    if reason:
        sys.exit(f"net_faults: {reason}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp = Path(
        subprocess.check_output(["mktemp", "-d", "/tmp/net_faults.XXXXXX"], text=True).strip()
    )
    net = netns.Namespaces().create()
    collector = Collector(tmp, prefix=net.prefix(net.coll_ns), host=net.coll_ip).start()
    proxy = FaultProxy(net.ranks_gw, collector.host, collector.port).start()
    job, work = "netfault-bench", tmp / "work"
    work.mkdir()
    log = open(work / "ranks.log", "w")
    ranks = subprocess.Popen(
        [
            *net.prefix(net.ranks_ns),
            sys.executable,
            str(REPO / "tests" / "python" / "netfault_ranks.py"),
            f"--collector={proxy.address}",
            f"--job={job}",
            f"--work={work}",
            f"--timeout={a.long + 20 * a.phase + 600}",
            "--attach=" + json.dumps({"queue_capacity": a.queue}),
        ],
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the launcher and its ranks: one process group to kill
    )
    peaks = {"collector": 0, "ranks": 0}
    samples = []

    def sample():
        c = rss_kib(collector.proc.pid)
        for pid in descendants(collector.proc.pid):
            c = max(c, rss_kib(pid))
        r = max((rss_kib(p) for p in descendants(ranks.pid)), default=0)
        peaks["collector"] = max(peaks["collector"], c)
        peaks["ranks"] = max(peaks["ranks"], r)
        return c, r

    def progress():
        try:
            return json.loads((work / "progress.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"step": 0, "phase": 0}

    bounds = []  # (phase name, first step, step after its end), as rank 0 saw them

    def run(phase, seconds, name):
        (work / "phase").write_text(str(phase))
        first = progress()["step"]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if ranks.poll() is not None:
                sys.exit(f"ranks exited {ranks.returncode}: {(work / 'ranks.log').read_text()}")
            c, r = sample()
            samples.append((name, time.monotonic(), c, r, progress()["step"]))
            time.sleep(1)
        bounds.append((name, first, progress()["step"]))
        print(
            f"  {name}: {seconds:.0f} s, step {progress()['step']}, rows stored {stored()}, "
            f"connections accepted by the proxy so far {proxy.accepted}",
            flush=True,
        )

    def stored():
        return collector.query("SELECT COUNT(*) FROM rank_steps WHERE job = ?", (job,))[0][0]

    names = []
    try:
        while progress()["step"] < 5:
            time.sleep(0.5)
        names.append("clean")
        run(0, a.phase, "clean")
        names.append("partition")
        net.partition()
        run(1, a.partition, "partition")
        net.heal()
        names.append("latency 500 ms")
        proxy.set_latency(0.5)
        run(2, a.phase, "latency 500 ms")
        proxy.set_latency(0.0)
        names.append("throttle 64 KiB/s")
        proxy.set_throttle(64 * 1024)
        run(3, a.phase, "throttle 64 KiB/s")
        proxy.set_throttle(None)
        names.append("blackhole")
        proxy.set_mode("blackhole")
        proxy.reset_all()
        run(4, max(a.phase, 60), "blackhole")
        proxy.set_mode("pass")  # no reset: the agents must notice the blackhole themselves
        names.append("reset")
        for _ in range(int(a.phase // 5)):
            proxy.reset_all()
            run(5, 5, "reset")
        names.append("half-open")
        proxy.set_mode("freeze")
        proxy.set_mode("pass")  # the frozen ones stay frozen; new connections pass
        run(6, max(a.phase, 60), "half-open")
        if a.long:
            names.append(f"partition {a.long:.0f} s")
            net.partition()
            run(7, a.long, f"partition {a.long:.0f} s")
            net.heal()
        else:
            names.append("(no long partition)")
        names.append("after")
        (work / "phase").write_text("8")
        # Until everything the agents still hold of the steps before the heal is stored: every
        # one, or (after drops) no new row of them for 15 s; at most 300 s.
        deadline = time.monotonic() + 300
        last, still_since = -1, time.monotonic()
        healed_at = progress()["step"]
        while time.monotonic() < deadline:
            n = collector.query(
                "SELECT COUNT(*) FROM rank_steps WHERE job = ? AND step < ?", (job, healed_at)
            )[0][0]
            if n >= 2 * healed_at:
                break
            if n != last:
                last, still_since = n, time.monotonic()
            elif time.monotonic() - still_since > 15:
                break
            sample()
            time.sleep(1)
        run(8, 10, "after")
        (work / "phase").write_text("-1")
        ranks.wait(600)
        results = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
        time.sleep(2)
        metrics = collector.scrape()
    except BaseException:
        collector.stop()
        net.destroy()
        raise
    finally:
        try:
            os.killpg(ranks.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proxy.close()

    steps = results[0]["steps"]
    rows = collector.query(
        "SELECT rank, COUNT(*), COUNT(DISTINCT step) FROM rank_steps WHERE job = ? GROUP BY rank",
        (job,),
    )
    dropped_agents = sum(r["stats"]["dropped"] for r in results)
    dropped_exported = parse_metric(metrics, "rankscope_agent_dropped_reports_total", train_job=job)
    out = {
        "steps": steps,
        "stored_per_rank": {r: n for r, n, _ in rows},
        "duplicates": sum(n - d for _, n, d in rows),
        "dropped_by_agents": dropped_agents,
        "dropped_exported": dropped_exported,
        "lost_silently": 2 * steps - sum(n for _, n, _ in rows) - dropped_agents,
        "reconnects": [r["stats"]["reconnects"] for r in results],
        "peak_rss_mib": {k: round(v / 1024, 1) for k, v in peaks.items()},
        "step_time_ratio": {},
    }
    for p, name in enumerate(names):
        meds = [statistics.median(r["times"][str(p)]) for r in results if str(p) in r["times"]]
        clean = [statistics.median(r["times"]["0"]) for r in results]
        if meds:
            out["step_time_ratio"][name] = round(max(m / c for m, c in zip(meds, clean)), 3)
    # Reports missing from the store, by the phase their step was trained in (each is one the
    # agents dropped and counted, when lost_silently is 0).
    out["missing_by_phase"] = {}
    for name, first, after in bounds:
        n = collector.query(
            "SELECT COUNT(*) FROM rank_steps WHERE job = ? AND step >= ? AND step < ?",
            (job, first, after),
        )[0][0]
        key = name if name not in out["missing_by_phase"] else f"{name} ({first})"
        out["missing_by_phase"][key] = 2 * (after - first) - n
    out["clean_step_ms"] = round(1e3 * max(statistics.median(r["times"]["0"]) for r in results), 2)
    out["rss_by_phase_mib"] = {
        name: {
            "collector": round(max(s[2] for s in samples if s[0] == name) / 1024, 1),
            "ranks": round(max(s[3] for s in samples if s[0] == name) / 1024, 1),
        }
        for name in dict.fromkeys(s[0] for s in samples)
    }

    if a.half_open:
        out["half_open"] = half_open(a.half_open, net, collector, FaultProxy)
    collector.stop()
    net.destroy()
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


def half_open(n, net, collector, FaultProxy):
    """n connections that sent the HTTP/2 preface and SETTINGS, then frozen half-open (no FIN,
    no answer) at the collector: its RSS before, at the peak and once keepalive closed them."""
    proxy = FaultProxy(net.coll_gw, collector.host, collector.port).start()
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
    before = rss_kib(collector.proc.pid)
    socks = []
    for _ in range(n):
        s = socket.create_connection((proxy.listen_host, proxy.listen_port))
        s.sendall(preface)
        socks.append(s)
    while proxy.live < n:
        time.sleep(0.1)
    time.sleep(2)  # the collector answered every preface (its SETTINGS)
    proxy.set_mode("freeze")
    t0 = time.monotonic()
    peak, series = 0, []
    open_at_collector = n
    while time.monotonic() - t0 < 180:
        r = rss_kib(collector.proc.pid)
        peak = max(peak, r)
        open_at_collector = count_established(net, collector.port)
        series.append((round(time.monotonic() - t0), round(r / 1024, 1), open_at_collector))
        if open_at_collector == 0:
            break
        time.sleep(2)
    closed_after = round(time.monotonic() - t0)
    for s in socks:
        s.close()
    proxy.close()
    return {
        "connections": n,
        "collector_rss_mib_before": round(before / 1024, 1),
        "collector_rss_mib_peak": round(peak / 1024, 1),
        "collector_rss_mib_after": round(rss_kib(collector.proc.pid) / 1024, 1),
        "all_closed_by_collector_after_s": closed_after if open_at_collector == 0 else None,
        "series": series[:: max(1, len(series) // 20)],
    }


def count_established(net, port: int) -> int:
    out = subprocess.run(
        [*net.prefix(net.coll_ns), "ss", "-Htn", "state", "established", f"sport = :{port}"],
        capture_output=True,
        text=True,
    ).stdout
    return len([line for line in out.splitlines() if line.strip()])


if __name__ == "__main__":
    main()
