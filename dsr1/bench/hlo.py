"""What a compiled program does per step, read from its optimized HLO text (`Compiled.as_text()`).

XLA's own cost analysis (`Compiled.cost_analysis()`) counts a `while` loop's body once, whatever its
trip count, and the model runs its layers under `lax.scan` and its attention's page blocks under a
`while_loop`, so its "bytes accessed" is about one layer's. This module walks the program instead:
each computation runs as often as its callers and loops say (a loop's trip count is the constant its
condition compares the counter with, or `dynamic_trips` when the bound is only known at run time), and
per run it counts

- every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute,
  ragged-all-to-all, and their async `-start` forms) with the bytes of its largest buffer per device;
- the bytes each instruction reads and writes, as XLA's cost analysis counts them: operands and
  result, where a fusion reads only the slices its `dynamic-slice`s and `gather`s take of a
  parameter and an in-place `dynamic-update-slice` writes only its update;
- copies (plain `copy`, `copy-start`, copy fusions) with their shapes, so that a copy of a whole
  weight stack (XLA:TPU moving a layer's experts before a kernel) can be named.

Two kernels take more than they read: the ragged paged attention kernel the whole page pool (it
copies one layer's pages of its rows), and the grouped-matmul kernel the whole expert stack, counted
by its own estimate (which experts get rows is known only at run time: `moe.grouped_experts` counts
those a uniformly routed step hits).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

from ..core import grouped_matmul, paged_attention

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
# Instructions that move no data of their own (their callees, or the `-start` of an async pair, count).
NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call", "conditional",
              "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-done",
              "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done", "send-done",
              "recv-done", "iota"}

_ARRAY = re.compile(r"\b(pred|token|bf16|[subfc]\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s+=\s+(.*?)\s([a-z][\w-]*)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, result type text, opcode, operand names and the rest of its line."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    root: bool = False
    args: str = ""  # the text between the parentheses: a constant's value, a parameter's number

    def attribute(self, key: str) -> str | None:
        """The value of `key=%value` (a called computation's name), or None."""
        m = re.search(rf"\b{key}=%([\w.\-]+)", self.attributes)
        return m.group(1) if m else None

    def called(self, key: str) -> list[str]:
        """Computations named by `key={%a, %b}` (a conditional's branches)."""
        m = re.search(rf"\b{key}=\{{([^}}]*)\}}", self.attributes)
        return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    instructions: tuple[Instruction, ...]
    entry: bool = False

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}

    @property
    def root(self) -> Instruction:
        return next((i for i in self.instructions if i.root), self.instructions[-1])


def array_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every `dtype[dims]` in a type text, e.g. a tuple's elements."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(text)]


def shape_bytes(text: str) -> int:
    """Bytes of a type text: the sum over its arrays (a tuple's elements)."""
    return int(sum(DTYPE_BYTES.get(dt, 4) * math.prod(dims) for dt, dims in array_shapes(text)))


def _split_operands(text: str) -> tuple[tuple[str, ...], str, str]:
    """`%a, %b), attrs...` -> operand names, the attribute text after the closing parenthesis, and the
    text inside."""
    depth, end = 1, len(text)
    for i, ch in enumerate(text):
        depth += ch in "({[" and 1 or 0
        depth -= ch in ")}]" and 1 or 0
        if depth == 0:
            end = i
            break
    return tuple(re.findall(r"%([\w.\-]+)", text[:end])), text[end + 1:], text[:end]


def parse_module(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    computations: dict[str, Computation] = {}
    name, entry, body = None, False, []
    for line in text.splitlines():
        if name is None:
            m = _HEADER.match(line)
            if m:
                name, entry, body = m.group(2), bool(m.group(1)), []
            continue
        if line.startswith("}"):
            computations[name] = Computation(name, tuple(body), entry)
            name = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            operands, attributes, args = _split_operands(m.group(5))
            body.append(Instruction(m.group(2), m.group(3), m.group(4), operands, attributes, bool(m.group(1)),
                                    args.strip()))
    return computations


def trip_count(condition: Computation) -> int | None:
    """A loop's trip count when its condition compares the counter with a constant (`i < N`): N."""
    constants = {i.name: int(i.args) for i in condition.instructions
                 if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.args)}
    root = condition.root
    if root.opcode != "compare" or "direction=LT" not in root.attributes:
        return None
    bounds = [constants[o] for o in root.operands[1:] if o in constants]
    return bounds[0] if bounds else None


