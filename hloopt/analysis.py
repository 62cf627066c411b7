"""``analyze``: what fills device memory in one step: the library behind ``hloopt analyze``.

``analyze(TARGET)`` resolves a TARGET (an HLO file, an XLA dump, or a JAX program), gets HLO
(lowered, or compiled with ``compile=``), and runs :class:`~hloopt.passes.memory.PeakMemory`
with the settings that reproduce how the module's compiler counts:

* a scheduled module with TPU tiled layouts (libtpu output): libtpu's ``peak_memory_in_bytes``
  accounting (512-byte aligned buffers, outputs and constants for the whole program, temporaries
  inside output allocations when XLA puts them there, the larger of the HBM and VMEM heaps, no
  generated code; see :mod:`hloopt.passes.memory`);
* any other scheduled module (XLA CPU/GPU output): the module's schedule, exact sizes;
* a pre-optimization module: ``platform="tpu"`` inlines calls (XLA's CallInliner, as the
  planner does), models XLA's fusion of cheap ops, TPU tiling, libtpu's placement of
  temporaries inside output allocations, its memory-space assignment into VMEM and its copy back
  of offloaded values right after the offload, over a memory-aware list schedule: a prediction
  of libtpu's ``peak_memory_in_bytes``, with :func:`prediction_notes` naming what it does not
  cover in this module; other platforms use text order.

HLO files and dumps never import jax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from hloopt.errors import UserError
from hloopt.ir import HOST_MEMORY_SPACE, Instruction, Module
from hloopt.passes import AnalysisManager
from hloopt.passes.fusion_model import host_stack_updates
from hloopt.passes.liveness import Liveness
from hloopt.passes.memory import MemoryProfile, PeakMemory
from hloopt.passes.residuals import is_host_annotation


@dataclass(eq=False)
class MemoryReport:
    """What ``hloopt analyze`` prints."""

    module: str
    #: "hlo", "lowered:<platform>" or "compiled:<target>"
    source: str
    profile: MemoryProfile
    #: the compiler's memory_analysis() figures when compiled here, or from a snapshot's JSON
    xla: Mapping[str, int] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    #: what the reader should know about the figures (a TPU prediction's known blind spots)
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return self.profile.peak_bytes

    def to_json(self) -> dict[str, Any]:
        p = self.profile
        inst = p.peak_instruction
        out: dict[str, Any] = {
            "module": self.module,
            "source": self.source,
            "peak_bytes": p.peak_bytes,
            "peak_at": {"index": p.peak_step, "instruction": inst.name,
                        "computation": inst.parent.name if inst.parent is not None else "",
                        "entry_index": p.ranges.entry_step[p.peak_step]},
            "argument_bytes": p.argument_bytes,
            "output_bytes": p.output_bytes,
            "host_bytes": p.host_bytes,
            "static_bytes": p.static_bytes,
            "code_bytes": p.code_bytes,
            "num_steps": len(p.timeline_bytes),
            "categories": p.categories,
            "live_at_peak": [b.to_json() for b in p.top],
            "settings": self.settings,
            "notes": list(self.notes),
        }
        if self.xla is not None:
            out["xla"] = dict(self.xla)
        return out


def settings_for(module: Module, *, platform: str | None = None, schedule: str | None = None,
                 code_bytes: int = 0) -> dict[str, Any]:
    """The PeakMemory settings that match how the module's compiler counts (module docstring)."""
    tpu_layout = module.is_scheduled and _has_tiles(module)
    plain = {"reuse_output_allocations": False, "on_chip_heap": False, "prefetch_at_offload": False}
    if tpu_layout:
        # libtpu's peak_memory_in_bytes leaves the generated code out (see PeakMemory)
        return {"kind": "tpu-compiled", "schedule": schedule or "module", "materialize": "all",
                "alignment_bytes": 512, "outputs_whole_program": True, "static_allocations": True,
                "code_bytes": 0, "reuse_output_allocations": True, "on_chip_heap": True,
                "prefetch_at_offload": False}
    if module.is_scheduled:
        return {"kind": "compiled", "schedule": schedule or "module", "materialize": "all",
                "alignment_bytes": 0, "outputs_whole_program": False, "static_allocations": False,
                "code_bytes": code_bytes, **plain}
    if platform == "tpu":
        # libtpu's accounting as on a compiled module, on the fusion model's buffers, in a
        # memory-aware order (XLA schedules a pre-optimization module; its text order is JAX's)
        return {"kind": "tpu-predicted", "schedule": schedule or "list", "materialize": "tpu-fusion",
                "alignment_bytes": 512, "outputs_whole_program": True, "static_allocations": False,
                "code_bytes": code_bytes, "reuse_output_allocations": True, "on_chip_heap": True,  # predicted MSA
                "prefetch_at_offload": True,  # libtpu's schedule of offloads (passes/memory.py)
                "narrow_stacks": True}  # bf16 scan stacks (passes/fusion_model.py)
    return {"kind": "unoptimized", "schedule": schedule or "module", "materialize": "all",
            "alignment_bytes": 0, "outputs_whole_program": False, "static_allocations": False,
            "code_bytes": code_bytes, **plain}


