"""Load a page in headless Chromium; report its errors, undecoded images and requests.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages ending in a NUL byte, commands on fd 3, replies on fd 4), so neither a WebDriver
nor a WebSocket library is needed, and no port is opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
INSTALL_LOCK = "/tmp/convoy-browser-install.lock"  # the Makefile's BROWSER_LOCK
INSTALL_WAIT_S = 600

PAGE_FACTS = """JSON.stringify({
  images: Array.from(document.images).map(i => ({
    alt: i.alt, complete: i.complete, width: i.naturalWidth, height: i.naturalHeight})),
  title: document.title,
})"""


def find_chromium() -> str | None:
    """The Chromium binary, after waiting for ``make browser``'s background install."""
    if shutil.which("flock") and Path(INSTALL_LOCK).exists():
        subprocess.run(
            ["flock", "-w", str(INSTALL_WAIT_S), INSTALL_LOCK, "true"], check=False, timeout=900
        )
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    return None


@dataclass
class PageLoad:
    """What one page load produced."""

    errors: list[str] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    title: str = ""


class DevTools:
    """A headless Chromium and its DevTools pipe."""

    def __init__(self, binary: str, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.profile = tempfile.mkdtemp(prefix="convoy-chromium-")
        commands_r, self._commands = os.pipe()
        self._replies, replies_w = os.pipe()

        def on_fds_3_and_4() -> None:  # in the child, before exec
            high_r = fcntl.fcntl(commands_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(replies_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", "--mute-audio",
             "--remote-debugging-pipe", f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False,  # os.pipe()'s descriptors are not inheritable; fds 3 and 4 are
            preexec_fn=on_fds_3_and_4,
        )  # fmt: skip
        os.close(commands_r)
        os.close(replies_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; events read meanwhile are kept."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        reply = self._read_until(lambda m: m.get("id") == self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def wait_for(self, method: str) -> dict[str, Any]:
        """The first event named ``method`` (already received, or to come)."""
        for event in self.events:
            if event.get("method") == method:
                return event
        return self._read_until(lambda m: m.get("method") == method)

    def _read_until(self, wanted: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "method" in message:
                    self.events.append(message)
                if wanted(message):
                    return dict(message)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer within {self.timeout_s} s")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (code {self.process.poll()})")
            self._buffer += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.send("Browser.close")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)
        shutil.rmtree(self.profile, ignore_errors=True)


def load_page(binary: str, page: Path) -> PageLoad:
    """Open ``page`` in a fresh headless Chromium; collect errors, images and requests."""
    browser = DevTools(binary)
    try:
        target = browser.send("Target.createTarget", url="about:blank")["targetId"]
        session = browser.send("Target.attachToTarget", targetId=target, flatten=True)
        sid = session["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.send(f"{domain}.enable", session=sid)
        navigated = browser.send("Page.navigate", session=sid, url=page.resolve().as_uri())
        result = PageLoad()
        if navigated.get("errorText"):
            result.errors.append(f"navigation: {navigated['errorText']}")
            return result
        browser.wait_for("Page.loadEventFired")
        facts = browser.send(
            "Runtime.evaluate", session=sid, expression=PAGE_FACTS, returnByValue=True
        )
        values = json.loads(facts["result"]["value"])
        result.images, result.title = values["images"], values["title"]
        result.requests = _requests(browser.events, page.resolve().as_uri())
        result.errors += [_error(e) for e in browser.events if _error(e)]
        return result
    finally:
        browser.close()


def _requests(events: list[dict[str, Any]], page_url: str) -> list[str]:
    """URLs the page asked for beyond itself and its inline ``data:`` images."""
    urls = [
        e["params"]["request"]["url"]
        for e in events
        if e.get("method") == "Network.requestWillBeSent"
    ]
    return [u for u in urls if u != page_url and not u.startswith("data:")]


def _error(event: dict[str, Any]) -> str:
    """An error-level console message, uncaught exception or log entry; else ''."""
    method, params = event.get("method"), event.get("params", {})
    if method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        return f"exception: {details.get('exception', {}).get('description') or details}"
    if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        args = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
        return f"console.{params['type']}: {args}"
    if method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        entry = params["entry"]
        return f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}"
    return ""
