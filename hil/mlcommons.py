"""The MLCommons runner (mlcommons/tiny, benchmark/runner) as a client of tinydeploy firmware: data
sets in its format, what its flows must report for them, and its checks re-implemented from its
documented behaviour, for CI (which cannot fetch the runner). No code of the runner is here.

What the runner does, as re-implemented here (read from its source, README and yaml files):
- It finds the DUT by USB VID:PID (hil/mlcommons_shim.py presents a pty as the l4r5zi entry),
  opens it with serial.Serial(port, baud, timeout=0.1) and reads lines in a thread; a command is
  `cmd%` and its reply is every line up to one containing "m-ready"; no line within 5 s (30 s
  for `infer`) is a failure ("No response to command").
- It identifies the board with name% (m-name-dut-[...]) and profile% (m-model-[...]: which test
  of the scripts runs), each tried up to three times.
- `download` sends a file as `db load N%` then `db <hex>%` chunks of 31 bytes, never looking at
  the replies; for ad01 a file is cut into windows of bytes_to_send bytes every stride bytes
  (performance mode: the first window only).
- `infer N W` sends `infer N W%` and reads m-lap-us-<start>, m-lap-us-<end> and
  m-results-[v,...] (floats); throughput = N / ((end - start) / 1e6).
- Performance: `loop 5` of download + infer (kws01 70 10, ic01 20 5, vww01 20 5, ad01 1500 10,
  tests_performance.yaml); a loop count other than 5 is "ERROR 1", a loop shorter than 10 s of
  host time "ERROR 2"; else the median throughput.
- Accuracy: one download + `infer 1 0` per file (ad01: per window); results with more than one
  value are divided by their sum (a zero sum fails); per file the mean over its windows; top-1
  accuracy of the argmax against the label (ad01: the best over 100 thresholds of
  (precision + recall) / 2), and the area under the ROC curve (two classes: of column 1;
  more: one-vs-rest, averaged over classes)."""
from __future__ import annotations

import csv
import queue
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tinydeploy.firmware import profiles

PERFORMANCE = {"kws01": (70, 10), "ic01": (20, 5), "vww01": (20, 5), "ad01": (1500, 10)}   # infer N W
LOOPS = 5
CHUNK = 31
REPLY_TIMEOUT_S = 5.0
INFER_TIMEOUT_S = 30.0
AD_STRIDE = 512                 # bytes between AD windows (one 128-value frame of float32)


class RunnerFailure(AssertionError):
    """The runner would have stopped or reported an error here."""


# ---- data sets in the runner's format ---------------------------------------------------------

@dataclass
class DataSet:
    folder: Path
    files: list[str]
    labels: list[int]
    windows: list[list[bytes]]        # what the runner sends per file (ad01: several windows)
    classes: int


