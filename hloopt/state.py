"""Where a step's state lives: device memory or the host's (``pinned_host``), per group of leaves.

A training step's inputs are pytrees (``params``, ``opt_state``, ``batch``). :func:`state_groups`
splits them into groups at the first *named* key of each leaf's path (a dict key or a NamedTuple
field): ``params['hidden']``, ``params['head']``, ``opt_state[0].mu``, ``opt_state[0].nu``,
``opt_state[0].count``, ... (sequence indices before it are kept, so two chained optimizers'
``mu`` stay apart). Each group has its bytes as the step's arrays hold them and as libtpu lays
them out on the host (:func:`tpu_array_bytes`: what ``host_argument_size_in_bytes`` counts).

A *placement* maps group names to ``"device"`` or ``"host"``. :func:`apply_state_plan` applies
one to an unmodified step: the arguments of host groups are re-typed (or, when concrete, moved)
with ``memory_kind="pinned_host"`` shardings; the returned step is ``jax.jit`` with those
``in_shardings``, moves each host leaf to device memory where the step starts
(``jax.device_put(x, jax.memory.Space.Device)``, which JAX lowers to a transfer), and its
``out_shardings`` put every output that is the updated value of a host argument (same argument
position and path, same shape and dtype: the ``(params, opt_state, batch) -> (params, opt_state,
loss)`` convention) back on the host. What XLA does with the transfers is XLA's: libtpu 0.0.42
brings a whole host group to the device at once (measured: see tests/test_state.py), so the
device arguments and outputs shrink by the host bytes while the temporaries grow by them.

Computing on the host instead: :func:`on_host` wraps a function (the optimizer update) so that it
runs on the host CPU (``jax.experimental.compute_on("device_host")``) on host copies of its
inputs; its outputs stay in host memory. A step written with it keeps the optimizer state out of
device memory altogether.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from hloopt.errors import UserError

__all__ = ["ACTIONS", "StateGroup", "apply_state_plan", "compile_placed", "load_placement", "on_host", "state_groups",
           "tpu_array_bytes", "transfer_s"]

#: where a group may live
ACTIONS: tuple[str, ...] = ("device", "host")

#: numpy dtype name -> HLO element type, for the TPU layout sizes
_HLO_TYPES: Mapping[str, str] = {
    "bool": "pred", "int8": "s8", "int16": "s16", "int32": "s32", "int64": "s64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
    "complex64": "c64", "complex128": "c128",
}


@dataclasses.dataclass(frozen=True)
class StateGroup:
    """Leaves of one argument that share a path prefix, placed together."""

    #: ``<argument name><key path prefix>``, e.g. ``opt_state[0].mu``
    name: str
    #: the argument's position in the step's signature
    argnum: int
    #: the key paths (``jax.tree_util.keystr``) of its leaves inside the argument
    leaves: tuple[str, ...]
    #: bytes of its arrays (shape x itemsize)
    nbytes: int
    #: bytes in libtpu's default tiled layout (:func:`tpu_array_bytes`)
    tpu_bytes: int
    #: whether the step returns an updated value of every leaf (output at the same argument
    #: position and path, same shape and dtype): state, not input data
    updated: bool


def tpu_array_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of an array in libtpu's most compact tiled layout (``T(8,128)`` tiles over the pair
    of dimensions that pads least, fewer sublanes for small or packed types; 1-D arrays in one
    ``T(128)``..``T(1024)`` row; 512-byte aligned). libtpu 0.0.42 lays out pinned_host arguments
    so: mlp small's ``f32[4096,1000]`` head takes 4096 x 1000 x 4 bytes on the host, not the
    size padded to 1024 lanes, while its ``f32[1000]`` bias takes 4096 bytes and a scalar 512."""
    import numpy as np

    from hloopt.passes.tpu.layout import tpu_compact_bytes

    return tpu_compact_bytes(_HLO_TYPES.get(np.dtype(dtype).name, "f32"), tuple(shape))


def transfer_s(group: StateGroup, profile: Any) -> float:
    """Seconds a step spends moving ``group`` when it lives on the host: in over the profile's
    host-to-device link, and, when the step returns it updated, back out over device-to-host;
    each array a transfer of its own (the profile's fixed latency each). Host-computed groups
    (:func:`on_host`) move nothing; this is the cost of :func:`apply_state_plan`."""
    n = len(group.leaves)
    t = group.tpu_bytes / profile.h2d_bytes_per_s + n * profile.transfer_latency_s
    if group.updated:
        t += group.tpu_bytes / profile.d2h_bytes_per_s + n * profile.transfer_latency_s
    return t


def _arg_names(step: Callable[..., Any], n: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(step).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"arg{i}" for i in range(len(names), n)]


