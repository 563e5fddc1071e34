"""A seeded fuzzer of the firmware's serial protocol (firmware_templates/mcu/harness.c), free of
pytest: hil/test_protocol_fuzz.py runs it against the boards of the rig (under QEMU in CI), and
tests/test_harness_host.py against harness.c built for this machine under ASan and UBSan.

Each fault is what a broken host, a noisy line or a hostile one sends:
  garbage       random bytes (control bytes, '%', bytes above 127), random printable text
  boundaries    counts and sizes at and beyond their limits (0, N, N + 1, 2^31, 2^32, 2^64),
                commands of 80, 81 and 1000 characters, odd or non-hex db chunks, wrong CRCs
  interleavings commands inside a load's payload, a db load interrupted by a bulk load (and the
                reverse), inference before a load is complete, commands split across writes,
                several commands in one write, a bulk load that stops halfway (the board times
                out and discards the late bytes)

After every fault the board must answer `name%` correctly (the host may first end a half-sent
command with '%') and then run an inference whose raw outputs are bit for bit those of the
inference before any fault."""
from __future__ import annotations

import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tinydeploy.errors import TinydeployError
from tinydeploy.runners import mcu
from tinydeploy.runners.protocol import CMD_MAX, INFER_MAX

BIG = ["0", "-1", str(2**31 - 1), str(2**31), str(2**32 - 1), str(2**32), str(2**64), "99999999999999999999",
       "0x10", "1e3", "", "+1", " "]
WORDS = ["name", "profile", "timestamp", "db", "load", "print", "infer", "results", "bload", "rawout", "ticks",
         "stack", "0", "1", "ff", "%", "\r\n", " "]


@dataclass
class Fault:
    kind: str
    what: str
    parts: list[tuple[bytes, float]] = field(default_factory=list)   # (bytes, seconds to wait after)
    slow: bool = False          # needs the board's bulk-load timeout to pass


def _bload(data: bytes, crc: int | None = None) -> bytes:
    return f"bload {len(data)} {zlib.crc32(data) if crc is None else crc:08x}%".encode()


