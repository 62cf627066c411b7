"""Test session set-up.

jax reads ``XLA_FLAGS`` and ``JAX_PLATFORMS`` once, when it starts. Importing ``hloopt.lowering``
before anything imports jax sets them as hloopt's own entry points do (8 host CPU devices for the
sharded programs, the CPU platform so that no test process holds libtpu's machine-wide lock by
merely importing jax), whatever order pytest collects the test files in.
"""

import hloopt.lowering  # noqa: F401  (sets XLA_FLAGS / JAX_PLATFORMS before jax starts)
