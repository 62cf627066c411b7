"""Names for residuals: which ``checkpoint_name`` (or primitive at a source line) a policy can use.

``checkpoint_name`` leaves no trace in HLO, so names are recovered by lowering the step again:

1. **Name sites.** ``jax.make_jaxpr`` of the step, with frames located as lowering locates ops
   (:func:`hloopt.lowering.framework_frames_skipped`); every ``name`` equation (in any sub-jaxpr:
   scan bodies, remat, pjit) gives a checkpoint_name and the user source line of its call. A name
   called inside a framework (haliax's ``tree_checkpoint_name`` on a scanned layer's carry and
   inputs) is at the model line that called the framework: a checkpoint's body is traced with
   only its own frames, so a name there with no user frame takes its enclosing equation's.
2. **Probe.** Lower the step once with a policy that offloads *every* name
   (``save_and_offload_only_these_names(names_which_can_be_offloaded=all names)``). Each
   offloaded residual of the probe (:func:`hloopt.passes.residuals.find_residuals`: a pinned_host
   annotation, directly or written into a scan stack) is one named value; its name is the name
   whose call site is the annotation's (unrolled: JAX puts it at the ``name`` equation) or the
   producing op's user source line (``checkpoint_name(h @ w, "q")`` on one line).
3. **One-name probes.** Values no line names (a scan carry has no location; annotations inside a
   scan carry the scan's line; haliax calls both its names on one line, :attr:`NameProbe.ambiguous`)
   are named by one more lowering per left-over name, offloading that name alone and keeping the
   baseline's policy for everything else. The baseline residuals that disappear from device in
   that lowering, matched to what it offloads (same producer and line, else same dtype,
   per-layer dims and layers), are what the name selects (:func:`_moved_by`). A name that moves
   nothing there keeps its offloaded values for step 4.
4. **Match.** A remaining residual of the baseline module gets name N when it has N's dtype,
   per-layer dims and layer count, and the all-names probe no longer keeps an equal device
   residual (so selecting N is what moves it). Everything else keeps its
   ``prim:<primitive>@file:line`` key.

All of this imports jax lazily; :mod:`hloopt.passes.residuals` itself needs no jax.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hloopt.errors import UserError
from hloopt.passes.residuals import Residual, ResidualSet, find_residuals


@dataclass(frozen=True)
class NameSite:
    """One ``checkpoint_name(x, name)`` call in the traced step."""

    name: str
    file: str
    line: int
    #: the named value is an input of the enclosing ``jax.checkpoint`` (through identity ops such
    #: as sharding constraints): not saving it makes JAX save that input instead, the same bytes,
    #: so rematerializing it frees nothing
    of_input: bool = False


@dataclass(frozen=True)
class NamedValue:
    """What offloading one name moves (from the probe lowering)."""

    name: str
    dtype: str
    #: dims of one layer's copy
    per_layer_dims: tuple[int, ...]
    layers: int
    bytes: int
    source: str


@dataclass(frozen=True)
class NameProbe:
    """The result of naming: the baseline residuals with names, and what every name selects."""

    residuals: ResidualSet
    sites: tuple[NameSite, ...]
    #: every named value the all-names probe offloaded, whether or not the baseline saves it
    values: tuple[NamedValue, ...]
    #: names whose call sites share a source line with another name (not attributable)
    ambiguous: tuple[str, ...] = ()
    #: residuals (instruction names) named by what a one-name lowering was seen to move, or by a
    #: probe value of the same producing op, line and shape: not by a shape alone
    diffed: frozenset[str] = frozenset()

    @property
    def coverage(self) -> float:
        """Share of baseline residual bytes some checkpoint_name selects."""
        total = self.residuals.total_bytes
        named = sum(r.bytes for r in self.residuals if r.name)
        return named / total if total else 0.0

    def bytes_by_name(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for v in self.values:
            out[v.name] += v.bytes
        return dict(out)


class ResidualNames(dict[str, str]):
    """``{instruction name: checkpoint_name}`` for a module's residuals, plus the names that are
    a ``jax.checkpoint``'s own input (:attr:`NameSite.of_input` at every site): policies can save
    or offload those, but not saving them makes JAX save the same input, so there is no remat."""

    def __init__(self, names: Mapping[str, str] | Iterable[tuple[str, str]] = (), *,
                 checkpoint_inputs: Iterable[str] = ()) -> None:
        super().__init__(names)
        self.checkpoint_inputs = frozenset(checkpoint_inputs)


def input_names(sites: Iterable[NameSite]) -> frozenset[str]:
    """Names every one of whose sites names a checkpoint's input."""
    by_name: dict[str, bool] = {}
    for s in sites:
        by_name[s.name] = by_name.get(s.name, True) and s.of_input
    return frozenset(n for n, v in by_name.items() if v)


