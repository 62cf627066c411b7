"""Device profiles: what one accelerator chip offers to a training step and to host offload.

A :class:`DeviceProfile` holds per-chip numbers in base units (bytes, bytes/s, FLOP/s, seconds):
HBM capacity and bandwidth, peak FLOP/s per element type, the host link in each direction alone
and with both directions busy at once, and the collective interconnect. Built-in profiles live in
``hloopt/device_profiles/*.toml``; every number there carries its source in the file's
``[sources]`` table, and numbers that are assumptions say so (their source starts with
``ASSUMPTION``).

Profile files (TOML, or JSON with the same keys) may give sizes and rates as numbers or as unit
strings (``"16 GiB"``, ``"25 GB/s"``); :func:`write_profile` always writes plain numbers.
Invariants: capacities and rates are positive; duplex rates never exceed the one-way rates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hloopt.errors import UserError
from hloopt.units import format_bytes, format_rate, parse_bytes, parse_rate

__all__ = [
    "DeviceProfile",
    "list_profiles",
    "load_profile",
    "profile_from_dict",
    "write_profile",
]

KINDS = ("tpu", "gpu")
#: Op classes the cost model times separately (passes/cost.py ``op_class``) and calibration fits.
OP_CLASSES = ("dot", "convolution", "reduction", "elementwise", "data_movement", "collective", "other")

#: Integer byte-count fields.
_BYTE_FIELDS = ("hbm_bytes", "host_memory_bytes")
#: Float rate fields (bytes per second).
_RATE_FIELDS = (
    "hbm_bytes_per_s",
    "d2h_bytes_per_s",
    "h2d_bytes_per_s",
    "duplex_d2h_bytes_per_s",
    "duplex_h2d_bytes_per_s",
    "interconnect_bytes_per_s",
)

#: HLO element type -> the peak_flops_per_s keys to try, in order. Low-precision floats and
#: integers fall back to the next wider type; f32 falls back to bf16 (see flops_per_s).
_FLOPS_FALLBACK: dict[str, tuple[str, ...]] = {
    "bf16": ("bf16",),
    "f16": ("f16", "bf16"),
    "f32": ("f32", "bf16"),
    "f64": ("f64", "f32", "bf16"),
    "s8": ("s8", "bf16"),
    "u8": ("s8", "bf16"),
    "s4": ("s4", "s8", "bf16"),
    "u4": ("s4", "s8", "bf16"),
    "f8": ("f8", "bf16"),
}
_F8_PREFIX = "f8e"
_ELEMENTWISE_TYPES = ("pred", "s16", "s32", "s64", "u16", "u32", "u64", "c64", "c128")


@dataclass(frozen=True)
class DeviceProfile:
    """Per-chip capabilities of one accelerator, in base units.

    Rates are for one chip; host-link rates are per direction.
    """

    #: Canonical profile name, e.g. ``"tpu-v5e"``.
    name: str
    #: ``"tpu"`` or ``"gpu"``.
    kind: str
    #: HBM capacity per chip, bytes.
    hbm_bytes: int
    #: HBM bandwidth per chip, bytes/s.
    hbm_bytes_per_s: float
    #: Peak dense FLOP/s (or OP/s for integers) per element type key: bf16, f16, f32, s8, f8, s4.
    peak_flops_per_s: Mapping[str, float]
    #: Device-to-host copy rate with nothing else on the link, bytes/s.
    d2h_bytes_per_s: float
    #: Host-to-device copy rate with nothing else on the link, bytes/s.
    h2d_bytes_per_s: float
    #: Device-to-host rate while a host-to-device copy runs at the same time, bytes/s.
    duplex_d2h_bytes_per_s: float
    #: Host-to-device rate while a device-to-host copy runs at the same time, bytes/s.
    duplex_h2d_bytes_per_s: float
    #: Copy (DMA) engines usable per direction by XLA's offload copies.
    dma_engines: int
    #: Fixed cost of one host<->device transfer (launch + DMA setup), seconds.
    transfer_latency_s: float
    #: Host DRAM available per chip, bytes.
    host_memory_bytes: int
    #: Chip-to-chip interconnect (ICI / NVLink) bandwidth, one direction summed over all links, bytes/s.
    interconnect_bytes_per_s: float
    #: Field name (``peak_flops_per_s.bf16`` for table entries) -> where the number comes from.
    sources: Mapping[str, str] = field(default_factory=dict)
    #: One line saying which product this is (form factor, memory variant).
    description: str = ""
    #: On-chip memory (TPU VMEM) the compiler's memory-space assignment fills, bytes; libtpu's
    #: peak_memory_in_bytes counts that heap when it peaks above the HBM one (passes/memory.py).
    #: 0: not modeled.
    on_chip_heap_bytes: int = 0
    #: Op class (:data:`OP_CLASSES`) -> measured roofline time / achieved time: the cost model
    #: divides an op's roofline time by its class's entry (``hloopt calibrate --profile`` fits it
    #: from a profiler trace). A class not listed runs at the roofline (1.0).
    compute_efficiency: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Freeze the mappings so a shared built-in profile cannot be edited through one user.
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(dict(self.peak_flops_per_s)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        object.__setattr__(self, "compute_efficiency", MappingProxyType(dict(self.compute_efficiency)))

    def efficiency(self, op_class: str) -> float:
        """The fitted share of the roofline rate ops of ``op_class`` reach (1.0 when not fitted)."""
        return float(self.compute_efficiency.get(op_class, 1.0))

    # -- queries -----------------------------------------------------------------------------

    def flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s for an HLO element type (``bf16``, ``f16``, ``f32``, ``s8``, ``f8e4m3fn``...).

        Fallbacks, used when the profile has no entry for the type itself:
          * every ``f8e*`` type uses the ``f8`` entry, then ``bf16``;
          * ``f16`` -> ``bf16``; ``f32`` -> ``bf16``; ``f64`` -> ``f32`` -> ``bf16``;
          * ``u8`` -> ``s8`` -> ``bf16``; ``s4``/``u4`` -> ``s4`` -> ``s8`` -> ``bf16``;
          * element-wise-only types (``pred``, ``s32``, ``c64``...) use ``f32`` then ``bf16``.
        Falling back to a faster type makes compute look shorter, which is the cautious side for
        an offload planner (less time appears available to hide transfers behind).
        Raises UserError for names that are not HLO element types.
        """
        key = dtype.strip().lower()
        if key.startswith(_F8_PREFIX):
            key = "f8"
        chain = _FLOPS_FALLBACK.get(key)
        if chain is None and key in _ELEMENTWISE_TYPES:
            chain = ("f32", "bf16")
        if chain is None:
            known = ", ".join(sorted([*_FLOPS_FALLBACK, *_ELEMENTWISE_TYPES, "f8e4m3fn", "f8e5m2"]))
            raise UserError(f"unknown element type {dtype!r}; known: {known}")
        for k in chain:
            if k in self.peak_flops_per_s:
                return float(self.peak_flops_per_s[k])
        raise UserError(f"device {self.name!r} has no peak FLOP/s for {dtype!r} or {', '.join(chain[1:]) or 'bf16'}")

    def is_assumption(self, field_name: str) -> bool:
        """True when the source of ``field_name`` says the number is an assumption."""
        return self.sources.get(field_name, "").upper().startswith("ASSUMPTION")

    # -- derivation --------------------------------------------------------------------------

    def with_overrides(
        self,
        *,
        hbm_bytes: int | None = None,
        d2h_bytes_per_s: float | None = None,
        h2d_bytes_per_s: float | None = None,
        duplex_d2h_bytes_per_s: float | None = None,
        duplex_h2d_bytes_per_s: float | None = None,
        transfer_latency_s: float | None = None,
        source: str = "user override",
    ) -> DeviceProfile:
        """A copy with some numbers replaced; ``source`` is recorded for each replaced field.

        Overriding a one-way host rate without its duplex rate scales the duplex rate by the same
        factor, so the measured duplex penalty of the base profile is kept.
        """
        changes: dict[str, Any] = {}
        sources = dict(self.sources)

        def put(name: str, value: Any, note: str = source) -> None:
            changes[name] = value
            sources[name] = note

        if hbm_bytes is not None:
            put("hbm_bytes", _positive_int(hbm_bytes, "hbm_bytes", "override"))
        for one_way, duplex, explicit in (
            ("d2h_bytes_per_s", "duplex_d2h_bytes_per_s", duplex_d2h_bytes_per_s),
            ("h2d_bytes_per_s", "duplex_h2d_bytes_per_s", duplex_h2d_bytes_per_s),
        ):
            new = d2h_bytes_per_s if one_way.startswith("d2h") else h2d_bytes_per_s
            if new is not None:
                new = _positive_float(new, one_way, "override")
                put(one_way, new)
                if explicit is None:
                    ratio = getattr(self, duplex) / getattr(self, one_way)
                    put(duplex, new * ratio, f"{source}, scaled by the base profile's duplex ratio {ratio:.2f}")
            if explicit is not None:
                put(duplex, _positive_float(explicit, duplex, "override"))
        if transfer_latency_s is not None:
            put("transfer_latency_s", _nonnegative_float(transfer_latency_s, "transfer_latency_s", "override"))
        if not changes:
            return self
        out = dataclasses.replace(self, **changes, sources=sources)
        _check_consistency(out, "override")
        return out

    # -- serialisation -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict: base-unit numbers, ``peak_flops_per_s`` and ``sources`` as dicts."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = dict(v) if isinstance(v, Mapping) else v
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, origin: str = "<dict>") -> DeviceProfile:
        """Build and validate a profile; ``origin`` (a file name) prefixes every error message."""
        return profile_from_dict(data, origin=origin)