def known_faults(size: int) -> list[Fault]:
    """The faults an adversarial probe found the firmware vulnerable to (issue 12), always first:
    a warm-up count of 2^32 - 1 (the board was deaf until reset) and the late bytes of a timed-out
    bulk load (they were run as commands; here they spell quit%)."""
    late = (b"quit%name%" * (size // 10 + 1))[:size]
    cut = max(1, size // 3)
    return [Fault("boundary", "infer 1 4294967295", [(b"infer 1 4294967295%", 0.0)]),
            Fault("interleaving", "late bytes of a timed-out bload are not commands",
                  [(_bload(late), 0.05), (late[:cut], 0.0), (b"", -1.0), (late[cut:], 0.0)], slow=True)]


def make_faults(rng: np.random.Generator, n: int, input_bytes: int, slow: int = 1) -> list[Fault]:
    """`n` faults: the known ones, then seeded ones; at most `slow` wait for the board's
    bulk-load timeout (besides the known one)."""
    size = input_bytes
    out: list[Fault] = known_faults(size)[:n]
    slow += sum(f.slow for f in out)
    makers = [_garbage, _printable, _boundary, _interleave]
    while len(out) < n:
        f = makers[len(out) % len(makers)](rng, size)
        if f.slow and sum(x.slow for x in out) >= slow:
            continue
        out.append(f)
    return out


def _garbage(rng, size) -> Fault:
    k = int(rng.integers(1, 600))
    junk = bytes(rng.integers(0, 256, k, dtype=np.uint8))
    return Fault("garbage", f"{k} random bytes", [(junk, 0.0)])


def _printable(rng, size) -> Fault:
    toks = [str(rng.choice(WORDS)) if rng.random() < 0.7 else str(rng.choice(BIG)) for _ in range(int(rng.integers(1, 8)))]
    text = " ".join(toks)
    text = text.replace("quit", "qu_it")          # never end the firmware
    if text.split() and text.split()[0] == "infer":   # an infer the board would accept could run for hours
        text = "infer 0 " + text
    data = (text + "%").encode()
    return Fault("garbage", f"text {text[:60]!r}", [(data, 0.0)])


def _boundary(rng, size) -> Fault:
    crc = zlib.crc32(bytes(size))
    cases = [
        ("infer 0 0%", "no runs"), (f"infer {INFER_MAX + 1} 0%", "runs past the limit"),
        (f"infer 1 {INFER_MAX + 1}%", "warm-up past the limit"), ("infer 1 4294967295%", "warm-up 2^32 - 1"),
        ("infer 4294967296 0%", "runs 2^32"), ("infer 18446744073709551616 1%", "runs 2^64"),
        ("infer -1 0%", "negative runs"), ("infer 1 0 0%", "too many arguments"),
        ("db load 0%", "empty db load"), (f"db load {size + 1}%", "db load past the buffer"),
        ("db load 4294967296%", "db load 2^32"), ("db 0%", "odd hex digits"), ("db zz%", "not hex"),
        (f"bload {size + 1} {crc:08x}%", "bload past the buffer"), ("bload 0 0%", "empty bload"),
        (f"bload {size} 123456789%", "CRC of 9 digits"), (f"bload {size} 0x%", "CRC without digits"),
        ("bload 4294967296 0%", "bload 2^32"), ("n" * CMD_MAX + "%", "80 characters"),
        ("n" * (CMD_MAX + 1) + "%", "81 characters"), ("x" * 1000 + "%", "1000 characters"),
        ("na\x00me%", "a NUL byte"), ("na\x7fme%", "DEL"), ("results extra%", "extra argument"),
        ("%%%%%%%%", "empty commands"), ("\r\n" * 50 + "%", "line ends only"),
    ]
    cmd, what = cases[int(rng.integers(len(cases)))]
    return Fault("boundary", what, [(cmd.encode("latin-1"), 0.0)])


def _interleave(rng, size) -> Fault:
    data = bytes(rng.integers(0, 256, size, dtype=np.uint8))
    k = int(rng.integers(0, 9))
    if k == 0:    # commands inside a bulk load's payload are payload
        inner = (b"quit%name%infer 1 0%" * (size // 20 + 1))[:size]
        return Fault("interleaving", "commands inside a bload payload", [(_bload(inner), 0.05), (inner, 0.0)])
    if k == 1:    # a bulk load with the wrong CRC
        return Fault("interleaving", "bload with a wrong CRC", [(_bload(data, zlib.crc32(data) ^ 1), 0.05), (data, 0.0)])
    if k == 2:    # a db load interrupted by a bulk load, then its chunks
        half = data[:max(1, size // 2)].hex()[:60]
        return Fault("interleaving", "db load, then bload, then db chunks",
                     [(f"db load {size}%".encode(), 0.0), (f"db {half}%".encode(), 0.0), (_bload(data), 0.05),
                      (data, 0.0), (f"db {half}%".encode(), 0.0)])
    if k == 3:    # inference before the db load is complete, results before anything
        return Fault("interleaving", "infer during an incomplete db load",
                     [(f"db load {size}%".encode(), 0.0), (b"db 00%", 0.0), (b"infer 1 0%", 0.0), (b"rawout%", 0.0)])
    if k == 4:    # a command split across writes with pauses, several in one write
        return Fault("interleaving", "split and batched commands",
                     [(b"na", 0.1), (b"me", 0.1), (b"%profile%timestamp%ticks%stack%", 0.0)])
    if k == 5:    # a bulk load sent one byte at a time (within the board's timeout)
        small = data[:min(size, 24)]
        parts = [(f"db load {size}%".encode(), 0.0)] + [(bytes([b]), 0.002) for b in f"db {small.hex()}%".encode()]
        return Fault("interleaving", "a db chunk one byte at a time", parts)
    if k == 6:    # a db load announced, then a different command, then more chunks than announced
        return Fault("interleaving", "db chunks past the announced size",
                     [(b"db load 2%", 0.0), (b"name%", 0.0), (b"db 001122%", 0.0)])
    if k == 7:    # garbage in the middle of a command
        return Fault("interleaving", "control bytes in a command", [(b"in\x01fer 1 0%", 0.0), (b"db load \xff%", 0.0)])
    # k == 8: a bulk load that stops halfway; the rest comes after the board gave up
    cut = max(1, size // 3)
    return Fault("interleaving", "bload stopped halfway, the rest late",
                 [(_bload(data), 0.05), (data[:cut], 0.0), (b"", -1.0), (data[cut:], 0.0)], slow=True)


def send(dev, f: Fault, timeout: float) -> None:
    """Sends a fault's parts; a pause of -1 waits until the board reports its bulk-load timeout."""
    for data, pause in f.parts:
        if pause < 0:
            dev.expect(r"^e-\[timeout: bulk load", timeout=timeout, what="the board's bulk-load timeout")
            continue
        if data:
            dev.write(data, note=f"({f.kind}: {len(data)} bytes)")
        if pause:
            time.sleep(pause)


def name_again(dev, name: str, timeout: float, tries: int = 4) -> int:
    """The board answers name% with `name` (after a '%' that ends any half-sent command); returns
    the number of tries it took. A board still inside a bulk load takes the bytes as payload and
    answers after its timeout, hence the retries."""
    for attempt in range(1, tries + 1):
        dev.write(b"%name%")
        try:
            m, _ = dev.expect(r"^m-name-dut-\[(.*)\]$", timeout=timeout, what="the answer to name% after a fault")
        except TinydeployError:
            if attempt == tries:
                raise
            continue
        if m.group(1) != name:
            raise AssertionError(f"name% answered {m.group(1)!r}, expected {name!r}")
        dev.expect(r"^m-ready$", timeout=timeout)
        dev.drain(quiet=0.1, limit=2.0)
        return attempt
    raise AssertionError("unreachable")


@dataclass
class Report:
    faults: int = 0
    kinds: Counter = field(default_factory=Counter)
    retries: int = 0
    inferences: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items()))
        return (f"{self.faults} faults ({kinds}): each followed by a correct name% ({self.retries} needed a retry) "
                f"and a bit-identical inference ({self.inferences}); {self.seconds:.0f} s")


def fuzz(dev, name: str, data: bytes, out_specs, baseline: bytes, n: int, seed: int,
         timeout: float = 60.0, slow: int = 1) -> Report:
    """Runs `n` seeded faults against the protocol Device `dev`, each followed by name% and an
    inference on `data` whose raw outputs must equal `baseline`. Raises AssertionError (or the
    device's TinydeployError) at the first fault the board does not survive."""
    rng = np.random.default_rng(seed)
    rep, t0 = Report(), time.monotonic()
    for i, f in enumerate(make_faults(rng, n, len(data), slow)):
        try:
            send(dev, f, timeout)
            rep.retries += name_again(dev, name, timeout) > 1
            got = mcu.infer(dev, data, out_specs, runs=1, timeout=timeout, stack=False)
        except (TinydeployError, AssertionError) as e:
            raise AssertionError(f"fault {i} ({f.kind}: {f.what}): {e}") from None
        if got["raw"] != baseline:
            raise AssertionError(f"fault {i} ({f.kind}: {f.what}): the inference after it differs from the one before")
        rep.faults += 1
        rep.kinds[f.kind] += 1
        rep.inferences += 1
    rep.seconds = time.monotonic() - t0
    return rep
