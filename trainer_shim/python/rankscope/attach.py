"""``rankscope attach``: make live training processes that never imported rankscope start
reporting, with no restart and no change to the script (``python -m rankscope.attach``; the
``rankscope attach`` verb runs this).

For each PID (or every rank of the torch.distributed job on this host, ``--all-local``):
  1. checks it is a Python process this user may trace, and writes a request (job, options,
     where to acknowledge) into a fresh 0700 folder in the target's /tmp, beside a copy of
     ``_attach_helper.so``;
  2. stops it with ptrace through ``gdb -batch -p PID``, loading no library symbols but libc's
     (``set auto-solib-add off``: reading libtorch's would stall the job for seconds), and on a
     thread other than the main one: maps a page for strings (nothing that mallocs), dlopen()s
     the helper, calls ``rankscope_attach_request(request)`` (it queues a Python pending call),
     unmaps the page and detaches. Python 3.14's ``sys.remote_exec`` replaces gdb where both
     this interpreter and the target have it;
  3. checks the process is running again (no tracer, not stopped; SIGCONT if it is), and waits
     for the payload's acknowledgement: the main thread ran it at its next bytecode boundary
     (rankscope._attach_payload);
  4. waits until every rank of each group agreed on the first step, and prints per PID: the
     step it reports from, the path (comm hook or parameter hooks), and the pause measured.
A process whose main thread never returns to Python (a hung collective) is reported "queued, not
run" and the command exits 1; no process is ever left stopped.
"""

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HELPER = "_attach_helper.so"
PTRACE_FIX = (
    "attach as the same user as the job, or as root / with CAP_SYS_PTRACE; with Yama "
    "(/proc/sys/kernel/yama/ptrace_scope = 1) a non-root user may trace only its own "
    "children: run as root or set it to 0; in Kubernetes, run `rankscope attach` in a "
    "container of the training pod with shareProcessNamespace: true and the "
    "SYS_PTRACE capability"
)


class AttachError(Exception):
    """A PID that cannot be attached; the message names the fix."""


# ---- checks on the target -----------------------------------------------------------------------


