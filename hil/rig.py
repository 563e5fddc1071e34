"""The rig's layers, free of pytest so they can be tested without a board:

    inventory (hil/boards.yml)  which boards exist, how to reach them, how to reset them
    app                         firmware built per model and board, cached in one folder
    transport                   the board's reset strategy around tinydeploy.runners: QEMU
                                (qemu_system.Emulator.boot) or a serial port (mcu.open_serial)
    device                      tinydeploy.runners.protocol.Device: expect-style reads, timeouts, full log
    Dut                         app + transport + device, with a health check and the board's reset;
                                inferences through tinydeploy.runners.mcu.infer

The tests only see Dut objects, so the same test code runs for every transport."""
from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tinydeploy import reference
from tinydeploy.targets import boards
from tinydeploy import firmware
from tinydeploy.build import file_lock
from tinydeploy.errors import TinydeployError
from tinydeploy.runners import mcu
from tinydeploy.runners.harness import pack_inputs, unpack_outputs
from tinydeploy.runners.qemu_system import Emulator

HIL_DIR = Path(__file__).resolve().parent
REPO = HIL_DIR.parent
DEFAULT_MODELS_DIR = REPO.parent / "shared" / "models" / "mlperf_tiny"
DEFAULT_MODELS = ["kws_dscnn_int8", "ad_autoencoder_int8", "ic_resnet8_int8", "vww_mobilenetv1_int8"]


class RigError(TinydeployError):
    """A problem with the rig's set-up (inventory, budgets, ports), as opposed to a board failure."""


# ---- inventory ------------------------------------------------------------------------------

TRANSPORTS = {"qemu", "serial"}
RESETS = {"qemu": {"restart"}, "serial": {"reopen", "touch1200"}}
BOARD_KEYS = {"manifest", "transport", "serial_number", "port", "baud", "reset", "flash", "flash_serial_number",
              "flash_port", "timeout_s", "boot_timeout_s", "reappear_timeout_s", "notes"}


@dataclass
class BoardEntry:
    """One board of the inventory. id is what --board names; manifest the boards/<id>.json it is."""
    id: str
    manifest: str
    transport: str                    # "qemu" or "serial"
    reset: str                        # qemu: restart; serial: reopen | touch1200
    serial_number: str | None = None  # USB serial number (stable across replugging)
    port: str | None = None           # a fixed device path or pyserial URL instead
    baud: int = 115200
    flash: str | None = None          # command template flashing {bin}/{hex}/{elf} to {port}
    flash_serial_number: str | None = None   # the port flashing goes through, when not the protocol's
    flash_port: str | None = None
    timeout_s: float = 60.0
    boot_timeout_s: float = 60.0
    reappear_timeout_s: float = 10.0
    notes: str = ""
    place: str | None = None          # transport labgrid: the place (hil/farm.py), not in inventories
    lg_emulated: bool = False         # ... whose board is emulated (tag kind=qemu)

    @property
    def board(self):
        return boards.get_board(self.manifest)

    @property
    def emulated(self) -> bool:
        return self.transport == "qemu" or self.lg_emulated


def _where(path, name=None) -> str:
    return f"{path}: board {name!r}" if name else str(path)


