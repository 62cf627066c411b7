"""From a JAX training step to HLO text, and optionally to XLA's compiled HLO and memory figures.

``lower(step_fn, *args, platform="tpu")`` traces the step once and lowers it for ``platform``
(``jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))``): the pre-optimization HLO with
op metadata, which needs no accelerator. ``compile=`` additionally runs XLA: ``"cpu"`` on the host,
``"tpu-v4"|"tpu-v5e"|"tpu-v5p"|"tpu-v6e"`` deviceless through libtpu on a TPU topology description
(``jax.experimental.topologies.get_topology_desc``), giving the scheduled optimized HLO,
``memory_analysis()`` and ``cost_analysis()``.

Arguments may be arrays or ``jax.ShapeDtypeStruct`` pytrees. For a compile they are all turned into
``ShapeDtypeStruct`` placed on the compile target's devices: unsharded leaves on its first device,
leaves sharded over a (possibly abstract) mesh onto a concrete mesh of the same shape and axis
names. So a step sharded over ``AbstractMesh((2, 4), ("data", "model"))`` lowers with no devices
and compiles on the first 8 devices of a TPU topology, or on 8 CPU devices.

Environment, set here only when this module is imported before jax (jax reads it at start-up):

* ``XLA_FLAGS`` gains ``--xla_force_host_platform_device_count=8`` so CPU compiles of 8-way sharded
  programs find 8 host devices;
* ``JAX_PLATFORMS=cpu`` unless set: hloopt never runs programs, and a process that initialises the
  TPU backend holds ``/tmp/libtpu_lockfile``. Deviceless TPU compiles work under ``cpu``.

Source paths in the HLO text (``source_file=``, the ``FileNames`` table) are made relative to the
working directory, so analyses, reports and plans are the same bytes in any checkout.

Checkpoint policies are fixed when a step is traced. ``policy=`` reaches the step in one of two
ways: a :class:`hloopt.targets.Target` whose factory declares a ``policy`` parameter is rebuilt with
it (the program's author said where it goes; every zoo factory does); any other step, a Target or a
plain function, is traced under :func:`hloopt.policy_override.override_policies`, which gives
every ``jax.checkpoint`` traced inside the policy, whatever framework called it.

Source lines. JAX records one "user" frame per op (``source_file=``/``source_line=``), skipping its
own files; while lowering, the files of the frameworks models are built *with* (flax, equinox,
haliax, optax, ...: :data:`hloopt.frameworks.FRAMEWORK_PACKAGES`) are skipped too, so an op is located at the
model's line (``transformers/models/bert/modeling_flax_bert.py:NNN``), not at framework plumbing
(``haliax/wrap.py``). Paths under an installed-packages folder (``site-packages``, a virtualenv's
inside or outside the checkout) are written by package path (``transformers/...``), the rest
relative to the working directory.

XLA dumps: ``dump_dir=`` passes ``xla_dump_to`` / ``xla_dump_hlo_as_text`` as per-compile
``compiler_options``; both the CPU backend and libtpu honour them per compile (``XLA_FLAGS`` is read
only once per process, so per-compile options are the only way to dump one program among many).
The folder receives ``module_NNNN.jit_<name>....before_optimizations.txt``,
``...after_optimizations.txt``, ``...-buffer-assignment.txt``, ``...-memory-usage-report.txt`` and
``...-live-range.txt`` (libtpu names them ``module_NNNN.jit_step.cl_<cl>.<stage>``; the CPU backend
``module_NNNN.jit_step.<stage>`` with ``cpu_after_optimizations``, plus LLVM ``.ll``/``.o`` files).

What XLA does, measured with jax 0.10.2 / libtpu 0.0.42 (tiny zoo models, ``fixtures/hlo/zoo``):

* Offload annotations (``annotate_device_placement`` custom-calls, one to ``pinned_host`` and one
  back to ``device`` per offloaded residual) appear once per layer body in the pre-optimization
  text: once for a ``lax.scan`` body, once per layer unrolled. Names the backward pass does not
  read (llama's ``mlpwo``) produce none.
* libtpu honors offloading inside ``lax.scan``: ``host_temp_size_in_bytes`` is the offloaded
  residuals of every layer, in TPU's tiled layout (f32 minor dims padded to 8x128).
* XLA CPU compiles offload policies but ignores them (no host memory space, host figures 0).
* A TPU compile that does not fit the chip's HBM fails (``RESOURCE_EXHAUSTED``: a UserError here),
  e.g. the sharded Llama-2-7B step on v5e (16 GiB); on v5p:2x2x2 it reports 45.9 GiB peak.
* Lowering needs no devices, even for a program sharded over an ``AbstractMesh``; compiling one
  needs concrete devices of the mesh's size (``compile(device_assignment=...)`` with topology
  devices fails in jax 0.10.2), hence the re-placement of arguments described above.

Per-device programs (``partitioned=True``): the pre-optimization text of a sharded step is the
*global* program. What one device runs is the module right after XLA's SPMD partitioner, which
both the CPU backend and libtpu write when the compile's dump options include
``xla_dump_hlo_pass_re=spmd-partitioning``: ``module_NNNN.jit_step.NNNN.spmd-partitioner.
after_spmd-partitioning.before_<next pass>.txt`` (libtpu: ``...after_tpu-spmd-partitioning...``), per-device
shapes, collectives inserted, op
metadata kept, not yet fused or scheduled. A CPU compile on 8 host devices is enough (sharded
Llama-2-7B: ~10 s, 0.4 GiB RSS); libtpu writes the file before buffer assignment, so it is there
even when the compile then fails with ``RESOURCE_EXHAUSTED`` (``Lowered.partitioned_text`` is
then set and ``compile_error`` says why nothing else is; measured: the sharded Llama-2-70B step on
v5p:2x2x2 fails after ~4 s needing 405.86G of temporaries, and the partitioned module is there). A program on
one device runs no SPMD
partitioner and gets ``partitioned_text=None``: its per-device program is ``hlo_text``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hloopt.errors import UserError

if "jax" not in sys.modules:
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

PLATFORMS: tuple[str, ...] = ("tpu", "cuda", "cpu")

#: compile target -> topology names for get_topology_desc, smallest first; the first with enough
#: devices for the program's mesh is used. (v4 reports 2 devices per chip: 2x2x1 has 8.)
TPU_TOPOLOGIES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "tpu-v4": ("v4:2x2x1", "v4:2x2x2", "v4:2x2x4"),
    "tpu-v5e": ("v5e:2x2", "v5e:2x4", "v5e:4x4"),
    "tpu-v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4"),
    "tpu-v6e": ("v6e:2x2", "v6e:2x4", "v6e:4x4"),
})
COMPILE_TARGETS: tuple[str, ...] = ("cpu", *TPU_TOPOLOGIES)

#: the dump of the module after the SPMD partitioner: CPU ``...spmd-partitioner.after_spmd-partitioning
#: .before_<next>.txt``, libtpu ``...xla-partitioner.after_tpu-spmd-partitioning.before_<next>.txt``
_PARTITIONED_FILE = re.compile(r"\.after_(tpu-)?spmd-partitioning\.before_[^/]*\.txt$")

#: memory_analysis() attributes copied into Lowered.memory, when the backend reports them
MEMORY_FIELDS: tuple[str, ...] = (
    "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
    "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
    "host_alias_size_in_bytes", "host_temp_size_in_bytes", "host_generated_code_size_in_bytes",
    "peak_memory_in_bytes",
)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """One step lowered for one platform, and (when asked) compiled."""

    #: the platform lowered for: "tpu", "cuda" or "cpu"
    platform: str
    #: pre-optimization HLO text with op metadata (``as_text(dialect="hlo", debug_info=True)``)
    hlo_text: str
    #: the compile target ("cpu", "tpu-v5e", ...) or None when not compiled
    compiled_for: str | None = None
    #: the topology compiled on (e.g. "v5e:2x2"), TPU compiles only
    topology: str | None = None
    #: scheduled, optimized HLO (``compiled.as_text()``)
    compiled_text: str | None = None
    #: ``memory_analysis()`` figures in bytes, keys from :data:`MEMORY_FIELDS`
    memory: Mapping[str, int] | None = None
    #: ``cost_analysis()`` numbers (``flops``, ``bytes accessed``, ...); a while body counts once
    cost: Mapping[str, float] | None = None
    #: XLA dump folder when ``dump_dir=`` was given
    dump_dir: Path | None = None
    #: the per-device module after XLA's SPMD partitioner (``partitioned=True``; None when the
    #: program is on one device and XLA partitions nothing)
    partitioned_text: str | None = None
    #: why the compile failed when ``partitioned=True`` still recovered ``partitioned_text``
    compile_error: str | None = None


def lower(step_fn: Any, *args: Any, platform: str = "tpu", policy: Any = None, compile: str | None = None,
          donate_argnums: int | tuple[int, ...] = (), dump_dir: str | os.PathLike[str] | None = None,
          partitioned: bool = False, **kwargs: Any) -> Lowered:
    """Lower ``step_fn(*args, **kwargs)`` for ``platform``; with ``compile=``, compile it too.

    ``step_fn`` is a function (or a ``jax.jit`` wrapped one, used as is) or a
    :class:`hloopt.targets.Target` of kind "jax" (then ``args``/``kwargs`` come from the target and
    ``policy=`` rebuilds it through its factory). ``compile`` is ``"cpu"`` or a TPU generation
    (``"tpu-v5e"``...); a TPU compile is always for TPU, whatever ``platform`` says of the
    pre-optimization text. ``dump_dir`` makes the compile write XLA's dump files there.
    ``partitioned=True`` (needs ``compile=``) also returns the per-device module after SPMD
    partitioning (see the module docstring); a TPU compile that runs out of HBM then still returns,
    with ``compile_error`` set, when the partitioned module was written.
    """
    import jax

    label = _label(step_fn)
    original = step_fn
    step_fn, args, kwargs, override = _resolve_step(step_fn, args, kwargs, policy)
    if platform not in PLATFORMS:
        raise UserError(f"unknown platform {platform!r}: expected one of {', '.join(PLATFORMS)}")
    if compile is not None and compile not in COMPILE_TARGETS:
        raise UserError(f"unknown compile target {compile!r}: expected one of {', '.join(COMPILE_TARGETS)}")
    if compile in TPU_TOPOLOGIES and not has_libtpu():
        raise UserError("TPU compile needs libtpu: pip install 'hloopt[tpu]'")
    if dump_dir is not None and compile is None:
        raise UserError("dump_dir= needs compile= (XLA writes dumps while compiling)")
    if partitioned and compile is None:
        raise UserError("partitioned=True needs compile= (XLA partitions while compiling)")

    jitted = _jit(step_fn, donate_argnums)
    with contextlib.ExitStack() as stack:
        from hloopt.frameworks import imported_by

        stack.enter_context(framework_frames_skipped(imported_by(_code_of(original))))
        if override is not _NO_OVERRIDE:
            from hloopt.policy_override import override_policies

            stack.enter_context(override_policies(override))
        return _lower_and_compile(jax, jitted, label, args, kwargs, platform=platform, compile=compile,
                                  dump_dir=dump_dir, partitioned=partitioned)


def _lower_and_compile(jax: Any, jitted: Any, label: str, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                       platform: str, compile: str | None, dump_dir: str | os.PathLike[str] | None,
                       partitioned: bool) -> Lowered:
    try:
        traced = jitted.trace(*args, **kwargs)
        lowered = traced.lower(lowering_platforms=(platform,))
    except UserError:
        raise
    except Exception as err:  # the user's step failed to trace: their program, not ours
        raise UserError(f"{label}: tracing the step for {platform} failed: "
                        f"{type(err).__name__}: {_first_line(err)}") from err
    hlo_text = relative_paths(lowered.as_text(dialect="hlo", debug_info=True))
    if compile is None:
        return Lowered(platform=platform, hlo_text=hlo_text)

    topology = None
    if compile == "cpu":
        devices = jax.devices("cpu")
    else:
        own = _own_tpu_devices(args, kwargs)
        if own is not None:  # placed on a topology's devices by the user (a shard_map's mesh is too)
            topology, devices = own
        else:
            topology, devices = _tpu_devices(compile, _mesh_size(args, kwargs))
    placed_args, placed_kwargs = _place((args, kwargs), devices, compile)
    options: dict[str, Any] = {}
    if dump_dir is not None:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        options = {"xla_dump_to": os.fspath(dump_dir), "xla_dump_hlo_as_text": True}
    if not partitioned:
        placed = _placed_lowering(jitted, placed_args, placed_kwargs, label, compile)
        key = None
        if dump_dir is None:
            key = (compile, topology, tuple(str(d) for d in devices), os.environ.get("XLA_FLAGS"),
                   os.environ.get("LIBTPU_INIT_ARGS"),
                   hashlib.sha256(placed.as_text(debug_info=True).encode()).hexdigest())
            hit = _COMPILED.get(key)
            if hit is not None:
                _COMPILED.move_to_end(key)
                return dataclasses.replace(hit, platform=platform, hlo_text=hlo_text)
        try:
            compiled = placed.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as err:
            raise xla_error(err, compile) from err
        result = _compiled_result(platform, hlo_text, compile, topology, compiled, dump_dir)
        if key is not None:
            _remember(key, result)
        return result

    import tempfile

    with tempfile.TemporaryDirectory(prefix="hloopt-spmd-") as tmp:
        where = Path(dump_dir) if dump_dir is not None else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        options = {"xla_dump_to": os.fspath(where), "xla_dump_hlo_as_text": True,
                   "xla_dump_hlo_pass_re": "spmd-partitioning"}
        before = set(where.iterdir())
        error = None
        try:
            compiled = _placed_lowering(jitted, placed_args, placed_kwargs, label, compile).compile(
                compiler_options=options)
        except jax.errors.JaxRuntimeError as err:
            compiled, error = None, str(xla_error(err, compile))
        written = sorted(f for f in set(where.iterdir()) - before
                         if _PARTITIONED_FILE.search(f.name))
        part_text = relative_paths(written[-1].read_text()) if written else None
    if compiled is None:
        if part_text is None:
            raise UserError(error or "XLA could not compile the step")
        return Lowered(platform=platform, hlo_text=hlo_text, compiled_for=compile, topology=topology,
                       dump_dir=Path(dump_dir) if dump_dir is not None else None,
                       partitioned_text=part_text, compile_error=error)
    return dataclasses.replace(_compiled_result(platform, hlo_text, compile, topology, compiled, dump_dir),
                               partitioned_text=part_text)


#: compiles already made in this process, by the placed module's text and target: the same module
#: compiled again (verify after plan, a plan re-checked at another budget, a policy compiled side by
#: side twice) gets the same compiled text and figures, so XLA is asked once. Compiles that write
#: dump files are not kept. Bounded by the compiled texts' total size (LRU).
_COMPILED: collections.OrderedDict[tuple[Any, ...], Lowered] = collections.OrderedDict()
_COMPILED_TEXT_BUDGET = 256 << 20


def _remember(key: tuple[Any, ...], result: Lowered) -> None:
    _COMPILED[key] = result
    while len(_COMPILED) > 1 and sum(len(r.compiled_text or "") for r in _COMPILED.values()) > _COMPILED_TEXT_BUDGET:
        _COMPILED.popitem(last=False)


def _compiled_result(platform: str, hlo_text: str, compile: str, topology: str | None, compiled: Any,
                     dump_dir: str | os.PathLike[str] | None) -> Lowered:
    return Lowered(
        platform=platform, hlo_text=hlo_text, compiled_for=compile, topology=topology,
        compiled_text=relative_paths(compiled.as_text()), memory=MappingProxyType(memory_stats(compiled)),
        cost=MappingProxyType(cost_stats(compiled)),
        dump_dir=Path(dump_dir) if dump_dir is not None else None,
    )


def xla_error(err: BaseException, compile: str) -> UserError:
    """A one-line UserError for an error XLA or libtpu raised while compiling for ``compile``.

    libtpu lets one process at a time use it (``/tmp/libtpu_lockfile``); a second one fails with
    ``ABORTED: Internal error when accessing libtpu multi-process lockfile``. Removing the file, as
    that message suggests, would break the process holding it, so we say to wait instead.
    """
    first = _first_line(err)
    if "lockfile" in first or "already in use" in first:
        first = first.split(' Run "')[0]  # not its advice to delete the lockfile (see above)
        return UserError(f"cannot compile for {compile}: libtpu is in use by another process "
                         f"(one process at a time may use it); wait for it to finish and retry ({first})")
    if "RESOURCE_EXHAUSTED" in first:
        return UserError(f"the step does not fit {compile}'s memory: XLA says {first}")
    return UserError(f"XLA could not compile the step for {compile}: {first}")


def relative_paths(text: str) -> str:
    """HLO text with source paths written so that they do not depend on where things lie: a file
    of an installed package by its package path (``"/venv/lib/python3.11/site-packages/flax/x.py"``
    -> ``"flax/x.py"``, whether the virtualenv is inside the checkout or not), a file under the
    working directory relative to it (``"/abs/cwd/model.py"`` -> ``"model.py"``), as the snapshots
    in ``fixtures/hlo`` are."""
    for folder in package_folders():
        text = text.replace('"' + folder, '"')
    cwd = os.getcwd().rstrip(os.sep) + os.sep
    return text.replace('"' + cwd, '"')


def package_folders() -> tuple[str, ...]:
    """The folders installed packages are imported from (``site-packages``/``dist-packages`` on
    ``sys.path``, the interpreter's purelib/platlib), each ending in a separator, longest first."""
    import sysconfig

    found = {p for p in sys.path if p and os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")}
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            found.add(path)
    return tuple(sorted((os.path.abspath(p).rstrip(os.sep) + os.sep for p in found), key=len, reverse=True))


def _console_script() -> list[str]:
    """The ``hloopt`` command's launcher script when it runs this process: the outermost frame
    of every op, which must not stand in for a model line when a framework's frames hide them all
    (``nnx.jit`` plumbing around an RNG split). A user's own script is kept."""
    script = sys.argv[0] if sys.argv else ""
    if Path(script).name in ("hloopt", "hloopt.exe", "hloopt-script.py") and os.path.isfile(script):
        return [os.path.abspath(script)]
    return []


@contextlib.contextmanager
def framework_frames_skipped(model_packages: Iterable[str] = ()) -> Iterator[None]:
    """While inside, JAX's op metadata locates ops at model code (restored on exit).

    JAX picks an op's "user" frame by skipping files under its exclusion prefixes: its own, and the
    standard library's folder, which on an interpreter without a virtualenv contains
    ``site-packages`` (every installed package is then skipped, a model library's layers too),
    while in a virtualenv nothing installed is (framework plumbing such as ``haliax/wrap.py`` or
    ``equinox/_jit.py`` then locates ops). So: the framework packages' folders
    (:data:`hloopt.frameworks.FRAMEWORK_PACKAGES`) and hloopt's own are excluded, and the folders
    of ``model_packages`` (installed libraries the step's code uses, e.g. ``transformers``) are
    included, which JAX ranks above its exclusions. A layer library's plumbing
    (:data:`hloopt.frameworks.FRAMEWORK_PLUMBING`: Keras' backend ops, graph walker, optimizers) is
    excluded and the rest of it, its layers, included."""
    import importlib.util

    from jax._src import source_info_util as siu

    from hloopt.frameworks import FRAMEWORK_PACKAGES, FRAMEWORK_PLUMBING

    def folders(names: Iterable[str]) -> list[str]:
        out = []
        for name in names:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            for loc in (spec.submodule_search_locations or []) if spec is not None else []:
                out.append(os.path.abspath(loc).rstrip(os.sep) + os.sep)
        return out

    excludes = getattr(siu, "_exclude_paths", None)
    includes = getattr(siu, "_include_paths", None)
    # a library's replacement of a JAX function is plumbing, not model code
    shims = jax_shims()
    # hloopt's own frames (lower() calling the step) are no user's either
    excluded = [os.path.dirname(os.path.abspath(__file__)) + os.sep, *folders(FRAMEWORK_PACKAGES), *sorted(shims),
                *_console_script()]
    installed = package_folders()
    # a layer library (keras): its layers are model code wherever the step imports it from, its
    # plumbing never is
    layer_libraries = [(f, parts) for pkg, parts in FRAMEWORK_PLUMBING.items() for f in folders([pkg])]
    plumbing = {f + part for f, parts in layer_libraries for part in parts}
    excluded += sorted(plumbing)
    included = [part for f in folders(set(model_packages) - set(FRAMEWORK_PACKAGES) - set(FRAMEWORK_PLUMBING)
                                      - _NOT_MODELS) if f.startswith(installed) for part in _cover(f, shims)]
    included += [part for f, _ in layer_libraries for part in _cover(f, shims | plumbing)]
    if not isinstance(excludes, list):
        excluded = []
    if not isinstance(includes, list):
        included = []
    for lst, add in ((excludes, excluded), (includes, included)):
        if add:
            lst.extend(add)  # type: ignore[union-attr]
    _clear_frame_caches(siu)
    try:
        yield
    finally:
        for lst, add in ((excludes, excluded), (includes, included)):
            for p in add:
                lst.remove(p)  # type: ignore[union-attr]
        _clear_frame_caches(siu)


#: JAX's public namespaces whose functions a library may replace (see :func:`jax_shims`)
_JAX_NAMESPACES = ("jax", "jax.lax", "jax.numpy", "jax.nn", "jax.random", "jax.sharding", "jax.ad_checkpoint")


def jax_shims() -> set[str]:
    """Source files outside JAX whose functions stand in JAX's public namespaces: a library that
    replaces a JAX function at import (MaxText's tunix adapter wraps
    ``jax.lax.with_sharding_constraint``) would otherwise be the "user" line of every op that
    function emits, in whichever layer called it."""
    import jax

    jax_dir = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep
    installed = package_folders()
    out: set[str] = set()
    for name in _JAX_NAMESPACES:
        mod = sys.modules.get(name)
        for value in list(vars(mod).values()) if mod is not None else ():
            code = getattr(value, "__code__", None)
            file = getattr(code, "co_filename", None)
            if not isinstance(file, str) or file.startswith("<"):
                continue
            file = os.path.abspath(file)
            if not file.startswith(jax_dir) and file.startswith(installed):
                out.add(file)
    return out


def _cover(folder: str, holes: set[str]) -> list[str]:
    """Path prefixes that match every file under ``folder`` except the files in ``holes``:
    ``folder`` itself when no hole lies under it, else its entries, recursively (a hole that is a
    folder ends in a separator)."""
    if folder in holes:
        return []
    if not any(h.startswith(folder) for h in holes):
        return [folder]
    out: list[str] = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []
    for entry in entries:
        if entry.is_dir():
            out += _cover(entry.path + os.sep, holes)
        elif entry.path not in holes:
            out.append(entry.path)
    return out


#: packages a step's code uses that hold no model code (never "included" as model frames)
_NOT_MODELS = frozenset({"jax", "jaxlib", "numpy", "ml_dtypes", "hloopt", "builtins", "typing", "functools",
                         "collections", "dataclasses", "math", "os", "sys"})


def _clear_frame_caches(siu: Any) -> None:
    # user_frame caches its answer per traceback too
    for name in ("_exclude_path_regex", "_include_path_regex", "is_user_filename", "user_frame"):
        fn = getattr(siu, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _code_of(step_fn: Any) -> Any:
    """The function whose module says which libraries the step uses: a Target's factory, else the
    step (through ``functools.partial`` and ``jax.jit`` wrappers)."""
    from hloopt.targets import Target

    if isinstance(step_fn, Target):
        return step_fn.factory
    for _ in range(8):
        inner = getattr(step_fn, "func", None) or getattr(step_fn, "__wrapped__", None)
        if inner is None:
            break
        step_fn = inner
    return step_fn


def _label(step_fn: Any) -> str:
    """How errors name the step: the TARGET as written, or the function's name."""
    from hloopt.targets import Target

    if isinstance(step_fn, Target):
        return step_fn.name
    return str(getattr(step_fn, "__name__", None) or type(step_fn).__name__)


def memory_stats(compiled: Any) -> dict[str, int]:
    """The :data:`MEMORY_FIELDS` that ``compiled.memory_analysis()`` reports, in bytes."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    return {name: int(getattr(stats, name)) for name in MEMORY_FIELDS if hasattr(stats, name)}


def cost_stats(compiled: Any) -> dict[str, float]:
    """``compiled.cost_analysis()`` as one flat ``{name: float}`` (older jax returned a list of dicts)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return {str(k): float(v) for k, v in sorted((cost or {}).items()) if isinstance(v, (int, float))}


#: "no policy given": the program's own policies apply (``None`` is a policy: JAX's default)
_NO_OVERRIDE: Any = object()


def _resolve_step(step_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  policy: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Any]:
    """The step, its arguments, and the policy to impose while tracing it (or ``_NO_OVERRIDE``)."""
    from hloopt.targets import Target

    override = _NO_OVERRIDE if policy is None else policy
    if isinstance(step_fn, Target):
        if step_fn.kind != "jax":
            raise UserError(f"{step_fn.name}: a {step_fn.kind} target is HLO already; only jax targets lower")
        if args or kwargs:
            raise TypeError("lower(target): the arguments come from the target; pass none")
        target = step_fn
        if policy is not None and step_fn.takes_policy:
            target, override = step_fn.rebuild(policy=policy), _NO_OVERRIDE
        assert target.step_fn is not None
        return target.step_fn, tuple(target.args), dict(target.kwargs), override
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable or a Target, got {type(step_fn).__name__}")
    # as a Target's step is: an eqx.filter_jit step's non-array leaves (and leaves jax.jit cannot
    # trace) held by the step, so that jax.jit traces what the program's own jit would
    from hloopt.frameworks import jittable

    step_fn, args, kwargs = jittable(step_fn, tuple(args), kwargs)
    return step_fn, args, kwargs, override


def _jit(step_fn: Callable[..., Any], donate_argnums: int | tuple[int, ...]) -> Any:
    import jax

    if hasattr(step_fn, "trace") and hasattr(step_fn, "lower"):
        if donate_argnums not in ((), None):
            raise TypeError("step_fn is already jitted: give donate_argnums to its jax.jit instead")
        return step_fn
    return jax.jit(step_fn, donate_argnums=donate_argnums)


def has_libtpu() -> bool:
    """Whether libtpu (deviceless TPU compiles) is installed; it is imported only when used."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def _named_meshes(tree: Any) -> list[Any]:
    import jax
    from jax.sharding import NamedSharding

    return [leaf.sharding.mesh for leaf in jax.tree.leaves(tree)
            if isinstance(getattr(leaf, "sharding", None), NamedSharding)]


def _mesh_size(*trees: Any) -> int:
    meshes = _named_meshes(trees)
    return max((m.size for m in meshes), default=1)


def _placed_lowering(jitted: Any, args: Any, kwargs: Any, label: str, compile: str) -> Any:
    """``jitted`` lowered for the compile target's devices. A mesh the step holds itself (a
    ``shard_map``'s, a sharding constraint's) cannot be moved there: said in one line."""
    try:
        return jitted.trace(*args, **kwargs).lower()
    except ValueError as err:
        if "incompatible devices" not in str(err):
            raise
        raise UserError(f"{label}: the step holds a mesh of its own (shard_map, with_sharding_constraint) on "
                        f"devices other than the {compile} ones its arguments were placed on, so it cannot be "
                        "compiled for them: build that mesh from jax.experimental.topologies.get_topology_desc"
                        "(...).devices and place the arguments on it, or leave out --compile (the TPU "
                        "prediction needs no compile)") from err


def _own_tpu_devices(*trees: Any) -> tuple[str, list[Any]] | None:
    """The TPU devices the arguments are already sharded over (a mesh the user built from a
    topology): compiling on the same device objects keeps a mesh captured inside the step (a
    ``shard_map``'s) compatible with its arguments. None when no argument is on TPU devices."""
    from jax.sharding import Mesh

    best = None
    for mesh in _named_meshes(trees):
        if not isinstance(mesh, Mesh):  # an AbstractMesh holds no devices: placed on the target's
            continue
        devs = list(mesh.devices.flat)
        if devs and getattr(devs[0], "platform", "") == "tpu" and (best is None or len(devs) > len(best)):
            best = devs
    if best is None:
        return None
    return f"the step's own mesh ({len(best)} x {getattr(best[0], 'device_kind', 'TPU')})", best


#: what libtpu prints to stderr when it starts on a machine without a TPU: it looks for the
#: Cloud TPU VM's accelerator type and worker hostnames, finds none, and says so. The deviceless
#: compile works regardless; a user reading ``verify --compile`` output would take them for errors.
_TPU_START_NOISE = re.compile(
    r"could not determine TPU|Failed to find host bounds|Logging before InitGoogle|unexpected worker hostname"
    r"|^=== Source Location Trace|libtpu_init_utils\.cc|^\s*$")


@contextlib.contextmanager
def _quiet_tpu_runtime_start() -> Iterator[None]:
    """Hold back libtpu's start-up lines on a machine without a TPU (:data:`_TPU_START_NOISE`):
    file descriptor 2 goes to a temporary file while the topology is built, and what it caught
    is written back afterwards except those lines; everything when the call fails. Nothing is
    held back where a TPU is attached (there the lines mean something) or after the first call
    (libtpu starts once per process)."""
    global _tpu_started
    if _tpu_started or _tpu_attached():
        yield
        return
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    failed = True
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            _tpu_started = True
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            kept = lines if failed else [ln for ln in lines if not _TPU_START_NOISE.search(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


_tpu_started = False


def _tpu_attached() -> bool:
    """Whether this machine has a TPU on its PCI bus (JAX's own test, where it has one)."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # another jax: assume one, and hold nothing back
        return True


def _tpu_devices(compile: str, n_devices: int) -> tuple[str, list[Any]]:
    if not has_libtpu():
        raise UserError("TPU compile needs libtpu: pip install 'hloopt[tpu]'")
    import jax
    from jax.experimental import topologies

    for name in TPU_TOPOLOGIES[compile]:
        try:
            with _quiet_tpu_runtime_start():
                topo = topologies.get_topology_desc(topology_name=name, platform="tpu")
        except jax.errors.JaxRuntimeError as err:
            raise xla_error(err, compile) from err
        if len(topo.devices) >= n_devices:
            return name, list(topo.devices)
    raise UserError(f"no {compile} topology known to hloopt has {n_devices} devices "
                    f"(tried {', '.join(TPU_TOPOLOGIES[compile])})")


def _place(tree: Any, devices: list[Any], compile: str) -> Any:
    """Every leaf as a ``ShapeDtypeStruct`` on ``devices`` (see the module docstring)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

    meshes: dict[tuple[tuple[str, ...], tuple[int, ...]], Mesh] = {}

    def concrete(mesh: Any) -> Mesh:
        key = (tuple(mesh.axis_names), tuple(mesh.axis_sizes))
        if key not in meshes:
            if mesh.size > len(devices):
                hint = (" (set XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts, "
                        "or import hloopt.lowering first)") if compile == "cpu" else ""
                raise UserError(f"the step is sharded over {mesh.size} devices but {compile} has "
                                f"{len(devices)}{hint}")
            meshes[key] = Mesh(np.array(devices[: mesh.size]).reshape(key[1]), key[0])
        return meshes[key]

    def leaf(x: Any) -> Any:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(concrete(sharding.mesh), sharding.spec)
        else:
            sharding = SingleDeviceSharding(devices[0])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)
