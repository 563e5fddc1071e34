"""The rig as a pytest plugin: options, parametrisation by board and model, the device-under-test
fixtures, the device log on failures, and the HTML report at the end of the session.
hil/conftest.py loads it; `python -m pytest -p hil.plugin ...` loads it elsewhere."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hil import rig
from hil.report import collect_report, write_html
from tinydeploy.runners.qemu_system import kill_left_behind

OPTION_GROUP = "hil (hardware-in-the-loop rig, see hil/README.md)"


def pytest_addoption(parser):
    g = parser.getgroup("hil", OPTION_GROUP)
    g.addoption("--board", action="append", default=None, metavar="ID",
                help="board of the inventory to test (repeatable, or 'all'; default mps2-an386)")
    g.addoption("--port", default=None, metavar="PORT",
                help="serial device or pyserial URL of the (single) real board; overrides the inventory")
    g.addoption("--inventory", default=str(rig.HIL_DIR / "boards.yml"), metavar="PATH",
                help="boards and ports (default hil/boards.yml)")
    g.addoption("--models", default=None, metavar="LIST",
                help="comma-separated model names (in --models-dir) or .onnx paths; default: the int8 "
                     "MLPerf Tiny models that fit the board")
    g.addoption("--models-dir", default=str(rig.DEFAULT_MODELS_DIR), metavar="DIR",
                help="where model names are looked up (default ../shared/models/mlperf_tiny)")
    g.addoption("--budgets", default=str(rig.HIL_DIR / "budgets.yml"), metavar="PATH",
                help="latency and memory budgets per board and model (default hil/budgets.yml)")
    g.addoption("--report-html", default=None, metavar="PATH",
                help="self-contained HTML report written at the end (default ./hil-report.html, or "
                     "pytest's temporary folder when the current folder is inside the checkout)")
    g.addoption("--update-budgets", action="store_true",
                help="write the figures measured by test_budgets.py into --budgets (re-seeding after a deliberate change)")
    g.addoption("--soak", type=int, default=5, metavar="N",
                help="inferences per model in test_soak.py (default 5; raise it on hardware)")
    g.addoption("--hil-seed", type=int, default=0, metavar="SEED", help="seed of the random inputs")
    g.addoption("--protofuzz", type=int, default=40, metavar="N",
                help="faults per board in test_protocol_fuzz.py (default 40; seeded by --hil-seed)")
    g.addoption("--mlcommons-full", action="store_true",
                help="hil/test_mlcommons.py: also VWW's runner flows (about 10 minutes of hex downloads under QEMU)")
    g.addoption("--lg-place", action="append", default=None, metavar="NAME",
                help="test the board of this labgrid place (repeatable; hil/LAB.md); the coordinator is "
                     "--lg-coordinator or $LG_COORDINATOR")
    g.addoption("--lg-tag", action="append", default=None, metavar="KEY=VALUE",
                help="test every labgrid place with these tags, e.g. board=nano33ble (repeatable: all must match)")
    g.addoption("--lg-wait", type=float, default=300.0, metavar="S",
                help="seconds to wait for a place someone else holds before refusing (default 300)")
    g.addoption("--lg-loopback", type=int, default=2, metavar="N",
                help="with an emulated board selected: start a labgrid coordinator and N lab hosts on "
                     "127.0.0.1, each exporting an emulated board as a place, and run the protocol, model and "
                     "fault tests through them too (marker labgrid; default 2, 0: off)")


def pytest_configure(config):
    for line in ("host: needs no board and no emulator (the hil rig's own logic)",
                 "qemu: runs on a QEMU-emulated board (hil)",
                 "hardware: runs on a real board over a serial port (hil)",
                 "labgrid: goes through a labgrid place (hil/LAB.md)",
                 "mlcommons: the MLCommons runner's flows against the firmware (hil/test_mlcommons.py)"):
        config.addinivalue_line("markers", line)
    config._hil_records = []
    _one_worker_per_board(config)
    if not hasattr(config, "workerinput"):
        _start_loopback_lab(config)


def _one_worker_per_board(config) -> None:
    """Under xdist every board (inventory board or labgrid place) belongs to one worker: a second
    worker would wait for a place the first holds, or start a second emulator of the board. So
    `-n N` alone means --dist loadgroup here, scheduled by board (pytest_xdist_make_scheduler);
    an explicit other --dist is kept."""
    if hasattr(config, "workerinput"):
        return
    if getattr(config.option, "dist", "no") == "load" and not any(
            a == "--dist" or a.startswith("--dist=") or a == "-d" for a in config.invocation_params.args):
        config.option.dist = "loadgroup"


def board_of_test(nodeid: str, board_ids) -> str | None:
    """The board (or place) a test's id names: the longest board id that is a whole
    '-'-separated part of its parameters (test[lab-a-mps2-an386-kws_dscnn_int8-0] -> lab-a-mps2-an386)."""
    import re
    if "[" not in nodeid:
        return None
    params = nodeid[nodeid.index("[") + 1:nodeid.rindex("]")]
    found = [b for b in board_ids if re.search(rf"(^|-){re.escape(b)}(-|$)", params)]
    return max(found, key=len) if found else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by board: every test of one board or place goes to one worker. (pytest-xdist
    3.8's own loadgroup renames items through an attribute pytest 9 no longer reads, so its
    xdist_group marks alone do not group anything.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling
    try:
        hs = _session(config)
        ids = sorted({e.id for e in hs.entries} | {p.id for p in hs.places})
    except rig.RigError:
        ids = []

    class ByBoard(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return board_of_test(nodeid, ids) or nodeid.split("@")[0]

    return ByBoard(config, log)


def _wants_lab(config) -> bool:
    """The loopback lab is started unless no labgrid test can run (-m host, -m "not labgrid", ...)."""
    if config.getoption("--lg-loopback") <= 0 or config.getoption("--lg-place") or config.getoption("--lg-tag"):
        return False
    expr = config.getoption("markexpr") or ""
    if expr:
        from _pytest.mark.expression import Expression
        if not Expression.compile(expr).evaluate(lambda name: name in ("labgrid", "qemu")):
            return False
    try:
        inv = rig.load_inventory(config.getoption("--inventory"))
        entries = rig.select_boards(inv, config.getoption("--board") or ["mps2-an386"])
    except rig.RigError:
        return False
    return any(e.transport == "qemu" and e.board.is_qemu_machine for e in entries)


def _start_loopback_lab(config) -> None:
    """The CI lab: a coordinator and N lab hosts on 127.0.0.1 (hil/farm.py), started once by the
    controlling process and shared with the xdist workers (pytest_configure_node)."""
    if not _wants_lab(config):
        return
    import tempfile
    from hil import farm
    inv = rig.load_inventory(config.getoption("--inventory"))
    board = next(e for e in rig.select_boards(inv, config.getoption("--board") or ["mps2-an386"])
                 if e.transport == "qemu" and e.board.is_qemu_machine)
    lab = farm.LoopbackLab(Path(tempfile.mkdtemp(prefix="tinydeploy-hil-lab-")), board.manifest,
                           config.getoption("--lg-loopback"))
    try:
        config._hil_lab = lab.start()
    except rig.RigError as e:
        config._hil_lab_error = e
        return
    config._hil_lab_info = lab.info()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist: every worker gets the loopback lab's coordinator and places."""
    info = getattr(node.config, "_hil_lab_info", None)
    if info:
        node.workerinput["hil_lab"] = info


