"""The whole compiler in one reading: import -> check -> passes -> lower -> plan -> codegen."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tinydeploy import ir, limits
from tinydeploy.codegen import project
from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError
from tinydeploy.frontend.importer import import_model, sha256_file
from tinydeploy.ops import REGISTRY, Kernel, unsupported_nodes
from tinydeploy.ops.verify import verify_graph
from tinydeploy.passes import LOWER_8BIT, run_passes
from tinydeploy.schedule import chain_candidates, fit_scratch, select_kernels
from tinydeploy.planner import Plan, plan_memory
from tinydeploy.targets import Target

RUNTIME_DTYPES = {np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.uint8)}


@dataclass
class Compiled:
    """The contract between the compiler and everything downstream (firmware, builds, runs,
    reports): the lowered graph, one kernel per node, the memory plan, the generated C, and the
    facts about them, so nothing downstream parses generated files back."""
    graph: ir.Graph
    kernels: list[Kernel | None]
    plan: Plan
    files: dict[str, str]
    macs: int
    weights_bytes: int
    sha256: str
    notes: list[str] = field(default_factory=list)
    model: str = "model"          # the model's file name (untrusted: print through cfmt.printable)
    api: project.Api | None = None    # the library form (named files and symbols), None: classic
    functions: dict[int, tuple[str, str]] = field(default_factory=dict)   # step -> (kernel function, ISA)

    @property
    def names(self) -> dict[str, str]:
        """The generated files by role (project.file_names)."""
        return project.file_names(self.api)

    @property
    def sources(self) -> list[str]:
        """The generated .c files, in the order a build lists them."""
        n = self.names
        return [n["model_c"], n["kernels_c"], n["weights_c"]]

    @property
    def headers(self) -> list[str]:
        n = self.names
        return [n["model_h"], n["kernels_h"], n["runtime_h"], n["weights_h"]]

    @property
    def states(self) -> tuple[tuple[str, str], ...]:
        return self.api.states if self.api else ()

    @property
    def arena_bytes(self) -> int:
        return self.plan.arena_bytes

    @property
    def input_bytes(self) -> int:
        """The inputs a caller writes (a model's state inputs are kept by its context)."""
        kept = {i for i, _ in self.states}
        return sum(self.graph.t(n).nbytes for n in self.graph.inputs if n not in kept)

    @property
    def inputs_int8(self) -> bool:
        return all(np.dtype(self.graph.t(n).dtype) == np.int8 for n in self.graph.inputs)

    def schedule(self) -> dict:
        """The schedule as data (JSON-able; names as the model gives them, untrusted): per step the
        operator, the node, its runtime inputs, its outputs (shape, type, per-tensor quantisation,
        where in the arena; `layout`: the permutation from the ONNX layout to the stored one, None
        when stored as ONNX lays it out), its kernel (function, ISA, description), MACs, weight
        bytes and scratch; and the arena's buffers with their lifetimes. What `validate` maps back
        to ONNX tensors and `report` draws; kept in the build's summary, so a reused build has it."""
        g, plan = self.graph, self.plan
        steps = []
        for step, (n, k) in enumerate(zip(g.nodes, self.kernels)):
            outs = []
            for o in n.outputs:
                if not o:
                    continue
                t = g.t(o)
                q = t.quant if t.quant is not None and t.quant.axis is None and np.size(t.quant.scale) == 1 else None
                outs.append({"name": o, "shape": list(t.shape), "dtype": np.dtype(t.dtype).name,
                             "scale": float(np.asarray(q.scale).reshape(-1)[0]) if q else None,
                             "zero_point": int(np.asarray(q.zero_point).reshape(-1)[0]) if q else None,
                             "offset": plan.offsets.get(o), "bytes": t.nbytes, "layout": layout_perm(t)})
            consts = {a: k.tensor(a, g) for a in k.args} if k is not None else {}
            fn, isa = self.functions.get(step, (None, None))
            steps.append({"step": step, "op": n.op, "onnx_op": n.onnx_op, "name": n.name,
                          "inputs": [i for i in n.inputs if i and not g.t(i).is_const],
                          "outputs": outs, "code": k is not None,
                          "kernel": None if k is None else {
                              "family": k.family, "dtype": k.dtype, "function": fn, "isa": isa, "desc": k.desc,
                              "scratch_bytes": k.scratch_bytes, "scratch_offset": plan.offsets.get(f"#scratch{step}")},
                          "macs": int(REGISTRY[n.op].macs(n, g)),
                          "weights_bytes": int(sum(t.nbytes for t in consts.values() if t.is_const))})
        return {"steps": steps, "arena_bytes": plan.arena_bytes, "lower_bound_bytes": plan.lower_bound,
                "inputs": list(g.inputs), "outputs": list(g.outputs),
                "input_shapes": {n: list(g.t(n).shape) for n in g.inputs},
                "buffers": [{"offset": b.offset, "bytes": b.size, "first": b.start, "last": b.end,
                             "tensors": list(b.tensors), "pinned": b.pinned} for b in plan.buffers]}


def layout_perm(t: ir.Tensor) -> list[int] | None:
    """How a tensor is stored, as the permutation of its ONNX (NCHW) dimensions: None when as ONNX
    lays it out; [0, 2, 3, 1] for a 4-D tensor a kernel keeps channels-last (`Tensor.layout`)."""
    if t.layout == "NHWC" and len(t.shape) == 4:
        return [0, 2, 3, 1]
    return None


def check_supported(g: ir.Graph) -> None:
    """Raise one error that lists every unsupported operator, with counts and node names."""
    problems: "OrderedDict[str, list[str]]" = OrderedDict()
    for n, why in unsupported_nodes(g):
        key = printable(n.op) if why == "no kernel" else f"{printable(n.op)} ({why})"
        problems.setdefault(key, []).append(printable(n.name, 40))
    for name in g.inputs + g.outputs:
        t = g.t(name)
        if np.dtype(t.dtype) not in RUNTIME_DTYPES:
            problems.setdefault(f"graph input/output of type {np.dtype(t.dtype).name}", []).append(printable(name, 40))
    if problems:
        parts = []
        for key, names in problems.items():
            shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
            parts.append(f"{key} x{len(names)} [{shown}]")
        raise TinydeployError("unsupported operators: " + "; ".join(parts))


def lower(g: ir.Graph) -> list[Kernel | None]:
    return [REGISTRY[n.op].emit(n, g) for n in g.nodes]


def prepared_graph(path, input_shapes=None, max_weights_bytes: "int | limits.Budget | None" = None,
                   bytes_max: int = 2**63 - 1) -> ir.Graph:
    """import -> the verifier (every problem at once: ops/verify.py) -> 8-bit islands to integer
    operators -> support check (every unsupported operator at once) -> the other passes: the graph
    kernel lowering starts from. `bytes_max`: the target's largest tensor (Target.bytes_max)."""
    g, _ = import_model(path, input_shapes, max_weights_bytes)
    verify_graph(g, bytes_max)
    run_passes(g, [LOWER_8BIT], done=())
    check_supported(g)
    run_passes(g)
    return g


def resolve_states(g: ir.Graph, pairs, required: bool = True) -> tuple[tuple[str, str], ...]:
    """The state pairs of `--state IN=OUT` (or "auto": every input `X_in` with an output `X_out`;
    `required`: finding none is an error), checked: a graph input and a graph output of the same
    shape and type, each in one pair."""
    if pairs == "auto":
        pairs = [(i, i[:-3] + "_out") for i in g.inputs if i.endswith("_in") and i[:-3] + "_out" in g.outputs]
        if not pairs and required:
            raise TinydeployError("--state auto found no state: it pairs an input named X_in with an output "
                                  "named X_out; name the pairs with --state IN=OUT")
    out, seen = [], set()
    for i, o in pairs:
        if i not in g.inputs or o not in g.outputs:
            missing = f"input {printable(i, 60)!r}" if i not in g.inputs else f"output {printable(o, 60)!r}"
            raise TinydeployError(f"--state {printable(i, 60)}={printable(o, 60)}: the model has no {missing} "
                                  f"(inputs: {', '.join(printable(x, 40) for x in g.inputs)}; outputs: "
                                  f"{', '.join(printable(x, 40) for x in g.outputs)})")
        ti, to = g.t(i), g.t(o)
        if ti.shape != to.shape or np.dtype(ti.dtype) != np.dtype(to.dtype):
            raise TinydeployError(f"--state {printable(i, 60)}={printable(o, 60)}: the input is "
                                  f"{np.dtype(ti.dtype).name} {list(ti.shape)}, the output {np.dtype(to.dtype).name} "
                                  f"{list(to.shape)}; a state pair needs the same shape and type")
        if i in seen or o in seen:
            raise TinydeployError(f"--state: {printable(i if i in seen else o, 60)!r} is in two state pairs")
        seen |= {i, o}
        out.append((i, o))
    if len(out) == len(g.inputs):
        raise TinydeployError("--state: every input of the model would be a state; a model needs at least one "
                              "input of its own")
    return tuple(out)


def compile_model(path, target: Target, input_shapes=None, command: str = "", board: str = "host",
                  threads: int = 1, max_weights_bytes: "int | limits.Budget | None" = None,
                  api: project.Api | None = None, state_pairs=None, states_required: bool = True,
                  optimize: str = "balanced") -> Compiled:
    """`max_weights_bytes`: the weights budget (tinydeploy.limits; None: sized against this
    machine's memory). The import holds the model to it, and so does the C written here.
    `api`: the library form (codegen/project.py Api; its states are `state_pairs`, resolved
    against the graph: resolve_states). `optimize` (balanced, speed, size): what
    microcontroller kernels may spend flash on."""
    budget = limits.budget(max_weights_bytes)
    g = prepared_graph(path, input_shapes, budget, target.bytes_max)
    if api is not None and state_pairs:
        api = dataclasses.replace(api, states=resolve_states(g, state_pairs, states_required))
    macs = sum(REGISTRY[n.op].macs(n, g) for n in g.nodes)
    kernels = select_kernels(g, lower(g), target, threads, optimize)   # fast conv/dense algorithms per layer
    # on microcontrollers the planner may run early layers patch by patch (schedule/stream.py)
    plan = plan_memory(g, kernels, target.alignment, fit_scratch, chain_candidates if target.bare_metal else None, macs,
                       states=api.states if api else (), scratch_apart=bool(api and api.scratch_section))
    weights = {a: t for k in kernels if k for a, t in k.constants(g).items()}
    weights_bytes = sum(t.nbytes for t in weights.values())
    if weights_bytes > budget.bytes:   # passes and kernel layouts can add to what the import held
        largest = max(weights, key=lambda w: (weights[w].nbytes, w))
        raise limits.refuse(f"the C would hold {len(weights)} weight tensor{'s' * (len(weights) != 1)}, "
                            f"{weights_bytes} bytes (largest {printable(largest, 60)!r}, "
                            f"{limits.human(weights[largest].nbytes)})", weights_bytes, budget)
    sha = sha256_file(Path(path))
    info = project.ModelInfo(Path(path).name, sha, command, board)
    chosen: dict = {}
    files = project.generate(g, kernels, plan, info, target.isas, target.alignment, macs, api, chosen)
    return Compiled(g, kernels, plan, files, macs, weights_bytes, sha, g.notes + plan.notes, Path(path).name, api, chosen)


@dataclass
class Image:
    """Library-form models (one or more) in one program, behind the model table that gives the
    harnesses their single-model API (codegen/image.py): what firmware projects and host builds
    read in place of one Compiled, with the same facts (files, sources, sizes)."""
    models: list[Compiled]
    table: dict[str, str]          # model.h and td_models.c
    share_arena: bool = False      # one arena for all models (they never run at the same time)

    @property
    def model(self) -> str:
        return "+".join(c.model for c in self.models)

    @property
    def files(self) -> dict[str, str]:
        return {k: v for c in self.models for k, v in c.files.items()} | self.table

    @property
    def sources(self) -> list[str]:
        return [s for c in self.models for s in c.sources] + ["td_models.c"]

    @property
    def headers(self) -> list[str]:
        return [h for c in self.models for h in c.headers] + ["model.h"]

    @property
    def weights_bytes(self) -> int:
        return sum(c.weights_bytes for c in self.models)

    @property
    def arena_bytes(self) -> int:
        """The activation arenas of the image: the largest when shared, else their sum."""
        sizes = [c.arena_bytes for c in self.models]
        return max(sizes) if self.share_arena else sum(sizes)

    @property
    def separate_arena_bytes(self) -> int:
        return sum(c.arena_bytes for c in self.models)

    @property
    def scratch_bytes(self) -> int:
        return sum(c.plan.scratch_bytes for c in self.models)

    @property
    def input_bytes(self) -> int:
        """The harness's input buffer: per input index the largest any model takes."""
        per = [[c.graph.t(n).nbytes for n in c.graph.inputs if n not in {i for i, _ in c.states}] for c in self.models]
        return sum(max((v[i] for v in per if i < len(v)), default=0) for i in range(max(map(len, per))))

    @property
    def inputs_int8(self) -> bool:
        return all(c.inputs_int8 for c in self.models)


def _shapes_per_model(paths, shapes: dict) -> list[dict]:
    """`--input-shape` of a build with several models: each pins the input of that name in every
    model that has one; a name no model has is refused."""
    import onnx
    names = []
    for p in paths:
        try:
            names.append({i.name for i in onnx.load(str(p), load_external_data=False).graph.input})
        except Exception:  # noqa: BLE001 - the import reads it defensively and says what is wrong
            names.append(set(shapes))
    unknown = [n for n in shapes if not any(n in ns for ns in names)]
    if unknown:
        raise TinydeployError(f"--input-shape names {printable(unknown[0])!r}, which none of the models has as an input")
    return [{k: v for k, v in shapes.items() if k in ns} for ns in names]


def compile_image(paths, target: Target, apis: list[project.Api], share_arena: bool = False, state_pairs=None,
                  header: str = "", **kw) -> Image:
    """Each model in its library form (`apis`, one per path; `state_pairs` as compile_model's,
    for every model), then the model table over them. `kw`: compile_model's options."""
    from tinydeploy.codegen import image
    shapes = kw.pop("input_shapes", None) or {}
    per = [shapes] if len(paths) == 1 else _shapes_per_model(paths, shapes)
    models = [compile_model(p, target, api=a, state_pairs=state_pairs, states_required=len(apis) == 1,
                            input_shapes=s, **kw) for p, a, s in zip(paths, apis, per)]
    table = image.generate([image.ImageModel(
        c.api.name, c.names["model_h"], c.api.arena == "static", c.arena_bytes, target.alignment,
        tuple(c.graph.t(n).nbytes for n in c.graph.inputs if n not in dict(c.states)),
        tuple(c.graph.t(n).nbytes for n in c.graph.outputs if n not in dict(c.states).values()),
        tuple(project.ONNX_DTYPE[np.dtype(c.graph.t(n).dtype)] for n in c.graph.outputs
              if n not in dict(c.states).values()),
        len(c.graph.nodes), bool(c.states)) for c in models], share_arena, header,
        models[0].api.arena_section if models else None)
    return Image(models, table, share_arena)
