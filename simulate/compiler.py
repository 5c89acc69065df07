"""``neuronxcc.nki.compiler`` (``ncc``): allocation and scheduling controls (spec §14).

All of these are accepted and have no functional effect in the simulator: ``sbuf``/``psum``
``auto_alloc()``, ``mod_alloc(...)``, ``alloc(func)`` return the plain buffer markers, so a
direct-allocation kernel runs like an auto-allocated one (its extra placement constraints are
not validated). Decorators return the function (or kernel) unchanged; directives are inert.
"""

from __future__ import annotations

from . import language as _nl


class _Space:
    def __init__(self, buf):
        self._buf = buf
        self.kind = buf.kind

    def auto_alloc(self, *args, **kwargs):
        return self._buf

    def mod_alloc(self, *args, **kwargs):
        return self._buf

    def alloc(self, *args, **kwargs):
        return self._buf

    def __call__(self, *args, **kwargs):
        return self._buf

    def __repr__(self):
        return f"ncc.{self._buf.name}"


sbuf = _Space(_nl.sbuf)
psum = _Space(_nl.psum)


def _passthrough_decorator(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


skip_middle_end_transformations = _passthrough_decorator
enable_stack_allocator = _passthrough_decorator
force_auto_alloc = _passthrough_decorator


class _Directive:
    def __init__(self, name, **kwargs):
        self.name = name
        self.kwargs = kwargs

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __repr__(self):
        return f"ncc.{self.name}({self.kwargs})"


def multi_buffer(factor=2, **kwargs):
    return _Directive("multi_buffer", factor=factor, **kwargs)


def no_reorder(*args, **kwargs):
    return _Directive("no_reorder", **kwargs)


def allocation_scope(*args, **kwargs):
    return _Directive("allocation_scope", **kwargs)