def profile_module(module: Module, *, platform: str | None = None, schedule: str | None = None,
                   code_bytes: int = 0, top: int = 10, on_chip_bytes: int | None = None,
                   off_device: frozenset[str] = frozenset(), prefetch_at_offload: bool | None = None,
                   am: AnalysisManager | None = None) -> tuple[MemoryProfile, dict[str, Any]]:
    """Run PeakMemory on ``module`` with :func:`settings_for`'s settings (``prefetch_at_offload``
    overrides theirs). For a TPU prediction the profile counts the module
    :func:`prepare_for_profile` makes (``profile.ranges.module``)."""
    s = settings_for(module, platform=platform, schedule=schedule, code_bytes=code_bytes)
    if prefetch_at_offload is not None:
        s["prefetch_at_offload"] = prefetch_at_offload
    module, am = prepare_for_profile(module, s, am=am)
    prof = am.get(peak_memory_pass(s, top=top, on_chip_bytes=on_chip_bytes, off_device=off_device))
    return prof, s


def prepare_for_profile(module: Module, settings: Mapping[str, Any], *,
                        am: AnalysisManager | None = None) -> tuple[Module, AnalysisManager]:
    """The module :func:`peak_memory_pass` counts with ``settings``, and its analysis manager.

    A TPU prediction (kind ``tpu-predicted``) counts a new module: ``module`` with its calls
    inlined (as XLA does before it assigns buffers), TPU's default tiles on its shapes (in place
    on ``module`` when it has no calls) and its instructions written in the memory-aware list
    schedule's order (:func:`~hloopt.passes.schedule.in_schedule_order`), so that the steps of the
    profile are the module's text order: what the planner builds its steps from
    (:func:`hloopt.pipeline.analyze_module`). Other kinds count ``module`` itself."""
    if settings["kind"] == "tpu-predicted":
        from hloopt.passes.inline import inline_for_assignment
        from hloopt.passes.schedule import Schedule, in_schedule_order

        inlined = inline_for_assignment(module)  # as XLA does before it assigns buffers (and the planner)
        if inlined is not module:
            module, am = inlined, None
        _apply_tpu_tiling(module)
        am = None  # shapes changed: analyses cached on the module are stale
        if settings["schedule"] != "module":
            order = Schedule(kind=settings["schedule"]).run(module, AnalysisManager(module))
            module = in_schedule_order(module, order)
    elif settings["kind"] == "unoptimized" and _place_annotated_on_host(module):
        am = None  # shapes changed: analyses cached on the module are stale
    return module, am or AnalysisManager(module)


