"""The screenshot of TensorBoard's trace viewer in docs/tensorboard.md (docs/trace_viewer.png):
tf_rdma's events in a real profile, shown by a real TensorBoard, taken with headless Chromium.

    .venv/bin/python -m tools.trace_viewer_screenshot [--backend tcp] [--output docs/trace_viewer.png]

1. captures a profile of TF1 parameter-server steps over tf_rdma (tests/tf/programs/profiled_ps_steps.py,
   what tests/tf/test_profiler_events.py checks: a ps and a worker, 5 steps with the profiler on);
2. serves it with TensorBoard and its profile plugin (tensorboard-plugin-profile), from a virtualenv
   of their own (build/trace_viewer/venv, made from requirements.txt beside this file on first use);
3. opens the plugin's trace viewer in headless Chromium (Debian's `chromium`), driven through its
   DevTools protocol: zooms to one step's tf_rdma events (the profile's threads all fit the window),
   selects the step's first receive so that its arguments show, and saves the page as a PNG.

Not part of `make test`: it needs a browser, which CI does not have. The trace viewer is the
plugin's default one (catapult's, drawn on a 2D canvas); its WebGL successor is opt-in
(use_trace_viewer_v2) and not used here."""
import argparse
import base64
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tf_rdma.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "build" / "trace_viewer" / "venv"
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
WINDOW = (1600, 1000)

# Run in the trace viewer's page once its model is loaded: zooms the timeline to the tf_rdma events
# of the profile's second step (the first may carry the profiler's start-up), padded by a third of
# their span each side so the step's ops around them show, and selects that step's first receive,
# whose arguments the details pane then lists.
# Returns what it showed, or why it could not.
SHOW_ONE_STEP = """
(() => {
  const viewer = document.querySelector('tf-trace-viewer');
  const timeline = viewer && viewer._traceViewer;
  if (!timeline || !timeline.model || !timeline.trackView) return {waiting: true};
  const slices = [];
  for (const thread of timeline.model.getAllThreads()) {
    for (const slice of thread.sliceGroup.slices) {
      if (slice.title.startsWith('tf_rdma ')) slices.push(slice);
    }
  }
  const steps = [...new Set(slices.map(s => s.args.step_id).filter(id => id !== undefined))]
      .sort((a, b) => Math.min(...slices.filter(s => s.args.step_id === a).map(s => s.start)) -
                      Math.min(...slices.filter(s => s.args.step_id === b).map(s => s.start)));
  if (steps.length < 2) return {error: `tf_rdma events of ${steps.length} step(s) in the profile`};
  const shown = slices.filter(s => s.args.step_id === steps[1]).sort((a, b) => a.start - b.start);
  const start = Math.min(...shown.map(s => s.start)), end = Math.max(...shown.map(s => s.end));
  const viewport = timeline.trackView.viewport;
  const transform = viewport.currentDisplayTransform.clone();
  transform.xSetWorldBounds(start - (end - start) / 3, end + (end - start) / 3,
                            viewport.modelTrackContainer.canvas.clientWidth);
  viewport.setDisplayTransformImmediately(transform);
  const receive = shown.find(s => s.title === 'tf_rdma receive') || shown[0];
  timeline.brushingStateController.changeSelectionFromTimeline(new tr.model.EventSet([receive]));
  return {step_id: steps[1], events: shown.map(s => `${s.title} ${s.args.peer} ${s.args.bytes}`),
          window_ms: [start, end], selected: receive.title};
})()
"""


def ensure_venv():
    """build/trace_viewer/venv with requirements.txt installed, made or refreshed when that changed."""
    stamp = VENV / "requirements.txt"
    if stamp.exists() and stamp.read_text() == REQUIREMENTS.read_text():
        return
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], check=True)
    shutil.copy(REQUIREMENTS, stamp)


def capture(log_dir, backend):
    """A profile of TF1 ps steps over tf_rdma's `backend` under `log_dir`; tf_rdma's events in it."""
    events = log_dir / "events.json"
    subprocess.run([sys.executable, "-m", "tests.tf.programs.profiled_ps_steps", str(log_dir / "profile"),
                    str(events)], cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "TF_RDMA_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"})
    return json.loads(events.read_text())