def pytest_unconfigure(config):
    kill_left_behind()                    # also after Ctrl-C or an internal error
    from tinydeploy.runners import farm as lgfarm
    lgfarm.close_all()                    # every labgrid place this process holds goes back
    lab = getattr(config, "_hil_lab", None)
    if lab is not None:
        lab.stop()
        left = lab.alive()
        if left:
            config.get_terminal_writer().line(f"hil: processes of the labgrid lab still running: {left}", red=True)


# ---- the session ------------------------------------------------------------------------------

class HilSession:
    """Per pytest process (each xdist worker has one): inventory, selected boards, models per board,
    the firmware cache and one live device under test per board."""

    def __init__(self, config):
        self.config = config
        opt = config.getoption
        self.inventory_path = Path(opt("--inventory"))
        self.inventory = rig.load_inventory(self.inventory_path)
        self.entries = rig.select_boards(self.inventory, opt("--board") or ["mps2-an386"], self.inventory_path)
        self.lab = getattr(config, "workerinput", {}).get("hil_lab") or getattr(config, "_hil_lab_info", None)
        self.lg_address = opt("lg_coordinator") if config.pluginmanager.hasplugin("labgrid") else None
        self.places = self._places(opt("--lg-place"), opt("--lg-tag"))
        if opt("--lg-place") or opt("--lg-tag"):
            self.entries = list(self.places)          # the farm's boards replace the inventory's
        if opt("--port") and sum(e.transport == "serial" for e in self.entries) != 1:
            raise rig.RigError("--port names one real board's port: select exactly one serial board with --board")
        self.models_dir = Path(opt("--models-dir"))
        self._models: dict[str, list[str]] = {}
        self.not_fitting: dict[str, dict[str, str]] = {}
        self._cache = None
        self._live: dict[str, rig.Dut] = {}
        self._budgets = None

    def _places(self, names, tags) -> list[rig.BoardEntry]:
        """The labgrid places to test: --lg-place / --lg-tag at the coordinator, else the loopback lab's."""
        from hil import farm
        if not names and not tags:
            if self.lab:
                self.lg_address = self.lab["address"]
                return [farm.place_entry(p, {"board": self.lab["board"], "kind": "qemu"}, self.inventory)
                        for p in self.lab["places"]]
            err = getattr(self.config, "_hil_lab_error", None)
            if err is not None:
                raise err
            return []
        from tinydeploy.errors import TinydeployError
        from tinydeploy.runners import farm as lgfarm
        try:
            c = lgfarm.client(self.lg_address)
            t = lgfarm.parse_tags(tags)
            found = sorted({n for name in (names or [None]) for n in c.match(name, t)})
            places = c.places()
            return [farm.place_entry(n, dict(places[n].tags), self.inventory) for n in found]
        except TinydeployError as e:
            raise rig.RigError(str(e)) from None

    def models(self, entry: rig.BoardEntry) -> list[str]:
        if entry.id not in self._models:
            given = self.config.getoption("--models")
            if given:
                names = [m.strip() for m in given.split(",") if m.strip()]
                self._models[entry.id] = names      # asked for explicitly: a misfit is a failure
            else:
                fit, skipped = rig.models_that_fit(entry, rig.DEFAULT_MODELS, self.models_dir)
                self._models[entry.id], self.not_fitting[entry.id] = fit, skipped
        return self._models[entry.id]

    def entry(self, board_id: str) -> rig.BoardEntry | None:
        return self.inventory.get(board_id) or next((p for p in self.places if p.id == board_id), None)

    def conformance_model(self, entry: rig.BoardEntry) -> str:
        models = self.models(entry)
        return "kws_dscnn_int8" if "kws_dscnn_int8" in models else models[0]

    @property
    def budgets(self) -> rig.Budgets:
        if self._budgets is None:
            self._budgets = rig.load_budgets(self.config.getoption("--budgets"))
        return self._budgets

    def cache(self, tmp_path_factory) -> rig.AppCache:
        if self._cache is None:
            base = tmp_path_factory.getbasetemp()
            # xdist workers get basetemp/popen-gwN: share the firmware folder one level up
            root = (base.parent if "workerinput" in self.config.__dict__ else base) / "hil-firmware"
            self._cache = rig.AppCache(root, self.models_dir)
        return self._cache

    def dut(self, entry: rig.BoardEntry, model: str, tmp_path_factory) -> rig.Dut:
        """The board's device under test running `model`'s firmware; one live per board (QEMU
        spins a core while the firmware polls its UART; a real board holds one firmware)."""
        live = self._live.get(entry.id)
        if live is not None and live.app.model == Path(model).stem:
            return live
        if live is not None:
            live.close()
            del self._live[entry.id]
        app = self.cache(tmp_path_factory).get(entry, model)
        if entry.transport == "labgrid":
            from hil import farm
            transport = getattr(self, "_lg_transports", {}).get(entry.id)
            if transport is None:         # one per place: it holds the place until the session ends
                tw = self.config.get_terminal_writer()
                transport = farm.LabgridTransport(entry, app, self.lg_address, self.config.getoption("--lg-wait"),
                                                  say=lambda m: tw.line(m))
                self.__dict__.setdefault("_lg_transports", {})[entry.id] = transport
            transport.app = app
        else:
            transport = rig.make_transport(entry, app, self.config.getoption("--port"))
        d = rig.Dut(app, transport)
        if entry.transport == "serial" and entry.flash:
            rig.run_flash(entry, app, rig.flash_port(entry, self.config.getoption("--port")))
        self._live[entry.id] = d
        return d

    def close(self) -> None:
        for d in self._live.values():
            d.close()
        self._live.clear()
        for t in getattr(self, "_lg_transports", {}).values():
            t.release()                   # the place goes back to the coordinator, also after failures


