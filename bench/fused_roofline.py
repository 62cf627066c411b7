"""The lowered step's roofline, unfused and fused, against each policy's device time.

``hloopt plan`` times a policy by the roofline of the step as lowered (pre-optimization HLO,
``passes/cost.py``), every instruction a kernel of its own; ``CostAnalysis(fusion=TpuFusion())``
instead charges HBM traffic per kernel libtpu is predicted to form (the fusion model the memory
prediction uses). For each policy of a ``bench/policy_traces.py`` archive (recorded on a TPU),
this lowers the step with that policy here (no device needed), computes both rooflines with the
uncalibrated ``tpu-v5e`` profile, and the roofline of the module libtpu compiled on the device
(its own fusions; the archive holds it), and prints them beside the device's time per module run (the
trace's ``XLA Modules`` line), the ratio of each, and how far each policy's ratio is from the
median ratio: a model whose ratios agree ranks the policies as the device does and is one factor
from its times::

    python bench/fused_roofline.py bench/results/2026-12-07-tpu-v5e-c/llama-small.tar.xz
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
from pathlib import Path


def main(argv: list[str]) -> int:
    from hloopt.devices import load_profile
    from hloopt.hlo.parser import parse_module
    from hloopt.lowering import lower
    from hloopt.passes import AnalysisManager
    from hloopt.passes.cost import CostAnalysis
    from hloopt.passes.inline import inline_for_assignment
    from hloopt.passes.tpu import TpuFusion
    from hloopt.targets import resolve

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from policy_traces import ROOT, builtin_policies

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", type=Path,
                    help="a bench/policy_traces.py archive (<target>.tar.gz, or repacked .tar.xz)")
    a = ap.parse_args(argv)
    try:
        with tarfile.open(a.archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/runs.jsonl"))
            f = tar.extractfile(member)
            assert f is not None
            lines = [json.loads(ln) for ln in f.read().decode().splitlines() if ln.strip()]
            folder = member.name.rsplit("/", 1)[0]
            compiled_text = {}
            for m in tar.getmembers():
                if m.name.startswith(folder + "/") and m.name.endswith(".hlo.txt"):
                    g = tar.extractfile(m)
                    assert g is not None
                    compiled_text[m.name[len(folder) + 1:-len(".hlo.txt")]] = g.read().decode()
    except (OSError, tarfile.TarError, StopIteration, ValueError) as err:
        print(f"fused_roofline: {a.archive}: not a policy_traces archive ({err})", file=sys.stderr)
        return 2
    head = lines[0]
    rows = [r for r in lines[1:] if r.get("device_run_s_median") and r["policy"] in compiled_text]
    model, _, size = head["target"].rpartition(":")
    if model.endswith(".py"):
        factory, _, fsize = size.partition("@")
        target = resolve(f"{ROOT / model}:{factory}", size=fsize or None)
    else:
        target = resolve(f"{ROOT / 'fixtures' / 'zoo' / model}.py:{size}")
    profile = load_profile("tpu-v5e")
    policies = builtin_policies()
    out = []
    for r in rows:
        pol = policies[r["policy"]]
        step, args, kwargs = (target.step_fn, target.args, dict(target.kwargs)) if pol is None \
            else target.with_policy(pol)
        module = inline_for_assignment(parse_module(lower(step, *args, platform="tpu", **kwargs).hlo_text))
        am = AnalysisManager(module)
        unfused = CostAnalysis(profile=profile).run(module, am).totals.seconds
        fused = CostAnalysis(profile=profile, fusion=TpuFusion()).run(module, am).totals.seconds
        # the module libtpu compiled on the device: its own fusions, each a kernel
        compiled = CostAnalysis(profile=profile).run(parse_module(compiled_text[r["policy"]])).totals.seconds
        out.append((r["policy"], r["device_run_s_median"], (unfused, fused, compiled)))
    # a policy the link sets (an offloading one) is not the roofline's to time: left out of the medians
    on_chip = [o for o in out if "offload" not in o[0]] or out
    meds = [statistics.median(o[2][k] / o[1] for o in on_chip) for k in range(3)]
    print(f"{head['target']} on {head.get('device_kind', '?')} (jax {head.get('jax', '?')}), profile tpu-v5e "
          "uncalibrated; ratio = roofline / device, off = ratio / median ratio - 1")
    print(f"{'policy':34} {'device':>9}" + "".join(f" {k:>9} {'ratio':>6} {'off':>7}"
                                                 for k in ("unfused", "fused", "compiled")))
    for name, d, secs in out:
        print(f"{name:34} {d * 1e3:7.2f}ms" + "".join(
            f" {s * 1e3:7.2f}ms {s / d:6.2f} {s / d / med - 1:+7.1%}" for s, med in zip(secs, meds)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
