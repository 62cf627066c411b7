"""Parsing and formatting of sizes, rates, budgets and percentages (hloopt.units)."""

from __future__ import annotations

import pytest

from hloopt.errors import UserError
from hloopt.units import (
    Budget,
    format_bytes,
    format_rate,
    format_seconds,
    parse_budget,
    parse_bytes,
    parse_percent,
    parse_rate,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("16 GB", 16 * 10**9),
        ("1.5e9", 1_500_000_000),
        ("512MiB", 512 * 2**20),
        ("1.5 KiB", 1536),
        ("95 GiB", 95 * 2**30),
        ("1024", 1024),
        ("0", 0),
        ("2 TB", 2 * 10**12),
        ("7B", 7),
        (4096, 4096),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected
    assert isinstance(parse_bytes(text), int)


@pytest.mark.parametrize("text", ["12 GB?", "16G", "abc", "-1GB", "", "1e400GB", "16 Gb", "GiB", "16 XB", "nan"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(UserError) as info:
        parse_bytes(text)
    msg = str(info.value)
    assert "\n" not in msg
    assert repr(text) in msg  # names the bad text
    assert "GiB" in msg  # says what is accepted


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("25GB/s", 25e9),
        ("25 GiB/s", 25 * 2**30),
        ("900GB/s", 900e9),
        ("2.5e10", 2.5e10),
        ("450 GB/sec", 450e9),
        (1.5e10, 1.5e10),
    ],
)
def test_parse_rate(text: str | float, expected: float) -> None:
    assert parse_rate(text) == pytest.approx(expected, rel=0, abs=0)


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("25Gb/s", "bits"),
        ("25Gbps", "bits"),
        ("25GBps", "25GB/s"),
        ("25 GB", "/s"),
        ("/s", "not a rate"),
        ("fast", "not a rate"),
        ("-3GB/s", "non-negative"),
    ],
)
def test_parse_rate_rejects(text: str, hint: str) -> None:
    with pytest.raises(UserError) as info:
        parse_rate(text)
    assert hint in str(info.value)
    assert repr(text) in str(info.value)
    assert "\n" not in str(info.value)


def test_parse_budget() -> None:
    assert parse_budget("12GiB") == Budget(bytes=12 * 2**30)
    assert parse_budget("75%") == Budget(fraction=0.75)
    assert parse_budget("75%").resolve(16 * 2**30) == 12 * 2**30
    assert parse_budget("12GiB").resolve(1) == 12 * 2**30
    assert str(parse_budget("75%")) == "75%"
    assert str(parse_budget("12GiB")) == "12.0 GiB"


@pytest.mark.parametrize("text", ["0%", "101%", "0", "-5%", "lots", "12 GB?"])
def test_parse_budget_rejects(text: str) -> None:
    with pytest.raises(UserError) as info:
        parse_budget(text)
    assert repr(text) in str(info.value)
    assert "75%" in str(info.value)


def test_budget_needs_exactly_one_field() -> None:
    with pytest.raises(ValueError):
        Budget()
    with pytest.raises(ValueError):
        Budget(bytes=1, fraction=0.5)


def test_parse_percent() -> None:
    assert parse_percent("3%") == pytest.approx(0.03)
    assert parse_percent("100%") == 1.0
    assert parse_percent(" 0 % ") == 0.0
    for bad in ["3", "3%%", "150%", "x%"]:
        with pytest.raises(UserError) as info:
            parse_percent(bad)
        assert repr(bad) in str(info.value)


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (13_207_024_435, "12.3 GiB"), (16 * 2**30, "16.0 GiB"),
     (95 * 2**30, "95.0 GiB"), (141e9, "131 GiB"), (3 * 2**50, "3.00 PiB")],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_rate_and_seconds() -> None:
    assert format_rate(25e9) == "25.0 GB/s"
    assert format_rate(819e9) == "819 GB/s"
    assert format_rate(4.8e12) == "4.80 TB/s"
    assert format_rate(12) == "12.0 B/s"
    assert format_seconds(0.00123) == "1.23 ms"
    assert format_seconds(2e-5) == "20.0 us"
    assert format_seconds(3.5) == "3.50 s"
    assert format_seconds(5e-9) == "5.00 ns"


def test_round_trip_format_parse() -> None:
    # What we print for a user can be typed back in (to within the three printed digits).
    for n in [1536, 12 * 2**30, 95 * 2**30]:
        assert parse_bytes(format_bytes(n)) == pytest.approx(n, rel=5e-3)
    assert parse_rate(format_rate(819e9)) == 819e9