def parse_inventory(text: str, path="inventory") -> dict[str, BoardEntry]:
    """Board id -> BoardEntry from the YAML text of an inventory; RigError naming the file, the
    board and the key for anything wrong."""
    import yaml
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("boards"), dict) or not data["boards"]:
        raise RigError(f"{path}: expected a mapping with a non-empty 'boards:' mapping (board id -> settings)")
    extra = set(data) - {"boards"}
    if extra:
        raise RigError(f"{path}: unknown top-level key(s) {', '.join(sorted(map(str, extra)))} (only 'boards')")
    known = boards.load_all()
    out = {}
    for bid, spec in data["boards"].items():
        where = _where(path, bid)
        if not isinstance(bid, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", bid):
            raise RigError(f"{path}: board id {bid!r} must be lower-case letters, digits, '-', '_' or '.'")
        if not isinstance(spec, dict):
            raise RigError(f"{where}: expected a mapping of settings, got {type(spec).__name__}")
        bad = set(spec) - BOARD_KEYS
        if bad:
            raise RigError(f"{where}: unknown key(s) {', '.join(sorted(map(str, bad)))}; known: {', '.join(sorted(BOARD_KEYS))}")
        manifest = spec.get("manifest", bid)
        if manifest not in known:
            raise RigError(f"{where}: no board manifest boards/{manifest}.json (known: {', '.join(sorted(known))})")
        b = known[manifest]
        if not b.is_mcu:
            raise RigError(f"{where}: boards/{manifest}.json is not a microcontroller (kind {b.kind})")
        transport = spec.get("transport", "qemu" if b.is_qemu_machine else "serial")
        if transport not in TRANSPORTS:
            raise RigError(f"{where}: transport must be one of {', '.join(sorted(TRANSPORTS))}, not {transport!r}")
        if transport == "qemu" and not b.is_qemu_machine and not b.emulate_with:
            raise RigError(f"{where}: transport qemu, but boards/{manifest}.json is neither a QEMU machine nor names emulate_with")
        if transport == "serial" and b.is_qemu_machine:
            raise RigError(f"{where}: boards/{manifest}.json is a QEMU machine; use transport: qemu")
        touch = bool((b.upload or {}).get("touch_baud"))
        reset = spec.get("reset", "restart" if transport == "qemu" else "reopen")
        if reset not in RESETS[transport]:
            raise RigError(f"{where}: reset {reset!r} is not possible with transport {transport} "
                           f"(choose {', '.join(sorted(RESETS[transport]))})")
        if reset == "touch1200" and not touch:
            raise RigError(f"{where}: reset touch1200, but boards/{manifest}.json has no upload.touch_baud")
        if reset == "touch1200" and not spec.get("flash"):
            raise RigError(f"{where}: reset touch1200 leaves the board in its bootloader; it needs a flash: command")
        for key in ("serial_number", "port", "flash", "flash_serial_number", "flash_port", "notes"):
            if key in spec and not isinstance(spec[key], str):
                raise RigError(f"{where}: {key} must be a string (quote numbers: serial_number: \"0123\")")
        if transport == "qemu" and (spec.get("serial_number") or spec.get("port")):
            raise RigError(f"{where}: serial_number/port make no sense with transport qemu")
        if spec.get("serial_number") and spec.get("port"):
            raise RigError(f"{where}: give serial_number or port, not both")
        if spec.get("flash_serial_number") and spec.get("flash_port"):
            raise RigError(f"{where}: give flash_serial_number or flash_port, not both")
        if (spec.get("flash_serial_number") or spec.get("flash_port")) and not spec.get("flash"):
            raise RigError(f"{where}: flash_serial_number/flash_port without a flash: command")
        baud = spec.get("baud", b.serial_baud)
        if isinstance(baud, bool) or not isinstance(baud, int) or baud <= 0:
            raise RigError(f"{where}: baud must be a positive integer, not {baud!r}")
        times = {}
        for key, default in (("timeout_s", 60.0), ("boot_timeout_s", 60.0), ("reappear_timeout_s", 10.0)):
            v = spec.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise RigError(f"{where}: {key} must be a positive number of seconds, not {v!r}")
            times[key] = float(v)
        if spec.get("flash"):
            try:
                spec["flash"].format(**{k: "x" for k in FLASH_FIELDS})
            except (KeyError, IndexError, ValueError) as e:
                raise RigError(f"{where}: flash command has an unknown placeholder {e} "
                               f"(known: {', '.join('{' + k + '}' for k in FLASH_FIELDS)})") from None
        out[bid] = BoardEntry(id=bid, manifest=manifest, transport=transport, reset=reset,
                              serial_number=spec.get("serial_number"), port=spec.get("port"), baud=baud,
                              flash=spec.get("flash"), flash_serial_number=spec.get("flash_serial_number"),
                              flash_port=spec.get("flash_port"), notes=spec.get("notes", ""), **times)
    return out


def load_inventory(path) -> dict[str, BoardEntry]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise RigError(f"cannot read the inventory {path}: {e.strerror}") from None
    return parse_inventory(text, path)


def select_boards(inventory: dict[str, BoardEntry], wanted: list[str], path="inventory") -> list[BoardEntry]:
    out = []
    for w in wanted:
        if w == "all":
            out += [e for e in inventory.values() if e not in out]
        elif w not in inventory:
            raise RigError(f"--board {w!r} is not in {path} (boards there: {', '.join(inventory)})")
        elif inventory[w] not in out:
            out.append(inventory[w])
    return out


# ---- ports ----------------------------------------------------------------------------------

FLASH_FIELDS = ("bin", "hex", "elf", "outdir", "port", "port_name", "baud")


def _comports():
    from serial.tools import list_ports
    return list_ports.comports()


def find_port(serial_number: str, list_ports=None) -> str:
    """The device path of the USB serial port whose serial number is serial_number (case
    insensitive); RigError listing what is plugged in otherwise."""
    ports = list((list_ports or _comports)())
    hits = [p for p in ports if (p.serial_number or "").lower() == serial_number.lower()]
    if len(hits) == 1:
        return hits[0].device
    seen = ", ".join(f"{p.device} (serial number {p.serial_number or 'none'}"
                     + (f", {p.description}" if getattr(p, "description", None) else "") + ")"
                     for p in ports) or "no serial ports at all"
    if not hits:
        raise RigError(f"no serial port with USB serial number {serial_number!r} is plugged in; seen: {seen}")
    raise RigError(f"{len(hits)} serial ports have USB serial number {serial_number!r}: "
                   f"{', '.join(p.device for p in hits)}; pass --port")


def resolve_port(entry: BoardEntry, cli_port: str | None = None, list_ports=None) -> str:
    """--port wins; then the inventory's serial number (looked up now, so replugging does not
    matter), then its fixed port."""
    if cli_port:
        return cli_port
    if entry.serial_number:
        return find_port(entry.serial_number, list_ports)
    if entry.port:
        return entry.port
    raise RigError(f"board {entry.id!r} needs a serial port: pass --port PORT or set serial_number "
                   "(or port) for it in the inventory")


# ---- budgets --------------------------------------------------------------------------------

BUDGET_KEYS = {"instructions", "us", "flash_bytes", "ram_bytes"}


@dataclass
class Budgets:
    margin_percent: dict[str, float]
    boards: dict[str, dict[str, dict[str, int]]]

    def get(self, board: str, model: str) -> dict[str, int] | None:
        return (self.boards.get(board) or {}).get(model)

    def check(self, board: str, model: str, measured: dict[str, float]) -> list[str]:
        """Regressions: measured figures above budget * (1 + margin). Returns messages."""
        budget = self.get(board, model) or {}
        out = []
        for key, limit in budget.items():
            if key not in measured or measured[key] is None:
                continue
            allowed = limit * (1 + self.margin_percent[key] / 100.0)
            if measured[key] > allowed:
                out.append(f"{key}: {measured[key]:,.0f} is over the budget {limit:,} + {self.margin_percent[key]:g}% "
                           f"= {allowed:,.0f} (+{(measured[key] / limit - 1) * 100:.1f}%)")
        return out


def parse_budgets(text: str, path="budgets") -> Budgets:
    import yaml
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("margin_percent"), dict):
        raise RigError(f"{path}: expected 'margin_percent:' (figure -> percent) and 'boards:'")
    margins = data["margin_percent"]
    for k, v in margins.items():
        if k not in BUDGET_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise RigError(f"{path}: margin_percent.{k}: want one of {', '.join(sorted(BUDGET_KEYS))} -> a percent >= 0")
    missing = BUDGET_KEYS - set(margins)
    if missing:
        raise RigError(f"{path}: margin_percent lacks {', '.join(sorted(missing))}")
    bds = data.get("boards") or {}
    if not isinstance(bds, dict):
        raise RigError(f"{path}: boards must map board id -> model -> figures")
    for b, models in bds.items():
        if not isinstance(models, dict):
            raise RigError(f"{path}: boards.{b} must map model -> figures")
        for m, figs in models.items():
            if not isinstance(figs, dict):
                raise RigError(f"{path}: boards.{b}.{m} must map figure -> number")
            for k, v in figs.items():
                if k not in BUDGET_KEYS or isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise RigError(f"{path}: boards.{b}.{m}.{k}: want one of {', '.join(sorted(BUDGET_KEYS))} "
                                   "-> a positive integer")
    return Budgets({k: float(v) for k, v in margins.items()}, bds)


