"""Zero-code launch: ``python -m rankscope.run [OPTIONS] train.py ARGS...`` runs ``train.py`` as
``__main__`` with every DistributedDataParallel, FSDP1, FSDP2 and Megatron-core DDP model it
builds attached to rankscope (dormant unless ``--enabled``), the loss taken from its backward
calls (their mean under gradient accumulation; their sum for Megatron) and the step from its
optimizer. Also ``torchrun ... -m rankscope.run train.py``
and ``python -m rankscope.run [OPTIONS] -m package.module ARGS...``.

Options (before the script): --job=NAME (default $RANKSCOPE_JOB), --collector=HOST:PORT (default
$RANKSCOPE_COLLECTOR or 127.0.0.1:50051), --enabled (report from the first agreed step instead of
waiting for ``rankscope ctl enable``), --sketch_bytes=B, --sketch_encoding=int8|float16|float32,
--sketch_dim=K, --sketch_threads=T, --every=N.
"""

import os
import runpy
import sys

USAGE = """usage: python -m rankscope.run [--job=NAME] [--collector=HOST:PORT] [--enabled]
                              [--sketch_bytes=B] [--sketch_encoding=E] [--sketch_dim=K]
                              [--sketch_threads=T] [--every=N] (SCRIPT | -m MODULE) [ARGS...]

Runs a training script with rankscope attached to every DistributedDataParallel or FSDP2 model
it builds, without changing the script: dormant until `rankscope ctl enable --job=NAME` (or reporting from
the first step every rank agrees on, with --enabled). Works under torchrun:
  torchrun --nproc_per_node=8 -m rankscope.run --job=exp-42 train.py --lr=3e-4
Job name and collector default to $RANKSCOPE_JOB and $RANKSCOPE_COLLECTOR.
"""


def _parse(argv):
    env = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            sys.stdout.write(USAGE)
            sys.exit(0)
        if a == "--enabled":
            env["RANKSCOPE_DORMANT"] = "0"
        elif a.startswith("--") and "=" in a:
            name, value = a[2:].split("=", 1)
            key = {
                "job": "RANKSCOPE_JOB",
                "collector": "RANKSCOPE_COLLECTOR",
                "sketch_dim": "RANKSCOPE_SKETCH_DIM",
                "every": "RANKSCOPE_EVERY",
                "sketch_bytes": "RANKSCOPE_SKETCH_BYTES",
                "sketch_encoding": "RANKSCOPE_SKETCH_ENCODING",
                "sketch_threads": "RANKSCOPE_SKETCH_THREADS",
            }.get(name)
            if key is None:
                sys.exit(f"rankscope.run: unknown option {a!r}\n{USAGE}")
            env[key] = value
        elif a.startswith("-") and a != "-m":
            sys.exit(f"rankscope.run: unknown option {a!r} (options take --name=value)\n{USAGE}")
        else:
            break
        i += 1
    rest = argv[i:]
    if not rest or (rest[0] == "-m" and len(rest) < 2):
        sys.exit(f"rankscope.run: no script to run\n{USAGE}")
    return env, rest


def main(argv=None) -> None:
    env, rest = _parse(sys.argv[1:] if argv is None else argv)
    os.environ.update(env)
    from rankscope import auto

    try:
        auto.install_from_env()
    except ValueError as e:
        sys.exit(str(e))
    if rest[0] == "-m":
        sys.argv = [rest[1]] + rest[2:]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        script = rest[0]
        if not os.path.exists(script):
            sys.exit(f"rankscope.run: {script}: no such file")
        sys.argv = rest
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
