#!/usr/bin/env python3
"""Drives headless Chromium over the DevTools protocol for the board's browser tests.

Started by the Rust test with the path of a scratch directory; reads one JSON command
per line on stdin and answers one JSON line on stdout ({"ok": value} or {"error": text}):

  {"cmd": "goto", "url": U}                  navigate and wait for the load event
  {"cmd": "eval", "js": E}                   evaluate (promises awaited), return the value
  {"cmd": "wait", "js": E, "timeout": S}     poll E until truthy; return its value
  {"cmd": "click", "selector": Q}            a real mouse click at the element's centre
  {"cmd": "type", "selector": Q, "text": T}  focus the element and type T
  {"cmd": "screenshot", "path": P}           full-page PNG
  {"cmd": "quit"}

Needs `websocket-client` (pip; .ci/install.sh puts it in the peers' venv).
"""
import base64
import json
import os
import subprocess
import sys
import time
import urllib.request

import websocket


class Page:
    def __init__(self, scratch):
        self.proc = subprocess.Popen(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                "--font-render-hinting=none",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                "--window-size=1280,900",
                "--user-data-dir=" + scratch,
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = os.path.join(scratch, "DevToolsActivePort")
        deadline = time.time() + 30
        while not os.path.exists(port_file) or os.path.getsize(port_file) == 0:
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.05)
        port = open(port_file).read().split()[0]
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(
            page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True
        )
        self.next_id = 0
        self.events = []
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=1280,
            height=900,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method, **params):
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, name, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for i, e in enumerate(self.events):
                if e.get("method") == name:
                    del self.events[: i + 1]
                    return e
            self.ws.settimeout(max(0.1, deadline - time.time()))
            try:
                self.events.append(json.loads(self.ws.recv()))
            except websocket.WebSocketTimeoutException:
                break
        raise RuntimeError(f"no {name} within {timeout}s")

    def goto(self, url):
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")
        return url

    def eval(self, js):
        r = self.call(
            "Runtime.evaluate", expression=js, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"{js}: {r['exceptionDetails'].get('exception', {}).get('description', r['exceptionDetails'])}")
        return r["result"].get("value")

    def wait(self, js, timeout=15):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                v = self.eval(js)
                if v:
                    return v
                last = v
            except RuntimeError as e:
                last = str(e)
            time.sleep(0.05)
        raise RuntimeError(f"timed out after {timeout}s waiting for {js} (last: {last})")

    def click(self, selector):
        box = self.wait(
            "(() => { const e = document.querySelector(%s); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()" % json.dumps(selector)
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box["x"],
                y=box["y"],
                button="left",
                clickCount=1,
            )
        return box

    def type(self, selector, text):
        self.wait("(() => { const e = document.querySelector(%s); if (e) e.focus(); return !!e; })()" % json.dumps(selector))
        self.call("Input.insertText", text=text)
        return True

    def screenshot(self, path):
        m = self.call("Page.getLayoutMetrics")
        size = m.get("cssContentSize") or m["contentSize"]
        r = self.call(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(r["data"]))
        return path

    def quit(self):
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main():
    page = Page(sys.argv[1])
    try:
        for line in sys.stdin:
            c = json.loads(line)
            try:
                cmd = c["cmd"]
                if cmd == "quit":
                    print(json.dumps({"ok": None}), flush=True)
                    break
                elif cmd == "goto":
                    v = page.goto(c["url"])
                elif cmd == "eval":
                    v = page.eval(c["js"])
                elif cmd == "wait":
                    v = page.wait(c["js"], c.get("timeout", 15))
                elif cmd == "click":
                    v = page.click(c["selector"])
                elif cmd == "type":
                    v = page.type(c["selector"], c["text"])
                elif cmd == "screenshot":
                    v = page.screenshot(c["path"])
                else:
                    raise RuntimeError(f"unknown command {cmd}")
                print(json.dumps({"ok": v}), flush=True)
            except Exception as e:  # reported to the test, which fails with it
                print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    finally:
        page.quit()


if __name__ == "__main__":
    main()
