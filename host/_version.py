"""The one home of nki-flash's version (read by pyproject.toml, ``host.__version__`` and
``nki-flash --version``). Plain Python, no imports, so the build can read it."""

__version__ = "0.2.0"
