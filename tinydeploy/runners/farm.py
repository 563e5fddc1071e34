"""Boards in a labgrid farm (https://labgrid.readthedocs.io): find a place by name or by tags,
acquire it through the coordinator (waiting, for a bounded time, while someone else holds it),
read the resources its exporters publish, release it at the end (also on errors, Ctrl-C and at
interpreter exit).

    with farm.hold(place="lab-a", tags={"board": "nano33ble"}, timeout=600) as p:
        p.serial_url        # rfc2217://host:port or socket://host:port (its NetworkSerialPort)
        p.ssh_target        # user@host:port (its NetworkService), for Linux boards
        p.resource("flash") # any resource by name: (class, args)

What a place holds for tinydeploy (hil/LAB.md): a serial port (`NetworkSerialPort`, or a
`USBSerialPort` the exporter publishes through ser2net), optionally a `NetworkSerialPort` named
`flash` (an emulated board's programming port, hil/emulated_board.py) and, for Linux boards, a
`NetworkService` (ssh). Places carry the board id as the tag `board=<id>` (boards/<id>.json).
labgrid is imported only here and only when a place is used."""
from __future__ import annotations

import argparse
import atexit
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

DEFAULT_COORDINATOR = "127.0.0.1:20408"
_HELD: dict[str, "Client"] = {}          # place name -> the client holding it (released at exit)


def coordinator_address(address: str | None = None) -> str:
    return address or os.environ.get("LG_COORDINATOR") or DEFAULT_COORDINATOR


def parse_tags(pairs) -> dict[str, str]:
    """["board=nano33ble", ...] -> {"board": "nano33ble"}; TinydeployError for anything else."""
    out = {}
    for p in pairs or []:
        k, sep, v = str(p).partition("=")
        if not sep or not k or not v:
            raise TinydeployError(f"labgrid tag {printable(str(p), 60)!r} is not KEY=VALUE (e.g. board=nano33ble)")
        out[k] = v
    return out


@dataclass
class Place:
    """An acquired place: its name, tags, and resources as (name, class) -> (exporter, args)."""
    name: str
    tags: dict[str, str]
    resources: dict[tuple[str, str], tuple[str, dict]] = field(default_factory=dict)
    client: "Client | None" = None

    @property
    def board(self) -> str | None:
        return self.tags.get("board")

    def resource(self, name: str | None = None, cls: str | None = None) -> tuple[str, dict] | None:
        """(class, args) of the resource with that name and/or class, else None."""
        for (n, c), (_, args) in sorted(self.resources.items()):
            if (name is None or n == name) and (cls is None or c == cls):
                return c, args
        return None

    @property
    def exporter(self) -> str:
        return ",".join(sorted({e for e, _ in self.resources.values()})) or "?"

    def _serial(self, name: str | None):
        r = None
        for n, c in sorted(self.resources):
            if c in ("NetworkSerialPort", "USBSerialPort", "RawSerialPort") and (n == name or (name is None and n != "flash")):
                r = self.resources[(n, c)][1]
                break
        return r

    @property
    def serial_url(self) -> str:
        """The pyserial URL of the place's serial port (the one not named flash)."""
        r = self._serial(None)
        if r is None:
            raise TinydeployError(f"labgrid place {self.name!r} has no serial port (NetworkSerialPort or an exported "
                                  f"USBSerialPort); it has {', '.join(c + '/' + n for n, c in self.resources) or 'nothing'}")
        return network_serial_url(r)

    @property
    def flash_url(self) -> str | None:
        r = self._serial("flash")
        return network_serial_url(r) if r else None

    @property
    def speed(self) -> int | None:
        r = self._serial(None)
        return int(r["speed"]) if r and r.get("speed") else None

    def control(self, cmd: str, data: bytes = b"", timeout: float = 120.0) -> str:
        """One command to the place's programming port (the NetworkSerialPort named `flash` of an
        emulated board, hil/emulated_board.py): `flash N` + N image bytes, `reset`, `kill`,
        `status`; the one-line answer ("error ..." becomes a TinydeployError)."""
        import socket
        url = self.flash_url
        if not url:
            raise TinydeployError(f"labgrid place {self.name!r} has no flash port (flash the board with its own "
                                  "tool, e.g. tinydeploy flash --port, before using it)")
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=timeout) as s:
                s.sendall(cmd.encode() + b"\n" + data)
                answer = s.makefile("rb").readline().decode("ascii", "replace").strip()
        except OSError as e:
            raise TinydeployError(f"labgrid place {self.name!r}: its flash port {url} does not answer: {e}") from None
        if not answer or answer.startswith("error"):
            raise TinydeployError(f"labgrid place {self.name!r}: {cmd.split()[0]}: {printable(answer, 200) or 'no answer'}")
        return answer

    def flash(self, image: bytes) -> None:
        self.control(f"flash {len(image)}", image)

    @property
    def ssh_target(self) -> tuple[str, int | None]:
        """(user@host, port) of the place's NetworkService (a Linux board reached over ssh)."""
        r = self.resource(cls="NetworkService")
        if r is None:
            raise TinydeployError(f"labgrid place {self.name!r} has no NetworkService (ssh) resource")
        a = r[1]
        return (f"{a['username']}@{a['address']}" if a.get("username") else a["address"]), a.get("port")