def _session(config) -> HilSession:
    if not hasattr(config, "_hil_session"):
        config._hil_session = HilSession(config)
    return config._hil_session


RIG_ERROR = "rig-setup-error"
# what runs through the loopback lab's places beside the inventory's boards (--lg-place/--lg-tag:
# every module runs on the places)
LABGRID_MODULES = {"test_protocol_conformance", "test_models", "test_faults"}


def pytest_generate_tests(metafunc):
    names = metafunc.fixturenames
    if "board_id" not in names:
        return
    try:
        hs = _session(metafunc.config)
        mod = metafunc.module.__name__.rsplit(".", 1)[-1]
        entries = hs.entries + [p for p in hs.places if p not in hs.entries and mod in LABGRID_MODULES]
        pairs = [(e.id, m) for e in entries for m in hs.models(e)] if "model" in names else None
    except rig.RigError as e:
        # a set-up problem (inventory, models): every board test errors with it at setup, while
        # `-m host` still runs the rig's own tests
        metafunc.config._hil_setup_error = e
        pairs = [(RIG_ERROR, RIG_ERROR)]
        hs = None
    if "model" in names:
        metafunc.parametrize(["board_id", "model"], pairs, ids=[f"{b}-{m}" for b, m in pairs], scope="module")
    else:
        ids = [e.id for e in entries] if hs else [RIG_ERROR]
        metafunc.parametrize("board_id", ids, ids=ids, scope="module")