def executions(module: dict[str, Computation], dynamic_trips: int = 1) -> dict[str, int]:
    """How many times each computation reached from the entry runs per program run: a loop body (and its
    condition) its trip count times its caller's, `dynamic_trips` where the bound is not a constant; each
    conditional branch as often as its caller (an upper bound). Fused computations are not listed: their
    fusion instruction accounts for them."""
    entry = next(c for c in module.values() if c.entry)
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        if name not in module or times == 0:
            return
        runs[name] = runs.get(name, 0) + times
        for ins in module[name].instructions:
            if ins.opcode == "while":
                cond, body = ins.attribute("condition"), ins.attribute("body")
                trips = trip_count(module[cond]) if cond in module else None
                trips = dynamic_trips if trips is None else trips
                visit(body, times * trips)
            elif ins.opcode == "conditional":
                for branch in ins.called("branch_computations") or [ins.attribute("true_computation"),
                                                                      ins.attribute("false_computation")]:
                    visit(branch, times)
            elif ins.opcode in ("call", "async-start"):
                visit(ins.attribute("to_apply") or ins.attribute("calls"), times)

    visit(entry.name, 1)
    return runs


# ---- what moves ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its op (without `-start`), bytes of its largest buffer per device, runs
    per program run, and the JAX operation it came from (`op_name` metadata)."""

    op: str
    bytes: int
    runs: int
    name: str
    source: str


def collective_op(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES else None


def _source(ins: Instruction) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attributes)
    return m.group(1) if m else ""


def _layer_bytes(shape: str) -> int:
    """The bytes of one index of an array's first dimension."""
    arrays = array_shapes(shape)
    return sum(DTYPE_BYTES.get(dt, 4) * math.prod(d[1:]) for dt, d in arrays if d) if arrays else 0


def _kernel_estimate(ins: Instruction) -> int | None:
    """A Pallas kernel's own bytes accessed (its `CostEstimate`, in the custom call's backend config)."""
    m = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', ins.attributes)
    return int(m.group(1)) if m else None


def _operand_bytes(ins: Instruction, shapes: dict[str, str]) -> list[int]:
    return [shape_bytes(shapes.get(o, "")) for o in ins.operands]


def collectives(module: dict[str, Computation], runs: dict[str, int]) -> list[Collective]:
    """Every collective the program runs, largest first."""
    found = []
    for name, times in runs.items():
        comp = module[name]
        shapes = {i.name: i.shape for i in comp.instructions}
        for ins in comp.instructions:
            op = collective_op(ins.opcode)
            if op is None:
                continue
            result = max((DTYPE_BYTES.get(dt, 4) * math.prod(d) for dt, d in array_shapes(ins.shape)), default=0)
            found.append(Collective(op, int(max([result, *_operand_bytes(ins, shapes)])), times, ins.name,
                                    _source(ins)))
    return sorted(found, key=lambda c: -c.bytes)


def _fusion_reads(fused: Computation, operand_bytes: list[int], module: dict[str, Computation] | None = None) -> int:
    """Bytes a fusion reads of its operands: a parameter used only by slicing ops counts their results,
    also where the slicing happens in a nested fusion (XLA:TPU slices a layer of a stacked weight
    inside the fusion that retiles it)."""
    params = {i.name: int(i.args) for i in fused.instructions if i.opcode == "parameter"}
    users: dict[str, list[Instruction]] = {}
    for ins in fused.instructions:
        for o in ins.operands:
            users.setdefault(o, []).append(ins)
    by_name = fused.by_name()

    def relaid(ins: Instruction) -> bool:
        """The same elements in another shape or layout (a nested fusion of one operand, e.g. XLA:TPU
        retiling int8 weights): computed only where its users read, so it reads what they do."""
        if ins.opcode in ("bitcast", "reshape"):
            return True
        if ins.opcode != "fusion" or len(ins.operands) != 1:
            return False
        source = by_name.get(ins.operands[0])
        return source is not None and array_shapes(source.shape) == array_shapes(ins.shape)

    passes = {v.name for v in fused.instructions if relaid(v)}

    def uses_of(name: str) -> list[Instruction]:  # through free reshapes, to the instructions that read
        found = []
        for u in users.get(name, []):
            found += uses_of(u.name) if u.name in passes else [u]
        return found

    def sliced_read(name: str, use: Instruction, full: int) -> int | None:
        """What `use` reads of `name` when it only slices it (directly or in a nested fusion), else None."""
        if use.opcode in ("dynamic-slice", "slice", "gather") and use.operands[0] in (name, *passes):
            return shape_bytes(use.shape)
        inner = module.get(use.attribute("calls") or "") if module is not None and use.opcode == "fusion" else None
        if inner is None:
            return None
        read = _fusion_reads(inner, [full if o == name else 0 for o in use.operands], module)
        return read if read < full else None

    total = 0
    for pname, index in params.items():
        full = operand_bytes[index] if index < len(operand_bytes) else 0
        uses = uses_of(pname)
        reads = [sliced_read(pname, u, full) for u in uses]
        if uses and all(r is not None for r in reads):
            total += min(full, sum(reads))
        elif uses and all(u.opcode == "dynamic-update-slice" and u.operands[0] == pname for u in uses):
            total += 0  # written in place: the update is counted with the result
        else:
            total += full
    return total