def checkpoint_names(target: Any) -> list[NameSite]:
    """Every checkpoint_name call site in ``target``'s step (a :class:`hloopt.targets.Target`)."""
    import jax
    from jax._src import source_info_util

    from hloopt.frameworks import imported_by
    from hloopt.lowering import _code_of, framework_frames_skipped

    _check_jax_target(target)
    sites: dict[tuple[str, str, int], bool | None] = {}

    def walk(jaxpr: Any, inputs: set[Any] | None, outer: Any = None) -> None:
        # inputs: the enclosing checkpoint body's inputs (and their identities); None outside one.
        # outer: the user frame of the enclosing equation: a body traced later (a checkpoint's)
        # keeps only its own frames, which may all be a framework's
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            here = source_info_util.user_frame(eqn.source_info.traceback) or outer
            passes_input = inputs is not None and bool(eqn.invars) and _is_var_in(eqn.invars[0], inputs)
            if name == "name":
                frame = here
                key = (eqn.params["name"], frame.file_name if frame else "", frame.start_line if frame else 0)
                vote = sites.get(key)
                # Only the copies inside a checkpoint decide (differentiation also leaves the
                # primal computation outside it).
                sites[key] = vote if inputs is None else (passes_input if vote is None else vote and passes_input)
            if passes_input and name in _IDENTITY_PRIMITIVES:
                assert inputs is not None
                inputs.update(eqn.outvars)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    inner: Any = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        # A checkpoint's body starts from its own inputs; inside any other body
                        # nothing is known to be a checkpoint's input.
                        walk(inner, set(inner.invars) if name in _CHECKPOINT_PRIMITIVES
                             else (None if inputs is None else set()), here)

    # Located as lowering locates ops: a name called inside a framework (haliax names a scanned
    # layer's carry in haliax/nn/scan.py) is at the model's line that called the framework.
    with framework_frames_skipped(imported_by(_code_of(target))):
        closed = jax.make_jaxpr(target.step_fn)(*target.args, **dict(target.kwargs))
        walk(closed.jaxpr, None)
    return [NameSite(n, f, line, bool(of_input)) for (n, f, line), of_input in sites.items()]


#: jaxpr primitives of ``jax.checkpoint`` (``remat2`` in jax 0.4-0.10, ``checkpoint`` in newer)
_CHECKPOINT_PRIMITIVES = frozenset({"remat2", "checkpoint", "remat"})
#: primitives whose output is their first input's value (same bytes)
_IDENTITY_PRIMITIVES = frozenset({"name", "sharding_constraint", "copy", "copy_p", "mesh_cast", "reshard"})


def _is_var_in(v: Any, inputs: set[Any]) -> bool:
    try:
        return v in inputs
    except TypeError:  # a literal
        return False


def offload_all_policy(names: Sequence[str]) -> Any:
    import jax

    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host")


def lower_module(target: Any, *, policy: Any = None, platform: str = "tpu") -> Any:
    """The pre-optimization HLO module of ``target`` (optionally rebuilt with ``policy=``), its
    calls inlined as XLA inlines them: a layer the user wrapped in its own ``jax.jit``, or a
    ``shard_map`` body, is a ``call`` in JAX's text, and its residuals are the step's."""
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.passes.inline import inline_for_assignment

    lowered = lower(target, platform=platform, policy=policy)
    return inline_for_assignment(parse_module(lowered.hlo_text, filename=f"{target.name} (lowered)"))


def offload_policy(names: Sequence[str], *, base: Any = None) -> Any:
    """A policy that offloads ``names`` to pinned host and decides everything else as ``base``
    does (``None``: saves nothing else, :func:`offload_all_policy`)."""
    offload = offload_all_policy(names)
    if base is None:
        return offload
    chosen = frozenset(names)

    def policy(prim: Any, *args: Any, **params: Any) -> Any:
        if getattr(prim, "name", None) == "name" and params.get("name") in chosen:
            return offload(prim, *args, **params)
        return base(prim, *args, **params)

    return policy


