"""HLO text printer: the inverse of the parser.

``print_module(parse_module(t))`` re-parses to an equal module, and printing is a fixed point:
``print(parse(print(parse(t)))) == print(parse(t))``. Attribute values are printed as the parser
kept them (raw), so nothing is lost or re-encoded. ``long_form=True`` writes operand shapes and
``%`` sigils as XLA's own printer does; the default short form is what JAX emits.
"""

from __future__ import annotations

from hloopt.ir import Computation, Instruction, Module, quote


def print_instruction(inst: Instruction, *, long_form: bool = False) -> str:
    pct = "%" if long_form else ""
    if inst.opcode in ("parameter", "constant"):
        args = inst.literal or ""
    elif long_form:
        args = ", ".join(f"{o.shape} %{o.name}" for o in inst.operands)
    else:
        args = ", ".join(o.name for o in inst.operands)
    head = ("ROOT " if inst.is_root else "") + f"{pct}{inst.name} = {inst.shape} {inst.opcode}({args})"
    if inst.attrs:
        head += "".join(f", {k}={v}" for k, v in inst.attrs.items())
    return head


def print_computation(comp: Computation, *, long_form: bool = False) -> str:
    pct = "%" if long_form else ""
    head = ("ENTRY " if comp.is_entry else "") + pct + comp.name
    if comp.signature is not None:
        params, result = comp.signature
        head += " (" + ", ".join(f"{n}: {s}" for n, s in params) + f") -> {result}"
    lines = [head + " {"]
    lines.extend("  " + print_instruction(i, long_form=long_form) for i in comp.instructions)
    tail = "}"
    if comp.execution_thread != "main":
        tail += f", execution_thread={quote(comp.execution_thread)}"
    lines.append(tail)
    return "\n".join(lines)


def print_module(mod: Module, *, long_form: bool = False) -> str:
    head = f"HloModule {mod.name}"
    if mod.header_attrs:
        head += "".join(f", {k}={v}" for k, v in mod.header_attrs.items())
    out = [head, ""]
    if mod.file_names:
        out.append("FileNames")
        out.extend(f"{k} {quote(v)}" for k, v in mod.file_names.items())
        out.append("")
    if mod.function_names:
        out.append("FunctionNames")
        out.extend(f"{k} {quote(v)}" for k, v in mod.function_names.items())
        out.append("")
    if mod.file_locations:
        out.append("FileLocations")
        out.extend(
            f"{k} {{file_name_id={a} function_name_id={b} line={c} end_line={d} column={e} end_column={f}}}"
            for k, (a, b, c, d, e, f) in mod.file_locations.items())
        out.append("")
    if mod.stack_frames:
        out.append("StackFrames")
        out.extend(f"{k} {{file_location_id={a} parent_frame_id={b}}}" for k, (a, b) in mod.stack_frames.items())
        out.append("")
    # Callees before callers keeps the text readable; the entry goes last as XLA prints it.
    comps = [c for c in mod.computations.values() if c is not mod.entry]
    if mod.entry is not None:
        comps.append(mod.entry)
    for c in comps:
        out.append(print_computation(c, long_form=long_form))
        out.append("")
    return "\n".join(out)
