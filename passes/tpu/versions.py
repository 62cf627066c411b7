"""The rules of the TPU compiler model that differ between libtpu releases.

libtpu is not one compiler: ``jax[tpu]`` pins one release (jax 0.10.2 -> 0.0.42) and a bare
``pip install libtpu`` gives the newest, and the same pre-optimization module compiles to
different peaks under them. Each rule here names the releases it was measured on and how.

**Temporaries in output allocations.** XLA's buffer assigner may place a temporary inside the
allocation of a module output whose value is not yet written (``BufferAssigner``'s
``MaybeAssignBuffer`` over the reusable live-out allocations; modeled by
:func:`hloopt.passes.memory.output_allocation_reuse`): a training step's scan stacks then sit in
the allocations of the gradients and the optimizer's new state, which are written only at the
end. Measured on one module (the zoo Llama, 4 layers of 512, 256 tokens, vocabulary 4096, every
residual saved) compiled deviceless for v5e by each release, reading its buffer-assignment dump:
libtpu 0.0.42, 0.0.43.2 and 0.0.45 put temporaries in 17 output allocations (3 or more values
each; peak 525,427,200 B); 0.0.46, 0.0.46.3, 0.0.47.1, 0.0.50.1 and 0.0.52 in none (each output
allocation holds its output alone; peak 611,456,000 B, 0.0.52: 606,622,720 B). On the zoo's
Llama and GPT-2 at size small the difference is 10% and 22% of the peak.
"""

from __future__ import annotations

import re

#: the first libtpu release that places no temporary in a module output's allocation
NO_OUTPUT_REUSE_FROM = (0, 0, 46)

_VERSION = re.compile(r"^\d+(\.\d+)*$")


def parse_version(text: str) -> tuple[int, ...] | None:
    """``"0.0.46.3"`` -> ``(0, 0, 46, 3)``; None where ``text`` is not dotted numbers (a
    development build's suffix after ``+`` or ``.dev`` is dropped first)."""
    core = re.split(r"[+]|\.dev|rc|a|b", text.strip(), maxsplit=1)[0]
    if not _VERSION.match(core):
        return None
    return tuple(int(p) for p in core.split("."))


def reuses_output_allocations(version: str) -> bool:
    """Whether libtpu ``version`` places temporaries inside module outputs' allocations."""
    v = parse_version(version)
    if v is None:
        raise ValueError(f"not a libtpu version: {version!r}")
    return v < NO_OUTPUT_REUSE_FROM