@pytest.hookimpl(tryfirst=True)      # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    hs = getattr(config, "_hil_session", None)
    for item in items:
        cs = getattr(item, "callspec", None)
        if cs is None or "board_id" not in cs.params or hs is None:
            continue
        entry = hs.entry(cs.params["board_id"])
        if entry is None:
            continue
        item.add_marker("qemu" if entry.emulated else "hardware")
        if entry.transport == "labgrid":
            item.add_marker("labgrid")
            item.user_properties.append(("hil_place", entry.place))
        item.add_marker(pytest.mark.xdist_group(entry.id))     # --dist loadgroup: one worker per board
        item.user_properties.append(("hil_board", entry.id))
        item.user_properties.append(("hil_transport", entry.transport))
        if "model" in cs.params:
            item.user_properties.append(("hil_model", cs.params["model"]))


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def no_qemu_left_behind(request):
    """Closes every device under test at the end and makes sure no QEMU process survives."""
    yield
    hs = getattr(request.config, "_hil_session", None)
    if hs is not None:
        hs.close()
    left = kill_left_behind()
    assert not left, f"QEMU processes were still running at the end of the session (killed now): {left}"


@pytest.fixture(scope="session")
def hil(request):
    """The rig session (inventory, boards, models, firmware cache, live devices)."""
    err = getattr(request.config, "_hil_setup_error", None)
    if err is not None:
        raise err
    return _session(request.config)


@pytest.fixture
def entry(hil, board_id) -> rig.BoardEntry:
    return hil.entry(board_id)


def _use_dut(request, d: rig.Dut) -> rig.Dut:
    d.begin_test()
    request.node._hil_logs = getattr(request.node, "_hil_logs", []) + [d.full_log]
    d.ready()
    if hasattr(d.transport, "where"):     # a labgrid place: which lab host ran the test
        request.node.user_properties.append(("hil_lab_host", d.transport.where()["lab_host"]))
    if d.kind == "serial" and not d.entry.flash and not getattr(d, "_model_checked", False):
        running = d.device.profile()["model"]
        if running != d.app.model_id:
            raise rig.RigError(f"{d.entry.id} runs firmware for model {running!r}, the test needs {d.app.model} "
                               f"({d.app.model_id}): flash it (see hil/README.md), pass --models, or add a "
                               "flash: command to the inventory")
        d._model_checked = True
    return d


@pytest.fixture
def dut(request, hil, entry, model, tmp_path_factory):
    """The board running `model`, in a known state (reset if the last test left it otherwise)."""
    d = hil.dut(entry, model, tmp_path_factory)
    mem = d.app.fw.memory             # known from the build, shown even when the test fails
    request.node.user_properties.append(("hil", rig.to_json({"flash_used_bytes": mem["flash_used_bytes"],
                                                            "ram_used_bytes": mem["ram_used_bytes"]})))
    yield _use_dut(request, d)
    _after(request, d)


