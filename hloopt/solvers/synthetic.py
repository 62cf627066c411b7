"""Generated offload Problems shaped like training steps, for tests and benchmarks.

``transformer_problem`` lays out L layers of forward compute (``fwd_steps_per_layer`` steps each),
then the backward pass in reverse layer order (``bwd_steps_per_layer`` steps each). Every layer
saves ``residuals_per_layer`` named residuals (MaxText names: ``query_proj``, ``mlpwi_0``...), each
produced at a fixed step inside its layer's forward, read once more a few steps later, read again
in the mirrored backward layer and freed there. ``base_bytes`` holds parameters plus optimizer
state (constant) plus a per-step temporary that varies along the layer.

Two groupings: ``per_layer=True`` makes one Candidate per (layer, name) (an unrolled model where
every layer's residual could be selected on its own); ``per_layer=False`` makes one Candidate per
name with L instances (a scanned model: one ``checkpoint_name`` selects every layer's copy).

Sizes are chosen so that the link cannot hide every offload: a layer's residuals take about
``link_load`` times the layer's forward time to copy at the device-to-host rate, so the optimum
is a real trade between memory and exposed transfer time.
"""

from __future__ import annotations

import numpy as np

from hloopt.problem import Action, Candidate, Instance, Problem, Step

__all__ = ["RESIDUAL_NAMES", "transformer_problem"]

#: MaxText's checkpoint names for a decoder layer's residuals.
RESIDUAL_NAMES = (
    "decoder_layer_input",
    "query_proj",
    "key_proj",
    "value_proj",
    "qkv_proj",
    "out_proj",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
)


def transformer_problem(
    layers: int,
    *,
    residuals_per_layer: int = 9,
    fwd_steps_per_layer: int = 20,
    bwd_steps_per_layer: int = 40,
    per_layer: bool = True,
    layer_fwd_s: float = 1e-3,
    link_load: float = 2.0,
    param_bytes: int = 2 << 30,
    d2h_bytes_per_s: float = 1.5e10,
    h2d_bytes_per_s: float = 1.5e10,
    transfer_latency_s: float = 1e-5,
    prefetch_window_steps: int | None = None,
    remat_every: int = 3,
    seed: int = 0,
) -> Problem:
    """A Problem with ``layers * residuals_per_layer`` instances (see the module docstring).

    ``remat_every``: every k-th residual name also allows REMAT (0: none do); its recompute cost
    is a random share of the layer's forward time.
    """
    if layers < 1 or residuals_per_layer < 1:
        raise ValueError("layers and residuals_per_layer must be >= 1")
    if fwd_steps_per_layer < residuals_per_layer + 2:
        raise ValueError("fwd_steps_per_layer must exceed residuals_per_layer + 1")
    rng = np.random.default_rng(seed)
    f, b, k = fwd_steps_per_layer, bwd_steps_per_layer, residuals_per_layer
    n_fwd = layers * f

    # Per-name sizes: random weights scaled so that one layer's residuals take link_load x the
    # layer's forward time to copy out.
    weights = rng.uniform(0.3, 1.7, size=k)
    name_bytes = weights / weights.sum() * link_load * layer_fwd_s * d2h_bytes_per_s
    name_bytes = np.maximum(np.round(name_bytes / 4096) * 4096, 4096).astype(np.int64)

    fwd_durs = rng.uniform(0.5, 1.5, size=f)
    fwd_durs *= layer_fwd_s / fwd_durs.sum()
    bwd_durs = rng.uniform(0.5, 1.5, size=b)
    bwd_durs *= 2 * layer_fwd_s / bwd_durs.sum()
    temp = (rng.uniform(0.0, 1.0, size=f + b) * float(name_bytes.mean())).astype(np.int64)

    steps: list[Step] = []
    for layer in range(layers):
        for j in range(f):
            steps.append(Step(float(fwd_durs[j]), int(param_bytes + temp[j]), f"fwd.L{layer}.{j}"))
    for layer in reversed(range(layers)):
        for j in range(b):
            steps.append(Step(float(bwd_durs[j]), int(param_bytes + temp[f + j]), f"bwd.L{layer}.{j}", True))

    # Name i is produced at forward step 1 + i of its layer, read again up to 2 steps later; in
    # the backward layer (which runs names in reverse order) it is first read at step
    # 2 * (k - 1 - i) + 1 and last read 2 steps later.
    names = [RESIDUAL_NAMES[i] if i < len(RESIDUAL_NAMES) else f"res{i}" for i in range(k)]
    remat_frac = rng.uniform(0.02, 0.15, size=k)

    def instance(layer: int, i: int) -> Instance:
        produced = layer * f + 1 + i
        bwd0 = n_fwd + (layers - 1 - layer) * b
        fbu = bwd0 + 2 * (k - 1 - i) + 1
        return Instance(
            bytes=int(name_bytes[i]),
            produced=produced,
            last_forward_use=min(produced + 2, layer * f + f - 1),
            first_backward_use=fbu,
            last_use=min(fbu + 2, bwd0 + b - 1),
        )

    def allowed(i: int) -> frozenset[Action]:
        if remat_every and i % remat_every == remat_every - 1:
            return frozenset({Action.DEVICE, Action.OFFLOAD, Action.REMAT})
        return frozenset({Action.DEVICE, Action.OFFLOAD})

    candidates: list[Candidate] = []
    if per_layer:
        for layer in range(layers):
            for i in range(k):
                candidates.append(Candidate(
                    key=f"name:{names[i]}@L{layer}", name=f"{names[i]}_L{layer}",
                    selector=f"checkpoint_name '{names[i]}_L{layer}'",
                    instances=(instance(layer, i),), allowed=allowed(i),
                    remat_s=float(remat_frac[i] * layer_fwd_s),
                ))
    else:
        for i in range(k):
            candidates.append(Candidate(
                key=f"name:{names[i]}", name=names[i], selector=f"checkpoint_name '{names[i]}'",
                instances=tuple(instance(layer, i) for layer in range(layers)), allowed=allowed(i),
                remat_s=float(remat_frac[i] * layer_fwd_s * layers),
            ))
    return Problem(
        steps=tuple(steps),
        candidates=tuple(candidates),
        d2h_bytes_per_s=d2h_bytes_per_s,
        h2d_bytes_per_s=h2d_bytes_per_s,
        duplex_d2h_bytes_per_s=d2h_bytes_per_s,
        duplex_h2d_bytes_per_s=h2d_bytes_per_s,
        transfer_latency_s=transfer_latency_s,
        prefetch_window_steps=prefetch_window_steps,
        device="synthetic",
    )
