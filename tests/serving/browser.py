"""A real headless Chromium (Debian's /usr/bin/chromium) driven over the DevTools protocol, standard library only.

The protocol runs over a pipe (`--remote-debugging-pipe`: the browser reads commands on its fd 3 and writes replies
on fd 4, one JSON object per NUL-terminated message), the transport Puppeteer uses: no websocket client and no
debugging port another process could reach.

    with HeadlessChromium(tmp_path / "profile") as browser:
        page = browser.open("http://127.0.0.1:8000/")
        page.wait_for("document.readyState === 'complete'")
        page.type_into("#message", "Hello")
        page.click("#send")
        page.screenshot("shot.png")
"""
import base64
import json
import select
import os
import shutil
import subprocess
import time

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class BrowserError(RuntimeError):
    """The browser refused a command, closed its pipe, or a wait ran out."""


def _above_four(fd):
    """The same pipe end as a descriptor numbered 10 or more (the one given is closed)."""
    import fcntl
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class HeadlessChromium:
    """One headless browser process with a fresh profile directory; close() (or the with-block) ends it."""

    def __init__(self, profile_dir, width=900, height=700):
        command_read, command_write = os.pipe()
        reply_read, reply_write = os.pipe()
        # bash moves the browser's two pipe ends onto the fds 3 and 4 the protocol fixes, then becomes
        # chromium; first they leave the low numbers, so that neither lands on 3 or 4 before it is moved.
        command_read, reply_write = (_above_four(fd) for fd in (command_read, reply_write))
        launch = f'exec "$0" "$@" 3<&{command_read} 4>&{reply_write} {command_read}<&- {reply_write}>&-'
        self.process = subprocess.Popen(
            ["bash", "-c", launch, CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-pipe", f"--user-data-dir={profile_dir}", f"--window-size={width},{height}",
             "about:blank"],
            pass_fds=(command_read, reply_write), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(command_read)
        os.close(reply_write)
        self._commands, self._replies = command_write, reply_read
        self._buffer, self._next_id = b"", 0

    def call(self, method, params=None, session=None, timeout=60):
        """Send one command and return its result; events that arrive meanwhile are dropped."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply["result"]

    def _read_message(self, deadline):
        while b"\0" not in self._buffer:
            if not select.select([self._replies], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise BrowserError("chromium did not answer in time")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise BrowserError(f"chromium closed its DevTools pipe (exit status {self.process.poll()})")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def open(self, url):
        """A new tab at `url`, attached: a Page to drive."""
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        return Page(self, session)

    def close(self):
        for fd in (self._commands, self._replies):
            os.close(fd)
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Page:
    """One attached tab: evaluate JavaScript, wait for a condition, type, click, screenshot."""

    def __init__(self, browser, session):
        self.browser, self.session = browser, session

    def call(self, method, params=None):
        return self.browser.call(method, params, session=self.session)

    def evaluate(self, expression):
        """The JSON value of a JavaScript expression in the page (a thrown exception raises BrowserError)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression, timeout=60):
        """Poll until `expression` is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError:
                value = None            # e.g. the element does not exist yet
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"waited {timeout} s for {expression!r}")
            time.sleep(0.05)

    def type_into(self, selector, text):
        """Focus the element and insert `text` as typed input (the browser fires the input events)."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", {"text": text})

    def click(self, selector):
        """A real mouse press and release at the centre of the element."""
        box = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def screenshot(self, path):
        """The visible page as a PNG file at `path`."""
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(data))
        return path
