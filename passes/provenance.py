"""Provenance: which module of the user's model a node comes from, the one reader of ``nn_module_stack``
and of the source strings TorchDynamo writes there (``L['self']._modules['layers'][3]`` is
``layers.3``). Errors, reports, site owners and the layer route's blocks are named from it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import fx, nn


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """``[(path, class name), ...]`` outermost first, from ``nn_module_stack`` (fx and export)."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value[0], value[1] if len(value) > 1 else ""
        cls_name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append((clean_path(str(path)), cls_name.rsplit(".", 1)[-1]))
    return out


_SOURCE_ROOT = re.compile(r"^[LG]\[[^\]]*\](\[\d+\])*")          # L['self'], G['m'], L['args'][0]
_MODULES_ITEM = re.compile(r"\._modules\['([^']*)'\]")             # ._modules['layers'] -> .layers
# An instance attribute ``forward`` (the wrapper attnres_fx.routing installs on a module it routes) is no
# submodule: nn.Module forbids a submodule named ``forward``, so the segment can be dropped safely.
_FORWARD_WRAPPER = re.compile(r"\.forward\.[A-Za-z_]\w*(\.__self__)?")
_INDEX = re.compile(r"\[(\d+)\]")


def clean_path(path: str) -> str:
    """Dotted module path (``decoder.block.0``) from an fx/export path or a Dynamo source expression
    (``L['self'].decoder.forward.module.block[0]``)."""
    path = _SOURCE_ROOT.sub("", path)
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _FORWARD_WRAPPER.sub("", path)
    path = _INDEX.sub(r".\1", path)
    return path.replace("['", ".").replace("']", "").strip(".")


def within(path: str, other: str) -> bool:
    """Whether the module at ``path`` is the one at ``other`` or inside it (every module is inside the
    root, ``""``)."""
    return not other or path == other or path.startswith(other + ".")


def owner_path(node: fx.Node) -> str:
    """Dotted path of the innermost module whose forward created ``node`` ('' for the root)."""
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def node_module_path(node: fx.Node) -> str:
    """The module a node belongs to: its ``call_module`` target, else its owner."""
    if node.op == "call_module":
        return str(node.target)
    return owner_path(node)


def common_parts(paths: Iterable[str]) -> list[str]:
    """The longest common dotted prefix of ``paths``, as a list of parts."""
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for column in zip(*split):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    return common


def modules_not_run(gm: fx.GraphModule, model: nn.Module) -> list[str]:
    """The outermost modules of ``model`` holding parameters of their own kind that no node of ``gm`` (a
    capture of one call of ``model``) comes from: the parts of the model that call did not run (a vision
    tower called without images). Not counted: a module whose parameters all belong to modules that ran
    too (a tied embedding), or one of several modules of a class of which some ran (the experts a
    mixture of experts did not route to)."""
    ran: set[str] = set()
    for node in gm.graph.nodes:
        ran.update(path for path, _ in module_stack(node))
        if node.op in ("call_module", "get_attr"):
            ran.add(str(node.target))
    seen = {id(p) for path, module in model.named_modules() if path in ran
            for p in module.parameters(recurse=False)}
    ran_classes: dict[str, set[type]] = {}
    for path, module in model.named_modules():
        if path in ran:
            ran_classes.setdefault(path.rpartition(".")[0], set()).add(type(module))
    found: list[str] = []
    for path, module in model.named_modules():
        if not path or path in ran or any(within(path, f) for f in found):
            continue
        parameters = list(module.parameters())
        if not parameters or all(id(p) in seen for p in parameters) or any(within(r, path) for r in ran):
            continue
        if type(module) in ran_classes.get(path.rpartition(".")[0], ()):
            continue
        found.append(path)
    return found