def _status(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            out[k] = v.strip()
    except OSError:
        pass
    return out


def python_version_of(pid: int):
    """(major, minor) of the Python a process runs, from its executable or mapped libpython;
    None when it is not a Python process."""
    pattern = re.compile(r"(?:^|/)(?:lib)?python(\d)\.(\d+)")
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError as e:
        raise AttachError(
            f"PID {pid}: cannot read /proc/{pid}/exe ({e.strerror}); {PTRACE_FIX}"
        ) from None
    m = pattern.search(os.path.basename(exe))
    if m:
        return int(m.group(1)), int(m.group(2))
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                m = pattern.search(line)
                if m and "libpython" in line:
                    return int(m.group(1)), int(m.group(2))
    except OSError:
        pass
    return None


def _may_trace(pid: int) -> None:
    st = _status(pid)
    if not st:
        raise AttachError(f"PID {pid}: no such process")
    uid = int(st.get("Uid", "0").split()[0])
    cap_eff = int(_status(os.getpid()).get("CapEff", "0"), 16)
    privileged = os.geteuid() == 0 or bool(cap_eff & (1 << 19))  # CAP_SYS_PTRACE
    if uid != os.geteuid() and not privileged:
        raise AttachError(
            f"PID {pid} belongs to uid {uid}, not to you (uid {os.geteuid()}): {PTRACE_FIX}"
        )
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        scope = 0
    if scope >= 3 or (scope == 2 and not privileged) or (scope == 1 and not privileged):
        raise AttachError(
            f"PID {pid}: ptrace is not permitted (kernel.yama.ptrace_scope = {scope}): {PTRACE_FIX}"
        )


def check_target(pid: int):
    """Raises AttachError when ``pid`` cannot be attached; returns its Python version."""
    _may_trace(pid)
    version = python_version_of(pid)
    if version is None:
        exe = os.readlink(f"/proc/{pid}/exe")
        raise AttachError(f"PID {pid} is not a Python process (it runs {exe})")
    state = _status(pid).get("State", "")
    if state.startswith("Z"):
        raise AttachError(f"PID {pid} has exited (zombie)")
    tracer = int(_status(pid).get("TracerPid", "0") or 0)
    if tracer:
        raise AttachError(
            f"PID {pid} is already traced by PID {tracer} (a debugger?); detach it first"
        )
    return version


def local_ranks():
    """PIDs of the torch.distributed ranks on this host (Python processes whose environment has
    RANK and WORLD_SIZE, as torchrun and torch.distributed.launch set), by job
    (MASTER_ADDR:MASTER_PORT and TORCHELASTIC_RUN_ID)."""
    jobs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(
            kv.split("=", 1) for kv in raw.decode("utf-8", "replace").split("\0") if "=" in kv
        )
        if "RANK" not in env or "WORLD_SIZE" not in env:
            continue
        try:
            if python_version_of(int(entry.name)) is None:
                continue
        except AttachError:
            continue
        key = (
            env.get("MASTER_ADDR", "") + ":" + env.get("MASTER_PORT", ""),
            env.get("TORCHELASTIC_RUN_ID", ""),
        )
        jobs.setdefault(key, []).append(int(entry.name))
    return {k: sorted(v) for k, v in jobs.items()}


# ---- injection ----------------------------------------------------------------------------------


def _prepare(pid: int, request: dict, package_dir: Path) -> Path:
    """Writes the request folder into the target's /tmp (as the target sees it); returns the
    folder's path as the target sees it."""
    token = secrets.token_hex(8)
    inside = Path(f"/tmp/rankscope-attach-{token}")
    outside = Path(f"/proc/{pid}/root") / inside.relative_to("/")
    outside.mkdir(mode=0o700)
    st = os.stat(f"/proc/{pid}")
    shutil.copyfile(package_dir / HELPER, outside / HELPER)
    request = dict(request, ack_path=str(inside / "ack.json"))
    (outside / "request.json").write_text(json.dumps(request))
    if os.geteuid() == 0 and st.st_uid != 0:  # the target must read its request
        for p in (outside, outside / HELPER, outside / "request.json"):
            os.chown(p, st.st_uid, st.st_gid)
    return inside


GDB_SCRIPT = r"""
python
import time
import gdb
print("RANKSCOPE_T_STOPPED %.6f" % time.time())
gdb.execute("sharedlibrary libc\\.so", to_string=True)
threads = sorted(gdb.selected_inferior().threads(), key=lambda t: t.num)
(threads[-1] if len(threads) > 1 else threads[0]).switch()
print("RANKSCOPE_THREADS %d" % len(threads))
try:
    page = int(gdb.parse_and_eval("(long) mmap(0, 4096, 3, 0x22, -1, 0)"))
    if page in (0, -1):
        print("RANKSCOPE_ERROR mmap failed")
    else:
        inferior = gdb.selected_inferior()
        inferior.write_memory(page, b"@HELPER@\0")
        inferior.write_memory(page + 1024, b"rankscope_attach_request\0")
        inferior.write_memory(page + 2048, b"@REQUEST@\0")
        handle = int(gdb.parse_and_eval("(long) dlopen((char *) %d, 2)" % page))
        if handle == 0:
            err = gdb.parse_and_eval("(char *) dlerror()")
            print("RANKSCOPE_ERROR dlopen failed: %s" % err.string())
        else:
            fn = int(gdb.parse_and_eval("(long) dlsym((void *) %d, (char *) %d)"
                                        % (handle, page + 1024)))
            if fn == 0:
                print("RANKSCOPE_ERROR dlsym failed")
            else:
                rc = int(gdb.parse_and_eval("((int (*)(char *)) %d)((char *) %d)"
                                            % (fn, page + 2048)))
                print("RANKSCOPE_QUEUED %d" % rc)
        gdb.parse_and_eval("(int) munmap((void *) %d, 4096)" % page)
except gdb.error as e:
    # A call into the process faulted; unwindonsignal undid it, so the process is as it was.
    print("RANKSCOPE_ERROR a call into the process failed and was undone (%s)"
          % str(e).splitlines()[0])
print("RANKSCOPE_T_DETACH %.6f" % time.time())
end
detach
quit
"""


def inject_gdb(pid: int, folder: Path, gdb: str, timeout: float) -> dict:
    """Runs gdb against ``pid``; returns {"stopped_s", "queued", "threads"} or raises."""
    script = GDB_SCRIPT.replace("@HELPER@", str(folder / HELPER)).replace(
        "@REQUEST@", str(folder / "request.json")
    )
    script_path = Path(f"/proc/{pid}/root") / folder.relative_to("/") / "attach.gdb"
    script_path.write_text(script)
    # The clock starts before gdb attaches (-iex runs first): the stop it reports is an upper
    # bound of the time the process was stopped. --readnever: no debug information is read (the
    # ELF symbol tables that name mmap, dlopen and dlsym are enough). Signals: while gdb runs a
    # function in the process (mmap, dlopen, the helper), a signal that arrives (a job's
    # SIGUSR1, SIGPIPE, SIGTERM, a timer...) is passed to the process's own handler, as if gdb
    # were not there, instead of stopping gdb inside the call; the faults that can only be the
    # call's own (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) stop it, and unwindonsignal then
    # undoes the call, so the process is never left inside a half-run function.
    cmd = [
        gdb,
        "-nx",
        "-batch",
        "--readnever",
        "-iex",
        "python import time; print('RANKSCOPE_T_BEGIN %.6f' % time.time())",
        "-iex",
        "set auto-solib-add off",
        "-iex",
        "set pagination off",
        "-iex",
        "set confirm off",
        "-iex",
        "set unwindonsignal on",
        "-iex",
        "handle all nostop noprint pass",
        "-iex",
        "handle SIGSEGV SIGBUS SIGILL SIGFPE SIGABRT stop print nopass",
        "-p",
        str(pid),
        "-x",
        str(script_path),
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, start_new_session=True
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or "") + (e.stderr or "") if isinstance(e.stdout, str) else ""
        raise AttachError(
            f"PID {pid}: gdb did not finish within {timeout:.0f} s; the process "
            f"was released. gdb said: {out.strip()[-400:]}"
        ) from None
    finally:
        _release(pid)
    out = proc.stdout + proc.stderr
    if "ptrace: Operation not permitted" in out or "Could not attach to process" in out:
        raise AttachError(f"PID {pid}: ptrace refused ({_first_line(out, 'ptrace')}): {PTRACE_FIX}")
    errors = re.findall(r"RANKSCOPE_ERROR (.*)", out)
    if errors:
        raise AttachError(f"PID {pid}: {errors[0]}")
    t0 = re.search(r"RANKSCOPE_T_BEGIN ([\d.]+)", out)
    t1 = re.search(r"RANKSCOPE_T_DETACH ([\d.]+)", out)
    queued = re.search(r"RANKSCOPE_QUEUED (-?\d+)", out)
    if not (t0 and t1 and queued):
        raise AttachError(f"PID {pid}: gdb could not run the attach script: {out.strip()[-600:]}")
    rc = int(queued.group(1))
    if rc != 0:
        why = {
            -1: "the request path was refused",
            -2: "another attach is still queued",
            -3: "the interpreter's pending-call queue is full",
        }.get(rc, f"code {rc}")
        raise AttachError(f"PID {pid}: the helper could not queue the request ({why})")
    threads = re.search(r"RANKSCOPE_THREADS (\d+)", out)
    return {
        "stopped_s": float(t1.group(1)) - float(t0.group(1)),
        "threads": int(threads.group(1)) if threads else 0,
    }


def inject_remote_exec(pid: int, folder: Path) -> dict:
    """Python 3.14+: the interpreter's own remote execution runs the same payload."""
    code = (
        f"import json, sys\nrequest = json.load(open({str(folder / 'request.json')!r}))\n"
        "for p in request.get('pythonpath', []):\n"
        "    p in sys.path or sys.path.append(p)\n"
        "from rankscope import _attach_payload\n_attach_payload.run(request)\n"
    )
    outside = Path(f"/proc/{pid}/root") / folder.relative_to("/") / "payload.py"
    outside.write_text(code)
    t0 = time.monotonic()
    sys.remote_exec(pid, str(folder / "payload.py"))
    return {"stopped_s": time.monotonic() - t0, "threads": 0}


def _first_line(text: str, needle: str) -> str:
    for line in text.splitlines():
        if needle in line:
            return line.strip()
    return text.strip().splitlines()[0] if text.strip() else ""


def _release(pid: int) -> None:
    """Never leave a process stopped: after gdb, it has no tracer and runs (SIGCONT if not)."""
    st = _status(pid)
    if st.get("State", "").startswith(("T", "t")) and int(st.get("TracerPid", "0") or 0) == 0:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass


# ---- acknowledgements ---------------------------------------------------------------------------


def read_ack(pid: int, folder: Path):
    base = Path(f"/proc/{pid}/root") / folder.relative_to("/")
    failed = base / "request.json.failed"
    if failed.exists():
        return {
            "status": "error",
            "error": "rankscope is not importable in the target's "
            f"environment: {failed.read_text()[:400]} (install the rankscope package where "
            "the job's Python finds it, built for the job's Python version)",
        }
    try:
        return json.loads((base / "ack.json").read_text())
    except (OSError, ValueError):
        return None


def _describe(pid: int, ack: dict, injected: dict) -> str:
    lines = []
    pause = injected["stopped_s"] + float(ack.get("pause_s") or 0.0)
    for m in ack.get("models", []):
        where = (
            f"job {ack.get('job')} group {m['group']!r} rank {m['rank']} "
            f"(global rank {m['global_rank']})"
        )
        if m["state"] == "reporting":
            what = "dormant from" if ack.get("dormant") else "reporting from"
            lines.append(
                f"PID {pid}: {where}: {what} step {m['start_step']}; path: "
                f"{m['path']}; step boundary: {m['step_boundary']}"
            )
        elif m["state"] == "failed":
            lines.append(f"PID {pid}: {where}: failed: {m['error']}")
        else:
            arrived = m.get("arrived")
            extra = f" ({arrived} of {m['world_size']} ranks arrived)" if arrived else ""
            lines.append(
                f"PID {pid}: {where}: installed, waiting for the other ranks of its "
                f"group to be attached{extra}"
            )
    lines.append(
        f"PID {pid}: pause {pause:.3f} s (stopped {injected['stopped_s']:.3f} s, "
        f"main thread {float(ack.get('pause_s') or 0):.3f} s)"
    )
    return "\n".join(lines)


# Long: the attaching side's steps in order (the /proc checks, the request folder, gdb, the
# acknowledgements), each with its own message to the user; the reusable pieces are the functions
# above.
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="rankscope attach",
        description="Attach rankscope to live training processes started without it (no "
        "restart, no change to the script). Every rank of a data-parallel group "
        "must be attached; they start reporting at the same step.",
    )
    ap.add_argument("pids", nargs="*", type=int, help="PIDs of the ranks to attach")
    ap.add_argument("--job", required=True, help="the job name to report under")
    ap.add_argument(
        "--collector",
        default=os.environ.get("RANKSCOPE_COLLECTOR", ""),
        help="HOST:PORT of the collector (default $RANKSCOPE_COLLECTOR, else 127.0.0.1:50051)",
    )
    ap.add_argument(
        "--dormant",
        action="store_true",
        help="install but report nothing until `rankscope ctl enable`",
    )
    ap.add_argument(
        "--all-local",
        action="store_true",
        help="attach every rank of the torch.distributed job on this host",
    )
    ap.add_argument(
        "--sketch_dim",
        type=int,
        default=0,
        help="count sketch bins k (float32 unless --sketch_encoding says otherwise)",
    )
    ap.add_argument(
        "--sketch_bytes",
        type=int,
        default=0,
        help="sketch bytes per rank and step (default 4096: k = bytes / bin size)",
    )
    ap.add_argument(
        "--sketch_encoding",
        choices=("float32", "float16", "int8"),
        help="sketch bin encoding (default int8)",
    )
    ap.add_argument(
        "--sketch_threads",
        type=int,
        default=0,
        help="threads that sketch a CPU gradient bucket (default: the cores the "
        "process may use that torch's threads leave free, 1 to 8)",
    )
    ap.add_argument("--every", type=int, default=0, help="report every N steps (default 1)")
    ap.add_argument(
        "--param_check_every",
        type=int,
        default=-1,
        help="fingerprint the parameters every N steps (default 5; 0 never)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for each process to run the payload and for the "
        "ranks to agree on a first step (default 60)",
    )
    ap.add_argument("--gdb", default="gdb", help="the gdb to use (default: gdb on PATH)")
    args = ap.parse_args(argv)

    pids = list(args.pids)
    if args.all_local:
        jobs = local_ranks()
        if not jobs:
            print(
                "rankscope attach: --all-local found no torch.distributed rank on this host "
                "(Python processes with RANK and WORLD_SIZE in their environment)",
                file=sys.stderr,
            )
            return 1
        if len(jobs) > 1:
            listing = "; ".join(f"{k[0]} run {k[1] or '-'}: PIDs {v}" for k, v in jobs.items())
            print(
                f"rankscope attach: --all-local found several jobs on this host ({listing}); "
                "pass the PIDs of one",
                file=sys.stderr,
            )
            return 1
        pids += next(iter(jobs.values()))
    if not pids:
        ap.error("no PID given (or --all-local)")
    use_remote_exec = hasattr(sys, "remote_exec")
    gdb = shutil.which(args.gdb)
    package_dir = Path(__file__).resolve().parent
    if not (package_dir / HELPER).exists():
        print(
            f"rankscope attach: {package_dir / HELPER} is missing (build the project: ./run build)",
            file=sys.stderr,
        )
        return 1
    request = {
        "job": args.job,
        "dormant": bool(args.dormant),
        "pythonpath": [str(package_dir.parent)],
    }
    if args.collector:
        request["collector"] = args.collector
    if args.sketch_dim:
        request["sketch_dim"] = args.sketch_dim
    if args.sketch_bytes:
        request["sketch_bytes"] = args.sketch_bytes
    if args.sketch_encoding:
        request["sketch_encoding"] = args.sketch_encoding
    if args.sketch_threads:
        request["sketch_threads"] = args.sketch_threads
    if args.every:
        request["every"] = args.every
    if args.param_check_every >= 0:
        request["param_check_every"] = args.param_check_every

    failures = 0
    pending = {}  # pid -> (folder, injected)
    for pid in pids:
        try:
            version = check_target(pid)
            remote = use_remote_exec and version >= (3, 14) and version == sys.version_info[:2]
            if not remote and gdb is None:
                raise AttachError(
                    f"gdb not found ({args.gdb}); install Debian's gdb "
                    "(apt-get install gdb; ./run setup does)"
                )
            folder = _prepare(pid, request, package_dir)
            injected = (
                inject_remote_exec(pid, folder)
                if remote
                else inject_gdb(pid, folder, gdb, args.timeout)
            )
            pending[pid] = (folder, injected)
        except AttachError as e:
            print(f"rankscope attach: {e}", file=sys.stderr)
            failures += 1
        except OSError as e:
            print(f"rankscope attach: PID {pid}: {e}", file=sys.stderr)
            failures += 1

    # Wait for every payload to run, then for every group's agreement.
    deadline = time.monotonic() + args.timeout
    acks = {}
    while pending and time.monotonic() < deadline:
        for pid, (folder, _) in pending.items():
            ack = read_ack(pid, folder)
            if ack is not None:
                acks[pid] = ack
        done = all(_settled(acks.get(pid)) for pid in pending)
        if done:
            break
        time.sleep(0.05)
    for pid, (folder, injected) in pending.items():
        ack = acks.get(pid)
        if ack is None:
            alive = bool(_status(pid))
            print(
                f"rankscope attach: PID {pid}: queued, not run: its main thread has not "
                f"returned to Python within {args.timeout:.0f} s (a hung collective, or one "
                "long C++ call); it runs the payload when it does"
                if alive
                else f"rankscope attach: PID {pid} exited before running the payload",
                file=sys.stderr,
            )
            failures += 1
            continue
        ack["dormant"] = args.dormant
        status = ack.get("status")
        if status == "error":
            print(f"rankscope attach: PID {pid}: {ack.get('error')}", file=sys.stderr)
            failures += 1
            continue
        if status == "already attached":
            print(f"PID {pid}: already attached (job {ack.get('job')}); nothing changed")
        print(_describe(pid, ack, injected))
        if any(m["state"] == "failed" for m in ack.get("models", [])):
            failures += 1
        _cleanup(pid, folder)
    return 1 if failures else 0


def _settled(ack) -> bool:
    if ack is None:
        return False
    if ack.get("status") in ("error", "already attached"):
        return True
    models = ack.get("models", [])
    return bool(models) and all(m["state"] in ("reporting", "failed") for m in models)


def _cleanup(pid: int, folder: Path) -> None:
    """Removes the request folder of a process that ran its payload (the helper stays mapped;
    later acknowledgements are then not written, which the payload tolerates)."""
    shutil.rmtree(Path(f"/proc/{pid}/root") / folder.relative_to("/"), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
