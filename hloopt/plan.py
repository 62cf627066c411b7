"""The plan file: what hloopt decided for each residual, and what it predicts, as versioned JSON.

A :class:`Plan` is what ``hloopt plan`` writes and everything downstream reads: the emitters
(:mod:`hloopt.emit`: a JAX policy, a MaxText config, annotated HLO) and ``hloopt verify``. It is
a frozen dataclass tree with one JSON form:

    {"schema": "hloopt.plan/1", "target": ..., "module": ..., "device": {...},
     "budget": {"spec": "75%", "bytes": N} | null, "mode": "budget"|"max-slowdown"|"pareto",
     "decisions": [{"key", "name", "selector", "action", "bytes", "layers", "shape", "reason",
                    "source", "values"}, ...],
     "predicted": {...}, "bounds": {...}, "solver": {...}, "pareto": [...] | null,
     "state": [{"group", "placement", "bytes", "reason", "role"}, ...], "host_budget_bytes": N,
     "host_peak_bytes": N, "builtin": "dots_saveable", "objective": "flops", "measured": {...}}
                                            (the last two only when argument groups were planned)

``objective`` (only where not ``"time"``): what the search minimised (:data:`OBJECTIVES`).
``"time"``, the default, is the step time with every transfer over the host link timed;
``"flops"`` is the recomputation alone, counted in FLOPs, with no weight on the step's waits for
the link (a link fast enough never to stall the step, or a user who wants the fewest FLOPs that
fit); memory is counted with the link's rates either way, and the predicted step time includes
the waits.

``measured`` (only with ``hloopt plan --judge measured``): the device the plan's policy and each
built-in policy and preset predicted within the budget ran on (``device_kind``, ``platform``),
``steps`` timed per policy, ``rows`` (``name``, ``median_s``, ``q1_s``, ``q3_s``: seconds per step)
and ``chosen``, the row the plan is. Such a plan holds timings, so two runs write different bytes.

``builtin`` (only where set): the plan is that JAX built-in policy (one of
:data:`BUILTIN_POLICIES` or :data:`OFFLOADING_BUILTINS`, ``jax.checkpoint_policies.<builtin>``),
chosen because it fits the budget with fewer FLOPs than the searched rules (an offloading one:
and no longer a step, both lowered and judged; :func:`hloopt.pipeline.plan`), or, with
``--judge measured``, because it ran faster on the device; its decisions say
what its replay does to each residual of the all-saved step, and the policy emitted is the
built-in itself.

Algorithm: :meth:`Plan.to_json` writes keys sorted, floats rounded to :data:`FLOAT_DIGITS`
significant digits, decisions in the order given and no timestamps or timings (the solver's
wall-clock time, :attr:`SolverInfo.time_s`, is printed by ``hloopt plan`` but never written), so
the same input always gives the same bytes (plans diff cleanly and are reproducible).
:meth:`Plan.load` checks every field's type and says which field of which file is wrong, in one
line (a :class:`UserError`); a ``solver.time_s`` in older files is ignored.

Invariants: decision keys are unique; a checkpoint name has one action (JAX's
``save_and_offload_only_these_names`` rejects a name both saved and offloaded); a file written by
a newer hloopt (``hloopt.plan/N``, N > :data:`SCHEMA_VERSION`) is refused, never half-read.
Unknown extra fields are ignored, so version 1 can grow optional fields.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hloopt.errors import UserError

__all__ = [
    "ACTIONS", "Bounds", "Budget", "Decision", "MODES", "Measured", "MeasuredRow", "ParetoPoint", "Plan", "Predicted",
    "SCHEMA", "SCHEMA_VERSION", "Selector", "SolverInfo", "StateDecision",
]

SCHEMA_VERSION = 1
SCHEMA_PREFIX = "hloopt.plan/"
SCHEMA = f"{SCHEMA_PREFIX}{SCHEMA_VERSION}"
ACTIONS: tuple[str, ...] = ("device", "offload", "remat")
MODES: tuple[str, ...] = ("budget", "max-slowdown", "pareto")
#: What a search minimises (module docstring): the step time, or the recomputation alone
OBJECTIVES: tuple[str, ...] = ("time", "flops")
SELECTOR_KINDS: tuple[str, ...] = ("name", "primitive")
#: JAX built-in policies that move nothing to host memory, which a plan can be (``Plan.builtin``)
BUILTIN_POLICIES: tuple[str, ...] = ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable")
#: JAX built-in policies that move values to host memory (called with ``('device', 'pinned_host')``),
#: which a plan can be too: judged on the step lowered with them (hloopt.pipeline.judge_lowered)
OFFLOADING_BUILTINS: tuple[str, ...] = ("offload_dot_with_no_batch_dims",)
#: Significant digits floats are written with: enough for nanoseconds in an hour-long step.
FLOAT_DIGITS = 12

_SCHEMA_RE = re.compile(r"^hloopt\.plan/(\d+)$")


def _round(x: float) -> float:
    if not math.isfinite(x):
        return x
    return float(f"{x:.{FLOAT_DIGITS}g}")


@dataclass(frozen=True)
class Selector:
    """How a JAX policy picks the residual: by ``checkpoint_name`` or by primitive."""

    #: "name" (a ``checkpoint_name``) or "primitive" (an unnamed value, by the primitive making it)
    kind: str
    #: kind "name": the checkpoint_name
    name: str | None = None
    #: kind "primitive": the JAX primitive name (``dot_general``)
    primitive: str | None = None
    #: kind "primitive": ``file:line`` that made it (informative: policies never see sources)
    source: str | None = None
    #: kind "primitive": HLO shape text of the primitive's output (``f32[2,32,64]``); when set the
    #: policy matches only outputs of this shape and element type
    shape: str | None = None

    @staticmethod
    def by_name(name: str) -> Selector:
        return Selector(kind="name", name=name)

    @staticmethod
    def by_primitive(primitive: str, *, source: str | None = None, shape: str | None = None) -> Selector:
        return Selector(kind="primitive", primitive=primitive, source=source, shape=shape)

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "name":
            return {"kind": "name", "name": self.name}
        d: dict[str, Any] = {"kind": "primitive", "primitive": self.primitive, "source": self.source}
        if self.shape is not None:
            d["shape"] = self.shape
        return d


@dataclass(frozen=True)
class StateDecision:
    """Where one group of the step's arguments lives (:mod:`hloopt.state`): ``device`` or ``host``
    (``pinned_host``, brought to the device around its use and written back updated)."""

    #: the group's name (``opt_state[0].mu``)
    group: str
    #: "device"; "host" (in host memory, brought to the device around its use); "host-compute"
    #: (the optimizer state, in host memory, updated on the host: ``hloopt.state.on_host``)
    placement: str
    #: device bytes of the group (its arguments and its updated outputs, as the timeline counts them)
    bytes: int
    reason: str = ""
    #: "parameters" (read by the differentiated computation) or "optimizer" (the optimizer's state)
    role: str = "parameters"

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "placement": self.placement, "bytes": self.bytes, "reason": self.reason,
                "role": self.role}


@dataclass(frozen=True)
class Decision:
    """The action for one candidate (a group of residuals one policy rule selects)."""

    #: stable key, e.g. ``name:query_proj`` or ``prim:dot_general@model.py:42``
    key: str
    #: the checkpoint_name, or None for an unnamed value
    name: str | None
    selector: Selector
    #: "device" (keep), "offload" (to pinned host memory) or "remat" (recompute in backward)
    action: str
    #: device bytes of all instances together (every layer)
    bytes: int
    #: number of instances (layers) the rule selects
    layers: int
    #: HLO shape text of one instance
    shape: str = ""
    #: why the solver chose this action, for people
    reason: str = ""
    #: ``file:line`` of the value in the user's program, when known
    source: str = ""
    #: names of the HLO instructions (in the plan's ``module``) defining the instances, when known
    values: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "name": self.name, "selector": self.selector.to_dict(), "action": self.action,
            "bytes": self.bytes, "layers": self.layers, "shape": self.shape, "reason": self.reason,
            "source": self.source, "values": list(self.values),
        }


@dataclass(frozen=True)
class Budget:
    """The device-memory budget the plan was made for."""

    #: as the user gave it: ``"75%"``, ``"12GiB"``
    spec: str
    bytes: int


@dataclass(frozen=True)
class Predicted:
    """What the simulator predicts for the plan, and for keeping every residual on device."""

    peak_bytes: int
    step_time_s: float
    #: transfer time compute waits for (not hidden behind compute)
    exposed_transfer_s: float
    baseline_peak_bytes: int
    baseline_step_time_s: float
    #: the memory model's peak (``hloopt analyze``'s TPU prediction) of the step lowered with the
    #: plan's policy, where the pipeline lowered it (budget plans of JAX targets for TPU); there
    #: ``peak_bytes`` is this figure too
    model_peak_bytes: int | None = None
    #: where the step was lowered with the plan: the simulator's replay of the plan's decisions on
    #: the analyzed timeline, the figure the search compared choices (and built-in policies) by
    replay_peak_bytes: int | None = None


@dataclass(frozen=True)
class Bounds:
    """The least peak any policy reaches (everything offloaded or recomputed), and the least time."""

    least_peak_bytes: int
    least_step_time_s: float


@dataclass(frozen=True)
class SolverInfo:
    #: "milp", "greedy", ...
    name: str
    #: "optimal", "feasible", "time-limit", ...
    status: str
    #: relative optimality gap (0 when proven optimal), None when unknown
    gap: float | None
    #: wall-clock seconds the search took in this run; not written to the file (it differs from
    #: run to run), so None for a loaded plan, and not part of equality
    time_s: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ParetoPoint:
    """One point of a peak/time trade-off curve and the non-device actions that reach it."""

    peak_bytes: int
    step_time_s: float
    #: candidate key -> "offload"/"remat" (keys not listed stay on device)
    actions: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MeasuredRow:
    """One policy timed on the device (``hloopt plan --judge measured``): seconds per step."""

    #: ``plan`` (the searched rules) or the built-in policy's or preset's name
    name: str
    median_s: float
    q1_s: float
    q3_s: float


@dataclass(frozen=True)
class Measured:
    """What ``--judge measured`` ran on the device and took (module docstring)."""

    #: ``jax.Device.device_kind`` and platform the steps ran on
    device_kind: str
    platform: str
    #: timed samples per policy
    steps: int
    #: the row the plan is: ``plan``, or the built-in that replaced the searched rules
    chosen: str
    rows: tuple[MeasuredRow, ...]


@dataclass(frozen=True)
class Plan:
    """A plan (see the module docstring for the file format)."""

    target: str
    #: HLO module name the plan was made for
    module: str
    #: the :class:`hloopt.devices.DeviceProfile` used, as ``to_dict()``
    device: Mapping[str, Any]
    budget: Budget | None
    mode: str
    decisions: tuple[Decision, ...]
    predicted: Predicted
    bounds: Bounds
    solver: SolverInfo
    pareto: tuple[ParetoPoint, ...] | None = None
    schema: str = SCHEMA
    #: placements of the step's argument groups (``hloopt plan --state``); empty: not planned
    state: tuple[StateDecision, ...] = ()
    #: the host memory the plan may fill (bytes), when state was planned
    host_budget_bytes: int | None = None
    #: the most host memory the plan holds at once (the simulator's host timeline), when state was planned
    host_peak_bytes: int | None = None
    #: the JAX built-in policy the plan is (module docstring), or None: its decisions' rules
    builtin: str | None = None
    #: what the search minimised (:data:`OBJECTIVES`, module docstring)
    objective: str = "time"
    #: the policies timed on the device and the one taken (``--judge measured``), or None
    measured: Measured | None = None

    @property
    def host_groups(self) -> list[str]:
        """Argument groups the plan puts in host memory (placed there, or updated there)."""
        return [s.group for s in self.state if s.placement in ("host", "host-compute")]

    @property
    def host_update(self) -> bool:
        """Whether the plan computes the optimizer update on the host."""
        return any(s.placement == "host-compute" for s in self.state)

    def __post_init__(self) -> None:
        # Constructed in code (by the pipeline) the same checks as a loaded file apply.
        _check_semantics(self, "<plan>")

    # -- views -------------------------------------------------------------------------------
    def of(self, action: str) -> tuple[Decision, ...]:
        """Decisions with ``action``, in plan order."""
        return tuple(d for d in self.decisions if d.action == action)

    def names(self, action: str) -> list[str]:
        """Checkpoint names selected by name with ``action``, sorted."""
        return sorted({d.selector.name for d in self.of(action)
                       if d.selector.kind == "name" and d.selector.name is not None})

    @property
    def by_name_only(self) -> bool:
        """Whether every decision selects by checkpoint_name (a stock JAX policy expresses it)."""
        return all(d.selector.kind == "name" for d in self.decisions)

    def device_profile(self) -> Any:
        from hloopt.devices import DeviceProfile

        return DeviceProfile.from_dict(self.device, origin="plan device")

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "target": self.target,
            "module": self.module,
            "device": _plain(self.device),
            "budget": None if self.budget is None else {"spec": self.budget.spec, "bytes": self.budget.bytes},
            "mode": self.mode,
            "decisions": [d.to_dict() for d in self.decisions],
            "predicted": dataclasses.asdict(self.predicted),
            "bounds": dataclasses.asdict(self.bounds),
            # an unbounded gap (the solver had no lower bound above 0) is "unknown", as JSON has no inf
            "solver": {"name": self.solver.name, "status": self.solver.status,
                       "gap": self.solver.gap if self.solver.gap is None or math.isfinite(self.solver.gap) else None},
            "pareto": None if self.pareto is None else [
                {"peak_bytes": p.peak_bytes, "step_time_s": p.step_time_s, "actions": dict(p.actions)}
                for p in self.pareto],
            # written only when planned, so plans without state keep their bytes
            **({"state": [s.to_dict() for s in self.state], "host_budget_bytes": self.host_budget_bytes,
                "host_peak_bytes": self.host_peak_bytes}
               if self.state else {}),
            **({"builtin": self.builtin} if self.builtin else {}),
            **({"objective": self.objective} if self.objective != "time" else {}),
            **({"measured": {"device_kind": self.measured.device_kind, "platform": self.measured.platform,
                             "steps": self.measured.steps, "chosen": self.measured.chosen,
                             "rows": [dataclasses.asdict(r) for r in self.measured.rows]}}
               if self.measured is not None else {}),
        }

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, rounded floats, ASCII), ending in a newline."""
        return json.dumps(_rounded(self.to_dict()), sort_keys=True, indent=2, ensure_ascii=True,
                          allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, origin: str = "<plan>") -> Plan:
        """Validate and build; ``origin`` (the file name) starts every error message."""
        return _parse_plan(data, origin)

    @classmethod
    def loads(cls, text: str, *, origin: str = "<plan>") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{origin}: not JSON (line {err.lineno} column {err.colno}: {err.msg})") from None
        return _parse_plan(data, origin)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file; every problem is one UserError line naming the file."""
        p = Path(path)
        origin = os.fspath(path)
        if p.is_dir():
            raise UserError(f"{origin}: is a folder, not a plan file")
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            raise UserError(f"{origin}: no such plan file") from None
        except OSError as err:
            raise UserError(f"{origin}: cannot read: {err.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{origin}: not JSON (not UTF-8 text)") from None
        return cls.loads(text, origin=origin)

    def save(self, path: str | os.PathLike[str], *, force: bool = False) -> None:
        """Write :meth:`to_json` atomically (see :func:`hloopt.fileio.write_text_atomic`)."""
        from hloopt.fileio import write_text_atomic

        write_text_atomic(path, self.to_json(), force=force)


# -- serialisation helpers ----------------------------------------------------------------------

def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return _round(value)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


# -- validation --------------------------------------------------------------------------------

def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


class _Reader:
    """Typed field access on one JSON object, with errors that name the file and the field path."""

    def __init__(self, origin: str, path: str, obj: Any) -> None:
        self.origin, self.path = origin, path
        if not isinstance(obj, dict):
            raise self.error(f"expected an object, got {_type_name(obj)}", path)
        self.obj = obj

    def error(self, msg: str, path: str | None = None) -> UserError:
        where = path if path is not None else self.path
        return UserError(f"{self.origin}: {where}: {msg}" if where else f"{self.origin}: {msg}")

    def _get(self, key: str, *, optional: bool) -> Any:
        if key not in self.obj:
            if optional:
                return None
            raise self.error(f"missing field {key!r}")
        return self.obj[key]

    def _at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def str(self, key: str, *, optional: bool = False, nullable: bool = False, default: str | None = None) -> Any:
        if key not in self.obj:
            if default is not None:
                return default
            if optional:
                return None
            raise self.error(f"missing field {key!r}")
        v = self.obj[key]
        if v is None and nullable:
            return None
        if not isinstance(v, str):
            raise self.error(f"expected a string, got {_type_name(v)}", self._at(key))
        return v

    def int(self, key: builtins.str, *, nullable: bool = False, minimum: int | None = 0) -> Any:
        v = self._get(key, optional=False)
        if v is None and nullable:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(f"expected an integer, got {_type_name(v)}", self._at(key))
        if minimum is not None and v < minimum:
            raise self.error(f"expected an integer >= {minimum}, got {v}", self._at(key))
        return v

    def num(self, key: builtins.str, *, nullable: bool = False) -> Any:
        v = self._get(key, optional=False)
        if v is None and nullable:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(f"expected a number, got {_type_name(v)}", self._at(key))
        if not math.isfinite(v) or v < 0:
            raise self.error(f"expected a finite number >= 0, got {v}", self._at(key))
        return float(v)

    def obj_(self, key: builtins.str, *, nullable: bool = False) -> Any:
        v = self._get(key, optional=False)
        if v is None and nullable:
            return None
        return _Reader(self.origin, self._at(key), v)

    def list(self, key: builtins.str, *, nullable: bool = False, optional: bool = False) -> Any:
        v = self._get(key, optional=optional)
        if v is None and (nullable or (optional and key not in self.obj)):
            return None
        if not isinstance(v, list):
            raise self.error(f"expected a list, got {_type_name(v)}", self._at(key))
        return v

    def one_of(self, key: builtins.str, choices: Sequence[builtins.str]) -> builtins.str:
        v = self.str(key)
        if v not in choices:
            raise self.error(f"expected one of {', '.join(choices)}, got {v!r}", self._at(key))
        return v


def _check_schema(data: Any, origin: str) -> None:
    if not isinstance(data, dict):
        raise UserError(f"{origin}: not an hloopt plan (expected a JSON object, got {_type_name(data)})")
    if "schema" not in data:
        raise UserError(f"{origin}: not an hloopt plan (no \"schema\" field)")
    schema = data["schema"]
    m = _SCHEMA_RE.match(schema) if isinstance(schema, str) else None
    if m is None:
        raise UserError(f"{origin}: not an hloopt plan (schema {schema!r}, expected {SCHEMA})")
    version = int(m.group(1))
    if version > SCHEMA_VERSION:
        raise UserError(f"{origin}: schema {schema} is newer than this hloopt (reads {SCHEMA}); "
                        "upgrade hloopt")
    if version < SCHEMA_VERSION:
        raise UserError(f"{origin}: schema {schema} is not supported (reads {SCHEMA})")


def _parse_selector(r: _Reader) -> Selector:
    kind = r.one_of("kind", SELECTOR_KINDS)
    if kind == "name":
        return Selector(kind="name", name=r.str("name"))
    return Selector(kind="primitive", primitive=r.str("primitive"), source=r.str("source", nullable=True,
                    optional=True), shape=r.str("shape", optional=True, nullable=True))


def _parse_decision(r: _Reader) -> Decision:
    values = r.list("values", optional=True) or []
    for j, v in enumerate(values):
        if not isinstance(v, str):
            raise r.error(f"expected a string, got {_type_name(v)}", f"{r.path}.values[{j}]")
    return Decision(
        key=r.str("key"), name=r.str("name", nullable=True), selector=_parse_selector(r.obj_("selector")),
        action=r.one_of("action", ACTIONS), bytes=r.int("bytes"), layers=r.int("layers"),
        shape=r.str("shape", default=""), reason=r.str("reason", default=""), source=r.str("source", default=""),
        values=tuple(values))


def _parse_plan(data: Any, origin: str) -> Plan:
    _check_schema(data, origin)
    r = _Reader(origin, "", data)
    device = r.obj_("device").obj
    budget_r = r.obj_("budget", nullable=True)
    budget = None if budget_r is None else Budget(spec=budget_r.str("spec"), bytes=budget_r.int("bytes"))
    decisions = []
    for i, d in enumerate(r.list("decisions")):
        decisions.append(_parse_decision(_Reader(origin, f"decisions[{i}]", d)))
    p = r.obj_("predicted")
    predicted = Predicted(peak_bytes=p.int("peak_bytes"), step_time_s=p.num("step_time_s"),
                          exposed_transfer_s=p.num("exposed_transfer_s"),
                          baseline_peak_bytes=p.int("baseline_peak_bytes"),
                          baseline_step_time_s=p.num("baseline_step_time_s"),
                          model_peak_bytes=p.int("model_peak_bytes", nullable=True)
                          if "model_peak_bytes" in p.obj else None,
                          replay_peak_bytes=p.int("replay_peak_bytes", nullable=True)
                          if "replay_peak_bytes" in p.obj else None)
    b = r.obj_("bounds")
    bounds = Bounds(least_peak_bytes=b.int("least_peak_bytes"), least_step_time_s=b.num("least_step_time_s"))
    s = r.obj_("solver")
    solver = SolverInfo(name=s.str("name"), status=s.str("status"), gap=s.num("gap", nullable=True))
    pareto_raw = r.list("pareto", nullable=True, optional=True)
    pareto = None
    if pareto_raw is not None:
        points = []
        for i, pt in enumerate(pareto_raw):
            pr = _Reader(origin, f"pareto[{i}]", pt)
            acts = pr.obj_("actions").obj
            for k, a in acts.items():
                if a not in ACTIONS:
                    raise pr.error(f"expected one of {', '.join(ACTIONS)}, got {a!r}", f"pareto[{i}].actions.{k}")
            points.append(ParetoPoint(peak_bytes=pr.int("peak_bytes"), step_time_s=pr.num("step_time_s"),
                                      actions=dict(acts)))
        pareto = tuple(points)
    state = []
    for i, s_raw in enumerate(r.list("state", optional=True) or []):
        sr = _Reader(origin, f"state[{i}]", s_raw)
        state.append(StateDecision(group=sr.str("group"),
                                   placement=sr.one_of("placement", ("device", "host", "host-compute")),
                                   bytes=sr.int("bytes"), reason=sr.str("reason", default=""),
                                   role=sr.one_of("role", ("parameters", "optimizer")) if "role" in sr.obj
                                   else "parameters"))
    measured = None
    if "measured" in r.obj:
        mr = r.obj_("measured")
        rows = []
        for i, row in enumerate(mr.list("rows")):
            rr = _Reader(origin, f"measured.rows[{i}]", row)
            rows.append(MeasuredRow(name=rr.str("name"), median_s=rr.num("median_s"), q1_s=rr.num("q1_s"),
                                    q3_s=rr.num("q3_s")))
        measured = Measured(device_kind=mr.str("device_kind"), platform=mr.str("platform"),
                            steps=mr.int("steps", minimum=1), chosen=mr.str("chosen"), rows=tuple(rows))
        if measured.chosen not in {x.name for x in rows}:
            raise mr.error(f"chosen {measured.chosen!r} is none of the measured rows", "measured.chosen")
    host_budget = r.int("host_budget_bytes", nullable=True) if "host_budget_bytes" in r.obj else None
    host_peak = r.int("host_peak_bytes", nullable=True) if "host_peak_bytes" in r.obj else None
    try:
        return Plan(target=r.str("target"), module=r.str("module"), device=device, budget=budget,
                    mode=r.one_of("mode", MODES), decisions=tuple(decisions), predicted=predicted,
                    bounds=bounds, solver=solver, pareto=pareto, schema=SCHEMA, state=tuple(state),
                    host_budget_bytes=host_budget, host_peak_bytes=host_peak,
                    builtin=r.one_of("builtin", BUILTIN_POLICIES + OFFLOADING_BUILTINS)
                    if "builtin" in r.obj else None,
                    objective=r.one_of("objective", OBJECTIVES) if "objective" in r.obj else "time",
                    measured=measured)
    except UserError as err:
        raise UserError(str(err).replace("<plan>", origin, 1)) from None


def _check_semantics(plan: Plan, origin: str) -> None:
    if plan.mode not in MODES:
        raise UserError(f"{origin}: mode: expected one of {', '.join(MODES)}, got {plan.mode!r}")
    if plan.objective not in OBJECTIVES:
        raise UserError(f"{origin}: objective: expected one of {', '.join(OBJECTIVES)}, got {plan.objective!r}")
    if plan.builtin is not None:
        known = BUILTIN_POLICIES + OFFLOADING_BUILTINS
        if plan.builtin not in known:
            raise UserError(f"{origin}: builtin: expected one of {', '.join(known)}, got {plan.builtin!r}")
        if plan.of("offload") and plan.builtin not in OFFLOADING_BUILTINS:
            raise UserError(f"{origin}: builtin: {plan.builtin} offloads nothing, but decisions offload "
                            f"{plan.of('offload')[0].key!r}")
    seen: dict[str, int] = {}
    name_action: dict[str, tuple[str, int]] = {}
    for i, d in enumerate(plan.decisions):
        where = f"{origin}: decisions[{i}]"
        if d.action not in ACTIONS:
            raise UserError(f"{where}.action: expected one of {', '.join(ACTIONS)}, got {d.action!r}")
        if d.key in seen:
            raise UserError(f"{where}.key: {d.key!r} repeats decisions[{seen[d.key]}]")
        seen[d.key] = i
        sel = d.selector
        if sel.kind not in SELECTOR_KINDS:
            raise UserError(f"{where}.selector.kind: expected one of {', '.join(SELECTOR_KINDS)}, got {sel.kind!r}")
        if sel.kind == "name":
            if sel.name is None:
                raise UserError(f"{where}.selector: a name selector needs a name")
            prev = name_action.get(sel.name)
            if prev is not None and prev[0] != d.action:
                raise UserError(f"{where}: checkpoint_name {sel.name!r} is both {prev[0]} "
                                f"(decisions[{prev[1]}]) and {d.action}")
            name_action[sel.name] = (d.action, i)
        elif not sel.primitive:
            raise UserError(f"{where}.selector: a primitive selector needs a primitive")
