"""A fault-injecting TCP proxy (asyncio, in a background thread) for the network-fault tests and
bench/net_faults.py: it forwards connections from ``listen`` to ``upstream`` and, on command,

- ``set_latency(s)``: delays every chunk by ``s`` seconds each way (order and throughput kept);
- ``set_throttle(n)``: forwards at most ``n`` bytes per second each way (None: unlimited);
- ``set_mode("blackhole")``: new connections are accepted and nothing is ever answered (nothing is
  forwarded, what they send is read and discarded);
- ``set_mode("freeze")``: live connections stop moving both ways and stay open, as when the peer
  vanished without a FIN: each end is left with a half-open connection;
- ``set_mode("pass")``: back to forwarding (frozen connections stay frozen: their ends must notice);
- ``reset_all()``: every live connection is reset (RST both ways, SO_LINGER 0), mid-stream.

``accepted`` counts the connections accepted so far, ``live`` the ones open now; the test reads
them to know a fault took effect (e.g. the agents reconnected after a reset) without timing.
"""

import asyncio
import socket
import struct
import threading
import time

CHUNK = 64 * 1024


def _rst(writer):
    """Closes the writer's socket with an RST (SO_LINGER on, timeout 0)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class _Conn:
    def __init__(self):
        self.writers = []
        self.tasks = []
        self.frozen = asyncio.Event()


class FaultProxy:
    def __init__(self, listen_host, upstream_host, upstream_port, listen_port=0):
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream = (upstream_host, upstream_port)
        self.latency = 0.0
        self.throttle = None
        self.mode = "pass"
        self.accepted = 0
        self._conns = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server = None

    # ---- control, from any thread ---------------------------------------------------------------

    def start(self) -> "FaultProxy":
        self._thread.start()
        self._server = self._call(
            asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        )
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    @property
    def live(self) -> int:
        return len(self._conns)

    def set_latency(self, seconds: float) -> None:
        self.latency = seconds

    def set_throttle(self, bytes_per_second) -> None:
        self.throttle = bytes_per_second

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "blackhole", "freeze"), mode
        self.mode = mode
        if mode == "freeze":
            self._call(self._freeze_all())

    def reset_all(self) -> int:
        """Resets every live connection; returns how many."""
        return self._call(self._reset_all())

    def close(self) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    # ---- the loop -------------------------------------------------------------------------------

    async def _freeze_all(self):
        for c in self._conns:
            c.frozen.set()

    async def _reset_all(self):
        conns = list(self._conns)
        for c in conns:
            for w in c.writers:
                _rst(w)
            for t in c.tasks:
                t.cancel()
        self._conns.difference_update(conns)
        return len(conns)

    async def _close(self):
        self._server.close()
        await self._reset_all()

    async def _accept(self, reader, writer):
        self.accepted += 1
        conn = _Conn()
        conn.writers.append(writer)
        self._conns.add(conn)
        try:
            if self.mode == "blackhole":
                while await reader.read(CHUNK):  # accepted, read, never answered
                    pass
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                _rst(writer)
                return
            conn.writers.append(up_writer)
            if self.mode == "freeze":
                conn.frozen.set()
            conn.tasks = [
                asyncio.ensure_future(self._pump(reader, up_writer, conn)),
                asyncio.ensure_future(self._pump(up_reader, writer, conn)),
            ]
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            if conn in self._conns:
                self._conns.discard(conn)
                for w in conn.writers:
                    w.close()

    async def _pump(self, reader, writer, conn):
        """Copies reader to writer, applying latency and throttle; stops moving when frozen."""
        queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                if data is None:
                    writer.write_eof() if writer.can_write_eof() else None
                    return
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if conn.frozen.is_set():
                    await asyncio.Event().wait()  # half-open: hold the bytes forever
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                if conn.frozen.is_set():
                    await asyncio.Event().wait()
                rate = self.throttle
                size = CHUNK if rate is None else max(1, min(CHUNK, rate // 10))
                data = await reader.read(size)
                if conn.frozen.is_set():
                    await asyncio.Event().wait()
                queue.put_nowait((time.monotonic() + self.latency, data or None))
                if not data:
                    break
                if rate is not None:
                    await asyncio.sleep(len(data) / rate)
            await sender
        finally:
            sender.cancel()
