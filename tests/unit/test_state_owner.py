"""RunState has one writer: its fields change only inside its own module, through its methods, and those
methods that change it are called only by the Ledger (daemon/records/ledger.py) and the rebuild from the
event log (daemon/records/state_rebuild.py): the live path and the rebuild call the same ones; every other
module reads the state and asks the Ledger to record what changes.

Checked on the source, by an AST walk of every project module outside tests/, in two steps.

What holds a RunState, found to a fixed point over the whole tree: `RunState(...)` and its class
methods; a function annotated to return one (or a tuple with one, for unpacking) or returning one; an
attribute a class declares as one or assigns one to (`Ledger.state`, plot's `Run.state`) or a property
that returns one (`Supervisor.state`); a parameter annotated with it or passed one at a call site (the
callee found by its name); a local name bound to any of these. A field of one, or anything below a
field, is a part of it, and so is a name bound to a container field (`changes = state.config_changes`)
or a parameter passed one.

What changes one, reported anywhere but daemon/records/state.py: assigning, augmenting or deleting an attribute
or item of a RunState or of a part; a mutating method (append, update, pop, ...) called on a part;
`+=` on a name bound to a container field; setattr/delattr/object.__setattr__ or vars()/__dict__ on
one; dataclasses.replace of one. Calling RunState's own methods is the allowed way.

It errs on the side of alarm: attributes and callees are matched by name, so an attribute named like
one that holds a RunState (`.state`) is taken to hold one everywhere; name other state otherwise.
The test fed the tree before RunState had its methods found the 45 assignments it then had.
"""
from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OWNER = Path("daemon", "records", "state.py")
# the Ledger; the rebuild from the event log; and the Ledger's state file, whose save stamps updated_unix_s
WRITERS = (Path("daemon", "records", "ledger.py"), Path("daemon", "records", "state_rebuild.py"),
           Path("daemon", "records", "state_file.py"))
CLASS = "RunState"
WHOLE = "whole"     # a function's result is a RunState (else: the index of one in the tuple it returns)
MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault",
                      "sort", "reverse", "add", "discard", "__setitem__", "__delitem__", "__iadd__", "__ior__"})
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def project_modules(root: Path) -> list[Path]:
    """Every .py file of the project's top-level directories but tests/ (and hidden ones, build output,
    virtual environments): daemon, engine, checkpointing, chaos, durable, bench, and any package added."""
    out = []
    for top in sorted(p for p in root.iterdir() if p.is_dir()):
        if top.name.startswith((".", "_")) or top.name in ("tests", "build", "dist") or top.name.endswith(
                ".egg-info") or (top / "pyvenv.cfg").exists():
            continue
        out += [p for p in sorted(top.rglob("*.py"))
                if not any(part.startswith(".") or part == "site-packages" for part in p.relative_to(root).parts)]
    return out


def _own_nodes(node: ast.AST):
    """The nodes of one scope: below `node`, not inside a nested function or class."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, SCOPES):
            yield from _own_nodes(child)


def _annotation(node: ast.AST | None):
    """WHOLE if a type annotation says RunState (alone, `| None`, Optional[...], quoted), the index of
    RunState in a tuple annotation, else None."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _annotation(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return None
    if isinstance(node, (ast.Name, ast.Attribute)):
        return WHOLE if (node.id if isinstance(node, ast.Name) else node.attr) == CLASS else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return WHOLE if WHOLE in (_annotation(node.left), _annotation(node.right)) else None
    if isinstance(node, ast.Subscript):
        base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        if base in ("Optional", "Union"):
            args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return WHOLE if any(_annotation(a) == WHOLE for a in args) else None
        if base in ("tuple", "Tuple") and isinstance(node.slice, ast.Tuple):
            return next((i for i, a in enumerate(node.slice.elts) if _annotation(a) == WHOLE), None)
    return None


