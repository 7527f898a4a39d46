"""The strategy lint's reading of a compiled forward graph (issue 34): every primitive a semi-auto model
calls, with its strategy, its inputs' shapes and the cell that called it, read off the IR MindSpore
saves when it compiles the model's forward pass on the CPU (stand-alone: the strategies are attributes
the CPU ignores, the graph is the logical one a semi-auto compile partitions).

`problems(nodes, devices, tp)` names each primitive that a semi-auto compile would split by MindSpore's
default batch strategy (none set), or whose strategy does not fit its inputs: a length other than the
input's rank, a split that does not divide its dimension, more devices than the stage has, or a
batch-parallel-only operator where tp > 1 (it would reduce each device's own rows, unnoticed)."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

# No strategy of their own: the compiler lays them out from their neighbours (or they move no data).
LAYOUT_FREE = {"Reshape", "Cast", "Depend", "Load", "UpdateState", "MakeTuple", "TupleGetItem", "StopGradient",
               "Switch", "Return", "Partial", "Shape", "ZerosLike", "OnesLike", "ExpandDims", "Squeeze",
               "ScalarToTensor", "TupleToTensor", "TensorToTuple", "ListToTensor", "make_range"}
# registered in MindSpore as BatchParallelInfo: split along the batch over every device, reduced locally
BATCH_PARALLEL = {"SparseSoftmaxCrossEntropyWithLogits", "CheckValid"}
# strategies that describe the output, not the inputs (MindSpore's OneHotInfo)
OUTPUT_STRATEGY = {"OneHot"}

_NODE = re.compile(r"^\s+%\S+ = (?:PrimFunc_)?(?P<op>[A-Za-z_][\w]*)\((?P<rest>.*)$")
_TENSOR = re.compile(r"<Tensor\[\w+\], \(([\d, ]*)\)")
_SCOPE = re.compile(r"# Fullname with scope: \((?P<scope>[^)]*)\)")


@dataclasses.dataclass
class Node:
    op: str
    scope: str
    strategy: tuple | None
    inputs: list[tuple[int, ...] | None]      # each input's shape; None: not a tensor
    output: tuple[int, ...] | None

    def where(self) -> str:
        return f"{self.op} in {self.scope}"


def forward_ir(folder: Path) -> Path:
    """The saved IR after inlining: every primitive, with its cell's scope and its inputs' shapes."""
    found = sorted(p for p in folder.glob("*.ir") if re.match(r"\d+_inline_\d+\.ir$", p.name))
    if not found:
        raise FileNotFoundError(f"no *_inline_*.ir under {folder}: MindSpore's IR dump names have changed")
    return found[0]


def read_nodes(ir: Path) -> list[Node]:
    lines = ir.read_text().splitlines()
    nodes = []
    for i, line in enumerate(lines):
        m = _NODE.match(line)
        if not m or i + 2 >= len(lines) or not lines[i + 1].lstrip().startswith(":"):
            continue
        scope = _SCOPE.search(lines[i + 2])
        inputs, output = _abstracts(lines[i + 1])
        nodes.append(Node(op=m["op"], scope=scope["scope"] if scope else "?", strategy=_strategy(m["rest"]),
                          inputs=inputs, output=output))
    return nodes


def _abstracts(line: str) -> tuple[list[tuple[int, ...] | None], tuple[int, ...] | None]:
    """(each input's shape, the output's shape) from `: (<in>, ...) -> (<out>)`."""
    ins, _, out = line.partition(") -> (")
    shapes = []
    for part in _split_top(ins.strip()[len(": ("):]):
        if part.startswith("<Tuple[Tensor"):           # a tuple of tensors (Concat's input): its elements
            shapes.extend(_shape(s) for s in re.findall(r"\(([\d, ]*)\)", part.partition("TupleShape")[2]))
        else:
            t = _TENSOR.match(part)
            shapes.append(_shape(t.group(1)) if t else None)
    t = _TENSOR.search(out)
    return shapes, _shape(t.group(1)) if t else None


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _split_top(text: str) -> list[str]:
    """`<a>, <b, <c>>` → ['<a>', '<b, <c>>']: the comma-separated abstracts at the top level."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _strategy(rest: str) -> tuple | None:
    at = rest.find("in_strategy: ")
    if at < 0:
        return None
    text, depth = rest[at + len("in_strategy: "):], 0
    for end, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            break
    value = eval(text[:end + 1].replace(")", ",)").replace("(,)", "()"), {})   # noqa: S307 (our own dump)
    return tuple(tuple(s) for s in value)


