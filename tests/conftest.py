"""Test session set-up.

jax reads ``XLA_FLAGS`` and ``JAX_PLATFORMS`` once, when it starts. Importing ``hloopt.lowering``
before anything imports jax sets them as hloopt's own entry points do (8 host CPU devices for the
sharded programs, the CPU platform so that no test process holds libtpu's machine-wide lock by
merely importing jax), whatever order pytest collects the test files in.
"""

import os

import pytest

import hloopt.lowering  # noqa: F401  (sets XLA_FLAGS / JAX_PLATFORMS before jax starts)

#: the libtpu release every TPU figure recorded under fixtures/ was compiled by (jax 0.10.2's pin)
RECORDED_LIBTPU = "0.0.42"


@pytest.fixture(autouse=True)
def _recorded_libtpu_rules(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """TPU accountings follow the rules of the installed libtpu by default, and releases differ
    (:mod:`hloopt.passes.tpu.versions`). Tests that check a prediction against figures recorded
    under ``fixtures/`` read them with the rules of the release that recorded them, whatever
    libtpu this interpreter has (the Python 3.12 run has a newer one); tests marked ``tpu``
    compile here, with the installed libtpu, and follow its rules."""
    if request.node.get_closest_marker("tpu") is None:
        monkeypatch.setenv("HLOOPT_LIBTPU", RECORDED_LIBTPU)


# -- the full tier ----------------------------------------------------------------------------------
# Tests marked ``full`` are side-by-side compiles beyond the sample CI runs: the other sizes, budget
# shares, presets and steps of a comparison whose code paths a CI-run case takes
# (tests/tiers.py), and the slowest end-to-end checks. On 2 cores they add about an hour, which would put CI past its 45 minutes,
# so they run only when asked: ``pytest --full`` (or ``HLOOPT_FULL_TESTS=1``). They are deselected,
# not skipped, and the run's summary says how many were left out.

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked `full` (side-by-side libtpu compiles beyond CI's sample)")


_LEFT_OUT = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full") or os.environ.get("HLOOPT_FULL_TESTS"):
        return
    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    for item in items:
        (left_out if item.get_closest_marker("full") is not None else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
    config.stash[_LEFT_OUT] = len(left_out)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} tests of the full tier (marked `full`: side-by-side compiles beyond CI's sample) "
            "were deselected; `pytest --full` runs them")
