"""``hloopt devices [NAME] [--json] [--hosts]``: list the device (or host) profiles, or show one with its sources."""

from __future__ import annotations

import json
from collections.abc import Mapping

import click

from hloopt.cli.params import device_options, profile_from_options, user_errors
from hloopt.devices import DeviceProfile, list_profiles, load_profile
from hloopt.hosts import HostProfile, list_host_profiles, load_host_profile
from hloopt.units import format_bytes, format_rate, format_seconds


def _gbps(x: float) -> str:
    return f"{x / 1e9:.1f}"


@click.command("devices")
@click.argument("name", required=False, metavar="[NAME|FILE]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (base units) instead of a table.")
@click.option("--hosts", is_flag=True, help="Host profiles (CPUs and DRAM of the accelerator host) instead of devices.")
@device_options
def devices(name: str | None, as_json: bool, hosts: bool, device: str | None, device_file: str | None,
            hbm: int | None, d2h: float | None, h2d: float | None) -> None:
    """List device profiles, or show NAME (a built-in name, alias or profile file) with sources.

    With --hosts, the same for host profiles.
    """
    with user_errors():
        if hosts:
            if device or device_file or hbm is not None or d2h is not None or h2d is not None:
                raise click.UsageError("--hosts takes no device options")
            if name is None:
                _show_hosts([load_host_profile(n) for n in list_host_profiles()], as_json=as_json)
            else:
                _show_host(load_host_profile(name), as_json=as_json)
            return
        if name is not None and (device or device_file):
            raise click.UsageError("give the device as NAME or with --device/--device-file, not both")
        if name is None and (device or device_file):
            name = device_file or device
        if name is None:
            if hbm is not None or d2h is not None or h2d is not None:
                raise click.UsageError("--hbm/--d2h/--h2d need a device NAME")
            profiles = [load_profile(n) for n in list_profiles()]
            _show_list(profiles, as_json=as_json)
        else:
            profile = profile_from_options(device=None, device_file=None, default=name, hbm=hbm, d2h=d2h, h2d=h2d)
            _show_one(profile, as_json=as_json)


def _show_list(profiles: list[DeviceProfile], *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in profiles], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Device profiles (per chip; * = includes an assumption, see `hloopt devices NAME`)")
    for col in ("name", "kind", "HBM GiB", "HBM GB/s", "bf16 TFLOP/s", "D2H GB/s", "H2D GB/s",
                "duplex D2H/H2D GB/s", "DMA engines", "host mem"):
        table.add_column(col, justify="left" if col in ("name", "kind") else "right")
    for p in profiles:
        star = "*" if any(p.is_assumption(k) for k in p.sources) else ""
        table.add_row(
            p.name + star, p.kind, f"{p.hbm_bytes / 2**30:.1f}", f"{p.hbm_bytes_per_s / 1e9:.0f}",
            f"{p.flops_per_s('bf16') / 1e12:.0f}", _gbps(p.d2h_bytes_per_s), _gbps(p.h2d_bytes_per_s),
            f"{_gbps(p.duplex_d2h_bytes_per_s)}/{_gbps(p.duplex_h2d_bytes_per_s)}", str(p.dma_engines),
            format_bytes(p.host_memory_bytes),
        )
    Console(width=160).print(table)


def _show_one(p: DeviceProfile, *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=2))
        return
    rows: list[tuple[str, str]] = [
        ("hbm_bytes", format_bytes(p.hbm_bytes)),
        ("hbm_bytes_per_s", format_rate(p.hbm_bytes_per_s)),
        *[(f"peak_flops_per_s.{k}", f"{v / 1e12:g} TFLOP/s") for k, v in p.peak_flops_per_s.items()],
        ("d2h_bytes_per_s", format_rate(p.d2h_bytes_per_s)),
        ("h2d_bytes_per_s", format_rate(p.h2d_bytes_per_s)),
        ("duplex_d2h_bytes_per_s", format_rate(p.duplex_d2h_bytes_per_s)),
        ("duplex_h2d_bytes_per_s", format_rate(p.duplex_h2d_bytes_per_s)),
        ("dma_engines", str(p.dma_engines)),
        ("transfer_latency_s", format_seconds(p.transfer_latency_s)),
        ("host_memory_bytes", format_bytes(p.host_memory_bytes)),
        ("interconnect_bytes_per_s", format_rate(p.interconnect_bytes_per_s)),
    ]
    _print_sourced(f"{p.name} ({p.kind}): {p.description}", rows, p.sources)


def _print_sourced(title: str, rows: list[tuple[str, str]], sources: Mapping[str, str]) -> None:
    """One profile's fields, values and the source of each."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    table.add_column("field")
    table.add_column("value", justify="right")
    table.add_column("source")
    for k, v in rows:
        table.add_row(k, v, sources.get(k, "(none)"))
    Console(width=160).print(table)


def _show_hosts(profiles: list[HostProfile], *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in profiles], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Host profiles (whole host, peak; * = includes an assumption, "
                        "see `hloopt devices --hosts NAME`)")
    for col in ("name", "cores", "AMX bf16 TFLOP/s", "f32 TFLOP/s", "DRAM GB/s", "host mem"):
        table.add_column(col, justify="left" if col == "name" else "right")
    for p in profiles:
        star = "*" if any(p.is_assumption(k) for k in p.sources) else ""
        amx = f"{p.peak_flops_per_s['amx_bf16'] / 1e12:.0f}" if p.has_amx else "-"
        table.add_row(p.name + star, str(p.cores), amx, f"{p.flops_per_s('f32') / 1e12:.1f}",
                      f"{p.dram_bytes_per_s / 1e9:.0f}", format_bytes(p.host_memory_bytes))
    Console(width=160).print(table)


def _show_host(p: HostProfile, *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=2))
        return
    rows: list[tuple[str, str]] = [
        ("sockets", str(p.sockets)),
        ("cores", str(p.cores)),
        ("clock_hz", f"{p.clock_hz / 1e9:g} GHz ({p.clock_kind})"),
        ("avx512_fma_units", str(p.avx512_fma_units)),
        ("memory_channels_per_socket", str(p.memory_channels_per_socket)),
        ("memory_mt_per_s", f"{p.memory_mt_per_s:g} MT/s"),
        *[(f"peak_flops_per_s.{k}", f"{v / 1e12:g} TFLOP/s") for k, v in p.peak_flops_per_s.items()],
        ("dram_bytes_per_s", format_rate(p.dram_bytes_per_s)),
        ("host_memory_bytes", format_bytes(p.host_memory_bytes)),
    ]
    _print_sourced(f"{p.name}: {p.description}", rows, p.sources)