def problems(nodes: list[Node], devices: int, tp: int) -> list[str]:
    out = []
    for n in nodes:
        tensors = [s for s in n.inputs if s is not None]
        if n.op in LAYOUT_FREE or not n.op[0].isupper() or not any(tensors):   # graph calls; scalar-only arithmetic
            continue
        if n.op in BATCH_PARALLEL and tp > 1:
            out.append(f"{n.where()}: batch-parallel only (each device reduces its own rows) under tp {tp}")
            continue
        if n.strategy is None:
            out.append(f"{n.where()}: no strategy (MindSpore's default batch split would redistribute around it)")
            continue
        shapes = [n.output] if n.op in OUTPUT_STRATEGY else tensors
        for k, (split, shape) in enumerate(zip(n.strategy, shapes)):
            if len(split) != len(shape):
                out.append(f"{n.where()}: strategy {split} for input {k} of rank {len(shape)} {shape}")
            elif any(d % s for d, s in zip(shape, split)):
                out.append(f"{n.where()}: strategy {split} does not divide input {k}'s shape {shape}")
            elif math.prod(split) > devices:
                out.append(f"{n.where()}: strategy {split} needs {math.prod(split)} devices, the stage has {devices}")
    return out


# ---- the partitioned graph (issue 47): MindSpore's dry run, after the parallel pass ----------------------
# `plan --dry-run`'s compile of one rank (engine.layout.dry_run.simulate with ir_dir) saves the graph after
# the parallel pass, `step_parallel_end_*.ir`: each parameter as this rank holds it (its slice), the
# gradients' reductions the compiler inserted (collectives carrying `mirror_user_id: "<parameter>"`), and
# the loss's divisor (`_VirtualDiv`, inserted only where the pass found the loss).
_PARAM = re.compile(r"^%para\d+_(?P<name>[^:]+): <Ref\[Tensor\[\w+\]\], \((?P<shape>[\d, ]*)\)")
_COMM = re.compile(r"= (?P<op>_Mirror\w*|_MicroStep\w*|AllReduce|ReduceScatter|AllGather)\(")
_GROUP = re.compile(r'\bgroup: "(?P<group>[^"]+)"')
_MIRROR_USER = re.compile(r'mirror_user_id: "(?P<param>[^"]+)"')
_DIVISOR = re.compile(r"= _VirtualDiv\(.*\bdivisor: I64\((?P<d>\d+)\)")
WORLD_GROUPS = {"hccl_world_group", "nccl_world_group", "mccl_world_group"}


@dataclasses.dataclass
class Partitioned:
    params: dict[str, tuple[int, ...]]           # every parameter, shaped as this rank holds it
    divisors: list[int]                          # the loss divisors (_VirtualDiv) the pass inserted
    reductions: dict[str, list[tuple[str, int]]]  # parameter -> (collective, its group's size) per gradient reduction
    norm_divs: int = 0                            # square sums the global norm divides by replicas (HandleGlobalNormScale)
    norm_reduced: bool = False                    # ... and their sum all-reduced within the stage
    norm_all_reduces: list[int] = dataclasses.field(default_factory=list)   # the step's own norm all-reduce: group sizes
    held_counts: int = 0                          # square sums weighted by the elements this rank holds (issue 47)
    updates: int = 0                              # the optimizer's updates (AdamWeightDecay) in this rank's graph

    def gradient_factor(self, stage_devices: int) -> float:
        """The update's gradient over the global mean's, as the compiler reduces it: every device of the stage
        holds the whole loss (it is replicated) and back-propagates it, the mirrors sum the replicas'
        gradients, so the sum is stage_devices times the mean's unless the loss is divided by them.
        The pass divides each tensor input of the loss node by the same divisor (the step's loss node is the
        loss times the loss scale: two _VirtualDivs, one on the path to the parameters)."""
        if len(set(self.divisors)) > 1:
            raise ValueError(f"loss divisors {self.divisors} differ: which one reaches the parameters?")
        return stage_devices / (self.divisors[0] if self.divisors else 1)


def partitioned_ir(folder: Path) -> Path:
    found = sorted(folder.rglob("step_parallel_end_*.ir"))
    if not found:
        raise FileNotFoundError(f"no step_parallel_end_*.ir under {folder}: MindSpore's IR dump names have changed")
    return found[-1]


def group_size(group: str, devices: int) -> int:
    """A group's size from its name: MindSpore names a group it creates "<size>-<hash>"; the world is `devices`."""
    if group in WORLD_GROUPS:
        return devices
    head = group.split("-", 1)[0]
    if not head.isdigit():
        raise ValueError(f"group {group!r}: not MindSpore's <size>-<hash> name")
    return int(head)