def render_budgets(header: str, b: Budgets) -> str:
    """budgets.yml text: the header comment, the margins, one line per board and model."""
    keys = ["instructions", "us", "flash_bytes", "ram_bytes"]
    out = [header[:-1] if header.endswith("\n") else header] if header.strip() else []
    out.append("margin_percent: {" + ", ".join(f"{k}: {b.margin_percent[k]:g}" for k in keys) + "}")
    out.append("boards:" + ("" if b.boards else " {}"))
    for board, models in b.boards.items():
        out.append(f"  {board}:")
        width = max(len(m) for m in models) + 1 if models else 0
        for m, figs in models.items():
            out.append(f"    {(m + ':').ljust(width)} {{" + ", ".join(f"{k}: {figs[k]}" for k in keys if k in figs) + "}")
    return "\n".join(out) + "\n"


def update_budgets(path, measured: dict[str, dict[str, dict[str, int]]]) -> Path:
    """Writes the measured figures (board -> model -> figure -> value) into the budgets file,
    keeping its header comment, its margins and the entries not measured."""
    path = Path(path)
    text = path.read_text() if path.is_file() else ""
    b = parse_budgets(text, path) if text else Budgets({"instructions": 5.0, "us": 10.0, "flash_bytes": 5.0,
                                                        "ram_bytes": 2.0}, {})
    header = "".join(ln for ln in text.splitlines(keepends=True)[:_header_lines(text)])
    for board, models in measured.items():
        for model, figs in models.items():
            b.boards.setdefault(board, {})[model] = {k: int(round(v)) for k, v in figs.items()}
    path.write_text(render_budgets(header, b))
    return path


