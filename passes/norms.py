"""Whether a branch reads the residual stream through a norm: a norm module or op, or a norm written out
by hand (Llama-family RMSNorm: ``x * rsqrt(mean(x ** 2) + eps) * w``, fp32 upcast included), seen
through casts.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

from .dataflow import reads_value
from .node_kinds import (MEAN_OPS, MUL_OPS, RSQRT_OPS, SQUARE_OPS, add_operands, is_add, is_norm_op, is_stream_op,
                         is_transparent, op_name)


def _through_casts(node: fx.Node, gm: fx.GraphModule) -> fx.Node:
    while len(node.users) == 1:
        (user,) = node.users
        if not is_transparent(user, gm):
            break
        node = user
    return node


def _cast_aliases(x: fx.Node, gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """``x`` and the dtype casts / copies of it (``x.to(float32)``), each mapped to the user of ``x`` its
    chain starts with (``x`` to itself)."""
    aliases = {x: x}
    todo = [(x, None)]
    while todo:
        node, root = todo.pop()
        for user in node.users:
            if user not in aliases and is_transparent(user, gm):
                aliases[user] = root or user
                todo.append((user, root or user))
    return aliases


def _decomposed_rms_users(x: fx.Node, gm: fx.GraphModule) -> set[fx.Node]:
    """Users of ``x`` that belong to a written-out ``x * rsqrt(mean(x**2) + eps)``; empty if none.

    Accepts ``pow(x, 2)``, ``square(x)`` or ``x * x``, an optional ``+ eps``, dtype casts anywhere (the
    square of ``x.to(float32)`` multiplying ``x`` itself, as T5 writes it), and the multiplication by
    ``x`` in either operand order.
    """
    aliases = _cast_aliases(x, gm)
    for alias in aliases:
        for square in alias.users:
            name = op_name(square)
            is_square = (name in SQUARE_OPS and (name == "square" or square.args[1:2] == (2,))) or (
                name in MUL_OPS and len(square.args) == 2 and square.args[0] is alias and square.args[1] is alias)
            if not is_square:
                continue
            mean = _through_casts(square, gm)
            mean = next((u for u in mean.users if op_name(u) in MEAN_OPS), None)
            if mean is None:
                continue
            scale = _through_casts(mean, gm)
            eps_add = next((u for u in scale.users if is_add(u) and add_operands(u) is None), None)
            scale = _through_casts(eps_add, gm) if eps_add is not None else scale
            rsqrt = next((u for u in scale.users if op_name(u) in RSQRT_OPS), None)
            if rsqrt is None:
                continue
            rsqrt = _through_casts(rsqrt, gm)
            normalise = next((u for u in rsqrt.users if op_name(u) in MUL_OPS
                              and any(a in aliases for a in u.args if isinstance(a, fx.Node))), None)
            if normalise is not None:
                scaled = next(a for a in normalise.args if isinstance(a, fx.Node) and a in aliases)
                return {square, normalise, aliases[alias], aliases[scaled]}
    return set()


def reads_normalised(value: fx.Node, readers: Iterable[fx.Node], gm: fx.GraphModule) -> bool:
    """Whether every one of ``readers`` (users of ``value``) feeds ``value`` only into a normalisation.

    Recognises norm modules, functional / aten norms, and RMSNorm written out with optional dtype
    casts in front (``x.to(float32)`` then ``x * rsqrt(mean(x**2) + eps)``).
    """
    readers = [r for r in readers if reads_value(r, value)]
    if not readers:
        return False
    decomposed = _decomposed_rms_users(value, gm)
    for reader in readers:
        if is_norm_op(reader, gm) or reader in decomposed:
            continue
        if is_stream_op(reader, gm) and reads_normalised(reader, list(reader.users), gm):
            continue
        return False
    return True
