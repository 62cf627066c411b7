"""``analyze``: what fills device memory in one step: the library behind ``hloopt analyze``.

``analyze(TARGET)`` resolves a TARGET (an HLO file, an XLA dump, or a JAX program), gets HLO
(lowered, or compiled with ``compile=``), and runs :class:`~hloopt.passes.memory.PeakMemory`
with the settings that reproduce how the module's compiler counts:

* a scheduled module with TPU tiled layouts (libtpu output): libtpu's ``peak_memory_in_bytes``
  accounting (512-byte aligned buffers, outputs and constants for the whole program, temporaries
  inside output allocations when XLA puts them there (libtpu up to 0.0.45: the rules follow the
  release the user compiles with, :func:`target_libtpu`), the larger of the HBM and VMEM heaps, no
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

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from hloopt.errors import UserError
from hloopt.ir import Instruction, Module, gc_paused
from hloopt.passes import AnalysisManager
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
    #: what the reader should know: what the step itself could change (:func:`step_notes`), then
    #: a TPU prediction's known blind spots (:func:`prediction_notes`)
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


#: the environment variable naming the libtpu release a TPU accounting describes
LIBTPU_ENV = "HLOOPT_LIBTPU"


def target_libtpu(explicit: str | None = None) -> str:
    """The libtpu release whose rules a TPU accounting applies (:mod:`hloopt.passes.tpu.versions`):
    ``explicit``, else the one :func:`libtpu_rules` holds, else ``$HLOOPT_LIBTPU``, else the
    installed libtpu (what a compile here uses), else the one the installed jax pins for
    ``jax[tpu]``, else 0.0.42 (jax 0.10.2's pin)."""
    import os

    from hloopt.passes.tpu.versions import parse_version

    for value, where in ((explicit, "--libtpu"), (_LIBTPU_RULES.get(), "--libtpu"),
                         (os.environ.get(LIBTPU_ENV), f"${LIBTPU_ENV}")):
        if value:
            if parse_version(value) is None:
                raise UserError(f"{where}={value!r}: not a libtpu version (e.g. 0.0.42, 0.0.52)")
            return value.strip()
    return _installed_libtpu()


_INSTALLED: list[str] = []
_LIBTPU_RULES: contextvars.ContextVar[str | None] = contextvars.ContextVar("hloopt_libtpu", default=None)


@contextlib.contextmanager
def libtpu_rules(version: str | None) -> Iterator[None]:
    """Within the block, TPU accountings that are not told a release follow ``version``'s rules
    (None: as outside it). What ``--libtpu`` does for a command."""
    if version is not None:
        from hloopt.passes.tpu.versions import parse_version

        if parse_version(version) is None:
            raise UserError(f"--libtpu={version!r}: not a libtpu version (e.g. 0.0.42, 0.0.52)")
    token = _LIBTPU_RULES.set(version.strip() if version else _LIBTPU_RULES.get())
    try:
        yield
    finally:
        _LIBTPU_RULES.reset(token)


def _installed_libtpu() -> str:
    if not _INSTALLED:
        import re
        from importlib import metadata

        from hloopt.passes.tpu.versions import parse_version

        found = None
        try:
            found = metadata.version("libtpu")
        except metadata.PackageNotFoundError:
            try:
                for req in metadata.requires("jax") or []:
                    m = re.match(r"\s*libtpu\s*==\s*([0-9.]+)", req)
                    if m:
                        found = m.group(1)
                        break
            except metadata.PackageNotFoundError:
                pass
        _INSTALLED.append(found if found and parse_version(found) is not None else "0.0.42")
    return _INSTALLED[0]


def settings_for(module: Module, *, platform: str | None = None, schedule: str | None = None,
                 code_bytes: int = 0, libtpu: str | None = None) -> dict[str, Any]:
    """The PeakMemory settings that match how the module's compiler counts (module docstring).
    TPU accountings follow the rules of libtpu release ``libtpu`` (:func:`target_libtpu`)."""
    from hloopt.passes.tpu.versions import reuses_output_allocations

    tpu_layout = module.is_scheduled and _has_tiles(module)
    plain = {"reuse_output_allocations": False, "on_chip_heap": False, "prefetch_at_offload": False}
    version = target_libtpu(libtpu) if tpu_layout or (not module.is_scheduled and platform == "tpu") else ""
    reuse = bool(version) and reuses_output_allocations(version)
    if tpu_layout:
        # libtpu's peak_memory_in_bytes leaves the generated code out (see PeakMemory)
        return {"kind": "tpu-compiled", "libtpu": version, "schedule": schedule or "module",
                "materialize": "all", "alignment_bytes": 512, "outputs_whole_program": True,
                "static_allocations": True, "code_bytes": 0, "reuse_output_allocations": reuse,
                "on_chip_heap": True, "prefetch_at_offload": False, "share_dying_operands": True}
    if module.is_scheduled:
        return {"kind": "compiled", "schedule": schedule or "module", "materialize": "all",
                "alignment_bytes": 0, "outputs_whole_program": False, "static_allocations": False,
                "code_bytes": code_bytes, **plain}
    if platform == "tpu":
        # libtpu's accounting as on a compiled module, on the fusion model's buffers, in a
        # memory-aware order (XLA schedules a pre-optimization module; its text order is JAX's)
        return {"kind": "tpu-predicted", "libtpu": version, "schedule": schedule or "list",
                "materialize": "tpu-fusion", "alignment_bytes": 512, "outputs_whole_program": True,
                "static_allocations": False, "code_bytes": code_bytes,
                "reuse_output_allocations": reuse, "on_chip_heap": True,  # predicted MSA
                "prefetch_at_offload": True,  # libtpu's schedule of offloads (passes/memory.py)
                "narrow_stacks": True}  # bf16 scan stacks (passes/tpu/storage.py)
    return {"kind": "unoptimized", "schedule": schedule or "module", "materialize": "all",
            "alignment_bytes": 0, "outputs_whole_program": False, "static_allocations": False,
            "code_bytes": code_bytes, **plain}


@gc_paused()  # builds millions of long-lived objects (hloopt.ir.gc_paused)
def profile_module(module: Module, *, platform: str | None = None, schedule: str | None = None,
                   code_bytes: int = 0, top: int = 10, on_chip_bytes: int | None = None,
                   off_device: frozenset[str] = frozenset(), prefetch_at_offload: bool | None = None,
                   am: AnalysisManager | None = None,
                   libtpu: str | None = None) -> tuple[MemoryProfile, dict[str, Any]]:
    """Run PeakMemory on ``module`` with :func:`settings_for`'s settings (``prefetch_at_offload``
    overrides theirs). For a TPU prediction the profile counts the module
    :func:`prepare_for_profile` makes (``profile.ranges.module``)."""
    s = settings_for(module, platform=platform, schedule=schedule, code_bytes=code_bytes, libtpu=libtpu)
    if prefetch_at_offload is not None:
        s["prefetch_at_offload"] = prefetch_at_offload
    module, am = prepare_for_profile(module, s, am=am)
    prof = am.get(peak_memory_pass(s, top=top, on_chip_bytes=on_chip_bytes, off_device=off_device))
    return prof, s


def prepare_for_profile(module: Module, settings: Mapping[str, Any], *, am: AnalysisManager | None = None,
                        owned: bool = False) -> tuple[Module, AnalysisManager]:
    """The module :func:`peak_memory_pass` counts with ``settings``, and its analysis manager.

    A TPU prediction (kind ``tpu-predicted``) counts a new module: ``module`` with its calls
    inlined (as XLA does before it assigns buffers), TPU's default tiles on its shapes
    (:func:`~hloopt.passes.tpu.layout.assign_tpu_layouts`) and its instructions written in the memory-aware list
    schedule's order (:func:`~hloopt.passes.schedule.in_schedule_order`), so that the steps of the
    profile are the module's text order: what the planner builds its steps from
    (:func:`hloopt.pipeline.analyze_module`). Other kinds count ``module`` itself. ``owned``: the
    caller built ``module`` and holds it nowhere else, so it need not be copied again."""
    if settings["kind"] == "tpu-predicted":
        from hloopt.passes.inline import inline_for_assignment
        from hloopt.passes.schedule import Schedule, in_schedule_order
        from hloopt.passes.tpu.layout import assign_tpu_layouts

        inlined = inline_for_assignment(module)  # as XLA does before it assigns buffers (and the planner)
        # a new module (call inlining's copy is not copied again): analyses cached on the old one do not apply
        module = assign_tpu_layouts(inlined, owned=owned or inlined is not module)
        am = None
        if settings["schedule"] == "list":
            from hloopt.passes.aliasing import control_flow_computations
            from hloopt.passes.schedule import ScheduleResult, list_schedule
            from hloopt.passes.tpu import TpuFusion

            # scheduled as libtpu's scheduler sees the module: after fusion, where a value
            # computed inside its readers allocates nothing and its operands live until they run
            fusion_am = AnalysisManager(module)
            fused = fusion_am.get(TpuFusion()).fused
            # only the computations that hold storage: the order of a reducer's or a fusion
            # body's instructions allocates nothing (they keep their text order)
            order = ScheduleResult("list", {c: list_schedule(c, fused) for c in control_flow_computations(module)})
            scheduled = in_schedule_order(module, order, owned=True)
            if scheduled is module:
                # reordered where it is: the same instructions and dataflow, and the fusion
                # model's plan depends on nothing else, so it holds for the profile too
                am = fusion_am
            module = scheduled
        elif settings["schedule"] != "module":
            order = Schedule(kind=settings["schedule"]).run(module, AnalysisManager(module))
            # the layouts' module is always this call's own (a copy, or the caller's owned one)
            module = in_schedule_order(module, order, owned=True)
    elif settings["kind"] == "unoptimized":
        placed = _place_annotated_on_host(module)
        if placed is not module:
            module, am = placed, None
    return module, am or AnalysisManager(module)


def compiler_model(settings: Mapping[str, Any]) -> Any:
    """The model of the target compiler's fusion and buffer sizes liveness counts with under
    ``settings`` (``materialize``): libtpu's (:class:`~hloopt.passes.tpu.TpuFusion`) for a TPU
    prediction, none where every instruction is a buffer as written (compiled modules)."""
    if settings["materialize"] == "all":
        return None
    if settings["materialize"] == "tpu-fusion":
        from hloopt.passes.tpu import TpuFusion

        return TpuFusion(narrow_stacks=bool(settings.get("narrow_stacks", False)))
    raise UserError(f"unknown materialize {settings['materialize']!r}: expected 'all' or 'tpu-fusion'")


def peak_memory_pass(settings: Mapping[str, Any], *, top: int = 10, on_chip_bytes: int | None = None,
                     off_device: frozenset[str] = frozenset()) -> PeakMemory:
    """The PeakMemory analysis ``settings`` describe, for the module :func:`prepare_for_profile`
    returns (a TPU prediction's list schedule is that module's text order by then)."""
    s = settings
    schedule = "module" if s["kind"] == "tpu-predicted" else s["schedule"]
    live = Liveness(schedule=schedule, fusion=compiler_model(s), alignment_bytes=s["alignment_bytes"])
    return PeakMemory(liveness=live, top=top, outputs_whole_program=s["outputs_whole_program"],
                      static_allocations=s["static_allocations"], code_bytes=s["code_bytes"],
                      reuse_output_allocations=s["reuse_output_allocations"],
                      on_chip_heap=s["on_chip_heap"], off_device=off_device,
                      prefetch_at_offload=s["prefetch_at_offload"],
                      share_dying_operands=s.get("share_dying_operands", False),
                      **({} if on_chip_bytes is None else {"on_chip_bytes": on_chip_bytes}))


def analyze(target: str | Path | Module, *, platform: str | None = None, compile: str | None = None,
            top: int = 10, schedule: str | None = None, size: str | None = None,
            xla: Mapping[str, int] | None = None, libtpu: str | None = None) -> MemoryReport:
    """Analyze a TARGET (path or string), or a parsed :class:`Module` (see the module docstring).

    ``platform`` is what pre-optimization HLO is lowered for / predicted for ("tpu", "cuda",
    "cpu"); ``compile`` compiles a JAX TARGET with XLA ("cpu", "tpu-v5e"...) and analyzes the
    compiled module, with XLA's own figures in ``report.xla``. ``libtpu``: the release whose rules
    a TPU accounting follows (:func:`target_libtpu`: by default the installed one).
    """
    from hloopt.hlo.parser import parse_module

    if isinstance(target, Module):
        prof, s = profile_module(target, platform=platform, schedule=schedule, top=top,
                                 code_bytes=_code(xla), libtpu=libtpu)
        return MemoryReport(target.name, "hlo", prof, xla, s, step_notes(prof) + prediction_notes(prof, s))
    from hloopt.targets import resolve

    t = resolve(str(target), size=size)
    if t.kind != "jax":
        if compile is not None:
            raise UserError(f"{target}: --compile applies to a JAX TARGET; this is HLO already")
        assert t.text is not None
        module = parse_module(t.text, filename=str(t.path))
        xla = xla if xla is not None else _snapshot_figures(t.path)
        prof, s = profile_module(module, platform=platform, schedule=schedule, top=top, code_bytes=_code(xla),
                                 libtpu=libtpu)
        return MemoryReport(module.name, "hlo", prof, xla, s, step_notes(prof) + prediction_notes(prof, s))

    from hloopt.lowering import lower

    plat = platform or ("tpu" if compile and compile.startswith("tpu") else "cpu" if compile == "cpu" else "tpu")
    lowered = lower(t, platform=plat, compile=compile)
    if compile is None:
        module = parse_module(lowered.hlo_text, filename=str(target))
        prof, s = profile_module(module, platform=plat, schedule=schedule, top=top, libtpu=libtpu)
        return MemoryReport(module.name, f"lowered:{plat}", prof, None, s,
                            step_notes(prof) + prediction_notes(prof, s))
    assert lowered.compiled_text is not None
    module = parse_module(lowered.compiled_text, filename=str(target))
    figures = dict(lowered.memory or {})
    # a module compiled here, by the installed libtpu, whatever ``libtpu`` says of predictions
    prof, s = profile_module(module, platform=plat, schedule=schedule, top=top, code_bytes=_code(figures),
                             libtpu=_installed_libtpu())
    return MemoryReport(module.name, f"compiled:{compile}", prof, figures, s, step_notes(prof))


def undonated_bytes(prof: MemoryProfile) -> int:
    """Bytes of the step's outputs that could be written over an argument it does not donate.

    A training step returns its new parameters and optimizer state with the shapes and types of
    the ones it takes. Unless the caller donates them (``jax.jit(step, donate_argnums=...)``,
    ``input_output_alias`` in the module), XLA keeps both for the whole step: arguments and
    outputs each hold a copy. Output buffers (as the profile counts them) are matched to
    undonated entry parameters by element type and dims, each parameter once; scalars are left
    out."""
    lr = prof.ranges
    entry = lr.module.entry
    if entry is None:
        return 0
    donated = {a.parameter_number for a in lr.module.input_output_alias}
    free: dict[tuple[str, tuple[int, ...]], int] = {}
    for inst in entry.instructions:
        if inst.opcode == "parameter" and inst.parameter_number not in donated and inst.shape.is_array \
                and inst.shape.dims:
            key = (inst.shape.element_type, tuple(inst.shape.dims))
            free[key] = free.get(key, 0) + 1
    counted = prof.counted_start or lr.start
    total = 0
    for b in lr.buffers:
        shape = b.instruction.shape
        if not b.output_indices or b.parameter >= 0 or not b.on_device or counted[b.id] < 0 or b.index != () \
                or not shape.is_array or not shape.dims:
            continue
        key = (shape.element_type, tuple(shape.dims))
        if free.get(key, 0) > 0:
            free[key] -= 1
            total += lr.size_bytes[b.id]
    return total


def step_notes(prof: MemoryProfile) -> list[str]:
    """What the user can change in the step itself that moves its peak (any accounting)."""
    from hloopt.units import format_bytes

    nbytes = undonated_bytes(prof)
    if prof.peak_bytes and nbytes >= 0.05 * prof.peak_bytes:
        return [f"{format_bytes(nbytes)} of the step's outputs have the shape and type of arguments it does not "
                "donate (new parameters and optimizer state, by the look): jax.jit(step, donate_argnums=...) "
                f"lets XLA write them over their inputs, up to {format_bytes(nbytes)} off the peak"]
    return []


def prediction_notes(prof: MemoryProfile, settings: Mapping[str, Any]) -> list[str]:
    """Known blind spots of a TPU prediction that apply to this module (passes/memory.py)."""
    if settings.get("kind") != "tpu-predicted":
        return []
    from hloopt.passes.residuals import offloaded_source

    notes: list[str] = []
    steps = prof.ranges.steps
    batches = [b for b in (_conv_batch(i) for i in steps if i.opcode == "convolution") if b]
    narrow = sum(1 for b in batches if b < 8)
    if narrow:
        notes.append(f"{narrow} convolution(s) over a batch smaller than 8: libtpu may rewrite them (0b1f); "
                     "the prediction models the values it copies between layouts (measured on such "
                     "convnets: -32% to +7%, bench/convnet_shapes.py)")
    if len(batches) > narrow:
        notes.append(f"{len(batches) - narrow} convolution(s) over a batch of 8 or more: libtpu lays their "
                     "activations out as the compiled ResNets measured show, not always as modeled "
                     "(transformers' ResNet-18: -1.7% of libtpu at batch 8, -7.0% at 64 x 128 x 128; "
                     "bench/thirdparty.py)")
    # libtpu reports the higher of its two temporaries heaps; where the model's VMEM side is the
    # higher one at the peak, the figure rests on what memory-space assignment may hold (VMEM
    # capacity, lifetimes, parameter prefetches), not on MSA's own placement, which evicts some
    # long-lived values and leaves room unused (passes/tpu/msa.py)
    chip = prof.on_chip_timeline_bytes
    if chip and prof.timeline_bytes and chip[prof.peak_step] >= prof.timeline_bytes[prof.peak_step]:
        notes.append("the peak is libtpu's on-chip VMEM heap, not HBM: predicted from what memory-space "
                     "assignment may place there, not from its own placement (steps measured with this "
                     "peak: -12% to +6% of libtpu, docs/measurements.md)")
    elif chip and prof.on_chip_relief_bytes >= 0.05 * prof.peak_bytes:
        # an HBM peak that holds only because the model puts temporaries in VMEM there: MSA may
        # keep fewer (a Pallas flash-attention step: 66 of 112 MiB at its HBM peak, -6.0%)
        notes.append(f"the HBM peak assumes memory-space assignment holds {prof.on_chip_relief_bytes / 2**20:.0f} "
                     "MiB of the step's temporaries in VMEM there, the most it may; libtpu may evict more to "
                     "HBM (steps measured with an HBM peak: -7.0% to +6.6% of libtpu, docs/measurements.md)")
    # libtpu's peak_memory_in_bytes is its fixed bytes plus whichever temporaries heap peaks
    # highest, the host one included (passes/memory.py); the prediction models the device, so
    # where the values offloaded to host memory outgrow the device's temporaries, libtpu's figure
    # is the host heap's, above what the device holds (zoo Llama small with
    # offload_dot_with_no_batch_dims: 1,638,111,744 B = arguments + outputs + its 285,212,672 B
    # host heap + constants, exactly)
    fixed = prof.argument_bytes + prof.output_bytes + prof.static_bytes + prof.code_bytes
    if prof.host_bytes > prof.peak_bytes - fixed:
        notes.append(f"the values offloaded to host memory ({prof.host_bytes / 2**20:.1f} MiB at once) outgrow the "
                     f"device's temporaries ({(prof.peak_bytes - fixed) / 2**20:.1f} MiB at the peak): libtpu reports "
                     f"its largest heap, so expect its peak_memory_in_bytes near {fixed + prof.host_bytes:,} B, above "
                     "the device's need predicted here")
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


def _place_annotated_on_host(module: Module) -> Module:
    """``module``, or a new module in which the value of every ``pinned_host`` annotation is in
    host memory (``S(5)``), as written (for a module analyzed as it is: the annotation's result is
    a host array)."""
    from hloopt.passes.inline import with_shapes
    from hloopt.passes.tpu.layout import in_host_memory

    host = {inst for inst in module.instructions()
            if is_host_annotation(inst) and inst.shape.is_array and not inst.shape.on_host}
    if not host:
        return module
    return with_shapes(module, lambda inst: in_host_memory(inst.shape) if inst in host else inst.shape)


__all__ = ["MemoryReport", "analyze", "compiler_model", "peak_memory_pass", "prediction_notes", "prepare_for_profile",
           "profile_module", "settings_for"]
