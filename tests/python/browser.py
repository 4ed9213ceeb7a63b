"""A real headless Chromium driven over the DevTools protocol, for the web view's tests.

Debian's ``chromium`` runs with ``--remote-debugging-pipe``: protocol messages are JSON, each
ended by a NUL byte, written to the browser's fd 3 and read from its fd 4, so no websocket
library and no debugging port are needed. One page (a target attached with ``flatten``) per
``Browser``. Every wait polls a condition in the page against a deadline.
"""

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class BrowserError(AssertionError):
    pass


class Browser:
    def __init__(self, width: int = 1400, height: int = 1000):
        if not Path(CHROMIUM).exists():
            raise BrowserError(f"{CHROMIUM} not found (./run setup installs Debian's chromium)")
        self._profile = tempfile.mkdtemp(prefix="rankscope-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The child's fds 3 and 4 must be these pipe ends; copies on free fds above 10 first, so
        # that the dup2 calls in the child cannot overwrite one with the other.
        hi_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
        hi_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)

        def child_fds():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile}",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-sync",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-dev-shm-usage",
                "--mute-audio",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=child_fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for fd in (to_browser_r, from_browser_w, hi_r, hi_w):
            os.close(fd)
        self._next_id = 0
        self._lock = threading.Lock()
        self._waiting = {}
        self.console = []  # console messages and exceptions of the page
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.page("Page.enable")
        self.page("Runtime.enable")
        self.page(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    # ---- protocol ----
    def _read_loop(self):
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    for q in self._waiting.values():
                        q.put({"error": {"message": "the browser closed its pipe"}})
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        q = self._waiting.pop(msg["id"], None)
                    if q is not None:
                        q.put(msg)
                elif msg.get("method") == "Runtime.consoleAPICalled":
                    args = msg["params"].get("args", [])
                    self.console.append(
                        " ".join(str(a.get("value", a.get("description", ""))) for a in args)
                    )
                elif msg.get("method") == "Runtime.exceptionThrown":
                    self.console.append(
                        "exception: " + json.dumps(msg["params"]["exceptionDetails"])[:2000]
                    )

    def call(self, method: str, session: str = None, timeout: float = 60.0, **params):
        with self._lock:
            self._next_id += 1
            msg_id = self._next_id
            q = queue.Queue()
            self._waiting[msg_id] = q
        msg = {"id": msg_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        try:
            reply = q.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"no reply to {method} within {timeout:.0f} s") from None
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def page(self, method: str, **params):
        return self.call(method, session=self._session, **params)

    # ---- page helpers ----
    def goto(self, url: str):
        self.page("Page.navigate", url=url)

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited). A DOM node comes
        back as {} (falsy): test for it with ``!!`` or compare with null."""
        r = self.page(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression!r} threw: {json.dumps(r['exceptionDetails'])[:1000]}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str, interval: float = 0.1):
        """Polls ``expression`` until it is truthy (returned) or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except BrowserError:
                value = None  # e.g. the page is still navigating
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(
                    f"timed out after {timeout:.0f} s waiting for {what} "
                    f"({expression}); console: {self.console[-5:]}"
                )
            time.sleep(interval)

    def screenshot(self, path: Path, full_page: bool = True):
        """Saves a PNG of the page (the whole scrollable page when ``full_page``)."""
        params = {"format": "png"}
        if full_page:
            m = self.page("Page.getLayoutMetrics")
            size = m.get("cssContentSize") or m["contentSize"]
            params.update(
                captureBeyondViewport=True,
                clip={
                    "x": 0,
                    "y": 0,
                    "width": size["width"],
                    "height": min(size["height"], 6000),
                    "scale": 1,
                },
            )
        data = self.page("Page.captureScreenshot", **params)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except BrowserError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)