@pytest.fixture
def cdut(request, hil, entry, tmp_path_factory):
    """The board running its conformance firmware (KWS when it fits)."""
    d = hil.dut(entry, hil.conformance_model(entry), tmp_path_factory)
    yield _use_dut(request, d)
    _after(request, d)


def _after(request, d: rig.Dut) -> None:
    rep = getattr(request.node, "_hil_call_report", None)
    if rep is None or rep.failed:
        d.dirty = True                    # the next test resets the board first


@pytest.fixture
def record(request):
    """record(**figures): figures for the HTML report (board and model come from the test's id)."""
    def _record(**kw):
        request.node.user_properties.append(("hil", rig.to_json(kw)))
    return _record


@pytest.fixture
def hil_log(request):
    """hil_log(callable): adds a source of device log text shown when the test fails."""
    def _add(source):
        request.node._hil_logs = getattr(request.node, "_hil_logs", []) + [source]
    return _add


# ---- reports ----------------------------------------------------------------------------------

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item._hil_call_report = rep
    if rep.failed and getattr(item, "_hil_logs", None):
        texts = []
        for source in item._hil_logs:
            try:
                texts.append(source() if callable(source) else str(source))
            except Exception as e:              # the log must never hide the failure
                texts.append(f"(device log unavailable: {e})")
        log = "\n".join(t for t in texts if t)
        if log:
            rep.sections.append((f"device log ({rep.when})", log))
            rep.user_properties.append(("hil_device_log", log[-20000:]))
            item.user_properties.append(("hil_device_log", log[-20000:]))   # JUnit reads the teardown report's


def pytest_runtest_logreport(report):
    cfg = _CONFIG.get("config")
    if cfg is not None:
        cfg._hil_records.append({
            "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration": report.duration, "props": [(k, v) for k, v in report.user_properties],
            "message": report.longreprtext[-4000:] if report.failed else
            (str(report.longrepr[2]) if report.skipped and isinstance(report.longrepr, tuple) else ""),
        })


_CONFIG: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _CONFIG["config"] = session.config
    session.config._hil_started = time.time()


def default_report_path(config) -> Path:
    """./hil-report.html, except inside the checkout (keep the repository clean): then beside
    pytest's temporary folders of this run."""
    here = Path.cwd().resolve()
    if here == rig.REPO or rig.REPO in here.parents:
        return config._tmp_path_factory.getbasetemp() / "hil-report.html"
    return here / "hil-report.html"


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):
        return                               # the controlling process writes the report
    path = config.getoption("--report-html") or default_report_path(config)
    hs = getattr(config, "_hil_session", None)
    if hs is None and any(r["props"] for r in config._hil_records):
        try:                                 # under xdist only the workers parametrised the tests
            hs = HilSession(config)
        except Exception:
            hs = None
    meta = {"boards": {}, "not_fitting": {},
            "duration_s": time.time() - getattr(config, "_hil_started", time.time()),
            "exit_status": int(exitstatus), "command": " ".join(config.invocation_params.args),
            "cwd": os.getcwd()}
    if hs is not None:
        for e in hs.entries:
            try:
                hs.models(e)                 # fills not_fitting (cheap: no C is compiled)
            except Exception:
                pass
            b = e.board
            meta["boards"][e.id] = {"manifest": e.manifest, "transport": e.transport, "name": b.name,
                                    "flash_bytes": b.flash_bytes, "ram_bytes": b.ram_bytes}
        meta["not_fitting"] = hs.not_fitting
    tests = collect_report(config._hil_records)
    if config.getoption("--update-budgets"):
        measured: dict = {}
        for t in tests:
            if t["board"] and t["model"] and t["figures"].get("measured"):
                measured.setdefault(t["board"], {})[t["model"]] = t["figures"]["measured"]
        if measured:
            done = rig.update_budgets(config.getoption("--budgets"), measured)
            config.get_terminal_writer().line(f"hil: budgets of {sum(map(len, measured.values()))} board/model "
                                              f"pairs written to {done}")
    try:
        write_html(Path(path), tests, meta)
    except OSError as e:
        config.get_terminal_writer().line(f"hil: could not write the HTML report {path}: {e}", red=True)
        return
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"hil: HTML report written to {Path(path).resolve()}")