def name_residuals(target: Any, *, baseline: ResidualSet | None = None, policy: Any = None,
                   platform: str = "tpu") -> NameProbe:
    """Residuals of ``target`` with names. ``baseline`` is the target lowered with ``policy``
    (``None``: its own policies); it is lowered here when not given."""
    _check_jax_target(target)
    if baseline is None:
        baseline = find_residuals(lower_module(target, policy=policy, platform=platform))
    sites = checkpoint_names(target)
    names = sorted({s.name for s in sites})
    if not names:
        return NameProbe(residuals=baseline, sites=(), values=())
    probe_set = find_residuals(lower_module(target, policy=offload_all_policy(names), platform=platform))
    by_line: dict[tuple[str, int], set[str]] = {}
    for s in sites:
        by_line.setdefault((_norm(s.file), s.line), set()).add(s.name)
    ambiguous = sorted({n for ns in by_line.values() if len(ns) > 1 for n in ns})

    probe_named: list[tuple[Residual, str]] = []
    single_values: list[tuple[Residual, str]] = []
    unnamed: list[Residual] = []
    for r in probe_set:
        if r.offloaded:
            name = _name_of(probe_set, r, by_line)
            (unnamed.append(r) if name is None else probe_named.append((r, name)))
    # Values the call site cannot name (a scan carry has no location; annotations inside a scan
    # carry the scan's line; two names called on one line): one more lowering per name left
    # over, offloading that name alone. What it offloads are the name's values; the baseline
    # residuals it moves (:func:`_moved_by`) are what the name selects. With the baseline lowered
    # under a known ``policy`` that comparison needs the probe to keep ``policy`` for everything
    # else: one lowering more.
    names_for: dict[str, str] = {}
    if unnamed:
        for n in [n for n in names if n not in {name for _, name in probe_named}]:
            single = find_residuals(lower_module(target, policy=offload_all_policy([n]), platform=platform))
            # look-alikes (two names called on one line, the same shape) go one to each name
            others = frozenset(names_for)
            moved = (_moved_by(baseline, single, taken=others) if policy is None else
                     moved_by_name(target, n, baseline, policy=policy, platform=platform, taken=others))
            for inst_name in moved:
                names_for.setdefault(inst_name, n)
            # a name whose moves the comparison found is settled; another's values (it moves
            # nothing with the baseline's policy, or moves what the comparison cannot match) are
            # matched by shape below, as the line-attributed ones are
            values_of_n = [(r, n) for r in single if r.offloaded]
            (single_values if moved else probe_named).extend(values_of_n)
    values = [NamedValue(name=name, dtype=r.dtype, per_layer_dims=r.per_layer_dims, layers=r.layers,
                         bytes=r.bytes, source=r.source_text) for r, name in probe_named + single_values]

    # The other residuals: those the all-names probe still keeps on device are not moved by any
    # name; the others take the probe value of the same producer and line, else the same shape.
    kept = Counter(_sig(r) for r in probe_set if not r.offloaded)
    taken: set[int] = set()
    pending: list[Residual] = []
    for r in baseline:
        sig = _sig(r)
        if kept[sig] > 0:
            kept[sig] -= 1
        elif r.inst.name not in names_for:
            pending.append(r)
    matched: frozenset[str] = frozenset(names_for)
    for same in (_sig, _shape_sig):  # the same producing op and line first, then the same shape
        for r in pending:
            if r.inst.name in names_for:
                continue
            for k, (p, name) in enumerate(probe_named):
                if k not in taken and same(p) == same(r):
                    names_for[r.inst.name] = name
                    taken.add(k)
                    break
        if same is _sig:
            matched = frozenset(names_for)  # the same producing op, line and shape
    return NameProbe(residuals=baseline.with_names(names_for), sites=tuple(sites), values=tuple(values),
                     ambiguous=tuple(ambiguous), diffed=matched)