def _group_prefix(path: tuple[Any, ...]) -> tuple[Any, ...]:
    from jax.tree_util import DictKey, GetAttrKey

    for k, key in enumerate(path):
        if isinstance(key, (DictKey, GetAttrKey)):
            return path[: k + 1]
    return path


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _nbytes(x: Any) -> int:
    import numpy as np

    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _updated_paths(step: Callable[..., Any], args: tuple[Any, ...], out: Any = None) -> set[tuple[int, str]]:
    """``(argnum, keystr)`` of the argument leaves the step returns updated (module docstring);
    ``out``: the step's ``jax.eval_shape`` when the caller has it already."""
    import jax
    from jax.tree_util import SequenceKey, keystr

    if out is None:
        out = jax.eval_shape(step, *args)
    outs: dict[tuple[int, str], Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if path and isinstance(path[0], SequenceKey):
            outs[(path[0].idx, keystr(path[1:]))] = leaf
    found = set()
    for i, arg in enumerate(args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            o = outs.get((i, keystr(path)))
            if o is not None and _is_array(leaf) and o.shape == leaf.shape and o.dtype == leaf.dtype:
                found.add((i, keystr(path)))
    return found


def state_groups(step: Callable[..., Any], args: tuple[Any, ...], *, out: Any = None) -> tuple[StateGroup, ...]:
    """The groups of ``step``'s array arguments (module docstring), in argument and tree order;
    ``out``: the step's ``jax.eval_shape`` when the caller has traced it already."""
    import jax
    from jax.tree_util import keystr

    names = _arg_names(step, len(args))
    updated = _updated_paths(step, args, out)
    groups: dict[str, dict[str, Any]] = {}
    for i, arg in enumerate(args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if not _is_array(leaf):
                continue
            name = names[i] + keystr(_group_prefix(path))
            g = groups.setdefault(name, {"argnum": i, "leaves": [], "nbytes": 0, "tpu_bytes": 0, "updated": True})
            g["leaves"].append(keystr(path))
            g["nbytes"] += _nbytes(leaf)
            g["tpu_bytes"] += tpu_array_bytes(tuple(leaf.shape), leaf.dtype)
            g["updated"] = g["updated"] and (i, keystr(path)) in updated
    return tuple(StateGroup(name=n, argnum=g["argnum"], leaves=tuple(g["leaves"]), nbytes=g["nbytes"],
                            tpu_bytes=g["tpu_bytes"], updated=g["updated"]) for n, g in groups.items())


def _check_placement(placement: Mapping[str, str], groups: tuple[StateGroup, ...]) -> None:
    known = {g.name for g in groups}
    for name, where in placement.items():
        if name not in known:
            raise UserError(f"placement names group {name!r}, which the step does not have "
                            f"(groups: {', '.join(sorted(known))})")
        if where not in ACTIONS:
            raise UserError(f"placement of {name!r} is {where!r}: expected one of {', '.join(ACTIONS)}")


def _base_sharding(leaf: Any, default: Any) -> Any:
    from jax.sharding import Sharding

    s = getattr(leaf, "sharding", None)
    return s if isinstance(s, Sharding) else default


def load_placement(placement: Mapping[str, str] | str | os.PathLike[str]) -> dict[str, str]:
    """A placement: a mapping as given, or a JSON file holding ``{"placement": {group: where}}``
    (the mapping alone is accepted too)."""
    if isinstance(placement, Mapping):
        return dict(placement)
    path = os.fspath(placement)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise UserError(f"{path}: cannot read the placement file ({err.strerror})") from err
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}:{err.colno}: not JSON: {err.msg}") from err
    data = data.get("placement", data) if isinstance(data, dict) else data
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise UserError(f'{path}: expected {{"placement": {{"<group>": "device" | "host", ...}}}}')
    return data


def apply_state_plan(placement: Mapping[str, str] | str | os.PathLike[str], step: Callable[..., Any],
                     args: tuple[Any, ...], *, donate_argnums: int | tuple[int, ...] = ()
                     ) -> tuple[Any, tuple[Any, ...]]:
    """``(step2, args2)``: ``step`` jitted with the placement's memory kinds, and ``args`` on them.

    ``placement`` maps :func:`state_groups` names to ``"device"``/``"host"`` (unnamed groups stay
    on device), or is a placement file (:func:`load_placement`). Abstract leaves come back as
    ``ShapeDtypeStruct`` with the sharding, concrete arrays are moved there. Leaves without a
    sharding get one on the arguments' device.
    ``donate_argnums`` goes to ``jax.jit`` (a donated host argument's buffer can hold its update).
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding
    from jax.tree_util import keystr

    args = tuple(args)
    placement = load_placement(placement)
    groups = state_groups(step, args)
    _check_placement(placement, groups)
    host_leaves = {(g.argnum, leaf) for g in groups if placement.get(g.name) == "host" for leaf in g.leaves}
    # outputs that are no argument's update (the loss) go where the arguments are: replicated
    # over their mesh, or on their device
    given = [leaf.sharding for leaf in jax.tree.leaves(args) if isinstance(getattr(leaf, "sharding", None), Sharding)]
    named = [s for s in given if isinstance(s, NamedSharding)]
    default: Any = SingleDeviceSharding(min(given[0].device_set, key=lambda d: d.id) if given else jax.devices()[0])
    if named:
        default = NamedSharding(named[0].mesh, PartitionSpec())

    def kind_of(i: int, path: Any) -> str:
        return "pinned_host" if (i, keystr(path)) in host_leaves else "device"

    in_shardings = tuple(
        jax.tree_util.tree_map_with_path(
            lambda path, x, i=i: (_base_sharding(x, default).with_memory_kind(kind_of(i, path))
                                  if _is_array(x) else None),
            arg)
        for i, arg in enumerate(args))

    def place(x: Any, s: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.device_put(x, s)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    args2 = tuple(jax.tree.map(lambda x, s: place(x, s) if _is_array(x) else x, arg, sh,
                               is_leaf=lambda x: x is None)
                  for arg, sh in zip(args, in_shardings))

    out = jax.eval_shape(step, *args)

    def out_sharding(path: Any, leaf: Any) -> Any:
        from jax.tree_util import SequenceKey

        if path and isinstance(path[0], SequenceKey) and path[0].idx < len(args):
            i = path[0].idx
            match = dict(jax.tree_util.tree_flatten_with_path(args[i])[0]).get(tuple(path[1:]))
            if match is not None and _is_array(match) and match.shape == leaf.shape and match.dtype == leaf.dtype:
                return _base_sharding(match, default).with_memory_kind(kind_of(i, tuple(path[1:])))
        return default.with_memory_kind("device")

    out_shardings = jax.tree_util.tree_map_with_path(out_sharding, out)

    @functools.wraps(step)
    def placed(*xs: Any) -> Any:
        xs = tuple(jax.tree_util.tree_map_with_path(
            lambda path, x, i=i: jax.device_put(x, jax.memory.Space.Device)
            if kind_of(i, path) == "pinned_host" else x, arg)
            for i, arg in enumerate(xs))
        return step(*xs)

    return jax.jit(placed, in_shardings=in_shardings, out_shardings=out_shardings,
                   donate_argnums=donate_argnums), args2


def on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` computed on the host CPU: its array inputs are moved to host memory
    (``jax.device_put(x, jax.memory.Space.Host)``, a no-op for what is there already) and it runs
    under ``compute_on("device_host")``; its outputs are in host memory. For use inside a
    jitted step, e.g. around the optimizer update::

        params_h, opt_state = hloopt.state.on_host(update)(grads, opt_state, params)
    """
    import jax
    from jax.experimental.compute_on import compute_on

    jitted = jax.jit(fn)
    # jax <= 0.11: compute_on("device_host") is a context manager around the call; jax 0.12 made
    # it a function transformation that says where its outputs live (out_memory_spaces)
    new_api = "out_memory_spaces" in inspect.signature(compute_on).parameters
    transform: Any = compute_on  # typed for one of the two signatures

    @functools.wraps(fn)
    def wrapped(*xs: Any) -> Any:
        hosted = jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host) if _is_array(x) else x, xs)
        if new_api:
            return transform(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*hosted)
        with transform("device_host"):
            return jitted(*hosted)

    return wrapped


def compile_placed(placement: Mapping[str, str], step: Callable[..., Any], args: tuple[Any, ...], *,
                   compile: str = "tpu-v5e", donate_argnums: int | tuple[int, ...] = ()) -> dict[str, int]:
    """``memory_analysis()`` figures of ``step`` compiled with ``placement`` for ``compile``
    (deviceless on a TPU topology, or ``"cpu"``); an empty placement compiles the step as written
    with the same arguments, for comparison."""
    import jax

    from hloopt.lowering import _place, _tpu_devices, memory_stats, xla_error

    if compile == "cpu":
        devices = jax.devices("cpu")
    else:
        _, devices = _tpu_devices(compile, 1)
    placed_args = _place(tuple(args), devices, compile)
    step2, args2 = apply_state_plan(placement, step, placed_args, donate_argnums=donate_argnums)
    try:
        compiled = step2.trace(*args2).lower().compile()
    except jax.errors.JaxRuntimeError as err:
        raise xla_error(err, compile) from err
    return memory_stats(compiled)
