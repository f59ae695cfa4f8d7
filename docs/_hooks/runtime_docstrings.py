"""Griffe extension: docstrings of module-level objects that set their own `__doc__`.

mkdocstrings reads the package by static analysis, which finds docstrings in the
source. The autocast rules (`eqx_amp.LOW`, `FULL`, `PROMOTE`, `KEEP`) and the fp8 rules
(`eqx_amp.fp8.TENSORWISE`, `eqx_amp.fp8.ROWWISE`) are instances whose documentation is set at runtime (a `doc`
argument, or their class's docstring), which static analysis cannot see. For each
module-level attribute of `eqx_amp` without a docstring, this imports the module and
uses the `__doc__` of the object, if the object's type is defined in `eqx_amp` (so a
dict or a string never gets `dict`'s or `str`'s documentation).
"""

import importlib
import inspect
import logging
import pathlib
import sys

import griffe


PACKAGE = "eqx_amp"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
logger = logging.getLogger("mkdocs.plugins.eqx_amp_docs")


class RuntimeDocstrings(griffe.Extension):
    def on_attribute(self, *, attr: griffe.Attribute, **kwargs) -> None:
        module = attr.parent
        if attr.docstring is not None or not isinstance(module, griffe.Module):
            return
        if module.path.split(".")[0] != PACKAGE:
            return
        if str(REPO_ROOT) not in sys.path:  # the checkout that is being documented
            sys.path.insert(0, str(REPO_ROOT))
        try:
            obj = getattr(importlib.import_module(module.path), attr.name)
        except Exception as error:  # noqa: BLE001 - reported, and fails a strict build
            logger.warning("Could not import %s: %r", attr.path, error)
            return
        if not type(obj).__module__.startswith(PACKAGE + "."):
            return
        doc = getattr(obj, "__doc__", None)
        if doc:
            attr.docstring = griffe.Docstring(
                inspect.cleandoc(doc), parent=attr, lineno=attr.lineno
            )