def moved_by_name(target: Any, name: str, baseline: ResidualSet, *, policy: Any, platform: str,
                  taken: frozenset[str] = frozenset()) -> list[str]:
    """Residuals of ``baseline`` (``target`` lowered with ``policy``) that lowering it with
    ``name`` alone offloaded, everything else as ``policy`` decides, moves (:func:`_moved_by`)."""
    single = find_residuals(lower_module(target, policy=offload_policy([name], base=policy), platform=platform))
    return _moved_by(baseline, single, taken=taken)


def _moved_by(baseline: ResidualSet, single: ResidualSet, taken: frozenset[str] = frozenset()) -> list[str]:
    """Baseline residuals (instruction names) that a one-name probe ``single`` moves: the probe
    keeps fewer device residuals of their producer, line and shape than the baseline does, and
    offloads a value of that producer and line, else of that shape (only where there are at
    least as many such values as such vanished residuals: no guessing among look-alikes). A
    scan carry is a stacked ``get-tuple-element`` in both; with everything saved it is the
    ``checkpoint_name`` marker (``reduce-precision``) in the baseline and the offloaded stack's
    ``get-tuple-element`` in the probe, the same dtype, per-layer dims and layers. Residuals in
    ``taken`` (another name's) are not this probe's when a look-alike is left."""
    gone = (Counter(_sig(r) for r in baseline if not r.offloaded)
            - Counter(_sig(r) for r in single if not r.offloaded))
    vanished: list[Residual] = []
    free = Counter(_sig(r) for r in baseline if not r.offloaded and r.inst.name not in taken)
    for r in baseline:
        # a taken residual only where no untaken look-alike is left to stand for what vanished
        if r.inst.name in taken and free[_sig(r)] >= gone[_sig(r)]:
            continue
        if not r.offloaded and gone[_sig(r)] > 0:
            if r.inst.name not in taken:
                free[_sig(r)] -= 1
            gone[_sig(r)] -= 1
            vanished.append(r)
    moved = [r for r in single if r.offloaded]
    out: list[str] = []
    for same in (_sig, _shape_sig):
        left: dict[Any, list[Residual]] = {}
        for r in vanished:
            if r.inst.name not in out:
                left.setdefault(same(r), []).append(r)
        for key, rs in left.items():
            values = [m for m in moved if same(m) == key]
            if len(rs) <= len(values):
                out += [r.inst.name for r in rs]
                used = {id(m) for m in values[: len(rs)]}
                moved = [m for m in moved if id(m) not in used]
    return out


#: ops that pass a value on unchanged (looked through to find where a function first uses it)
_PASS_ON = frozenset({"bitcast", "reshape", "copy", "convert", "broadcast", "transpose", "get-tuple-element",
                      "reduce-precision", "opt-barrier", "optimization-barrier"})
#: users that store or carry a value rather than compute with it
_NOT_A_USE = frozenset({"dynamic-update-slice", "tuple", "custom-call", "while", "call", "parameter"})


def first_use_text(module: Any, r: Residual) -> str | None:
    """``file:line`` where the forward pass first computes with ``r`` (for a scan's stack, the
    value a loop iteration writes into it): for the argument of a checkpointed function, the
    function's first use of it, where a ``checkpoint_name`` would have to go."""
    from hloopt.passes.residuals import LIBRARY_PATHS

    value = r.producer if r.stacked else r.inst
    frontier, seen, uses = [value], {id(value)}, []
    while frontier:
        inst = frontier.pop()
        for u in inst.users:
            if id(u) in seen or u.parent is not value.parent:
                continue
            seen.add(id(u))
            if u.opcode in _PASS_ON:
                frontier.append(u)
            elif u.opcode not in _NOT_A_USE and (r.stacked or u.index < r.first_backward_use):
                uses.append(u)
    for u in sorted(uses, key=lambda u: u.index):
        loc = module.user_source_of(u, skip=LIBRARY_PATHS)
        if loc is not None:
            return f"{loc[0]}:{loc[1]}"  # as Residual.source_text writes its own
    return None