def _header_lines(text: str) -> int:
    n = 0
    for ln in text.splitlines():
        if ln.startswith("#") or not ln.strip():
            n += 1
        else:
            break
    return n


def load_budgets(path) -> Budgets:
    path = Path(path)
    try:
        return parse_budgets(path.read_text(), path)
    except OSError as e:
        raise RigError(f"cannot read the budgets {path}: {e.strerror}") from None


# ---- app: firmware per model and board --------------------------------------------------------

@dataclass
class App:
    """A model compiled and built for one board (the build outputs the tests run)."""
    model: str                                  # file stem, e.g. kws_dscnn_int8
    path: Path
    entry: BoardEntry
    fw: firmware.Firmware
    in_specs: list[tuple[str, tuple, np.dtype]]
    out_specs: list[tuple[tuple, np.dtype]]

    @property
    def input_bytes(self) -> int:
        return self.fw.memory["input_buffer_bytes"]

    @property
    def model_id(self) -> str:
        return firmware.model_id(self.path.name)

    def inputs(self, seed: int) -> tuple[dict[str, np.ndarray], bytes]:
        feeds = reference.random_inputs(self.in_specs, seed)
        return feeds, pack_inputs(feeds[n] for n, _, _ in self.in_specs)

    def reference(self, feeds) -> list[np.ndarray]:
        """What the outputs should be: the oracle (reference.run_oracle; 8-bit models: the graph
        run node by node, never onnxruntime's CPU-dependent fast kernels)."""
        return reference.run_oracle(self.path.read_bytes(), feeds)

    def check(self, feeds, got) -> dict:
        """The verdict on the board's outputs (reference.check_outputs: 8-bit outputs also bit
        for bit against tinydeploy's exact reference)."""
        return reference.check_outputs(self.path, self.path.read_bytes(), feeds, got, 1e-4)

    def split_outputs(self, raw: bytes) -> list[np.ndarray]:
        return unpack_outputs(raw, self.out_specs, f"the board running {self.model}")