def peak_memory_pass(settings: Mapping[str, Any], *, top: int = 10, on_chip_bytes: int | None = None,
                     off_device: frozenset[str] = frozenset()) -> PeakMemory:
    """The PeakMemory analysis ``settings`` describe, for the module :func:`prepare_for_profile`
    returns (a TPU prediction's list schedule is that module's text order by then)."""
    s = settings
    schedule = "module" if s["kind"] == "tpu-predicted" else s["schedule"]
    live = Liveness(schedule=schedule, materialize=s["materialize"], alignment_bytes=s["alignment_bytes"],
                    narrow_stacks=bool(s.get("narrow_stacks", False)))
    return PeakMemory(liveness=live, top=top, outputs_whole_program=s["outputs_whole_program"],
                      static_allocations=s["static_allocations"], code_bytes=s["code_bytes"],
                      reuse_output_allocations=s["reuse_output_allocations"],
                      on_chip_heap=s["on_chip_heap"], off_device=off_device,
                      prefetch_at_offload=s["prefetch_at_offload"],
                      **({} if on_chip_bytes is None else {"on_chip_bytes": on_chip_bytes}))


def analyze(target: str | Path | Module, *, platform: str | None = None, compile: str | None = None,
            top: int = 10, schedule: str | None = None, size: str | None = None,
            xla: Mapping[str, int] | None = None) -> MemoryReport:
    """Analyze a TARGET (path or string), or a parsed :class:`Module` (see the module docstring).

    ``platform`` is what pre-optimization HLO is lowered for / predicted for ("tpu", "cuda",
    "cpu"); ``compile`` compiles a JAX TARGET with XLA ("cpu", "tpu-v5e"...) and analyzes the
    compiled module, with XLA's own figures in ``report.xla``.
    """
    from hloopt.hlo.parser import parse_module

    if isinstance(target, Module):
        prof, s = profile_module(target, platform=platform, schedule=schedule, top=top,
                                 code_bytes=_code(xla))
        return MemoryReport(target.name, "hlo", prof, xla, s, prediction_notes(prof, s))
    from hloopt.targets import resolve

    t = resolve(str(target), size=size)
    if t.kind != "jax":
        if compile is not None:
            raise UserError(f"{target}: --compile applies to a JAX TARGET; this is HLO already")
        assert t.text is not None
        module = parse_module(t.text, filename=str(t.path))
        xla = xla if xla is not None else _snapshot_figures(t.path)
        prof, s = profile_module(module, platform=platform, schedule=schedule, top=top, code_bytes=_code(xla))
        return MemoryReport(module.name, "hlo", prof, xla, s, prediction_notes(prof, s))

    from hloopt.lowering import lower

    plat = platform or ("tpu" if compile and compile.startswith("tpu") else "cpu" if compile == "cpu" else "tpu")
    lowered = lower(t, platform=plat, compile=compile)
    if compile is None:
        module = parse_module(lowered.hlo_text, filename=str(target))
        prof, s = profile_module(module, platform=plat, schedule=schedule, top=top)
        return MemoryReport(module.name, f"lowered:{plat}", prof, None, s, prediction_notes(prof, s))
    assert lowered.compiled_text is not None
    module = parse_module(lowered.compiled_text, filename=str(target))
    figures = dict(lowered.memory or {})
    prof, s = profile_module(module, platform=plat, schedule=schedule, top=top, code_bytes=_code(figures))
    return MemoryReport(module.name, f"compiled:{compile}", prof, figures, s)


def prediction_notes(prof: MemoryProfile, settings: Mapping[str, Any]) -> list[str]:
    """Known blind spots of a TPU prediction that apply to this module (passes/memory.py)."""
    if settings.get("kind") != "tpu-predicted":
        return []
    from hloopt.passes.residuals import offloaded_source

    notes: list[str] = []
    steps = prof.ranges.steps
    narrow = sum(1 for i in steps if i.opcode == "convolution" and 1 <= (_conv_batch(i) or 0) < 8)
    if narrow:
        notes.append(f"{narrow} convolution(s) over a batch smaller than 8: libtpu may rewrite them (0b1f); "
                     "the prediction models the values it copies between layouts (measured on such "
                     "convnets: -32% to +7%, bench/convnet_shapes.py)")
    eager = sum(1 for i in steps if offloaded_source(i) is not None)
    if eager:
        notes.append(f"{eager} value(s) offloaded outside a loop: libtpu copies them back right after "
                     "offloading them, so they are counted on the device throughout (no HBM saved)")
    return notes