def _fusion_writes(fused: Computation, result_bytes: int) -> int:
    """Bytes a fusion writes: an in-place `dynamic-update-slice` root (or a tuple of them) its updates."""
    by_name = fused.by_name()
    root = fused.root
    parts = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    if parts and all(p is not None and p.opcode == "dynamic-update-slice" for p in parts):
        return sum(shape_bytes(by_name[p.operands[1]].shape) if p.operands[1] in by_name else 0 for p in parts)
    return result_bytes


def instruction_bytes(ins: Instruction, shapes: dict[str, str], module: dict[str, Computation]) -> int:
    """Bytes one run of `ins` reads and writes (0 for instructions that move nothing themselves)."""
    if ins.opcode in NO_TRAFFIC:
        return 0
    operands, result = _operand_bytes(ins, shapes), shape_bytes(ins.shape)
    if ins.opcode == "custom-call" and ins.name.startswith(paged_attention.NAME):
        # The ragged paged kernel takes the whole pool (every layer) and copies one layer's pages of
        # the rows it serves: a plan's rows hold every page, so one layer of each pool operand.
        pools = [_layer_bytes(shapes.get(o, "")) for o in ins.operands[paged_attention.POOLS_FROM:]]
        return sum(operands[:paged_attention.POOLS_FROM]) + sum(pools) + result
    if ins.opcode == "custom-call" and ins.name.startswith(grouped_matmul.NAME) and (
            estimate := _kernel_estimate(ins)) is not None:
        return estimate
    if ins.opcode == "fusion" and (fused := module.get(ins.attribute("calls") or "")) is not None:
        return _fusion_reads(fused, operands, module) + _fusion_writes(fused, result)
    if ins.opcode in ("dynamic-slice", "slice", "gather"):
        return 2 * result
    if ins.opcode == "dynamic-update-slice":
        return 2 * (operands[1] if len(operands) > 1 else 0)
    if ins.opcode.endswith("-start"):  # async pair: the result tuple holds the operand and the output
        return 2 * max((DTYPE_BYTES.get(dt, 4) * math.prod(d) for dt, d in array_shapes(ins.shape)), default=0)
    return sum(operands) + result


def bytes_accessed(module: dict[str, Computation], runs: dict[str, int]) -> int:
    """Bytes every instruction the program runs reads and writes, each as often as it runs."""
    total = 0
    for name, times in runs.items():
        comp = module[name]
        shapes = {i.name: i.shape for i in comp.instructions}
        total += times * sum(instruction_bytes(i, shapes, module) for i in comp.instructions)
    return total


@dataclasses.dataclass(frozen=True)
class Copy:
    """A copy the program runs: instruction, result type, bytes and runs per program run."""

    name: str
    shape: str
    bytes: int
    runs: int
    source: str


def _is_copy(ins: Instruction, module: dict[str, Computation]) -> bool:
    if ins.opcode in ("copy", "copy-start"):
        return True
    fused = module.get(ins.attribute("calls") or "") if ins.opcode == "fusion" else None
    return fused is not None and fused.root.opcode == "copy"


def copies_of(module: dict[str, Computation], runs: dict[str, int],
              dims: Iterable[tuple[int, ...]]) -> list[Copy]:
    """Every copy whose result holds an array of one of the shapes `dims` (e.g. a device's whole stack of
    routed experts, one layer's or all layers')."""
    wanted = {tuple(d) for d in dims}
    found = []
    for name, times in runs.items():
        for ins in module[name].instructions:
            if _is_copy(ins, module) and any(d in wanted for _, d in array_shapes(ins.shape)):
                size = max(DTYPE_BYTES.get(dt, 4) * math.prod(d) for dt, d in array_shapes(ins.shape) if d in wanted)
                found.append(Copy(ins.name, ins.shape.split("{")[0], int(size), times, _source(ins)))
    return sorted(found, key=lambda c: -c.bytes * c.runs)
