"""The TPU compiler (libtpu) as hloopt models it: one home for its rules.

A pre-optimization module is what JAX lowers: no fusions, no layouts, global shapes. What fills a
TPU's HBM is what libtpu makes of it. Every rule hloopt applies for libtpu lives in this package,
each in the module for the compiler stage it describes:

* :mod:`~hloopt.passes.tpu.layout`: layout assignment and tiling (the bytes an array takes in
  HBM and in VMEM), and :func:`~hloopt.passes.tpu.layout.assign_tpu_layouts`, the transform that
  writes them (and the host memory space of offloaded values) on a new module;
* :mod:`~hloopt.passes.tpu.fusion`: instruction fusion (which values get an HBM buffer at all)
  and :class:`~hloopt.passes.tpu.fusion.TpuFusion`, the analysis that sizes every buffer;
* :mod:`~hloopt.passes.tpu.storage`: storage types (f32 values kept as bf16) and the host
  offloader's stacks;
* :mod:`~hloopt.passes.tpu.msa`: memory-space assignment (what VMEM holds; libtpu reports the
  larger of its HBM and VMEM heaps);
* :mod:`~hloopt.passes.tpu.versions`: the rules that differ between libtpu releases (from 0.0.46
  no temporary shares a module output's allocation), which the accounting applies for the release
  the user compiles with.

Sharding propagation, which every backend's SPMD partitioner shares, lives with the SPMD code
(:mod:`hloopt.spmd`).

The interface: generic analyses never import this package. Liveness takes a compiler model as a
field (``Liveness(fusion=TpuFusion())``: an analysis whose result is a
:class:`hloopt.passes.liveness.Materialization`, the fused set and each buffer's bytes), and the
memory accountant takes the VMEM model only when an accounting asks for libtpu's
(``PeakMemory(on_chip_heap=True)``). Which accounting applies to a module (as written, compiled
by XLA, predicted for libtpu) is decided once, in :func:`hloopt.analysis.settings_for`.
"""

from hloopt.passes.tpu.fusion import FusionPlan, TpuFusion, fused_instructions, layout_boundaries
from hloopt.passes.tpu.layout import assign_tpu_layouts, tpu_compact_bytes, tpu_layout_bytes
from hloopt.passes.tpu.storage import bf16_stacks, bf16_stored, host_stack_updates

__all__ = ["FusionPlan", "TpuFusion", "assign_tpu_layouts", "bf16_stacks", "bf16_stored", "fused_instructions",
           "host_stack_updates", "layout_boundaries", "tpu_compact_bytes", "tpu_layout_bytes"]