def make_dataset(app, folder: Path, n_files: int, seed: int = 0, ad_windows: int = 3) -> DataSet:
    """Seeded files for the app's model, in the runner's layout (folder/<model id>/y_labels.csv:
    file, classes, class, bytes_to_send, stride), labelled round robin over the classes; AD files
    hold `ad_windows` windows each."""
    h = app.fw.harness
    mid = h["model_id"]
    out = Path(folder) / mid
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_in = app.input_bytes
    classes = 2 if h["results"] == "mse" else sum(o["elements"] for o in h["outputs"])
    files, labels, windows, rows = [], [], [], []
    for i in range(n_files):
        name = f"{mid}_{i:03d}.bin"
        if h["db_float32"]:
            n_win = ad_windows
            x = rng.normal(0.0, 4.0 + 8.0 * (i % 2), (n_in + (n_win - 1) * AD_STRIDE // 4)).astype(np.float32)
            data = x.tobytes()
            wins = [data[k * AD_STRIDE:k * AD_STRIDE + 4 * n_in] for k in range(n_win)]
            rows.append([name, 2, i % 2, 4 * n_in, AD_STRIDE])
        else:
            data = bytes(rng.integers(0, 256, n_in, dtype=np.uint8))
            wins = [data]
            rows.append([name, classes, i % classes, n_in, n_in])
        (out / name).write_bytes(data)
        files.append(name)
        labels.append(rows[-1][2])
        windows.append(wins)
    with open(out / "y_labels.csv", "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return DataSet(out, files, labels, windows, classes)


def device_inputs(h: dict, window: bytes) -> tuple[np.ndarray, np.ndarray | None]:
    """What the harness makes of a window the runner sends: the 8-bit input bytes and, for
    float32 loads, the float window."""
    if h["db_float32"]:
        x = np.frombuffer(window, np.float32)
        i = h["input"]
        return profiles.quantise(x, i["scale"], i["zero_point"], i["lo"], i["hi"]).astype(np.int8), x
    raw = np.frombuffer(window, np.uint8)
    return ((raw ^ 0x80).view(np.int8) if h["db_subtract_128"] else raw.view(np.int8)), None


def expected_values(app, ds: DataSet) -> list[list[list[float]]]:
    """Per file, per window: the values the board prints (tinydeploy's exact reference on the
    inputs the harness makes, dequantised as the harness does, rounded to %0.3f)."""
    from tinydeploy.quant import exact
    h = app.fw.harness
    name, shape, _ = app.in_specs[0]
    out = []
    for wins in ds.windows:
        per = []
        for w in wins:
            q, x = device_inputs(h, w)
            outs = exact.run_model(app.path, {name: q.reshape(shape)})
            if not isinstance(outs, (list, tuple)):
                outs = [outs]
            line = profiles.printed_results(h, outs, x)
            per.append([float(v) for v in line[len("m-results-["):-1].split(",")])
        out.append(per)
    return out


# ---- the runner's arithmetic -------------------------------------------------------------------

def _auc_binary(y: np.ndarray, s: np.ndarray) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic, ties counted half)."""
    pos, neg = s[y == 1], s[y == 0]
    if not len(pos) or not len(neg):
        raise RunnerFailure("AUC needs both classes among the labels")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def auc(y_true, y_pred) -> float:
    y, p = np.asarray(y_true), np.asarray(y_pred, np.float64)
    if p.shape[1] == 2:
        return _auc_binary(y, p[:, 1])
    if p.shape[1] == 1:
        return _auc_binary(y, p[:, 0])
    if len(set(y.tolist())) != p.shape[1]:
        raise RunnerFailure(f"one-vs-rest AUC needs every one of the {p.shape[1]} classes among the labels")
    return float(np.mean([_auc_binary((y == k).astype(int), p[:, k]) for k in range(p.shape[1])]))


def accuracy(y_true, y_pred) -> float:
    y, p = np.asarray(y_true), np.asarray(y_pred, np.float64)
    if p.shape[1] == 1:
        best = 0.0
        for t in np.amin(p) + np.arange(0.0, 1.0, 0.01) * (np.amax(p) - np.amin(p)):
            b = (p > t).astype(int)[:, 0]
            tp, fp, fn = np.sum(b[y == 1] == 1), np.sum(b[y == 0] == 1), np.sum(b[y == 1] == 0)
            best = max(best, 100 * (tp / (tp + fp + 1e-8) + tp / (tp + fn + 1e-8)) / 2)
        return float(best)
    return float(100 * np.sum(np.argmax(p, axis=1) == y) / len(y))


def summarise(results: list[list[list[float]]], labels: list[int]) -> dict:
    """Top-1 accuracy and AUC as the runner computes them from per-file, per-window results."""
    y_pred = []
    for per in results:
        vals = []
        for r in per:
            if len(r) > 1:
                total = sum(r)
                if total == 0:
                    raise RunnerFailure(f"results {r} sum to 0: the runner's normalisation divides by zero")
                r = [v / total for v in r]
            vals.append(r)
        y_pred.append(np.mean(vals, axis=0))
    return {"accuracy": accuracy(labels, y_pred), "auc": auc(labels, y_pred)}


# ---- the runner's host side ----------------------------------------------------------------------

@dataclass
class RunnerDut:
    """The runner's view of the DUT: a serial port read line by line in a thread."""
    port: str
    baud: int
    log: list[str] = field(default_factory=list)

    def __post_init__(self):
        import serial
        self.ser = serial.Serial(self.port, self.baud, timeout=0.1)
        self.lines: queue.Queue = queue.Queue()
        self._run = True
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        buf = ""
        while self._run:
            try:
                b = self.ser.read(1)
            except Exception:
                return
            c = b.decode("ascii", "replace") if b else ""
            if c and c not in "\n\r\0":
                buf += c
            elif c == "\n":
                self.lines.put(buf)
                buf = ""

    def close(self):
        self._run = False
        self._t.join(2)
        self.ser.close()

    def command(self, cmd: str, timeout: float = REPLY_TIMEOUT_S) -> list[str]:
        self.log.append("> " + cmd[:60])
        self.ser.write((cmd + "%").encode())
        out = []
        while True:
            try:
                ln = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise RunnerFailure(f"No response to command {cmd[:40]} within {timeout:g} s") from None
            if ln:
                out.append(ln)
                self.log.append("< " + ln[:100])
            if "m-ready" in ln:
                return out

    def identify(self) -> tuple[str, str]:
        name = model = None
        for _ in range(3):
            name = name or next((m[1] for ln in self.command("name") if (m := re.match(r"^m-name-dut-\[([^]]+)]$", ln))), None)
            model = model or next((m[1] for ln in self.command("profile") if (m := re.match(r"^m-model-\[([^]]+)]$", ln))), None)
            if name and model:
                return name, model
        raise RunnerFailure(f"the DUT did not identify itself (name {name!r}, model {model!r})")

    def load(self, data: bytes) -> None:
        self.command(f"db load {len(data)}")
        for i in range(0, len(data), CHUNK):
            self.command("db " + data[i:i + CHUNK].hex())

    def infer(self, n: int, warmups: int) -> dict:
        lines = self.command(f"infer {n} {warmups}", timeout=INFER_TIMEOUT_S)
        laps = [int(m[1]) for ln in lines if (m := re.match(r"^m-lap-us-([0-9]+)$", ln))]
        res = next((m[1] for ln in lines if (m := re.match(r"^m-results-\[([^]]+)\]$", ln))), None)
        if len(laps) < 2 or res is None:
            raise RunnerFailure(f"incomplete infer reply: {lines}")
        values = [float(x) for x in res.split(",") if x.strip()]
        return {"elapsed_us": laps[1] - laps[0], "results": values,
                "throughput": n / ((laps[1] - laps[0]) / 1e6) if laps[1] > laps[0] else 0.0}


def performance(dut: RunnerDut, model: str, ds: DataSet) -> dict:
    n, w = PERFORMANCE[model]
    t0 = time.time()
    windows = []
    for i in range(LOOPS):
        dut.load(ds.windows[i % len(ds.windows)][0])
        windows.append(dut.infer(n, w))
    duration = time.time() - t0
    if duration < 10.0:
        raise RunnerFailure(f"ERROR 2 - loop exited before 10 seconds elapsed ({duration:.1f} s)")
    return {"windows": windows, "median_throughput": statistics.median(r["throughput"] for r in windows),
            "host_s": duration}


def accuracy_flow(dut: RunnerDut, ds: DataSet) -> dict:
    results = []
    for wins in ds.windows:
        per = []
        for w in wins:
            dut.load(w)
            per.append(dut.infer(1, 0)["results"])
        results.append(per)
    return {"results": results, **summarise(results, ds.labels)}