class AppCache:
    """Builds firmware once per (board, model) into root/<board>/<model>/ (shared by pytest-xdist
    workers through a file lock; make keeps unchanged objects)."""

    def __init__(self, root: Path, models_dir: Path):
        self.root = Path(root)
        self.models_dir = Path(models_dir)
        self._apps: dict[tuple[str, str], App] = {}

    def model_path(self, model: str) -> Path:
        p = Path(model)
        if p.suffix != ".onnx":
            p = self.models_dir / f"{model}.onnx"
        if not p.is_file():
            raise RigError(f"model {str(p)!r} does not exist (the MLPerf Tiny models belong in "
                           f"{DEFAULT_MODELS_DIR}, beside the checkout)")
        return p

    def get(self, entry: BoardEntry, model: str) -> App:
        key = (entry.id, model)
        if key not in self._apps:
            self._apps[key] = self._build(entry, model)
        return self._apps[key]

    def _build(self, entry: BoardEntry, model: str) -> App:
        from tinydeploy.pipeline import compile_model
        path = self.model_path(model)
        board = entry.board
        c = compile_model(path, board.make_target(), board=entry.manifest)
        outdir = self.root / entry.id / path.stem
        emulate = entry.emulated and not board.is_qemu_machine
        with file_lock(self.root / f".{entry.id}-{path.stem}.lock"):
            fw = firmware.build_firmware(c, board, outdir, emulate=emulate, force=True)
        g = c.graph
        ins = [(n, tuple(g.t(n).shape), np.dtype(g.t(n).dtype)) for n in g.inputs]
        outs = [(tuple(g.t(n).shape), np.dtype(g.t(n).dtype)) for n in g.outputs]
        return App(path.stem, path, entry, fw, ins, outs)