def checkpoint_inputs(target: Any, baseline: ResidualSet, *, platform: str = "tpu") -> dict[str, str | None]:
    """Residuals of ``baseline`` that JAX saves whatever the checkpoint policy, by instruction
    name, with where the forward pass first uses each (:func:`first_use_text`).

    A checkpointed function's arguments are what its backward pass recomputes from: JAX keeps
    them, and a policy decides only the values computed inside (a scan's per-layer carry, the
    output of one checkpointed layer entering the next). Told by lowering the step once more
    with every policy saving nothing (``nothing_saveable``): the residuals left under a
    checkpoint are those arguments; the baseline's residuals of the same producing op, line and
    shape are them. The way to let a policy move one is to name it inside the function, before
    its first use (``x = checkpoint_name(x, "layer_input")``): the recomputation then reads the
    named value, which a policy may offload, instead of the argument."""
    import jax

    from hloopt.passes.residuals import under_checkpoint

    bare = find_residuals(lower_module(target, policy=jax.checkpoint_policies.nothing_saveable, platform=platform))
    left = Counter(_sig(r) for r in bare if not r.offloaded and under_checkpoint(r))
    out: dict[str, str | None] = {}
    for r in baseline:
        if not r.offloaded and left[_sig(r)] > 0:
            left[_sig(r)] -= 1
            out[r.inst.name] = first_use_text(baseline.module, r)
    return out


@dataclass(frozen=True)
class TargetResiduals:
    """What ``hloopt residuals`` shows: the residuals, names if known, and the peak they share."""

    residuals: ResidualSet
    probe: NameProbe | None
    #: top-level packages the target's factory uses (hloopt.frameworks.imported_by)
    imports: frozenset[str]
    #: peak device bytes from the memory model (None when it could not run)
    peak_bytes: int | None
    #: what the peak counts (hloopt analyze's profile for the platform: a TPU prediction for TPU)
    peak_source: str = "hloopt memory model"
    #: residuals saved whatever the policy (checkpointed functions' arguments), by instruction
    #: name, with where the forward pass first uses each (:func:`checkpoint_inputs`)
    inputs: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def coverage(self) -> float | None:
        return self.probe.coverage if self.probe is not None else None

    def unmovable_line(self) -> str | None:
        """For a step without checkpointing: its residual bytes and the framework's switch."""
        from hloopt.pipeline import unmovable_residuals_line

        return unmovable_residuals_line(self.residuals, imports=self.imports)

    def input_slices_line(self) -> str | None:
        """For a loop that slices the step's inputs outside its checkpoint: the bytes saved twice
        and what to change (:func:`hloopt.passes.residuals.input_slice_residuals`)."""
        from hloopt.passes.residuals import input_slice_residuals
        from hloopt.units import format_bytes

        rs = input_slice_residuals(self.residuals)
        if not rs:
            return None
        where = sorted({r.source_text for r in rs if r.source_text})
        return (f"{format_bytes(sum(r.bytes for r in rs))} of residuals are a loop's slices of the step's own inputs"
                + (f" (at {', '.join(where)})" if where else "")
                + ", saved for the backward pass as a second copy: slice inside the function given to "
                  "jax.checkpoint (pass it the whole stack and the index) and the backward pass reads the inputs")


def residuals_of(target: str, *, size: str | None = None, platform: str = "tpu", names: bool = True) -> TargetResiduals:
    """Resolve ``target``; HLO files and dumps are read as they are (no jax), JAX targets are lowered
    (pre-optimization) and, with ``names``, named by :func:`name_residuals`."""
    from hloopt.hlo.parser import parse_module
    from hloopt.targets import resolve

    tgt = resolve(target, size=size)
    if tgt.kind == "jax":
        module = lower_module(tgt, platform=platform)
    else:
        assert tgt.text is not None
        module = parse_module(tgt.text, filename=str(tgt.path or target))
    rs = find_residuals(module)
    probe = name_residuals(tgt, baseline=rs, platform=platform) if names and tgt.kind == "jax" else None
    if probe is not None:
        rs = probe.residuals
    from hloopt.frameworks import imported_by

    imports = frozenset(imported_by(tgt.factory)) if tgt.factory is not None else frozenset()
    peak, source = _peak(module, platform=platform)
    inputs = checkpoint_inputs(tgt, rs, platform=platform) if names and tgt.kind == "jax" else {}
    return TargetResiduals(residuals=rs, probe=probe, imports=imports, peak_bytes=peak, peak_source=source,
                           inputs=inputs)