def read_partitioned(ir: Path, devices: int) -> Partitioned:
    params, divisors, reductions = {}, [], {}
    text = ir.read_text()
    norm_divs = len(re.findall(r"instance name: PARALLEL_GLOBALNORM_DIV\b", text))
    norm_reduced = re.search(r"instance name: PARALLEL_GLOBALNORM_IN_STAGES\b", text) is not None
    # engine.training.sharded_step: the norm's one reduction (the primitive `norm_sum`), and each gradient's
    # count of the elements this rank holds (`held`), its square sum's weight
    norm_all_reduces = [group_size(g["group"], devices) for line in text.splitlines()
                        if re.search(r"= AllReduce\(.*\binstance name: norm_sum\b", line) and (g := _GROUP.search(line))]
    updates = len(re.findall(r"= (?:PrimFunc_)?AdamWeightDecay\(", text))
    held_counts = len(re.findall(r"^\s+%\d+\(held\) = (?:PrimFunc_)?ReduceSum\(", text, re.MULTILINE))
    for line in text.splitlines():
        if m := _PARAM.match(line):
            params[m["name"]] = _shape(m["shape"])
        elif m := _DIVISOR.search(line):
            divisors.append(int(m["d"]))
        elif (c := _COMM.search(line)) and (u := _MIRROR_USER.search(line)) and (g := _GROUP.search(line)):
            reductions.setdefault(u["param"], []).append((c["op"], group_size(g["group"], devices)))
    return Partitioned(params, divisors, reductions, norm_divs, norm_reduced, norm_all_reduces, held_counts,
                       updates)


def norm_problems(part: Partitioned, devices: int, gradients: int) -> list[str]:
    """What keeps the partitioned step's global norm from being the same on every rank by construction
    (issue 47): its square sums must meet in one all-reduce over the world, each weighted by the elements this
    rank holds (a slice's holders), and nothing of MindSpore's HandleGlobalNormScale may rescale or reduce them
    again (its search for `grad_scale` marks is 10 nodes deep: a parameter it misses keeps a local norm)."""
    out = []
    if part.norm_all_reduces != [devices]:
        out.append(f"the norm's all-reduce over the world ({devices} devices): found {part.norm_all_reduces}")
    if part.held_counts != gradients:
        out.append(f"{part.held_counts} of {gradients} square sums weighted by the elements this rank holds")
    if part.norm_divs or part.norm_reduced:
        out.append(f"HandleGlobalNormScale rescaled {part.norm_divs} square sums"
                   f"{' and all-reduced them within the stage' if part.norm_reduced else ''}: the norm depends on "
                   "its search")
    return out


def partition_problems(part: Partitioned, whole: dict[str, tuple[int, ...]], splits: dict[str, tuple[int, ...]],
                       stage_devices: int, optimizer_shard_dp: int = 1) -> list[str]:
    """What the partitioned graph gets wrong for the trainable parameters `whole` (name -> full shape):
    - the loss's divisor: missing, or not the stage's devices (the gradient factor is not 1);
    - a parameter's slice unlike its layout's strategy `splits` (name -> splits per dimension; whole if not
      named), allowing the optimizer shard's further split of dimension 0 by dp;
    - a gradient with no reduction, or reduced over a group other than its slice's replicas (a device
      count over its slices)."""
    out = []
    factor = part.gradient_factor(stage_devices)
    if not part.divisors and stage_devices > 1:       # one device: nothing to divide by, none inserted
        out.append(f"no loss divisor (_VirtualDiv): the pass did not find the loss; every gradient is summed over "
                   f"the stage's {stage_devices} devices (factor {factor:g})")
    elif factor != 1:
        out.append(f"loss divisor {part.divisors} on {stage_devices} devices: gradient factor {factor:g}")
    for name, shape in whole.items():
        if name not in part.params:
            out.append(f"{name}: not a parameter of the partitioned graph")
            continue
        got = part.params[name]
        split = splits.get(name)          # None: not one the layout names (a bias): its slice as the IR has it
        if split is None:
            split = tuple(d // max(g, 1) for d, g in zip(shape, got))
        want = tuple(d // s for d, s in zip(shape, split))
        sharded = (want[0] // optimizer_shard_dp,) + want[1:] if want and optimizer_shard_dp > 1 else want
        if got not in (want, sharded):
            out.append(f"{name}: slice {got}, the layout's strategy {split} of {shape} gives {want}")
        slices = math.prod(split)
        replicas = stage_devices // slices
        groups = [size for _, size in part.reductions.get(name, [])]
        if replicas > 1 and not groups:
            out.append(f"{name}: its gradient is not reduced (held by {replicas} devices)")
        elif replicas > 1 and replicas not in groups and max(groups) != replicas:
            out.append(f"{name}: gradient reduced over {groups} devices, its slice has {replicas} replicas")
    return out
