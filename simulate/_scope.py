"""Front-end block-scope rule: ``err_local_variable_used_out_of_scope`` (spec §3.5, §13).

In NKI, the bodies of ``if``/``else``/``for``/``while`` are scopes for tensors: a tensor
assigned to a name inside such a block cannot be used after the block (D26 errors)::

    for i in range(4):
        if i < 2:
            tmp = nl.load(a)
        else:
            tmp = nl.load(b)
        nl.store(c, tmp)  # Error: Local variable 'tmp' is referenced outside of its parent scope

The real front end parses the kernel's source; so does this check (once per kernel function,
at its first launch). To avoid false positives it is deliberately narrow:

* only the kernel function's own body is analysed (not helper functions it calls, not nested
  ``def``/``lambda``/comprehension bodies);
* a binding counts as a *tensor* binding only when the assigned value is visibly a tensor: a
  call of an ``nl``/``nisa`` function (resolved through the kernel's globals to the simulator's
  ``language``/``isa`` modules, or to functions defined in them), a method call on such a call
  result (``nisa.iota(...).broadcast_to(...)``), a name currently bound to a tensor, or an
  arithmetic expression (``+ - * / ...``) with such an operand; every other assignment of the
  name (ints, shapes, lists, helper results) makes it untracked;
* scopes are the bodies of ``for``/``while`` loops and of ``if``/``else`` statements whose
  condition involves a loop index (or a name computed from one): those are traced as IR
  blocks. An ``if`` on a Python-level value (a kernel flag, a shape) is decided while tracing
  and opens no scope: the official NKI samples bind tensors under ``if config.training:`` /
  ``if dropout_p > 0.0:`` and use them after the block;
* reads are checked in program order with per-branch state: the ``else`` branch does not see
  the ``if`` branch's bindings; after the statement a name bound in either branch is out of
  scope; a loop body may run zero times, so a name bound in it is out of scope afterwards;
* ``with``/``try`` do not open scopes.

A name rebound at the enclosing level (``t = nl.load(x)`` after the loop) is back in scope.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

from ._errors import nki_error

_cache = {}

# nl / nisa functions that do not return a tensor (loop iterators, ids, in-place writers, ...)
_NON_TENSOR = frozenset({
    "affine_range", "sequential_range", "static_range", "device_print", "finfo", "iinfo", "nc",
    "num_programs", "program_id", "program_ndim", "spmd_dim", "random_seed", "store",
    "atomic_rmw", "all_reduce", "scalar", "gemm_grid", "gemm_stationary_grid", "static_cast",
    "get_nc_version", "dma_copy", "tensor_copy_dynamic_dst", "tensor_copy_predicated",
    "select_reduce", "nc_stream_shuffle", "builtin_custom_op",
    "loop_reduce",          # its accumulator is meant to be read after the loop
})


def check_kernel(func):
    """Raise err_local_variable_used_out_of_scope if ``func``'s source reads a tensor name
    outside the block that bound it. Cached per code object; silent when the source is not
    available."""
    f = inspect.unwrap(func) if callable(func) else func
    code = getattr(f, "__code__", None)
    if code is None:
        return
    try:
        err = _cache[code]
    except KeyError:
        err = _cache[code] = _analyse(f)
    if err is not None:
        raise nki_error("err_local_variable_used_out_of_scope", "syntax", err)


def _analyse(f):
    try:
        src = textwrap.dedent(inspect.getsource(f))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
              None)
    if fn is None:
        return None
    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    first = getattr(f.__code__, "co_firstlineno", 1) - start
    w = _Walker(getattr(f, "__globals__", {}), first, getattr(f, "__name__", "kernel"))
    try:
        w.block(fn.body, (), {})
    except _Found as e:
        return str(e)
    return None


class _Found(Exception):
    pass


def _api_modules():
    from . import isa, language
    return (language, isa)


class _Walker:
    def __init__(self, globs, line_offset, name):
        self.g = globs
        self.off = line_offset
        self.name = name
        self.mods = _api_modules()
        self.ids = 0
        self.loopvars = set()       # loop targets and names computed from them

    @staticmethod
    def _names(node):
        return {n.id for n in _walk_no_scopes(node) if isinstance(n, ast.Name)}

    # -- tensor-valued expressions ---------------------------------------------------------
    def _resolve(self, node):
        """Object an attribute chain ``a.b.c`` names in the kernel's globals, or None."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.g:
            return None
        obj = self.g[node.id]
        for p in reversed(parts):
            obj = getattr(obj, p, None)
            if obj is None:
                return None
        return obj

    def _is_api_call(self, node):
        if not isinstance(node, ast.Call):
            return False
        fn = node.func
        if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Call):
            return self._is_api_call(fn.value)          # method on an API result
        obj = self._resolve(fn)
        if not isinstance(obj, types.FunctionType) or obj.__name__ in _NON_TENSOR:
            return False
        return any(obj.__module__ == m.__name__ for m in self.mods)

    def _is_tensor(self, node, state, path):
        if self._is_api_call(node):
            return True
        if isinstance(node, ast.Name):
            b = state.get(node.id)
            return b is not None and _visible(b[0], path)
        if isinstance(node, ast.BinOp):
            return self._is_tensor(node.left, state, path) or \
                self._is_tensor(node.right, state, path)
        if isinstance(node, ast.UnaryOp):
            return self._is_tensor(node.operand, state, path)
        return False

    # -- reads -----------------------------------------------------------------------------
    def _reads(self, node, state, path):
        for n in _walk_no_scopes(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                b = state.get(n.id)
                if b is not None and not _visible(b[0], path):
                    _, line, kind, bline = b
                    raise _Found(
                        f"Local variable '{n.id}' is referenced outside of its parent scope "
                        f"(kernel '{self.name}', line {n.lineno + self.off}: '{n.id}' is the "
                        f"tensor assigned at line {line + self.off} inside the '{kind}' block "
                        f"at line {bline + self.off}). Allocate it before the block "
                        f"(nl.ndarray) and assign into it with '{n.id}[...] = ...'.")

    # -- statements --------------------------------------------------------------------------
    def _bind(self, target, value, state, path, info):
        names = []
        if isinstance(target, ast.Name):
            names = [target]
        elif isinstance(target, (ast.Tuple, ast.List)):
            names = [e for e in target.elts if isinstance(e, ast.Name)]
            value = None                                   # unpacking: untracked
        for t in names:
            if value is not None and self._is_tensor(value, state, path):
                state[t.id] = (path, t.lineno, info[0], info[1])
            else:
                state.pop(t.id, None)

    def block(self, stmts, path, state, info=("", 0)):
        for s in stmts:
            self.stmt(s, path, state, info)
        return state

    def _sub(self, stmts, path, state, kind, line):
        self.ids += 1
        return self.block(stmts, path + (self.ids,), dict(state), (kind, line))

    def stmt(self, s, path, state, info):
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for d in s.decorator_list:
                self._reads(d, state, path)
            state.pop(s.name, None)
            return
        if isinstance(s, ast.Assign):
            self._reads(s.value, state, path)
            if self._names(s.value) & self.loopvars:       # i = i0 * n + i1: loop-derived
                for t in s.targets:
                    self.loopvars |= self._names(t)
            for t in s.targets:
                if not isinstance(t, (ast.Name, ast.Tuple, ast.List)):
                    self._reads(t, state, path)          # t[...] = v reads t
            for t in s.targets:
                self._bind(t, s.value, state, path, info)
            return
        if isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self._reads(s.value, state, path)
                if isinstance(s.target, ast.Name):
                    self._bind(s.target, s.value, state, path, info)
                else:
                    self._reads(s.target, state, path)
            return
        if isinstance(s, ast.AugAssign):                 # in-place: reads the target
            self._reads(s.value, state, path)
            self._reads(s.target if not isinstance(s.target, ast.Name)
                        else ast.Name(id=s.target.id, ctx=ast.Load(), lineno=s.lineno,
                                      col_offset=0), state, path)
            return
        if isinstance(s, ast.If):
            self._reads(s.test, state, path)
            if self._names(s.test) & self.loopvars:
                # a branch on a loop index is traced as an IR conditional: its blocks are
                # scopes
                a = self._sub(s.body, path, state, "if", s.lineno)
                b = self._sub(s.orelse, path, state, "else", s.lineno)
            else:
                # a Python-level condition is decided while tracing: no new scope (the NKI
                # samples bind tensors under ``if config.training:`` and use them after)
                a = self.block(s.body, path, dict(state), info)
                b = self.block(s.orelse, path, dict(state), info)
            _merge(state, (a, b), path)
            return
        if isinstance(s, (ast.For, ast.AsyncFor)):
            self._reads(s.iter, state, path)
            self.loopvars |= self._names(s.target)
            inner = dict(state)
            self._bind(s.target, None, inner, path, info)
            self.ids += 1
            a = self.block(s.body, path + (self.ids,), inner, ("for", s.lineno))
            _merge(state, (a,), path)
            self._bind(s.target, None, state, path, info)
            if s.orelse:
                b = self._sub(s.orelse, path, state, "for-else", s.lineno)
                _merge(state, (b,), path)
            return
        if isinstance(s, ast.While):
            self._reads(s.test, state, path)
            a = self._sub(s.body, path, state, "while", s.lineno)
            _merge(state, (a,), path)
            if s.orelse:
                b = self._sub(s.orelse, path, state, "while-else", s.lineno)
                _merge(state, (b,), path)
            return
        if isinstance(s, (ast.With, ast.AsyncWith)):
            for it in s.items:
                self._reads(it.context_expr, state, path)
                if it.optional_vars is not None:
                    self._bind(it.optional_vars, None, state, path, info)
            self.block(s.body, path, state, info)
            return
        if isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            self.block(s.body, path, state, info)
            for h in s.handlers:
                if h.name:
                    state.pop(h.name, None)
                self.block(h.body, path, state, info)
            self.block(s.orelse, path, state, info)
            self.block(s.finalbody, path, state, info)
            return
        if isinstance(s, ast.Delete):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    state.pop(t.id, None)
                else:
                    self._reads(t, state, path)
            return
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            for a in s.names:
                state.pop((a.asname or a.name).split(".")[0], None)
            return
        if isinstance(s, (ast.Global, ast.Nonlocal)):
            for n in s.names:
                state.pop(n, None)
            return
        # Expr, Return, Assert, Raise, Pass, Break, Continue, Match, ...: reads only
        self._reads(s, state, path)


def _visible(bpath, path):
    """A binding made in block ``bpath`` is in scope at ``path`` iff bpath encloses path."""
    return path[:len(bpath)] == bpath


def _merge(state, branches, path):
    """State after a compound statement: a name bound inside a branch (not visible at
    ``path``) is out of scope afterwards; otherwise the branches' bindings agree with or
    replace the old one (an untracked rebinding in any branch makes the name untracked)."""
    names = set(state)
    for b in branches:
        names |= set(b)
    for n in names:
        inner = [b[n] for b in branches if n in b and not _visible(b[n][0], path)]
        if inner:
            state[n] = inner[-1]
            continue
        if any(n not in b for b in branches):
            state.pop(n, None)              # rebound to a non-tensor (or deleted) somewhere
        else:
            state[n] = branches[-1][n]


def _walk_no_scopes(node):
    """ast.walk that does not enter nested function / lambda / comprehension scopes."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        for c in ast.iter_child_nodes(n):
            if isinstance(c, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                              ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                continue
            todo.append(c)