def _conv_batch(inst: Instruction) -> int | None:
    """The batch of a convolution over activations (``dim_labels`` ``b01f_...``), else None."""
    labels = inst.attrs.get("dim_labels", "")
    lhs = labels.split("_")[0] if "_" in labels else ""
    if not lhs.startswith("b") or not inst.operands or len(inst.operands[0].shape.dims) != len(lhs):
        return None
    return inst.operands[0].shape.dims[lhs.index("b")]


def _code(xla: Mapping[str, int] | None) -> int:
    return int(xla.get("generated_code_size_in_bytes", 0)) if xla else 0


def _snapshot_figures(path: Path | None) -> dict[str, int] | None:
    """A snapshot's ``.json`` beside its ``.hlo`` (fixtures/hlo/zoo), when there is one."""
    if path is None:
        return None
    side = path.with_suffix(".json")
    if not side.is_file():
        return None
    import json

    try:
        data = json.loads(side.read_text())
    except ValueError:
        return None
    mem = data.get("memory") if isinstance(data, dict) else None
    return {k: int(v) for k, v in mem.items()} if isinstance(mem, dict) else None


def _has_tiles(module: Module) -> bool:
    if module.entry_layout is not None:
        params, result = module.entry_layout
        for s in [*params, result]:
            for _, leaf in s.leaves():
                if leaf.layout is not None and leaf.layout.tiles:
                    return True
    return False


def _apply_tpu_tiling(module: Module) -> None:
    """Give the layout-less shapes of a pre-optimization module TPU's default tiles (in place),
    and put what JAX offloads in host memory (``S(5)``) as XLA's host offloader will: a
    ``pinned_host`` annotation's value, and a dynamic-update-slice that writes one (through
    reshapes) into a scan's stack, whose loop-state buffer is then host memory
    (:mod:`hloopt.passes.aliasing`)."""
    from hloopt.ir import Layout, Shape

    cache: dict[Shape, Shape] = {}

    def tiled(s: Shape) -> Shape:
        got = cache.get(s)
        if got is not None:
            return got
        if s.is_tuple:
            got = Shape("tuple", tuple_shapes=tuple(tiled(x) for x in s.tuple_shapes))
        elif not s.is_array or (s.layout is not None and s.layout.tiles):
            got = s
        else:
            rank = len(s.dims)
            m2m = s.layout.minor_to_major if s.layout is not None and s.layout.minor_to_major \
                else tuple(range(rank - 1, -1, -1))
            tiles = ((8, 128),) if rank >= 2 else ((128,),)
            space = s.layout.memory_space if s.layout is not None else 0
            got = Shape(s.element_type, s.dims, s.dynamic, Layout(m2m, tiles, memory_space=space))
        cache[s] = got
        return got

    for inst in module.instructions():
        inst.shape = tiled(inst.shape)  # keeps the memory space a stack update below was given
        if is_host_annotation(inst):
            _to_host(inst)
            # XLA's host offloader writes the value into a host buffer: a scan's stacked residual
            # (the loop state these update) is allocated in host memory
            for update in host_stack_updates(inst)[0]:
                _to_host(update)


def _place_annotated_on_host(module: Module) -> bool:
    """Put the value of every ``pinned_host`` annotation in host memory (``S(5)``), as written
    (in place; for a module analyzed as it is: the annotation's result is a host array). Returns
    whether any shape changed."""
    changed = False
    for inst in module.instructions():
        if is_host_annotation(inst) and inst.shape.is_array and not inst.shape.on_host:
            _to_host(inst)
            changed = True
    return changed


def _to_host(inst: Instruction) -> None:
    """Give ``inst``'s array shape host memory space (``S(5)``), keeping its layout (in place)."""
    from hloopt.ir import Layout, Shape

    shape = inst.shape
    if not shape.is_array:
        return
    lay = shape.layout
    m2m = lay.minor_to_major if lay is not None else tuple(range(len(shape.dims) - 1, -1, -1))
    tiles = lay.tiles if lay is not None else ()
    inst.shape = Shape(shape.element_type, shape.dims, shape.dynamic,
                       Layout(m2m, tiles, memory_space=HOST_MEMORY_SPACE))


__all__ = ["MemoryReport", "analyze", "peak_memory_pass", "prediction_notes", "prepare_for_profile", "profile_module",
           "settings_for"]
