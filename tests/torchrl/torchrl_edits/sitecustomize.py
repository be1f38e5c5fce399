"""Loaded at start-up by every Python process of a test that plays a TorchRL release which changed
(this folder goes first on ``PYTHONPATH``): it rewrites TorchRL modules' source as such a release
would, an internal renamed or removed, a call made otherwise, in the trainer and in every
worker, node and Ray actor it starts alike.

``SHMSYNC_TORCHRL_EDITS`` is a JSON list of ``[module, old, new]``: in ``module``'s source every
``old`` becomes ``new`` (``old`` starting with ``re:`` is a regular expression). An ``old`` that is
not in the source fails the import: a test never passes on an edit that changed nothing.
"""

import importlib.abc
import importlib.machinery
import json
import os
import re
import sys

EDITS = {}
for _module, _old, _new in json.loads(os.environ.get("SHMSYNC_TORCHRL_EDITS", "[]")):
    EDITS.setdefault(_module, []).append((_old, _new))


def edit(source, edits, module):
    for old, new in edits:
        if old.startswith("re:"):
            source, n = re.subn(old[3:], new, source)
        else:
            n = source.count(old)
            source = source.replace(old, new)
        if n == 0:
            raise ImportError(f"torchrl edit: {old!r} is not in {module}")
    return source


class EditedLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        source = self.get_data(self.path).decode("utf-8")
        return compile(edit(source, EDITS[fullname], fullname), self.path, "exec", dont_inherit=True)


class EditingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in EDITS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and (spec.origin or "").endswith(".py"):
            spec.loader = EditedLoader(name, spec.origin)
        return spec


if EDITS:
    sys.meta_path.insert(0, EditingFinder())