@dataclasses.dataclass
class Func:
    key: str                     # "daemon.records.ledger.Ledger._load"
    node: ast.AST                # a FunctionDef, a ClassDef (its body) or a Module (its top level)
    module: Module
    cls: str | None              # the class a method is defined in
    kind: str                    # function, method, classmethod, staticmethod, property, class, module
    params: list[str]            # positional parameters, without self/cls
    outer: Func | None           # the enclosing scope (a closure reads its names)


@dataclasses.dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # alias -> (module, attr or "")
    scopes: list[Func] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Facts:
    holders: set[str] = dataclasses.field(default_factory=set)             # attribute names holding a RunState
    returns: dict[str, object] = dataclasses.field(default_factory=dict)   # function key -> WHOLE or tuple index
    whole_params: set[tuple[str, str]] = dataclasses.field(default_factory=set)   # (function key, parameter)
    part_params: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    containers: set[str] = dataclasses.field(default_factory=set)          # RunState's list/dict fields


class Analysis:
    """The two steps of the module docstring over one source tree."""

    def __init__(self, root: Path):
        self.root = root
        paths = project_modules(root)
        names = {p: ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__") for p in paths}
        self.module_names = set(names.values())
        self.modules = [self._module(names[p], p) for p in paths]
        self.by_key = {f.key: f for m in self.modules for f in m.scopes}
        self.methods = {}       # name -> instance methods of that name (a call on an unknown receiver)
        for f in self.by_key.values():
            if f.kind == "method":
                self.methods.setdefault(f.key.rsplit(".", 1)[-1], []).append(f)
        self.facts = Facts(containers=self._containers())
        # scope key -> names bound to a RunState, to a part of one, to a container field of one
        self.bound: dict[str, tuple[set[str], set[str], set[str]]] = {}
        for _ in range(100):                    # what is known only grows, so a fixed point comes
            before = self._known()
            for m in self.modules:
                for scope in m.scopes:
                    self._learn(scope)
            if self._known() == before:
                break
        else:
            raise AssertionError("the analysis found no fixed point")

    def _known(self):
        f = self.facts
        return (len(f.holders), sorted(f.returns.items(), key=str), len(f.whole_params), len(f.part_params),
                sum(len(names) for bound in self.bound.values() for names in bound))

    # The tree ---------------------------------------------------------------------------------------
    def _module(self, name: str, path: Path) -> Module:
        m = Module(name, path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    m.imports[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], "")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                for a in node.names:
                    full = f"{base}.{a.name}"
                    m.imports[a.asname or a.name] = (full, "") if full in self.module_names or not base else (base, a.name)
        m.scopes.append(Func(name, m.tree, m, None, "module", [], None))
        self._scopes(m, m.tree, name, None, m.scopes[0])
        return m

    def _scopes(self, m: Module, node: ast.AST, prefix: str, cls: str | None, outer: Func) -> None:
        for child in _own_nodes(node):
            if isinstance(child, ast.ClassDef):
                f = Func(f"{prefix}.{child.name}", child, m, child.name, "class", [], outer)
                m.scopes.append(f)
                self._scopes(m, child, f.key, child.name, outer)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in child.decorator_list}
                kind = next((k for k in ("property", "classmethod", "staticmethod") if k in decorators),
                            "method" if node is not m.tree and isinstance(node, ast.ClassDef) else "function")
                args = [a.arg for a in [*child.args.posonlyargs, *child.args.args]]
                if kind in ("method", "classmethod", "property"):
                    args = args[1:]
                f = Func(f"{prefix}.{child.name}", child, m, cls if kind != "function" else None, kind,
                         args + [a.arg for a in child.args.kwonlyargs], outer)
                m.scopes.append(f)
                self._scopes(m, child, f.key, None, f)

    def _containers(self) -> set[str]:
        owner = next((m for m in self.modules if m.path == self.root / OWNER), None)
        cls = owner and next((n for n in owner.tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS), None)
        return {n.target.id for n in (cls.body if cls else ()) if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name) and any(isinstance(s, ast.Name) and s.id in (
                    "list", "dict", "List", "Dict", "Mapping") for s in ast.walk(n.annotation))}

    def _resolve(self, func: ast.AST, scope: Func) -> tuple[list[Func], str | None]:
        """The project functions a call's callee may be, and the class key when it constructs a class."""
        m, target = scope.module, None
        if isinstance(func, ast.Name):
            local = [f for f in m.scopes if f.key.rsplit(".", 1)[-1] == func.id and f.kind in ("function", "class")]
            if local:
                target = local[0].key
            elif func.id in m.imports:
                mod, attr = m.imports[func.id]
                target = f"{mod}.{attr}" if attr else None
        elif isinstance(func, ast.Attribute):
            base = func.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls") and _class_of(scope):
                target = f"{_class_of(scope)}.{func.attr}"
            elif isinstance(base, ast.Name) and (base.id in m.imports or any(
                    f.kind == "class" and f.key == f"{m.name}.{base.id}" for f in m.scopes)):
                mod, attr = m.imports.get(base.id, (m.name, base.id))
                target = f"{mod}.{attr}.{func.attr}" if attr else f"{mod}.{func.attr}"
                if not attr and mod not in self.module_names:
                    return [], None                     # json.load, os.replace: not the project's
            else:
                return list(self.methods.get(func.attr, ())), None
        if target is None:
            return [], None
        f = self.by_key.get(target)
        if f is not None and f.kind == "class":
            init = self.by_key.get(f"{target}.__init__")
            return ([init] if init else []), target
        return ([f] if f else []), None

    # What holds a RunState --------------------------------------------------------------------------
    def result(self, call: ast.Call, scope: Func):
        funcs, cls = self._resolve(call.func, scope)
        if cls is not None and cls.rsplit(".", 1)[-1] == CLASS:
            return WHOLE
        return next((self.facts.returns[f.key] for f in funcs if f.key in self.facts.returns), None)

    def is_whole(self, e: ast.AST, scope: Func) -> bool:
        if isinstance(e, ast.Name):
            return self._named(e.id, scope, 0)
        if isinstance(e, ast.Attribute):
            return e.attr in self.facts.holders
        if isinstance(e, ast.Call):
            return self.result(e, scope) == WHOLE
        return any(self.is_whole(v, scope) for v in _alternatives(e))

    def is_part(self, e: ast.AST, scope: Func) -> bool:
        """A field of a RunState or anything below one (not a copy: a call's result is not a part)."""
        if isinstance(e, ast.Name):
            return self._named(e.id, scope, 1)
        if isinstance(e, (ast.Attribute, ast.Subscript)):
            return self.is_whole(e.value, scope) or self.is_part(e.value, scope)
        return any(self.is_part(v, scope) for v in _alternatives(e))

    def is_container(self, e: ast.AST, scope: Func) -> bool:
        """A list/dict field of a RunState, or a name bound to one: `+=` on such a name changes the state."""
        if isinstance(e, ast.Name):
            return self._named(e.id, scope, 2)
        if isinstance(e, ast.Attribute):
            return self.is_whole(e.value, scope) and e.attr in self.facts.containers
        return any(self.is_container(v, scope) for v in _alternatives(e))

    def _named(self, name: str, scope: Func, which: int) -> bool:
        return any(name in self.bound[s.key][which] for s in _chain(scope) if s.key in self.bound)

    def _learn(self, scope: Func) -> None:
        whole, parts, containers = self.bound.setdefault(scope.key, (set(), set(), set()))
        node = scope.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for a in args:
                if _annotation(a.annotation) == WHOLE or (scope.key, a.arg) in self.facts.whole_params:
                    whole.add(a.arg)
                if (scope.key, a.arg) in self.facts.part_params:
                    parts.add(a.arg)
                    containers.add(a.arg)
            returned = _annotation(node.returns)
            for r in _own_nodes(node):
                if isinstance(r, ast.Return) and r.value is not None:
                    if self.is_whole(r.value, scope):
                        returned = WHOLE
                    elif isinstance(r.value, ast.Tuple):
                        returned = next((i for i, v in enumerate(r.value.elts) if self.is_whole(v, scope)), returned)
                    elif isinstance(r.value, ast.Call) and isinstance(self.result(r.value, scope), int):
                        returned = self.result(r.value, scope)
            if returned is not None:
                (self.facts.holders.add(node.name) if scope.kind == "property"
                 else self.facts.returns.__setitem__(scope.key, returned))
        for n in _own_nodes(node):
            if isinstance(n, ast.AnnAssign) and scope.kind == "class" and isinstance(n.target, ast.Name) \
                    and _annotation(n.annotation) == WHOLE:
                self.facts.holders.add(n.target.id)
            for target, value, element in _bindings(n):
                self._bind(target, value, scope, (whole, parts, containers), element=element)
            if isinstance(n, ast.Call):
                funcs, _ = self._resolve(n.func, scope)
                # a method called on an object of unknown class (`self.x.save(state)`) resolves to every
                # project method of that name; a RunState passed there is followed only when that name is
                # one method's (else `state` would make every `save(step)` a holder); an annotated parameter
                # (`state: RunState`) is seen whatever the call site
                for f in funcs if len(funcs) == 1 else ():
                    given = [(f.params[i], a) for i, a in enumerate(n.args)
                             if i < len(f.params) and not any(isinstance(b, ast.Starred) for b in n.args[:i + 1])]
                    given += [(k.arg, k.value) for k in n.keywords if k.arg in f.params]
                    for param, value in given:
                        if self.is_whole(value, scope):
                            self.facts.whole_params.add((f.key, param))
                        elif self.is_container(value, scope):
                            self.facts.part_params.add((f.key, param))

    def _bind(self, target, value, scope, names: tuple[set[str], set[str], set[str]], *, element: bool = False) -> None:
        whole, parts, containers = names
        if isinstance(target, (ast.Tuple, ast.List)):
            if element:                                 # for name, value in <a part>
                for t in _flat(target.elts):
                    self._bind(t, value, scope, names, element=True)
            elif isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts):
                    self._bind(t, v, scope, names)
            elif isinstance(value, ast.Call) and isinstance(i := self.result(value, scope), int) \
                    and i < len(target.elts) and isinstance(target.elts[i], ast.Name):
                whole.add(target.elts[i].id)
            return
        if isinstance(target, ast.Attribute) and self.is_whole(value, scope) and not element:
            self.facts.holders.add(target.attr)         # self.state = RunState.load(...)
        if not isinstance(target, ast.Name):
            return
        if element:                                     # for r in state.incidents
            if self.is_part(value, scope) or self.is_whole(value, scope):
                parts.add(target.id)
        elif self.is_whole(value, scope):
            whole.add(target.id)
        elif self.is_part(value, scope):
            parts.add(target.id)
            if self.is_container(value, scope):
                containers.add(target.id)

    def mutating_methods(self) -> set[str]:
        """RunState's methods that change it: they assign, augment or delete an attribute of `self` (or
        below one), call a mutating method on one, or call another such method of `self` (a fixed point)."""
        owner = next((m for m in self.modules if m.path == self.root / OWNER), None)
        cls = owner and next((n for n in owner.tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS), None)
        methods = {n.name: n for n in (cls.body if cls else ()) if isinstance(n, ast.FunctionDef)}

        def on_self(e: ast.AST) -> bool:
            while isinstance(e, (ast.Attribute, ast.Subscript)):
                e = e.value
            return isinstance(e, ast.Name) and e.id == "self"

        found: set[str] = set()
        while True:
            more = set(found)
            for name, fn in methods.items():
                for n in ast.walk(fn):
                    targets = (n.targets if isinstance(n, (ast.Assign, ast.Delete))
                               else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
                    if any(isinstance(x, (ast.Attribute, ast.Subscript)) and on_self(x) for x in _flat(targets)):
                        more.add(name)
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and on_self(n.func.value) and (
                            n.func.attr in MUTATORS and isinstance(n.func.value, ast.Attribute)
                            or isinstance(n.func.value, ast.Name) and n.func.attr in found):
                        more.add(name)
            if more == found:
                return found
            found = more

    # What changes one --------------------------------------------------------------------------------
    def violations(self) -> list[str]:
        found, mutating = [], self.mutating_methods()
        for m in self.modules:
            if m.path == self.root / OWNER:
                continue
            writer = m.path in [self.root / w for w in WRITERS]
            for scope in m.scopes:
                for n in _own_nodes(scope.node):
                    if self._changes(n, scope) or not writer and self._calls_mutator(n, scope, mutating):
                        found.append(f"{m.path.relative_to(self.root)}:{n.lineno}: {ast.unparse(n).splitlines()[0]}")
        return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))

    def _calls_mutator(self, n: ast.AST, scope: Func, mutating: set[str]) -> bool:
        """`ledger.state.set_status(...)` outside the Ledger: a second writer."""
        return isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in mutating \
            and self.is_whole(n.func.value, scope)

    def _changes(self, n: ast.AST, scope: Func) -> bool:
        def below(e: ast.AST) -> bool:
            return self.is_whole(e, scope) or self.is_part(e, scope)

        targets = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and (n.value is not None or isinstance(n, ast.AugAssign)):
            targets = [n.target]
            if isinstance(n, ast.AugAssign) and self.is_container(n.target, scope):
                return True                             # changes = state.config_changes; changes |= {...}
        elif isinstance(n, ast.Delete):
            targets = n.targets
        elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
            targets = [n.target]
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            targets = [n.optional_vars]
        elif isinstance(n, ast.NamedExpr):
            targets = [n.target]
        for t in _flat(targets):
            if isinstance(t, (ast.Attribute, ast.Subscript)) and below(t.value):
                return True
        if isinstance(n, ast.Attribute) and n.attr == "__dict__" and below(n.value):
            return True
        if not isinstance(n, ast.Call):
            return False
        f, first = n.func, n.args[0] if n.args else None
        if isinstance(f, ast.Attribute) and f.attr in MUTATORS and self.is_part(f.value, scope):
            return True                                 # state.incidents.append(...)
        if isinstance(f, ast.Attribute) and f.attr in ("__setattr__", "__delattr__"):
            return below(f.value) or (first is not None and below(first))
        builtin = f.id if isinstance(f, ast.Name) else ""       # or dataclasses.replace, however imported
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "dataclasses":
            builtin = f.attr
        return builtin in ("setattr", "delattr", "vars", "replace") and first is not None and below(first)