# -- validation ------------------------------------------------------------------------------


def _field_error(origin: str, name: str, expected: str, got: Any) -> UserError:
    return UserError(f"{origin}: field {name!r}: expected {expected}, got {got!r}")


def _positive_int(v: Any, name: str, origin: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise _field_error(origin, name, "a positive integer", v)
    return v


def _positive_float(v: Any, name: str, origin: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _field_error(origin, name, "a positive number", v)
    return float(v)


def _nonnegative_float(v: Any, name: str, origin: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _field_error(origin, name, "a non-negative number", v)
    return float(v)


def _size(v: Any, name: str, origin: str) -> int:
    if isinstance(v, str):
        try:
            v = parse_bytes(v)
        except UserError as err:
            raise UserError(f"{origin}: field {name!r}: {err}") from None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return _positive_int(v, name, origin + "")


def _rate(v: Any, name: str, origin: str) -> float:
    if isinstance(v, str):
        try:
            v = parse_rate(v)
        except UserError as err:
            raise UserError(f"{origin}: field {name!r}: {err}") from None
    return _positive_float(v, name, origin)


def _check_consistency(p: DeviceProfile, origin: str) -> None:
    if p.duplex_d2h_bytes_per_s > p.d2h_bytes_per_s * (1 + 1e-9):
        raise _field_error(origin, "duplex_d2h_bytes_per_s", f"at most d2h_bytes_per_s ({p.d2h_bytes_per_s:g})",
                           p.duplex_d2h_bytes_per_s)
    if p.duplex_h2d_bytes_per_s > p.h2d_bytes_per_s * (1 + 1e-9):
        raise _field_error(origin, "duplex_h2d_bytes_per_s", f"at most h2d_bytes_per_s ({p.h2d_bytes_per_s:g})",
                           p.duplex_h2d_bytes_per_s)


_REQUIRED = (
    "name", "kind", "hbm_bytes", "hbm_bytes_per_s", "peak_flops_per_s", "d2h_bytes_per_s",
    "h2d_bytes_per_s", "duplex_d2h_bytes_per_s", "duplex_h2d_bytes_per_s", "dma_engines",
    "transfer_latency_s", "host_memory_bytes", "interconnect_bytes_per_s",
)
_FIELDS = {f.name for f in dataclasses.fields(DeviceProfile)}


def profile_from_dict(data: Mapping[str, Any], *, origin: str = "<dict>") -> DeviceProfile:
    """Validate ``data`` (as read from TOML/JSON) into a :class:`DeviceProfile`.

    Raises UserError naming ``origin`` and the offending field.
    """
    kw: dict[str, Any] = {"name": check_profile_table(data, fields=_FIELDS, required=_REQUIRED, origin=origin,
                                                      table_of="profile fields")}
    kind = data["kind"]
    if kind not in KINDS:
        raise _field_error(origin, "kind", " or ".join(repr(k) for k in KINDS), kind)
    kw["kind"] = kind
    for k in _BYTE_FIELDS:
        kw[k] = _size(data[k], k, origin)
    for k in _RATE_FIELDS:
        kw[k] = _rate(data[k], k, origin)
    kw["dma_engines"] = _positive_int(data["dma_engines"], "dma_engines", origin)
    kw["transfer_latency_s"] = _nonnegative_float(data["transfer_latency_s"], "transfer_latency_s", origin)
    flops = data["peak_flops_per_s"]
    if not isinstance(flops, Mapping) or not flops:
        raise _field_error(origin, "peak_flops_per_s", "a table such as {bf16 = 197e12}", flops)
    kw["peak_flops_per_s"] = {str(k): _positive_float(v, f"peak_flops_per_s.{k}", origin) for k, v in flops.items()}
    if "bf16" not in kw["peak_flops_per_s"]:
        raise UserError(f"{origin}: field 'peak_flops_per_s': needs at least a bf16 entry")
    sources = data.get("sources", {})
    if not isinstance(sources, Mapping) or not all(isinstance(v, str) for v in sources.values()):
        raise _field_error(origin, "sources", "a table of strings", sources)
    kw["sources"] = {str(k): v for k, v in sources.items()}
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise _field_error(origin, "description", "a string", desc)
    kw["description"] = desc
    if data.get("on_chip_heap_bytes", 0) not in (0, "0"):
        kw["on_chip_heap_bytes"] = _size(data["on_chip_heap_bytes"], "on_chip_heap_bytes", origin)
    eff = data.get("compute_efficiency", {})
    if not isinstance(eff, Mapping):
        raise _field_error(origin, "compute_efficiency", "a table such as {dot = 0.6}", eff)
    for k in eff:
        if k not in OP_CLASSES:
            raise UserError(f"{origin}: field 'compute_efficiency': unknown op class {k!r}; "
                            f"known: {', '.join(OP_CLASSES)}")
    kw["compute_efficiency"] = {str(k): _positive_float(v, f"compute_efficiency.{k}", origin) for k, v in eff.items()}
    profile = DeviceProfile(**kw)
    _check_consistency(profile, origin)
    return profile


# -- built-in profiles and files ---------------------------------------------------------------

#: Extra names accepted for built-in profiles (after lower-casing and mapping ' ' and '_' to '-').
ALIASES: dict[str, str] = {
    "v4": "tpu-v4",
    "v5e": "tpu-v5e",
    "v5litepod": "tpu-v5e",
    "v5-lite": "tpu-v5e",
    "v5p": "tpu-v5p",
    "v6e": "tpu-v6e",
    "trillium": "tpu-v6e",
    "h100": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h200-sxm": "h200",
    "h200-141gb": "h200",
    "gh200-96gb": "gh200",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
}


def check_profile_table(data: Any, *, fields: set[str], required: Sequence[str], origin: str, table_of: str) -> str:
    """What every profile table (device, host) must be: a table with only ``fields``, all of
    ``required``, and a non-empty ``name``, which it returns. One UserError line otherwise."""
    if not isinstance(data, Mapping):
        raise UserError(f"{origin}: expected a table of {table_of}, got {type(data).__name__}")
    unknown = sorted(set(data) - fields)
    if unknown:
        raise UserError(f"{origin}: unknown field {unknown[0]!r}; known fields: {', '.join(sorted(fields))}")
    missing = [k for k in required if k not in data]
    if missing:
        raise UserError(f"{origin}: missing field {missing[0]!r}")
    name = data["name"]
    if not isinstance(name, str) or not name.strip():
        raise _field_error(origin, "name", "a non-empty string", name)
    return name


def builtin_profiles(folder: str) -> list[str]:
    """Names of the built-in profiles in the package folder ``folder``, sorted."""
    files = resources.files("hloopt").joinpath(folder)
    return sorted(p.name[: -len(".toml")] for p in files.iterdir() if p.name.endswith(".toml"))


def read_profile_table(name_or_path: str | Path, *, folder: str, what: str,
                       canonical: Callable[[str], str | None]) -> tuple[Any, str]:
    """The table a profile holds, and its origin for messages: a built-in one of ``folder`` by the
    name ``canonical`` gives for ``name_or_path``, or a TOML/JSON file. ``what`` ("device",
    "host") names the kind of profile in messages."""
    s = str(name_or_path)
    path = Path(s)
    if not (path.suffix.lower() in (".toml", ".json") or "/" in s or path.exists()):
        name = canonical(s)
        if name is None:
            raise UserError(f"unknown {what} {s!r}; known: {', '.join(builtin_profiles(folder))} "
                            "(or a .toml/.json file)")
        origin = f"{folder}/{name}.toml"
        text = resources.files("hloopt").joinpath(folder).joinpath(f"{name}.toml").read_text(encoding="utf-8")
        return _parse_table(text, origin=origin, fmt="toml"), origin
    if not path.is_file():
        raise UserError(f"{s}: no such {what} profile file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{s}: not a text file (a TOML or JSON {what} profile expected)") from None
    except OSError as err:
        raise UserError(f"{s}: cannot read: {err.strerror}") from None
    return _parse_table(text, origin=s, fmt="json" if path.suffix.lower() == ".json" else "toml"), s


def _parse_table(text: str, *, origin: str, fmt: str) -> Any:
    try:
        return tomllib.loads(text) if fmt == "toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{origin}: not valid {fmt.upper()}: {err}") from None


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return builtin_profiles("device_profiles")


def _canonical(name: str) -> str | None:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    known = list_profiles()
    for cand in (key, ALIASES.get(key), "tpu-" + key.removeprefix("tpu"), ALIASES.get(key.removeprefix("tpu-"))):
        if cand and cand in known:
            return cand
    return None


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A built-in profile by name or alias (``tpu-v5e``, ``v5e``, ``h100``), or a TOML/JSON file.

    Raises UserError listing the known names for an unknown name, and naming the file and field
    for a malformed file.
    """
    data, origin = read_profile_table(name_or_path, folder="device_profiles", what="device", canonical=_canonical)
    return profile_from_dict(data, origin=origin)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    return json.dumps(str(v), ensure_ascii=False)


def _toml_key(k: str) -> str:
    import re

    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k, ensure_ascii=False)


def profile_to_toml(profile: DeviceProfile) -> str:
    """TOML text for ``profile`` that :func:`load_profile` reads back to an equal profile."""
    lines = [f"# hloopt device profile: {profile.name}", ""]
    d = profile.to_dict()
    for k in ("name", "kind", "description"):
        lines.append(f"{k} = {_toml_value(d[k])}")
    for k in _REQUIRED:
        if k in ("name", "kind", "peak_flops_per_s"):
            continue
        v = d[k]
        comment = ""
        if k in _BYTE_FIELDS:
            comment = f"  # {format_bytes(v)}"
        elif k in _RATE_FIELDS:
            comment = f"  # {format_rate(v)}"
        lines.append(f"{k} = {_toml_value(v)}{comment}")
    if d["on_chip_heap_bytes"]:
        lines.append(f"on_chip_heap_bytes = {d['on_chip_heap_bytes']}  # {format_bytes(d['on_chip_heap_bytes'])}")
    lines += ["", "[peak_flops_per_s]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d["peak_flops_per_s"].items()]
    if d["compute_efficiency"]:
        lines += ["", "# measured roofline time / achieved time per op class (hloopt calibrate --profile)",
                  "[compute_efficiency]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d["compute_efficiency"].items()]
    lines += ["", "[sources]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d["sources"].items()]
    return "\n".join(lines) + "\n"


def write_profile(profile: DeviceProfile, path: str | Path) -> None:
    """Write ``profile`` as TOML (or JSON when ``path`` ends in ``.json``)."""
    p = Path(path)
    text = json.dumps(profile.to_dict(), indent=2) + "\n" if p.suffix.lower() == ".json" else profile_to_toml(profile)
    try:
        p.write_text(text, encoding="utf-8")
    except OSError as err:
        raise UserError(f"{p}: cannot write: {err.strerror}") from None