def wait_for_json(url, accept, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = response.read()
                if response.headers.get("Content-Encoding") == "gzip":  # TensorBoard's answers are
                    body = gzip.decompress(body)
                value = json.loads(body)
            if accept(value):
                return value
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from {url} within {timeout} s")
        time.sleep(0.5)


def stop(process):
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class DevTools:
    """Chromium's DevTools protocol over the websocket of one page."""

    def __init__(self, url):
        import websocket  # from build/trace_viewer/venv: this runs in .venv, see main()
        self.socket = websocket.create_connection(url, timeout=120, suppress_origin=True)
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"in the page: {result['exceptionDetails']}")
        return result["result"].get("value")


def screenshot(page_url, output):
    profile_dir = Path(tempfile.mkdtemp(prefix="trace_viewer_chromium_"))
    # No sandbox as root (Chromium refuses to start with one then); no GPU: the viewer draws on a
    # 2D canvas, which Chromium renders in software.
    chromium = subprocess.Popen(
        ["chromium", "--headless", "--disable-gpu", *(["--no-sandbox"] if os.geteuid() == 0 else []),
         f"--user-data-dir={profile_dir}", "--remote-debugging-port=0", f"--window-size={WINDOW[0]},{WINDOW[1]}",
         "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or chromium.poll() is not None:
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        pages = wait_for_json(f"http://127.0.0.1:{port}/json/list", lambda targets: any(
            t["type"] == "page" for t in targets))
        devtools = DevTools(next(t for t in pages if t["type"] == "page")["webSocketDebuggerUrl"])
        devtools.call("Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1], deviceScaleFactor=1,
                      mobile=False)
        devtools.call("Page.navigate", url=page_url)
        deadline = time.monotonic() + 120
        while True:
            try:
                shown = devtools.evaluate(SHOW_ONE_STEP)
            except RuntimeError as error:  # the page may still be navigating, its scripts half loaded
                shown = {"waiting": True, "last_error": str(error)}
            if shown and not shown.get("waiting"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the trace viewer did not load the profile within 120 s"
                                   + (f" ({shown['last_error']})" if shown and "last_error" in shown else ""))
            time.sleep(1)
        if "error" in shown:
            raise RuntimeError(f"the trace viewer's profile: {shown['error']}")
        time.sleep(2)  # the zoomed timeline and the details pane are drawn on the next frames
        image = devtools.call("Page.captureScreenshot", format="png")["data"]
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(base64.b64decode(image))
        return shown
    finally:
        stop(chromium)
        shutil.rmtree(profile_dir, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(prog="python -m tools.trace_viewer_screenshot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="tcp", help="tf_rdma's backend for the profiled steps (default tcp)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "trace_viewer.png")
    args = parser.parse_args()
    if not shutil.which("chromium"):
        sys.exit("tools.trace_viewer_screenshot needs Chromium: apt-get install chromium")
    ensure_venv()
    sys.path.append(str(next((VENV / "lib").glob("python3*/site-packages"))))  # websocket-client
    with tempfile.TemporaryDirectory(prefix="trace_viewer_") as work:
        log_dir = Path(work)
        events = capture(log_dir, args.backend)
        print(f"profiled: {len(events['events'])} tf_rdma events", file=sys.stderr)
        port = free_ports(1)[0]
        tensorboard = subprocess.Popen(
            [str(VENV / "bin" / "tensorboard"), "--logdir", str(log_dir / "profile"), "--host", "127.0.0.1",
             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}/data/plugin/profile"
            runs = wait_for_json(f"{base}/runs", lambda runs: len(runs) > 0)
            run = runs[0] if isinstance(runs[0], str) else runs[0]["name"]
            hosts = wait_for_json(f"{base}/hosts?{urllib.parse.urlencode({'run': run, 'tag': 'trace_viewer'})}",
                                  lambda hosts: len(hosts) > 0)
            host = hosts[0] if isinstance(hosts[0], str) else hosts[0]["hostname"]
            data = "/data/plugin/profile/data?" + urllib.parse.urlencode(
                {"run": run, "tag": "trace_viewer", "host": host})
            page = f"{base}/trace_viewer_index.html?" + urllib.parse.urlencode(
                {"is_streaming": "false", "is_oss": "true", "trace_data_url": data})
            shown = screenshot(page, args.output)
        finally:
            stop(tensorboard)
    print(json.dumps({"run": run, "host": host, "page": page, "shown": shown}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
