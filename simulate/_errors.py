"""NKI error classes and the message builder.

Every front-end error carries its documented id (``err_<name>``) as ``.nki_error`` and its
message ends with a newline plus the error-docs URL, as neuronx-cc prints it (spec §3.3, §13).
The exception *class* follows the spec's type column: builtins (ValueError, TypeError,
IndexError, RuntimeError) or ``NKISyntaxError`` (a ``SyntaxError`` subclass; the spec marks the
exact class UNCONFIRMED but users see "SyntaxError: ...").
"""

from __future__ import annotations

ERRORS_URL = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/nki/api/nki.errors.html"


class NKIError(Exception):
    """Mixin base of every simulator-raised NKI error (``except NKIError`` catches them all)."""

    nki_error: str = ""


class NKISyntaxError(NKIError, SyntaxError):
    pass


class NKIValueError(NKIError, ValueError):
    pass


class NKITypeError(NKIError, TypeError):
    pass


class NKIIndexError(NKIError, IndexError):
    pass


class NKIRuntimeError(NKIError, RuntimeError):
    pass


class NKINotImplementedError(NKIError, NotImplementedError):
    pass


_KIND = {
    "syntax": NKISyntaxError,
    "value": NKIValueError,
    "type": NKITypeError,
    "index": NKIIndexError,
    "runtime": NKIRuntimeError,
    "notimpl": NKINotImplementedError,
}


class ProgramSizeWarning(UserWarning):
    """A kernel's compiled program is large enough to make neuronx-cc slow (see _hw)."""


def error_url(name: str) -> str:
    """Docs anchor: ``err_foo_bar`` -> ``...nki.errors.html#err-foo-bar``."""
    return ERRORS_URL + "#" + name.replace("_", "-")


def nki_error(name: str, kind: str, message: str) -> NKIError:
    """Build (not raise) an NKI error of class ``kind`` with the docs URL appended."""
    cls = _KIND[kind]
    exc = cls(message + "\n" + error_url(name))
    exc.nki_error = name
    return exc


def hw_error(kind: str, message: str) -> NKIError:
    """An error for a hardware rule that has no documented ``err_`` id (allocator / inline
    asserts in neuronx-cc, e.g. PSUM bank overflow). No URL is appended."""
    exc = _KIND[kind](message)
    exc.nki_error = ""
    return exc


def fmt_shape(shape) -> str:
    """NKI prints shapes as ``[128, 512]``."""
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"
