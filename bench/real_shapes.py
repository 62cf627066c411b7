"""``hloopt analyze --platform tpu`` on modules shaped like real training steps, next to XLA's parse.

    python bench/real_shapes.py                      # 6, 12, 24, 48 layers
    python bench/real_shapes.py --layers 48 --out /tmp/real   # also keep the lowered texts

The generated modules in ``analyze.py`` have one parameter; a training step lowered from a real
model has thousands: every layer's weights, biases and layernorm scales are separate leaves, and
the optimizer adds two moments and an update per leaf. :func:`training_step` builds such a step in
plain JAX (a GPT-style decoder: per layer two layernorms, q/k/v/output projections and a two-layer
MLP, 16 leaves; ``layers`` of them unrolled in Python and ``scanned`` more stacked under
``lax.scan``, i.e. a while loop over stacked parameters) trained with
``optax.chain(clip_by_global_norm, adamw)``, and lowers it for TPU with
:func:`hloopt.lowering.lower` from ``jax.ShapeDtypeStruct`` (nothing is allocated), so the HLO is
what JAX emits. Nothing is cached: every run lowers again (the 48-layer step takes ~20 s).

Per size the table gives the module's instructions and entry parameters (leaves), XLA's own parse
of the text (``hlo_module_from_text``), hloopt's parse, and ``analyze --platform tpu`` (the
in-process work of the CLI: :func:`hloopt.analysis.analyze` on the parsed module, then the JSON
report), then ``analyze/XLA``: hloopt's analyze (parse excluded) over XLA's parse, ``total/XLA``:
parse and analyze (what the CLI does with a file) over XLA's parse, and the per-instruction
times, which stay flat when the work grows linearly with the module. Times are CPU seconds of
this process (``time.process_time``), best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hloopt.lowering  # noqa: E402  (before jax: sets XLA_FLAGS / JAX_PLATFORMS)

LAYER_LEAVES = ("ln1_scale", "ln1_bias", "q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w", "o_b",
                "ln2_scale", "ln2_bias", "fc_w", "fc_b", "proj_w", "proj_b")


def training_step(layers: int, *, scanned: int = 4, d_model: int = 128, heads: int = 4, seq: int = 32,
                  batch: int = 2, vocab: int = 512) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A decoder training step with ``layers`` unrolled layers and ``scanned`` stacked ones, and its
    abstract ``(params, opt_state, tokens)``."""
    import jax
    import jax.numpy as jnp
    import optax

    d, f = d_model, 4 * d_model

    def layer_shapes(lead: tuple[int, ...]) -> dict[str, jax.ShapeDtypeStruct]:
        shapes = {"ln1_scale": (d,), "ln1_bias": (d,), "q_w": (d, d), "q_b": (d,), "k_w": (d, d),
                  "k_b": (d,), "v_w": (d, d), "v_b": (d,), "o_w": (d, d), "o_b": (d,), "ln2_scale": (d,),
                  "ln2_bias": (d,), "fc_w": (d, f), "fc_b": (f,), "proj_w": (f, d), "proj_b": (d,)}
        return {k: jax.ShapeDtypeStruct(lead + s, jnp.float32) for k, s in shapes.items()}

    params = {"wte": jax.ShapeDtypeStruct((vocab, d), jnp.float32),
              "wpe": jax.ShapeDtypeStruct((seq, d), jnp.float32),
              "layers": [layer_shapes(()) for _ in range(layers)],
              "lnf_scale": jax.ShapeDtypeStruct((d,), jnp.float32),
              "lnf_bias": jax.ShapeDtypeStruct((d,), jnp.float32)}
    if scanned:
        params["stack"] = layer_shapes((scanned,))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    opt_state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

    def norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * scale + bias

    def block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        h = norm(x, p["ln1_scale"], p["ln1_bias"])
        b, s, _ = h.shape

        def split(y: jax.Array) -> jax.Array:
            return y.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)

        q, k, v = (split(h @ p[n + "_w"] + p[n + "_b"]) for n in ("q", "k", "v"))
        att = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(d // heads)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
        y = (jax.nn.softmax(att, -1) @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        x = x + y @ p["o_w"] + p["o_b"]
        h = norm(x, p["ln2_scale"], p["ln2_bias"])
        return x + jax.nn.gelu(h @ p["fc_w"] + p["fc_b"]) @ p["proj_w"] + p["proj_b"]

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        x = params["wte"][inp] + params["wpe"][None]
        for p in params["layers"]:
            x = block(x, p)
        if "stack" in params:
            x, _ = jax.lax.scan(lambda c, p: (block(c, p), None), x, params["stack"])
        x = norm(x, params["lnf_scale"], params["lnf_bias"])
        logits = x @ params["wte"].T
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, tgt[..., None], -1).mean()

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, tokens)


def lowered_text(layers: int, *, scanned: int = 4) -> str:
    """The pre-optimization TPU HLO of :func:`training_step`."""
    step, args = training_step(layers, scanned=scanned)
    return hloopt.lowering.lower(step, *args, platform="tpu").hlo_text


def measure(text: str, *, repeat: int) -> dict[str, float | int]:
    """Best-of-``repeat`` CPU seconds of XLA's parse, hloopt's parse and hloopt's analyze."""
    from jax._src.lib import xla_client as xc

    from hloopt.analysis import analyze
    from hloopt.hlo.parser import parse_module

    xla_s = parse_s = analyze_s = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        xc.hlo.hlo_module_from_text(text)
        t1 = time.process_time()
        module = parse_module(text)
        t2 = time.process_time()
        json.dumps(analyze(module, platform="tpu").to_json())
        t3 = time.process_time()
        xla_s, parse_s, analyze_s = min(xla_s, t1 - t0), min(parse_s, t2 - t1), min(analyze_s, t3 - t2)
    params = sum(1 for i in module.entry.instructions if i.opcode == "parameter")
    return {"instructions": module.num_instructions, "parameters": params, "mb": len(text) / 1e6,
            "xla_parse_s": xla_s, "parse_s": parse_s, "analyze_s": analyze_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[6, 12, 24, 48],
                    help="unrolled layers per module (one module each)")
    ap.add_argument("--scanned", type=int, default=4, help="stacked layers under lax.scan in every module")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many timings")
    ap.add_argument("--out", type=Path, help="write the lowered texts here (real-<layers>L.hlo)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    opts = ap.parse_args(argv)

    rows = []
    for n in opts.layers:
        text = lowered_text(n, scanned=opts.scanned)
        if opts.out is not None:
            opts.out.mkdir(parents=True, exist_ok=True)
            (opts.out / f"real-{n}L.hlo").write_text(text)
        rows.append((f"{n}L + {opts.scanned} scanned", measure(text, repeat=opts.repeat)))

    head = ["step", "instructions", "parameters", "MB", "XLA parse s", "parse s", "analyze s",
            "analyze/XLA", "total/XLA", "parse us/inst", "analyze us/inst"]
    lines = []
    for name, r in rows:
        n = r["instructions"]
        total = r["parse_s"] + r["analyze_s"]
        lines.append([name, f"{n:,}", f"{r['parameters']:,}", f"{r['mb']:.1f}", f"{r['xla_parse_s']:.2f}",
                      f"{r['parse_s']:.2f}", f"{r['analyze_s']:.2f}", f"{r['analyze_s'] / r['xla_parse_s']:.2f}",
                      f"{total / r['xla_parse_s']:.2f}",
                      f"{1e6 * r['parse_s'] / n:.1f}", f"{1e6 * r['analyze_s'] / n:.1f}"])
    if opts.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
        print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        for line in lines:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
