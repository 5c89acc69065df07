"""``neuronxcc.nki.compiler`` (``ncc``): allocation and scheduling controls (spec §14).

``auto_alloc()`` returns the plain buffer marker. ``mod_alloc(...)`` and ``alloc(func)`` return
a placed marker (``language.Placed``): the tensor then occupies the physical space the author
gave it, not its logical size: block indices wrap modulo ``num_free_tiles``/``num_bank_tiles``
(rotating buffers), so a ``[2, 8, 128, 512]`` fp32 PSUM tensor placed with
``num_bank_tiles=(2, 4)`` takes 8 banks, not 16. Placed tensors are checked against the
capacity (``base + size``), not counted by the stack allocator (AWS's direct-allocation guide:
the author, not the compiler, places them; two placements may alias on purpose). Functionally the
simulator keeps every logical block separate, so it does not reproduce a data race between
aliased blocks. Decorators return the function (or kernel) unchanged; ``no_reorder`` keeps instructions in program order in the scheduled estimate (``_sched``); the other
directives are inert.
"""

from __future__ import annotations

from . import _runtime, language as _nl


class _Space:
    def __init__(self, buf):
        self._buf = buf
        self.kind = buf.kind

    def auto_alloc(self, *args, **kwargs):
        return self._buf

    def mod_alloc(self, *args, base_addr=None, base_bank=None, num_free_tiles=None,
                  num_bank_tiles=None, base_partition=0, **kwargs):
        if self.kind == _nl.psum.kind:
            base = base_bank if base_bank is not None else (args[0] if args else 0)
            tiles = num_bank_tiles
        else:
            base = base_addr if base_addr is not None else (args[0] if args else 0)
            tiles = num_free_tiles
        return _nl.Placed(self._buf, base=int(base), tiles=tiles)

    def alloc(self, func=None, *args, **kwargs):
        if not callable(func):
            raise TypeError(f"ncc.{self._buf.name}.alloc() takes an allocation function "
                            f"(block index, partition size, free size) -> address; got {func!r}")
        return _nl.Placed(self._buf, func=func)

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
        # ``with ncc.no_reorder():`` inside a kernel: program order in the scheduled estimate
        if self.name == "no_reorder" and _runtime.in_kernel():
            _runtime.current().no_reorder += 1
            self._ctx = _runtime.current()
        return self

    def __exit__(self, *exc):
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.no_reorder -= 1
            self._ctx = None
        return False

    def __repr__(self):
        return f"ncc.{self.name}({self.kwargs})"


def multi_buffer(factor=2, **kwargs):
    return _Directive("multi_buffer", factor=factor, **kwargs)


def no_reorder(*args, **kwargs):
    return _Directive("no_reorder", **kwargs)


def allocation_scope(*args, **kwargs):
    return _Directive("allocation_scope", **kwargs)
