"""Host profiles: what the CPUs and DRAM of an accelerator host offer to work moved off the chip.

A :class:`HostProfile` holds whole-host numbers in base units (Hz, FLOP/s, bytes, bytes/s): sockets
and cores, the clock the FLOP rates assume, peak FLOP/s for AMX (bf16 matrix tiles) and AVX-512
(bf16 dot products, f32 FMAs), the DRAM bandwidth and the DRAM size. Built-in profiles live in
``hloopt/host_profiles/*.toml`` and mirror the device profiles (:mod:`hloopt.devices`): every number
carries its source in the file's ``[sources]`` table, as a URL with a quote, ``DERIVED: formula
from (sourced inputs)``, ``MEASURED ...`` or ``ASSUMPTION: ...`` with the reasoning.

Profile files (TOML, or JSON with the same keys) may give sizes and rates as unit strings
(``"512 GiB"``, ``"614.4 GB/s"``), parsed by the same helpers as device profiles. FLOP rates are
plain numbers. The built-in rates are derived from the other fields (``avx512_f32 = cores x
clock_hz x avx512_fma_units x 16 lanes x 2``); a user file may give measured rates instead, so the
loader does not insist on the formula.

The time model is a roofline: :func:`host_compute_s` is ``max(flops / rate, bytes / DRAM rate)``;
:func:`optimizer_update_host_s` applies it to an AdamW step (FLOP and byte counts below).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hloopt.devices import (
    _field_error,
    _positive_float,
    _positive_int,
    _rate,
    _size,
    builtin_profiles,
    check_profile_table,
    read_profile_table,
)
from hloopt.errors import UserError

__all__ = [
    "ADAMW_ARITH_FLOPS_PER_PARAM",
    "ADAMW_ARRAYS_MOVED",
    "ADAMW_FLOPS_PER_PARAM",
    "ADAMW_SQRT_PER_PARAM",
    "DEFAULT_HOST",
    "HostProfile",
    "host_compute_s",
    "host_profile_from_dict",
    "list_host_profiles",
    "load_host_profile",
    "optimizer_update_host_s",
]

#: The built-in host the planner assumes unless told otherwise (two Sapphire Rapids Xeons).
DEFAULT_HOST = "xeon-spr-8480"

#: ``clock_kind`` values: which clock ``clock_hz`` is.
CLOCK_KINDS = ("base", "all-core-turbo")
#: ``peak_flops_per_s`` keys. ``amx_bf16`` may be 0 or absent (no AMX); the others are required.
FLOPS_KEYS = ("amx_bf16", "avx512_bf16", "avx512_f32")
_REQUIRED_FLOPS = ("avx512_bf16", "avx512_f32")

# AdamW per parameter, counted from optax.adamw's update (optax 0.2: scale_by_adam,
# add_decayed_weights, scale_by_learning_rate) followed by optax.apply_updates:
#   mu     = b1*mu + (1-b1)*g                       3  (2 mul, 1 add)
#   nu     = b2*nu + (1-b2)*g*g                     4  (square, 2 mul, 1 add)
#   mu_hat = mu / (1 - b1**t)                       1  (the power is per step, not per parameter)
#   nu_hat = nu / (1 - b2**t)                       1
#   u      = mu_hat / (sqrt(nu_hat + eps_root) + eps)
#                                                   2  (+eps, divide) and 1 sqrt; optax's default
#                                                      eps_root is 0.0, and XLA folds the + 0.0 away
#   u      = u + weight_decay * param               2
#   u      = -learning_rate * u                     1
#   param  = param + u                              1  (optax.apply_updates)
# = 15 arithmetic FLOPs and 1 square root. XLA's cost analysis of the jitted step on the CPU
# backend reports the same: flops = 15 per parameter and transcendentals = 1 per parameter, plus a
# few per-step scalar operations (tests/test_hosts.py checks it within 2%). The time model counts
# the square root as one more FLOP: 16.
#: Arithmetic FLOPs per parameter of one AdamW step (see the table above).
ADAMW_ARITH_FLOPS_PER_PARAM = 15
#: Square roots per parameter of one AdamW step (XLA counts them as transcendentals).
ADAMW_SQRT_PER_PARAM = 1
#: FLOPs per parameter the time model charges for one AdamW step (the square root as one FLOP).
ADAMW_FLOPS_PER_PARAM = ADAMW_ARITH_FLOPS_PER_PARAM + ADAMW_SQRT_PER_PARAM
#: Arrays of one element per parameter that one fused AdamW step moves through DRAM: it reads
#: param, grad, mu and nu and writes param, mu and nu.
ADAMW_ARRAYS_MOVED = 7

_DTYPE_ALIASES = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class HostProfile:
    """One accelerator host's CPUs and DRAM, whole-host numbers in base units."""

    #: Canonical profile name, e.g. ``"xeon-spr-8480"``.
    name: str
    #: CPU sockets in the host.
    sockets: int
    #: Physical cores, all sockets together.
    cores: int
    #: The clock the FLOP rates assume, Hz (``clock_kind`` says which clock it is).
    clock_hz: float
    #: ``"base"`` or ``"all-core-turbo"``.
    clock_kind: str
    #: 512-bit FMA operations one core issues per cycle (2 on Xeon Platinum; 1 on Zen 4, whose
    #: two 256-bit pipes run a 512-bit FMA in halves).
    avx512_fma_units: int
    #: DDR channels per socket.
    memory_channels_per_socket: int
    #: DDR transfer rate, mega-transfers per second (DDR5-4800: 4800).
    memory_mt_per_s: float
    #: Peak FLOP/s of the whole host per key of :data:`FLOPS_KEYS` (``amx_bf16`` 0: no AMX).
    peak_flops_per_s: Mapping[str, float]
    #: Peak DRAM bandwidth of the whole host, bytes/s.
    dram_bytes_per_s: float
    #: DRAM of the whole host, bytes.
    host_memory_bytes: int
    #: Field name (``peak_flops_per_s.amx_bf16`` for table entries) -> where the number comes from.
    sources: Mapping[str, str] = field(default_factory=dict)
    #: One line saying which machine this is.
    description: str = ""

    def __post_init__(self) -> None:
        # Freeze the mappings so a shared built-in profile cannot be edited through one user.
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(dict(self.peak_flops_per_s)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    @property
    def has_amx(self) -> bool:
        """True when the host has AMX tiles (a positive ``amx_bf16`` rate)."""
        return float(self.peak_flops_per_s.get("amx_bf16", 0.0)) > 0

    def flops_per_s(self, dtype: str = "f32", *, elementwise: bool = False) -> float:
        """Peak FLOP/s for work on ``dtype`` (``"f32"`` or ``"bf16"``; ``float32``/``bfloat16`` too).

        ``bf16`` uses AMX when the host has it, else the AVX-512 bf16 dot-product rate; ``f32`` uses
        AVX-512 FMAs. Both bf16 paths are dot products (AMX tiles, VDPBF16PS), so element-wise work
        (``elementwise=True``) runs at the f32 FMA rate whatever the type.
        """
        key = _DTYPE_ALIASES.get(str(dtype).strip().lower())
        if key is None:
            raise UserError(f"host {self.name!r}: no FLOP rate for element type {dtype!r}; "
                            f"known: {', '.join(sorted(_DTYPE_ALIASES))}")
        if key == "f32" or elementwise:
            return float(self.peak_flops_per_s["avx512_f32"])
        if self.has_amx:
            return float(self.peak_flops_per_s["amx_bf16"])
        return float(self.peak_flops_per_s["avx512_bf16"])

    def is_assumption(self, field_name: str) -> bool:
        """True when the source of ``field_name`` says the number rests on an assumption."""
        return "ASSUMPTION" in self.sources.get(field_name, "").upper()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict: base-unit numbers, ``peak_flops_per_s`` and ``sources`` as dicts."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = dict(v) if isinstance(v, Mapping) else v
        return d


# -- the time model ----------------------------------------------------------------------------


def _nonnegative(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite, non-negative number, got {value!r}")
    return float(value)


def host_compute_s(profile: HostProfile, flops: float, bytes_accessed: float, dtype: str = "f32", *,
                   elementwise: bool = False) -> float:
    """Roofline seconds for host work: ``max(flops / rate(dtype), bytes_accessed / DRAM rate)``.

    ``rate`` is :meth:`HostProfile.flops_per_s` (AMX for bf16 when present; the f32 FMA rate for
    element-wise work). Peak rates on both sides: a lower bound on the real time.
    """
    flops = _nonnegative(flops, "flops")
    bytes_accessed = _nonnegative(bytes_accessed, "bytes_accessed")
    rate = profile.flops_per_s(dtype, elementwise=elementwise)
    return max(flops / rate, bytes_accessed / profile.dram_bytes_per_s)


def optimizer_update_host_s(profile: HostProfile, n_params: int, bytes_per_param_state: int,
                            dtype: str = "f32") -> float:
    """Roofline seconds for one AdamW step over ``n_params`` parameters on the host.

    ``bytes_per_param_state`` is the size of one element of each array the step touches (param,
    grad, mu, nu: 4 for f32, 2 for bf16). The step does :data:`ADAMW_FLOPS_PER_PARAM` FLOPs per
    parameter (counted from optax.adamw; see the module's table) and moves
    :data:`ADAMW_ARRAYS_MOVED` elements per parameter through DRAM (reads param, grad, mu, nu;
    writes param, mu, nu). It is element-wise, so it runs at the f32 FMA rate for either ``dtype``
    (which is still checked); at about 0.6 FLOP per byte it is bandwidth-bound on every built-in host.
    """
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 0:
        raise ValueError(f"n_params must be a non-negative integer, got {n_params!r}")
    if isinstance(bytes_per_param_state, bool) or not isinstance(bytes_per_param_state, int) or \
            bytes_per_param_state <= 0:
        raise ValueError(f"bytes_per_param_state must be a positive integer, got {bytes_per_param_state!r}")
    flops = ADAMW_FLOPS_PER_PARAM * n_params
    moved = ADAMW_ARRAYS_MOVED * n_params * bytes_per_param_state
    return host_compute_s(profile, flops, moved, dtype, elementwise=True)


# -- validation --------------------------------------------------------------------------------

_REQUIRED = (
    "name", "sockets", "cores", "clock_hz", "clock_kind", "avx512_fma_units", "memory_channels_per_socket",
    "memory_mt_per_s", "peak_flops_per_s", "dram_bytes_per_s", "host_memory_bytes",
)
_FIELDS = {f.name for f in dataclasses.fields(HostProfile)}


def _nonnegative_rate(v: Any, name: str, origin: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _field_error(origin, name, "a non-negative number (FLOP/s)", v)
    return float(v)


def host_profile_from_dict(data: Mapping[str, Any], *, origin: str = "<dict>") -> HostProfile:
    """Validate ``data`` (as read from TOML/JSON) into a :class:`HostProfile`.

    Raises UserError naming ``origin`` and the offending field.
    """
    kw: dict[str, Any] = {"name": check_profile_table(data, fields=_FIELDS, required=_REQUIRED, origin=origin,
                                                      table_of="host profile fields")}
    for k in ("sockets", "cores", "avx512_fma_units", "memory_channels_per_socket"):
        kw[k] = _positive_int(data[k], k, origin)
    if kw["cores"] % kw["sockets"]:
        raise _field_error(origin, "cores", f"the total over all {kw['sockets']} sockets (a multiple of it)",
                           kw["cores"])
    kw["clock_hz"] = _positive_float(data["clock_hz"], "clock_hz", origin)
    kind = data["clock_kind"]
    if kind not in CLOCK_KINDS:
        raise _field_error(origin, "clock_kind", " or ".join(repr(k) for k in CLOCK_KINDS), kind)
    kw["clock_kind"] = kind
    kw["memory_mt_per_s"] = _positive_float(data["memory_mt_per_s"], "memory_mt_per_s", origin)
    kw["dram_bytes_per_s"] = _rate(data["dram_bytes_per_s"], "dram_bytes_per_s", origin)
    kw["host_memory_bytes"] = _size(data["host_memory_bytes"], "host_memory_bytes", origin)
    flops = data["peak_flops_per_s"]
    if not isinstance(flops, Mapping):
        raise _field_error(origin, "peak_flops_per_s", "a table such as {avx512_f32 = 14.3e12}", flops)
    for k in flops:
        if k not in FLOPS_KEYS:
            raise UserError(f"{origin}: field 'peak_flops_per_s': unknown key {k!r}; known: {', '.join(FLOPS_KEYS)}")
    for k in _REQUIRED_FLOPS:
        if k not in flops:
            raise UserError(f"{origin}: missing field 'peak_flops_per_s.{k}'")
    rates = {k: _nonnegative_rate(v, f"peak_flops_per_s.{k}", origin) for k, v in flops.items()}
    for k in _REQUIRED_FLOPS:
        if rates[k] <= 0:
            raise _field_error(origin, f"peak_flops_per_s.{k}", "a positive number (FLOP/s)", flops[k])
    kw["peak_flops_per_s"] = rates
    sources = data.get("sources", {})
    if not isinstance(sources, Mapping) or not all(isinstance(v, str) for v in sources.values()):
        raise _field_error(origin, "sources", "a table of strings", sources)
    kw["sources"] = {str(k): v for k, v in sources.items()}
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise _field_error(origin, "description", "a string", desc)
    kw["description"] = desc
    return HostProfile(**kw)


# -- built-in profiles and files ---------------------------------------------------------------

#: Extra names accepted for built-in profiles (after lower-casing and mapping ' ' and '_' to '-').
ALIASES: dict[str, str] = {
    "spr": "xeon-spr-8480",
    "sapphire-rapids": "xeon-spr-8480",
    "8480": "xeon-spr-8480",
    "8480+": "xeon-spr-8480",
    "emr": "xeon-emr-8592",
    "emerald-rapids": "xeon-emr-8592",
    "8592": "xeon-emr-8592",
    "8592+": "xeon-emr-8592",
    "gnr": "xeon-gnr-6980p",
    "granite-rapids": "xeon-gnr-6980p",
    "6980p": "xeon-gnr-6980p",
    "genoa": "epyc-genoa-9654",
    "9654": "epyc-genoa-9654",
}


def list_host_profiles() -> list[str]:
    """Names of the built-in host profiles, sorted."""
    return builtin_profiles("host_profiles")


def _canonical(name: str) -> str | None:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return key if key in list_host_profiles() else ALIASES.get(key)


def load_host_profile(name_or_path: str | Path) -> HostProfile:
    """A built-in host profile by name or alias (``xeon-spr-8480``, ``spr``, ``genoa``), or a TOML/JSON file.

    Raises UserError listing the known names for an unknown name, and naming the file and field
    for a malformed file.
    """
    data, origin = read_profile_table(name_or_path, folder="host_profiles", what="host", canonical=_canonical)
    return host_profile_from_dict(data, origin=origin)