#: what each kind of hloopt analyze's profile counts (hloopt.analysis.settings_for)
_PEAK_SOURCES = {
    "tpu-predicted": "hloopt memory model: analyze's TPU prediction of libtpu's peak_memory_in_bytes",
    "tpu-compiled": "hloopt memory model: libtpu's accounting of the compiled module",
    "compiled": "hloopt memory model: no-fragmentation peak of the module's schedule",
    "unoptimized": "hloopt memory model: no-fragmentation peak of the text order",
}


def _peak(module: Any, *, platform: str | None) -> tuple[int | None, str]:
    """The peak ``hloopt analyze --platform PLATFORM`` reports for ``module`` (on a copy: a TPU
    prediction tiles shapes in place), and what it counts."""
    from hloopt.analysis import profile_module
    from hloopt.hlo.parser import parse_module
    from hloopt.hlo.printer import print_module

    try:
        copy = parse_module(print_module(module), filename=module.filename)
        prof, settings = profile_module(copy, platform=platform)
    except Exception:  # the memory model is another analysis; its failure must not hide residuals
        return None, "memory model failed"
    return int(prof.peak_bytes), _PEAK_SOURCES.get(settings["kind"], "hloopt memory model")


def _name_of(rs: ResidualSet, r: Residual, by_line: dict[tuple[str, int], set[str]]) -> str | None:
    from hloopt.passes.residuals import LIBRARY_PATHS

    locs = []
    if r.offload_marker is not None:
        locs.append(rs.module.user_source_of(r.offload_marker, skip=LIBRARY_PATHS))
    locs.append(r.source)
    for loc in locs:
        if loc is None:
            continue
        ns = by_line.get((_norm(loc[0]), loc[1]))
        if ns and len(ns) == 1:
            return next(iter(ns))
    return None


def _norm(path: str) -> str:
    """Compare paths by their last two components (HLO metadata may be relative or normalized)."""
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def _shape_sig(r: Residual) -> tuple[str, tuple[int, ...], int]:
    return (r.dtype, r.per_layer_dims, r.layers)


def _sig(r: Residual) -> tuple[Any, ...]:
    return (*_shape_sig(r), r.primitive, r.source_text)


def _check_jax_target(target: Any) -> None:
    from hloopt.targets import Target

    if not isinstance(target, Target) or target.kind != "jax":
        kind = getattr(target, "kind", type(target).__name__)
        raise UserError(f"naming residuals needs a JAX TARGET (file.py:factory), not {kind}: "
                        "checkpoint_name leaves no trace in HLO")


def loss_function(target: Any) -> Any:
    """The ``loss_fn(params, batch)`` inside a zoo-style train step (``_common.train_step``).

    Found in the step's closure (``loss_fn``), looking through wrappers that close over an
    ``inner`` step (the sharded zoo model). For :func:`jax_saved_residuals`.
    """
    _check_jax_target(target)
    fn = target.step_fn
    for _ in range(4):
        cells = {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())}
        if "loss_fn" in cells:
            return cells["loss_fn"]
        nxt = next((v for v in cells.values() if callable(v) and hasattr(v, "__code__")
                    and "loss_fn" in v.__code__.co_freevars), None)
        if nxt is None:
            break
        fn = nxt
    raise UserError(f"{target.name}: no loss_fn in the step's closure (expected a train_step(loss_fn, ...))")


def jax_saved_residuals(target: Any) -> list[tuple[Any, str]]:
    """``jax._src.ad_checkpoint.saved_residuals`` of the target's loss w.r.t. (params, batch)."""
    from jax._src.ad_checkpoint import saved_residuals

    loss = loss_function(target)
    params, _opt_state, batch = target.args
    return saved_residuals(loss, params, batch)


def jax_bytes_by_name(saved: Iterable[tuple[Any, str]]) -> dict[str, int]:
    """Bytes per checkpoint_name in a saved_residuals list (``named 'x' from ...`` entries)."""
    import re

    out: Counter[str] = Counter()
    for aval, desc in saved:
        m = re.match(r"named '([^']+)'", desc)
        if m:
            out[m.group(1)] += int(aval.size) * aval.dtype.itemsize
    return dict(out)


__all__ = ["NameProbe", "NameSite", "NamedValue", "ResidualNames", "input_names", "TargetResiduals", "residuals_of",
           "checkpoint_names", "jax_bytes_by_name", "jax_saved_residuals",
           "loss_function", "lower_module", "name_residuals", "offload_all_policy"]
