"""Test session set-up.

jax reads ``XLA_FLAGS`` and ``JAX_PLATFORMS`` once, when it starts. Importing ``hloopt.lowering``
before anything imports jax sets them as hloopt's own entry points do (8 host CPU devices for the
sharded programs, the CPU platform so that no test process holds libtpu's machine-wide lock by
merely importing jax), whatever order pytest collects the test files in.
"""

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
