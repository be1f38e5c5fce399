"""The memory fence, from the compiler's C11 atomics: the one C extension, optional
(shmsync/core/fences.py falls back to libatomic, then membarrier, where it was not built).
Everything else is declared in pyproject.toml; this file keeps setuptools' experimental
``ext-modules`` table (and its warning) out of it."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shmsync.core._atomics", sources=["shmsync/core/_atomics.c"], optional=True)])
