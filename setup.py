"""What pyproject.toml cannot say in its tables: which packages ship, and the one C extension.

Packages are found, not listed, so a new folder under ``shmsync/`` ships without an edit here:
every folder of ``shmsync/`` (a data-only one, such as the Hydra config group, as a namespace
package), the ``hydra_plugins`` namespace that Hydra scans, and ``workers/``, which installs as
``shmsync.workers`` so that no bare ``workers`` package lands on users' import path.
``tests/test_shipped.py`` checks, against the built wheel, that every module of the checkout is in it.

The memory fence, from the compiler's C11 atomics, is optional: where it does not build,
``shmsync/core/fences.py`` falls back to libatomic, then membarrier. Declaring it here keeps
setuptools' experimental ``ext-modules`` table (and its warning) out of pyproject.toml. It is
linked against the C library although it calls nothing there: a linker that drops unused
libraries (``--as-needed``, many distributions' default) would leave it naming no library at all,
and auditwheel (``make dist``) then cannot tell which C library a Python 3.10 extension is for.
"""

from setuptools import Extension, find_namespace_packages, setup

PACKAGES = find_namespace_packages(
    include=["shmsync", "shmsync.*", "hydra_plugins", "hydra_plugins.*"], exclude=["*.__pycache__"]
)
WORKERS = [
    "shmsync.workers",
    *(f"shmsync.workers.{p}" for p in find_namespace_packages("workers", exclude=["*.__pycache__", "__pycache__"])),
]

setup(
    packages=PACKAGES + WORKERS,
    package_dir={"shmsync.workers": "workers"},
    ext_modules=[
        Extension(
            "shmsync.core._atomics",
            sources=["shmsync/core/_atomics.c"],
            extra_link_args=["-Wl,--no-as-needed", "-lc"],
            optional=True,
        )
    ],
)
