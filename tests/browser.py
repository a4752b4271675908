"""Open a local HTML file in headless Chromium and ask the page what happened, over the DevTools
protocol on a pipe (--remote-debugging-pipe: commands on fd 3, replies on fd 4, each message JSON
ended by a NUL byte), so no websocket library and no port are needed.

The browser runs with networking off: in a fresh network namespace (``unshare --net``, which has
only a loopback device that is down) where the kernel allows it, and always with every host name
mapped to nothing and a proxy that does not exist, plus Chromium's own background traffic switched
off. Every request the page starts is recorded (Network.requestWillBeSent) whether it could
succeed or not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
          "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
          "--disable-default-apps", "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
          "--remote-debugging-pipe", "--window-size=1500,1000", "--hide-scrollbars"]

# What the page is asked once loaded: every image's state, and the Resource Timing entries.
_PROBE = """JSON.stringify({
  images: Array.from(document.images).map(i => ({complete: i.complete, width: i.naturalWidth,
                                                  height: i.naturalHeight, src: i.src.slice(0, 40)})),
  resources: performance.getEntriesByType("resource").map(e => e.name.slice(0, 80)),
  scripts: document.scripts.length,
  height: document.documentElement.scrollHeight})"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def network_namespace_works() -> bool:
    unshare = shutil.which("unshare")
    return bool(unshare) and subprocess.run([unshare, "--net", "true"], capture_output=True).returncode == 0


@dataclass
class PageVisit:
    requests: list[str]  # URL of every request the page started (the document's own included)
    images: list[dict]  # complete, width, height, src of every <img>
    resources: list[str]  # Resource Timing entries
    scripts: int
    screenshot_png: bytes
    isolated: bool  # ran in its own network namespace


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int):
        self.write_fd, self.read_fd = write_fd, read_fd
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        while True:
            reply = self.receive(timeout)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def receive(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self.buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def wait_for(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(self.receive(max(deadline - time.monotonic(), 0.01)))


def visit(path: str, *, timeout: float = 60) -> PageVisit:
    """Load ``path`` (a local file) in headless Chromium and report what the page did."""
    browser = chromium()
    assert browser, "chromium is not installed (apt-get install chromium)"
    isolated = network_namespace_works()
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()

    def child_fds():  # the child's fd 3 reads our commands, its fd 4 writes the replies
        a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
        os.dup2(a, 3)
        os.dup2(b, 4)

    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = ([shutil.which("unshare"), "--net"] if isolated else []) + [browser, *_FLAGS,
                                                                         f"--user-data-dir={profile}", "about:blank"]
        proc = subprocess.Popen(cmd, preexec_fn=child_fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        pipe = _Pipe(to_chrome_w, from_chrome_r)
        try:
            targets = pipe.send("Target.getTargets", timeout=timeout)["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            session = pipe.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
            pipe.send("Network.enable", session=session)
            pipe.send("Page.enable", session=session)
            pipe.events.clear()
            pipe.send("Page.navigate", {"url": f"file://{os.path.abspath(path)}"}, session=session)
            pipe.wait_for("Page.loadEventFired", timeout)
            probe = json.loads(pipe.send("Runtime.evaluate", {"expression": _PROBE, "returnByValue": True},
                                         session=session)["result"]["value"])
            pipe.send("Emulation.setDeviceMetricsOverride",
                      {"width": 1500, "height": min(probe["height"], 6000), "deviceScaleFactor": 1, "mobile": False},
                      session=session)
            shot = pipe.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
            requests = [e["params"]["request"]["url"] for e in pipe.events
                        if e.get("method") == "Network.requestWillBeSent"]
            try:
                pipe.send("Browser.close", timeout=10)
            except RuntimeError:
                pass  # the pipe closes as the browser exits
        finally:
            os.close(to_chrome_w)
            os.close(from_chrome_r)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    import base64

    return PageVisit(requests=requests, images=probe["images"], resources=probe["resources"],
                     scripts=probe["scripts"], screenshot_png=base64.b64decode(shot), isolated=isolated)


if __name__ == "__main__":  # python tests/browser.py PAGE.html SHOT.png: a screenshot, as the test takes it
    import sys

    visit_result = visit(sys.argv[1])
    with open(sys.argv[2], "wb") as f:
        f.write(visit_result.screenshot_png)
    print(f"{len(visit_result.images)} images, requests: {len(visit_result.requests)}; wrote {sys.argv[2]}")
