"""Renders a parsed Go template over plain values: no attribute of a Python object is reachable.

Output and any string value a function builds are capped by the caller's limit; ranges over integers are
lazy, so the caller's deadline bounds them.
"""

from __future__ import annotations

from typing import Any

from localrun.templates.go.funcs import FUNCS, arity_error
from localrun.templates.go.parser import GoPipe, GoTemplateError
from localrun.templates.go.values import MISSING, GoStruct, go_str, truth


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def _field(v: Any, name: str) -> Any:
    if isinstance(v, GoStruct):
        if name not in v.fields:
            raise GoTemplateError(f"Go template: can't evaluate field {name}")
        return v.fields[name]
    if isinstance(v, dict):
        return v.get(name, MISSING)
    if v is None or v is MISSING:
        raise GoTemplateError(f"Go template: nil pointer evaluating .{name}")
    raise GoTemplateError(f"Go template: can't evaluate field {name} in a {type(v).__name__}")



class _Renderer:
    def __init__(self, root: Any, out_limit: int) -> None:
        self.root, self.out, self.size, self.limit = root, [], 0, out_limit
        self.scopes: list[dict[str, Any]] = [{"$": root}]

    def emit(self, s: str) -> None:
        self.size += len(s)
        if self.size > self.limit:
            raise GoTemplateError(f"the chat template produced a prompt over {self.limit} characters")
        self.out.append(s)

    def var(self, name: str) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise GoTemplateError(f"Go template: undefined variable {name}")

    def set_var(self, name: str, value: Any) -> None:
        for scope in reversed(self.scopes):
            if name in scope:
                scope[name] = value
                return
        raise GoTemplateError(f"Go template: undefined variable {name}")

    def run(self, nodes: list, dot: Any) -> None:
        for node in nodes:
            kind = node[0]
            if kind == "text":
                self.emit(node[1])
            elif kind == "action":
                pipe = node[1]
                v = self.pipe(pipe, dot)
                if not pipe.decl:
                    self.emit(go_str(v))
            elif kind in ("if", "with"):
                self.scopes.append({})
                try:
                    v = self.pipe(node[1], dot)
                    if truth(v):
                        self.run(node[2], v if kind == "with" else dot)
                    elif node[3] is not None:
                        self.run(node[3], dot)
                finally:
                    self.scopes.pop()
            elif kind == "range":
                self.range(node, dot)
            elif kind == "break":
                raise _Break()
            elif kind == "continue":
                raise _Continue()

    def range(self, node: tuple, dot: Any) -> None:
        pipe = node[1]
        self.scopes.append({})
        try:
            v = self.pipe(GoPipe(cmds=pipe.cmds), dot)
            if isinstance(v, dict):
                items: Any = [(k, v[k]) for k in sorted(v, key=str)]
            elif isinstance(v, (list, tuple)):
                items = list(enumerate(v))
            elif isinstance(v, int) and not isinstance(v, bool):
                items = ((i, i) for i in range(v)) if v > 0 else []  # lazily: the caller's deadline bounds it
            elif v is None or v is MISSING:
                items = []
            else:
                raise GoTemplateError(f"Go template: range can't iterate over {go_str(v)}")
            if isinstance(items, list) and not items:
                if node[3] is not None:
                    self.run(node[3], dot)
                return
            for k, x in items:
                scope = {}
                if len(pipe.decl) == 1:
                    scope[pipe.decl[0]] = x
                elif len(pipe.decl) == 2:
                    scope[pipe.decl[0]], scope[pipe.decl[1]] = k, x
                self.scopes.append(scope)
                try:
                    self.run(node[2], x)
                except _Continue:
                    pass
                except _Break:
                    break
                finally:
                    self.scopes.pop()
        finally:
            self.scopes.pop()

    def pipe(self, pipe: GoPipe, dot: Any) -> Any:
        v: Any = None
        for n, cmd in enumerate(pipe.cmds):
            v = self.command(cmd, dot, v if n else None, n > 0)
        for name in pipe.decl[:1]:
            if pipe.assign:
                self.set_var(name, v)
            else:
                self.scopes[-1][name] = v
        return v

    def command(self, cmd: list, dot: Any, piped: Any, has_piped: bool) -> Any:
        head = cmd[0]
        if head[0] == "func":
            name = head[1]
            if name in ("and", "or"):  # evaluated lazily, as Go does
                args = cmd[1:]
                if not args and not has_piped:
                    arity_error(name)
                v = None
                for a in args:
                    v = self.operand(a, dot)
                    if truth(v) != (name == "and"):
                        return v
                return piped if has_piped else v
            fn = FUNCS.get(name)
            if fn is None:
                raise GoTemplateError(f"Go template: function {name!r} not defined")
            args = [self.operand(a, dot) for a in cmd[1:]] + ([piped] if has_piped else [])
            try:
                v = fn(*args)
            except TypeError:
                raise GoTemplateError(f"Go template: wrong number of arguments for {name}") from None
            if isinstance(v, str) and len(v) > self.limit:  # a value doubled in a loop stops here
                raise GoTemplateError(f"the chat template built a value over {self.limit} characters")
            return v
        if len(cmd) > 1 or has_piped:
            raise GoTemplateError("Go template: can't give arguments to a value (methods are not supported)")
        return self.operand(head, dot)

    def operand(self, op: tuple, dot: Any) -> Any:
        kind = op[0]
        if kind == "lit":
            return op[1]
        if kind == "field":
            v = dot
            for name in op[1]:
                v = _field(v, name)
            return v
        if kind == "var":
            v = self.var(op[1])
            for name in op[2]:
                v = _field(v, name)
            return v
        if kind == "pipe":
            v = self.pipe(op[1], dot)
            for name in op[2]:
                v = _field(v, name)
            return v
        if kind == "func":
            return self.command([op], dot, None, False)
        raise GoTemplateError("Go template: bad operand")


def execute(tree: list, data: Any, out_limit: int) -> str:
    r = _Renderer(data, out_limit)
    try:
        r.run(tree, data)
    except (_Break, _Continue):
        raise GoTemplateError("Go template: break or continue outside a range") from None
    except RecursionError:
        raise GoTemplateError("Go template: nested too deeply") from None
    return "".join(r.out)

