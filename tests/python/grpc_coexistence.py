"""A DDP rank that streams through grpcio and through rankscope in one process (test_wheel.py):
grpcio (from PyPI, its own gRPC core) serves and calls a bidirectional echo on the main thread
while rankscope's agent (the wheel's grafted gRPC) streams every step's report to a real
collector from its own thread. Imported by the spawned ranks; nothing here imports grpc or
rankscope at module level, so ``grpc_first`` decides which loads first."""

import json
from concurrent import futures
from pathlib import Path

ECHO_METHOD = "/rankscope.test.Echo/Stream"


def _echo_server_and_stub():
    import grpc

    def echo(requests, context):
        yield from requests

    handler = grpc.method_handlers_generic_handler(
        "rankscope.test.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, channel.stream_stream(ECHO_METHOD)  # bytes in, bytes out


def worker(rank, world_size, collector, job, out_dir, steps, grpc_first):
    import torch
    import torch.nn as nn

    if grpc_first:
        server, channel, echo = _echo_server_and_stub()
        import rankscope.torch as rst
    else:
        import rankscope.torch as rst

        server, channel, echo = _echo_server_and_stub()

    torch.manual_seed(7)  # the same initial weights on every rank
    ddp = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mon = rst.attach(ddp, collector=collector, job=job, sketch_dim=256)
    data = torch.Generator().manual_seed(100 + rank)
    losses, echoes = [], []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 1, generator=data)
        opt.zero_grad(set_to_none=True)
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        mon.step(loss)
        losses.append(loss.item())
        sent = [f"{rank}:{step}:{i}".encode() for i in range(3)]
        echoes.append(list(echo(iter(sent), timeout=30)) == sent)
    mon.close()
    channel.close()
    server.stop(None)
    with open("/proc/self/maps") as f:
        maps = sorted({ln.split()[5] for ln in f if len(ln.split()) >= 6})
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"losses": losses, "echoes": echoes, "maps": maps})
    )
