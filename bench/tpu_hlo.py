"""A compiled TPU program's bytes by memory space, read off its optimized HLO.

Owns: `traffic` (the bytes a program's top-level ops read and write, in every memory
space, in HBM alone, and both again with named scopes' conditional branches not taken).
Receives the optimized HLO text of a program compiled for a TPU (jax's
`compiled.as_text()`), with XLA's memory-space assignment on or off; emits `Traffic`.
Pure text processing; bench.tpu_aot calls it.

XLA's cost analysis counts every op's operands and outputs wherever they live: with
memory-space assignment on, an array staged into VMEM is counted when copied in and again
where it is read, and arrays that never leave VMEM are counted as if they went through
HBM. This restates the rules of XLA's HloCostAnalysis for the ops of a program and
keeps each array's memory space (0 is HBM, 1 VMEM):

- an op executed at the top level (the entry computation, a conditional's branches at
  its costliest branch, a while body once, an async call's computation) counts the
  bytes of its operands and outputs; a fusion counts what its parameters' users read (a
  slice, dynamic slice or gather reads its output's bytes; an in-place update or scatter
  reads nothing of its target; a nested fusion, what its own parameter's users read)
  and, for an output that is an in-place update or a scatter, the update's bytes;
- parameters, constants, tuples, bitcasts and the `-done` halves of async ops count
  nothing; the Pallas kernels (`tpu_custom_call`) count nothing (XLA cannot see into
  them: bench.tpu_roofline.kernel_work adds their traffic);
- an async copy or slice (`copy-start`, `slice-start`) counts both its ends, each in
  the memory space it lives in.

Each array is counted at its tiled size (its layout's T(...) tile pads the minor
dimensions), as XLA's TPU figures are. The sum is not XLA's own total (XLA's TPU
analysis has rules of its own; bench/README.md, "TPU programs", has the figures), so
bench.tpu_aot takes from it only what it subtracts from XLA's count: `on_chip`, the
bytes of arrays outside HBM, and the branches' bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

ITEM_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
    "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
HBM = 0  # memory space 0; VMEM is S(1), semaphores and scalar memory others
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "copy-done", "slice-done", "call-done", "async-done",
    "all-reduce-done", "all-gather-done", "collective-permute-done", "opt-barrier",
}  # fmt: skip
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\](\{[^{}]*\})?")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_HEAD = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")


@dataclass(frozen=True)
class Traffic:
    all_spaces: float  # every op's operands and outputs wherever they live
    hbm: float  # those in HBM only
    # the same with every conditional branch in one of the `untaken` scopes not taken
    plain_all_spaces: float
    plain_hbm: float

    @property
    def on_chip(self) -> float:
        """The bytes counted of arrays outside HBM (VMEM's, mostly)."""
        return self.all_spaces - self.hbm


@dataclass(frozen=True)
class _Op:
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    root: bool
    inside: str  # the text between the op's parentheses (a parameter's number)


def _arrays(text: str) -> Iterator[tuple[int, int]]:
    """(bytes at the tiled size, memory space) of each array in a type string."""
    for m in _SHAPE.finditer(text):
        dtype, dims_text, layout = m.group(1), m.group(2), m.group(3) or ""
        if dtype not in ITEM_BYTES:
            continue
        dims = [int(d) for d in dims_text.split(",") if d]
        space = re.search(r"S\((\d+)\)", layout)
        order = re.match(r"\{([0-9,]+)", layout)
        physical = [dims[i] for i in reversed([int(x) for x in order.group(1).split(",")])] if (
            order and dims
        ) else dims  # fmt: skip
        tile = re.search(r"T\(([0-9,]+)\)", layout)
        if tile:
            sizes = [int(x) for x in tile.group(1).split(",")]
            for j in range(1, min(len(sizes), len(physical)) + 1):
                physical[-j] = -(-physical[-j] // sizes[-j]) * sizes[-j]
        yield math.prod(physical) * ITEM_BYTES[dtype], int(space.group(1)) if space else HBM


def _bytes(type_text: str, space: int | None) -> int:
    return sum(b for b, s in _arrays(type_text) if space is None or s == space)


def _split_type(rest: str) -> tuple[str, str]:
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].strip()
    head, _, tail = rest.partition(" ")
    return head, tail.strip()


def _parse(text: str) -> tuple[dict[str, list[_Op]], str]:
    computations: dict[str, list[_Op]] = {}
    current, entry = None, ""
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head and not line.startswith(" "):
            current = head.group(2)
            computations[current] = []
            entry = current if head.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m is None or current is None:
            continue
        type_text, rest = _split_type(m.group(3))
        opcode = re.match(r"([\w\-]+)\(", rest)
        start, depth, end = rest.find("("), 0, len(rest)
        for j in range(start, len(rest)):
            depth += {"(": 1, ")": -1}.get(rest[j], 0)
            if depth == 0:
                end = j
                break
        operands = tuple(re.findall(r"%([\w.\-]+)", rest[start : end + 1]))
        op = _Op(
            m.group(2),
            type_text,
            opcode.group(1) if opcode else "",
            operands,
            rest[end + 1 :],
            bool(m.group(1)),
            rest[start + 1 : end],
        )
        computations[current].append(op)
    return computations, entry


class _Counter:
    def __init__(self, text: str) -> None:
        self.computations, self.entry = _parse(text)
        self.ops = {(c, op.name): op for c, ops in self.computations.items() for op in ops}
        self.skipped: set[str] = set()  # branches counted as not taken

    def scoped(self, name: str, scopes: tuple[str, ...]) -> bool:
        """Whether computation `name` (or a fusion it calls) has an op in one of `scopes`."""
        for op in self.computations[name]:
            if any(f"/{scope}/" in op.attrs for scope in scopes):
                return True
            if op.opcode == "fusion" and self.scoped(self.called(op, "calls")[0], scopes):
                return True
        return False

    def called(self, op: _Op, key: str) -> list[str]:
        m = re.search(key + r"=(\{[^}]*\}|%[\w.\-]+)", op.attrs)
        return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []

    def computation(self, name: str, space: int | None) -> int:
        return sum(self.op(name, op, space) for op in self.computations[name])

    def parameters(self, computation: str) -> dict[int, str]:
        return {
            int(op.inside): op.name
            for op in self.computations[computation]
            if op.opcode == "parameter"
        }

    def read(self, fused: str, name: str, type_text: str) -> int:
        """What a fusion's ops read of value `name` (a parameter, or a bitcast of one)."""
        total = 0
        for user in (op for op in self.computations[fused] if name in op.operands):
            first = user.operands[0] == name
            if user.opcode in ("slice", "dynamic-slice", "gather") and first:
                total += _bytes(user.type, None)
            elif user.opcode in ("dynamic-update-slice", "scatter") and first:
                continue  # updated in place
            elif user.opcode == "bitcast":
                total += self.read(fused, user.name, user.type)
            elif user.opcode == "fusion":  # a nested fusion: what its own parameter's users read
                nested = self.called(user, "calls")[0]
                params = self.parameters(nested)
                for k, operand in enumerate(user.operands):
                    if operand == name:
                        total += self.read(nested, params[k], type_text)
            else:
                return _bytes(type_text, None)
        return total

    def fusion(self, computation: str, op: _Op, space: int | None) -> int:
        fused = self.called(op, "calls")[0]
        params = self.parameters(fused)
        total = 0
        for i, operand in enumerate(op.operands):
            outer = self.ops[(computation, operand)].type
            if _bytes(outer, space) and i in params:
                total += self.read(fused, params[i], outer)
        root = next(inner for inner in self.computations[fused] if inner.root)
        outputs = list(_arrays(op.type))
        parts = [root] if root.opcode != "tuple" else [
            self.ops[(fused, name)] for name in root.operands
        ]  # fmt: skip
        for (size, where), part in zip(outputs, parts, strict=False):
            if space is not None and where != space:
                continue
            if part.opcode == "dynamic-update-slice":
                size = _bytes(self.ops[(fused, part.operands[1])].type, None)
            elif part.opcode == "scatter":
                size = _bytes(self.ops[(fused, part.operands[2])].type, None)
            total += size
        return total

    def op(self, computation: str, op: _Op, space: int | None) -> int:
        code = op.opcode
        if code in FREE:
            return 0
        if code == "fusion":
            return self.fusion(computation, op, space)
        if code == "custom-call" and '"tpu_custom_call"' in op.attrs:
            return 0
        if code == "conditional":
            branches = self.called(op, "branch_computations")
            branches = branches or self.called(op, "true_computation") + self.called(
                op, "false_computation"
            )
            taken = [b for b in branches if b not in self.skipped] or branches
            return max(self.computation(b, space) for b in taken)
        if code == "while":
            return sum(self.computation(b, space) for b in self.called(op, "body"))
        if code in ("call", "call-start", "async-start"):
            return sum(
                self.computation(c, space)
                for c in self.called(op, "to_apply") + self.called(op, "calls")
            )
        if code == "copy-start":  # (one end, the other end, context)
            return sum(b for b, s in list(_arrays(op.type))[:2] if space is None or s == space)
        if code == "slice-start":  # ((source), destination, context): the slice both sides
            arrays = list(_arrays(op.type))
            size, where = arrays[-2]
            source = arrays[0][1]
            return size * ((space is None or source == space) + (space is None or where == space))
        operands = sum(
            _bytes(self.ops[(computation, o)].type, space)
            for o in op.operands
            if (computation, o) in self.ops
        )
        return _bytes(op.type, space) + operands


def traffic(hlo_text: str, untaken: tuple[str, ...] = ()) -> Traffic:
    """The bytes a compiled program's ops move: in every memory space, and in HBM; and
    the same where no conditional takes a branch that has an op in one of the named
    scopes `untaken` (jax.named_scope; each such conditional at its costliest other
    branch)."""
    counter = _Counter(hlo_text)
    entry = counter.entry
    every = counter.computation(entry, None), counter.computation(entry, HBM)
    counter.skipped = {
        branch
        for name, ops in counter.computations.items()
        for op in ops
        if op.opcode == "conditional"
        for branch in counter.called(op, "branch_computations")
        if untaken and counter.scoped(branch, untaken)
    }
    plain = counter.computation(entry, None), counter.computation(entry, HBM)
    return Traffic(float(every[0]), float(every[1]), float(plain[0]), float(plain[1]))