def _class_of(scope: Func) -> str | None:
    """The key of the class whose `self` a scope sees (a method's, or an enclosing method's for a closure)."""
    for s in _chain(scope):
        if s.cls is not None and s.kind != "class":
            return s.key.rsplit(".", 1)[0]
    return None


def _chain(scope: Func | None):
    while scope is not None:
        yield scope
        scope = scope.outer


def _alternatives(e: ast.AST) -> list[ast.AST]:
    """What an expression may evaluate to, when it passes a value through: `a or b`, `a if c else b`, `(x := a)`."""
    if isinstance(e, ast.BoolOp):
        return e.values
    if isinstance(e, ast.IfExp):
        return [e.body, e.orelse]
    if isinstance(e, (ast.NamedExpr, ast.Await)):
        return [e.value]
    return []


def _bindings(n: ast.AST):
    """(target, value, is an element of value) for each name a statement binds."""
    if isinstance(n, ast.Assign):
        return [(t, n.value, False) for t in n.targets]
    if isinstance(n, (ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
        return [(n.target, n.value, False)]
    if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
        return [(n.target, n.iter, True)]
    return []


def _flat(targets):
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            yield from _flat(t.elts)
        elif isinstance(t, ast.Starred):
            yield from _flat([t.value])
        else:
            yield t


# The tests ----------------------------------------------------------------------------------------------
def test_runstate_changes_only_inside_its_own_module():
    found = Analysis(ROOT).violations()
    assert not found, (f"RunState is changed outside {OWNER} ({len(found)} places); give RunState a method "
                       "for the change and call it:\n" + "\n".join(found))


def test_the_check_sees_the_run_state_where_the_daemon_holds_it():
    """A rename (of Ledger.state, of the rebuild's fold) must not blind the check: it still finds
    RunState values in the modules that use them most."""
    a = Analysis(ROOT)
    assert {"daemon", "engine", "checkpointing", "chaos"} <= {m.name.split(".")[0] for m in a.modules}
    assert "state" in a.facts.holders and a.facts.containers >= {"incidents", "config_changes", "processes"}
    for module in ("daemon.records.ledger", "daemon.acting.decisions", "daemon.records.state_rebuild", "daemon.supervisor",
                   "daemon.machines.generation_handshake", "daemon.machines.decision_exchange"):
        m = next(m for m in a.modules if m.name == module)
        held = [n for s in m.scopes for n in _own_nodes(s.node) if isinstance(n, ast.expr) and a.is_whole(n, s)]
        assert held, f"{module}: no RunState value found; the check no longer follows how the daemon holds it"


STATE = '''
import dataclasses

@dataclasses.dataclass
class RunState:
    generation: int = 0
    status: str = "new"
    incidents: list[int] = dataclasses.field(default_factory=list)
    config_changes: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path) -> "RunState":
        return cls()

    def set_status(self, status: str) -> None:
        self.status = status             # the owner may

    def bump(self) -> None:
        self.set_status("bumped")        # mutating through another method

    def describe(self) -> str:
        return f"{self.status} at {self.generation}"
'''

HEAD = "import dataclasses, json\nfrom dataclasses import replace\nfrom daemon.records.state import RunState\nfrom daemon.records import state as st\n"


@pytest.mark.parametrize("source", [
    "def f(ledger):\n    ledger.state.status = 'x'",
    "def f(ledger):\n    ledger.state.generation += 1",
    "def f(ledger):\n    a = b = ledger.state\n    a.generation = 2",
    "def f(ledger):\n    code, s = 3, ledger.state\n    s.generation = 2",
    "def f(ledger):\n    ledger.state.status, n = 'x', 1",
    "def f(ledger):\n    del ledger.state.status",
    "def f(ledger):\n    setattr(ledger.state, 'status', 'x')",
    "def f(ledger):\n    object.__setattr__(ledger.state, 'status', 'x')",
    "def f(ledger):\n    vars(ledger.state).update(status='x')",
    "def f(ledger):\n    ledger.state.__dict__['status'] = 'x'",
    "def f(ledger):\n    return dataclasses.replace(ledger.state, status='x')",
    "def f(ledger):\n    return replace(ledger.state, status='x')",
    "def f(ledger):\n    ledger.state.incidents.append(1)",
    "def f(ledger):\n    ledger.state.config_changes['k'] = 1",
    "def f(ledger):\n    del ledger.state.config_changes['k']",
    "def f(ledger):\n    ledger.state.config_changes.update(k=1)",
    "def f(ledger):\n    c = ledger.state.config_changes\n    c.pop('k')",
    "def f(ledger):\n    c = ledger.state.incidents\n    c += [1]",
    "def f(ledger):\n    for r in ledger.state.incidents:\n        r.kind = 1",
    "def f(s: RunState):\n    s.status = 'x'",
    "def f(s: 'RunState | None'):\n    s.status = 'x'",
    "def f(s: 'st.RunState'):\n    s.status = 'x'",
    "def f(path):\n    s = RunState.load(path)\n    s.status = 'x'",
    "def f(path):\n    s = st.RunState()\n    s.status = 'x'",
    "def fold() -> tuple[RunState, int]:\n    return RunState(), 0\n\ndef f():\n    s, n = fold()\n    s.status = 'x'",
    "def fold():\n    return RunState(), 0\n\ndef f():\n    s, n = fold()\n    s.status = 'x'",
    "def g(x):\n    x.status = 'x'\n\ndef f(ledger):\n    g(ledger.state)",
    "def g(*, x):\n    x.status = 'x'\n\ndef f(ledger):\n    g(x=ledger.state)",
    "def g(xs):\n    xs.append(1)\n\ndef f(ledger):\n    g(ledger.state.incidents)",
    "class L:\n    def __init__(self):\n        self.run = RunState()\n\ndef f(l):\n    l.run.status = 'x'",
    "class L:\n    def make(self):\n        return RunState()\n    def f(self):\n        self.make().status = 'x'",
    "class L:\n    @property\n    def run(self):\n        return RunState()\n\ndef f(l):\n    l.run.status = 'x'",
    "@dataclasses.dataclass\nclass Run:\n    run: RunState\n\ndef f(r):\n    r.run.incidents.clear()",
    "def f(ledger):\n    def inner():\n        ledger.state.status = 'x'",
    "def f(ledger):\n    ledger.state.set_status('x')",                # a mutating method outside the Ledger
    "def f(ledger):\n    s = ledger.state\n    s.bump()",                  # one that calls a mutating one
    "def f(path):\n    RunState.load(path).set_status('x')",
    "def f(ledger):\n    s = ledger.state\n    def inner():\n        s.status = 'x'",
])
def test_the_check_finds_each_way_of_changing_a_run_state(tmp_path, source):
    _tree(tmp_path, HEAD + source)
    assert Analysis(tmp_path).violations(), f"not found:\n{source}"


@pytest.mark.parametrize("source", [
    "def f(ledger):\n    ledger.state.describe()",                     # a method that only reads
    "def f(ledger):\n    ledger.set_status('x')",                      # asking the Ledger
    "def f(ledger):\n    ledger.status = 'x'",
    "def f(ledger):\n    n = ledger.state.generation\n    n += 1",
    "def f(ledger):\n    label = ledger.state.status\n    label += ' (paused)'",
    "def f(ledger):\n    x = dict(ledger.state.config_changes)\n    x['k'] = 1",
    "def f(ledger):\n    ledger.metrics.update(status=ledger.state.status)",
    "def f(fp):\n    data = json.load(fp)\n    data['x'] = 1",
    "def f(ledger):\n    xs = [r for r in ledger.state.incidents]\n    xs.append(1)",
    "def f(text):\n    return text.replace('a', 'b')",
])
def test_the_check_lets_reads_and_the_owners_methods_be(tmp_path, source):
    _tree(tmp_path, HEAD + source)
    assert Analysis(tmp_path).violations() == []


LEDGER = """
from daemon.records.state import RunState

class Ledger:
    def __init__(self, run_dir):
        self.state = RunState.load(run_dir)     # so `<anything>.state` holds a RunState, as in the daemon
"""


def _tree(root: Path, source: str) -> None:
    (root / "daemon" / "records").mkdir(parents=True)
    (root / "daemon" / "__init__.py").write_text("")
    (root / "daemon" / "records" / "__init__.py").write_text("")
    (root / OWNER).write_text(STATE)
    (root / "daemon" / "records" / "ledger.py").write_text(LEDGER)
    (root / "daemon" / "user.py").write_text(textwrap.dedent(source))


def test_the_ledger_and_the_rebuild_may_call_the_mutating_methods(tmp_path):
    _tree(tmp_path, HEAD + "def f(ledger):\n    ledger.state.describe()")
    (tmp_path / "daemon" / "records" / "ledger.py").write_text(LEDGER + "\n    def set_status(self, s):\n"
                                                                "        self.state.set_status(s)\n")
    (tmp_path / "daemon" / "records" / "state_rebuild.py").write_text(
        "from daemon.records.state import RunState\n\ndef fold(path):\n    s = RunState.load(path)\n    s.bump()\n"
        "    return s\n")
    analysis = Analysis(tmp_path)
    assert analysis.mutating_methods() == {"set_status", "bump"}
    assert analysis.violations() == []