def network_serial_url(args: dict) -> str:
    host, port = args.get("host"), args.get("port")
    if not host or not port:
        raise TinydeployError(f"labgrid serial resource without host and port: {printable(str(args), 120)}")
    scheme = "socket" if args.get("protocol", "rfc2217") == "raw" else "rfc2217"
    return f"{scheme}://{host}:{int(port)}"


class Client:
    """One connection to a labgrid coordinator (labgrid.remote.client.ClientSession)."""

    def __init__(self, address: str | None = None, user: str | None = None):
        try:
            from labgrid.remote.client import start_session
        except ImportError:
            raise TinydeployError("labgrid is not installed: pip install -c constraints.txt labgrid "
                                  "(or pip install -e '.[lab]')") from None
        self.address = coordinator_address(address)
        if user:
            os.environ["LG_USERNAME"] = user
        try:
            self.s = start_session(self.address, extra={"args": argparse.Namespace(allow_unmatched=True, kick=False)})
        except Exception as e:
            raise TinydeployError(f"cannot reach the labgrid coordinator at {printable(self.address)}: "
                                  f"{printable(str(e), 160) or type(e).__name__} (start it with labgrid-coordinator, "
                                  "or set LG_COORDINATOR / --lg-coordinator)") from None

    @property
    def me(self) -> str:
        return f"{self.s.gethostname()}/{self.s.getuser()}"

    def _run(self, coro):
        return self.s.loop.run_until_complete(coro)

    def sync(self) -> None:
        self._run(self.s.sync_with_coordinator())

    def places(self) -> dict:
        self.sync()
        return dict(self.s.places)

    def match(self, name: str | None = None, tags: dict | None = None) -> list[str]:
        """Place names: exactly `name` if given, and having every tag in `tags`."""
        places = self.places()
        out = [n for n, p in sorted(places.items())
               if (name is None or n == name) and all(p.tags.get(k) == v for k, v in (tags or {}).items())]
        if not out:
            want = " and ".join(([f"named {name!r}"] if name else []) + [f"tagged {k}={v}" for k, v in (tags or {}).items()])
            raise TinydeployError(f"no labgrid place {want} at {self.address} (places there: "
                                  f"{', '.join(f'{n} {dict(p.tags)}' for n, p in sorted(places.items())) or 'none'})")
        return out

    def _try_acquire(self, name: str) -> bool:
        import grpc
        from labgrid.remote.generated import labgrid_coordinator_pb2 as pb2
        try:
            self._run(self.s.stub.AcquirePlace(pb2.AcquirePlaceRequest(placename=name)))
        except grpc.aio.AioRpcError:
            return False
        self.sync()
        return self.s.places[name].acquired == self.me

    def acquire(self, name: str | None = None, tags: dict | None = None, timeout: float = 300.0,
                poll: float = 0.5, say=None) -> Place:
        """Acquires the first free place among those matching; while all are held by others,
        waits up to `timeout` seconds, then refuses naming who holds them."""
        deadline = time.monotonic() + timeout
        told = False
        while True:
            names = self.match(name, tags)
            places = self.places()
            for n in names:
                if not places[n].acquired and self._try_acquire(n):
                    _HELD[n] = self
                    return self._place(n)
            holders = ", ".join(f"{n} by {places[n].acquired}" for n in names if places[n].acquired)
            if time.monotonic() >= deadline:
                raise TinydeployError(f"labgrid place{'s' * (len(names) > 1)} {', '.join(names)} still held after "
                                      f"waiting {timeout:g} s: {holders} (ask them to release it: labgrid-client -p "
                                      f"{names[0]} release; or raise the wait)")
            if say and not told:
                say(f"labgrid: waiting up to {timeout:g} s for {holders}")
                told = True
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))

    def _place(self, name: str) -> Place:
        p = self.s.places[name]
        res = {}
        for (rname, cls), r in self.s.get_target_resources(p).items():
            res[(rname, cls)] = (self._exporter_of(p, rname, cls), dict(r.args))
        return Place(name, dict(p.tags), res, self)

    def _exporter_of(self, p, rname, cls) -> str:
        for path in p.acquired_resources:
            if path[2] == cls and (path[3] == rname or (p.getmatch(path) and p.getmatch(path).rename == rname)):
                return path[0]
        return "?"

    def release(self, name: str) -> None:
        from labgrid.remote.generated import labgrid_coordinator_pb2 as pb2
        _HELD.pop(name, None)
        try:
            self._run(self.s.stub.ReleasePlace(pb2.ReleasePlaceRequest(placename=name)))
            self.sync()
        except Exception:
            pass                                   # gone already (coordinator stopped, released by hand)

    def close(self) -> None:
        for n in [n for n, c in _HELD.items() if c is self]:
            self.release(n)
        try:
            self._run(self.s.stop())
            self._run(self.s.close())
        except Exception:
            pass

    # ---- setting up places (hil/farm.py's loopback lab, `python -m hil.farm places`) ----

    def ensure_place(self, name: str, tags: dict, matches: list[str]) -> None:
        import grpc
        from labgrid.remote.generated import labgrid_coordinator_pb2 as pb2
        if name not in self.places():
            self._run(self.s.stub.AddPlace(pb2.AddPlaceRequest(name=name)))
        try:
            self._run(self.s.stub.SetPlaceTags(pb2.SetPlaceTagsRequest(placename=name, tags=tags)))
            for m in matches:
                self._run(self.s.stub.AddPlaceMatch(pb2.AddPlaceMatchRequest(placename=name, pattern=m)))
        except grpc.aio.AioRpcError as e:
            if "exists" not in (e.details() or ""):
                raise TinydeployError(f"labgrid: setting up place {name!r}: {e.details()}") from None
        self.sync()


_CLIENTS: dict[str, Client] = {}


def client(address: str | None = None) -> Client:
    """This process's connection to the coordinator at `address` (the coordinator takes one
    client session per host and user at a time, so every user of a process shares it)."""
    address = coordinator_address(address)
    if address not in _CLIENTS:
        _CLIENTS[address] = Client(address)
    return _CLIENTS[address]


def release_all() -> None:
    """Releases every place this process holds (atexit, the rig's end of session, Ctrl-C)."""
    for name, c in list(_HELD.items()):
        c.release(name)


def close_all() -> None:
    release_all()
    for c in list(_CLIENTS.values()):
        c.close()
    _CLIENTS.clear()


atexit.register(close_all)


@contextmanager
def hold(place: str | None = None, tags: dict | None = None, address: str | None = None,
         timeout: float = 300.0, say=None):
    """Acquires a matching place for the duration of the block; always releases it."""
    c = client(address)
    p = c.acquire(place, tags, timeout, say=say)
    try:
        yield p
    finally:
        c.release(p.name)