def models_that_fit(entry: BoardEntry, names: list[str], models_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The models whose weights and arena fit the board (tinydeploy.firmware.check_fits, before any
    compiling of C); the others with the reason."""
    from tinydeploy.pipeline import compile_model
    fit, skipped = [], {}
    board = entry.board
    for name in names:
        path = Path(name) if name.endswith(".onnx") else Path(models_dir) / f"{name}.onnx"
        if not path.is_file():
            raise RigError(f"model {str(path)!r} does not exist (the MLPerf Tiny models belong in "
                           f"{DEFAULT_MODELS_DIR}, beside the checkout)")
        c = compile_model(path, board.make_target(), board=entry.manifest)
        try:
            firmware.check_fits(c, board)
        except TinydeployError as e:
            skipped[path.stem] = str(e)
            continue
        fit.append(path.stem)
    return fit, skipped


# ---- transports -----------------------------------------------------------------------------

class Transport:
    """Gets a protocol Device to a freshly booted (or resynchronised) board."""
    kind = "?"
    strategy = "?"                       # the reset strategy, for the log

    def open(self):                      # -> tinydeploy.runners.protocol.Device
        raise NotImplementedError

    def reset(self):
        self.close()
        return self.open()

    def close(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def extra_log(self) -> str:
        return ""

    def latency_unit(self) -> str:
        return "us"


class QemuTransport(Transport):
    """The firmware under QEMU; reset = kill QEMU and start it again (the guest boots fresh)."""
    kind = "qemu"
    strategy = "restart"

    def __init__(self, fw: firmware.Firmware, timeout: float = 60.0, boot_timeout: float = 60.0):
        self.fw, self.timeout, self.boot_timeout = fw, timeout, boot_timeout
        self.emu = None
        self.dev = None
        self._last_output = ""

    def open(self):
        self.close()
        self.emu = Emulator(self.fw.elf, self.fw.machine, boot_timeout=self.boot_timeout)
        try:
            self.dev = self.emu.boot(timeout=self.timeout)
        except BaseException:
            self.close()
            raise
        return self.dev

    def close(self) -> None:
        if self.emu is not None:
            self._last_output = self.emu.messages()
            self.emu.close()
            self.emu = None
        self.dev = None

    def alive(self) -> bool:
        return (self.emu is not None and self.emu.running() and self.dev is not None
                and bool(getattr(self.dev.ser, "is_open", True)))

    def kill(self) -> None:
        """SIGKILLs QEMU as a crash would (fault tests)."""
        if self.emu is not None:
            self.emu.kill()

    def exit_code(self, timeout: float) -> int | None:
        """QEMU's exit code once the firmware ended it (quit%), None if it still runs."""
        return self.emu.wait(timeout) if self.emu is not None else None

    def extra_log(self) -> str:
        text = self.emu.messages() if self.emu is not None else self._last_output
        return text and "QEMU said: " + text

    def latency_unit(self) -> str:
        return "instructions"


class SerialTransport(Transport):
    """A real board on a serial port (or any pyserial URL). reset: reopen the port and resync;
    touch1200: open it at 1200 baud (the Arduino bootloader starts), flash the app again, reopen."""
    kind = "serial"

    def __init__(self, entry: BoardEntry, port: str | None = None, list_ports=None, flasher=None):
        self.entry = entry
        self.strategy = entry.reset
        self.cli_port = port
        self.list_ports = list_ports
        self.flasher = flasher            # callable(port) that flashes the current app, or None
        self.baud = None                  # the firmware's rate (its profile's), over the inventory's
        self.dev = None
        self.port = None

    def _port(self) -> str:
        """Resolves the port, waiting up to reappear_timeout_s for a replugged board."""
        deadline = time.monotonic() + self.entry.reappear_timeout_s
        while True:
            try:
                return resolve_port(self.entry, self.cli_port, self.list_ports)
            except RigError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def open(self):
        self.close()
        self.port = self._port()
        e = self.entry
        self.dev = mcu.open_serial(self.port, self.baud or e.baud, e.timeout_s, e.boot_timeout_s, e.reappear_timeout_s,
                                   resync=True)
        return self.dev

    def touch(self, baud: int = 1200) -> None:
        """Opens and closes the port at `baud`: the Arduino 'touch' that starts the bootloader."""
        import serial
        s = serial.serial_for_url(self._port(), baudrate=baud)
        s.dtr = False
        s.close()

    def reset(self):
        self.close()
        if self.entry.reset == "touch1200":
            self.touch((self.entry.board.upload or {}).get("touch_baud", 1200))
            time.sleep(1.0)
            if self.flasher is None:
                raise RigError(f"board {self.entry.id!r}: reset touch1200 needs a flash command in the inventory")
            self.flasher(self._port())
        return self.open()

    def close(self) -> None:
        if self.dev is not None:
            self.dev.close()
            self.dev = None

    def alive(self) -> bool:
        return self.dev is not None and bool(getattr(self.dev.ser, "is_open", True))


def flash_command(entry: BoardEntry, app: App, port: str) -> list[str]:
    build = app.fw.outdir / "build"
    fields = {"bin": build / "firmware.bin", "hex": build / "firmware.hex", "elf": app.fw.elf,
              "outdir": app.fw.outdir, "port": port, "port_name": Path(port).name, "baud": entry.baud}
    import shlex
    return [part.format(**{k: str(v) for k, v in fields.items()}) for part in shlex.split(entry.flash)]


def flash_port(entry: BoardEntry, cli_port: str | None = None, list_ports=None) -> str:
    """The port the flash command talks to: flash_serial_number / flash_port, else the protocol's."""
    if entry.flash_serial_number:
        return find_port(entry.flash_serial_number, list_ports)
    if entry.flash_port:
        return entry.flash_port
    return resolve_port(entry, cli_port, list_ports)


def run_flash(entry: BoardEntry, app: App, port: str, timeout: float = 300.0) -> None:
    cmd = flash_command(entry, app, port)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise RigError(f"flashing {entry.id}: {cmd[0]!r} not found") from None
    except subprocess.TimeoutExpired:
        raise RigError(f"flashing {entry.id} took more than {timeout:g} s: {' '.join(cmd)}") from None
    if r.returncode != 0:
        raise RigError(f"flashing {entry.id} failed (exit {r.returncode}): {' '.join(cmd)}: "
                       f"{(r.stderr or r.stdout).strip()[-300:]}")


# ---- the device under test -------------------------------------------------------------------

@dataclass
class Dut:
    """One board running one app, reachable through one transport. `device` is the current
    tinydeploy.runners.protocol.Device; `log` keeps every line of every device opened for the current
    test (reset() opens a new one)."""
    app: App
    transport: Transport
    device: object = None
    dirty: bool = False
    resets: int = 0
    log: list[str] = field(default_factory=list)
    _logged: int = 0

    @property
    def entry(self) -> BoardEntry:
        return self.app.entry

    @property
    def kind(self) -> str:
        return self.transport.kind

    def start(self):
        self.device = self.transport.open()
        self._logged = 0
        return self.device

    def _collect(self) -> None:
        if self.device is not None:
            self.log += self.device.log[self._logged:]
            self._logged = len(self.device.log)

    def reset(self, why: str = "") -> object:
        """The board's reset strategy: back to a freshly booted, idle board."""
        self._collect()
        self.log.append(f"# reset ({self.transport.strategy}){': ' + why if why else ''}")
        self.device = self.transport.reset()
        self._logged = 0
        self.dirty = False
        self.resets += 1
        return self.device

    def ready(self, ping_timeout: float = 20.0) -> object:
        """A device in a known state for the next test: resets when the last test left it dirty,
        the transport died, or it does not answer name% at once."""
        if self.device is None:
            return self.start()
        if self.dirty or not self.transport.alive():
            return self.reset("the previous test left the board in an unknown state" if self.dirty
                              else "the transport was gone")
        try:
            self.device.drain(quiet=0.05, limit=1.0)
            self.device.command("name", timeout=min(ping_timeout, self.entry.timeout_s))
        except TinydeployError as e:
            return self.reset(f"no answer to name% ({e})")
        return self.device

    def begin_test(self) -> None:
        self._collect()
        self.log = []

    def full_log(self) -> str:
        self._collect()
        extra = self.transport.extra_log()
        return "\n".join(self.log + ([extra] if extra else []))

    def close(self) -> None:
        self._collect()
        self.transport.close()
        self.device = None

    # ---- measurements shared by the tests ----

    def latency(self, counts) -> tuple[float, str]:
        """Per inference: exact instructions under QEMU, microseconds on hardware."""
        if counts.instructions is not None:
            return float(counts.instructions), "instructions"
        return counts.ms_per_run * 1000.0, "us"

    def run(self, seed: int, runs: int = 1, warmup: int = 0) -> dict:
        """Loads the seeded inputs, infers, reads the raw outputs; holds them to the references."""
        feeds, data = self.app.inputs(seed)
        r = mcu.infer(self.device, data, self.app.out_specs, runs, warmup, timeout=max(self.entry.timeout_s, 120.0 * runs),
                      stack=False, source=f"the board running {self.app.model}")
        cmp = self.app.check(feeds, r["outputs"])
        lat, unit = self.latency(r["counts"])
        return {"outputs": r["outputs"], "raw": r["raw"], "compare": cmp, "counts": r["counts"],
                "latency": lat, "latency_unit": unit}


def make_transport(entry: BoardEntry, app: App, cli_port: str | None = None, list_ports=None) -> Transport:
    if entry.transport == "qemu":
        return QemuTransport(app.fw, entry.timeout_s, entry.boot_timeout_s)
    flasher = (lambda port: run_flash(entry, app, flash_port(entry, cli_port, list_ports))) if entry.flash else None
    t = SerialTransport(entry, cli_port, list_ports, flasher)
    t.baud = (app.fw.harness or {}).get("baud")
    return t


def to_json(obj) -> str:
    return json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o))
