"""Training a converted model: optimizer groups, a frozen warm-up, and a monitor of the depth attention.

The AttnRes parameters (each site's pseudo-query ``proj.weight`` and key norm ``norm.weight``) are few
and behave unlike the rest (docs/method.md, section 7):

- they take a larger learning rate (1.5-2x is reported to work) and no or light weight decay: decay
  pulls a pseudo-query back to zero, that is to uniform averaging over depth;
- when a trained model is converted, holding them fixed for a warm-up lets the rest adapt to the new
  stream before the depth weights start to move;
- a site whose softmax puts nearly all weight on one source early in training signals instability.

::

    model = attnres_fx.attnresify(model, (ids,))
    optimizer = torch.optim.AdamW(attnres_fx.param_groups(model, lr=3e-4, weight_decay=0.1))
    attnres_fx.freeze(model)                 # warm-up: AttnRes parameters fixed
    ...
    attnres_fx.unfreeze(model)
    ...
    if step % 100 == 0:
        log(attnres_fx.monitor_depth(model, ids))    # entropy and max weight per site; warns on collapse

With the Hugging Face ``Trainer``: ``Trainer(..., optimizers=(AdamW(param_groups(...)), None),
callbacks=[attnres_fx.depth_monitor_callback()])``.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

from torch import nn

from .. import routing
from ..conversion import conversion_of
from ..compat import unwrapped
from ..conversion import sites
from ..op.module import BlockAttnRes
from .depth import DepthRecorder, DepthWeights, depth_weights, source_label
from ..errors import AttnResWarning

DEFAULT_ATTNRES_LR_MULT = 2.0
DEFAULT_COLLAPSE_THRESHOLD = 0.95
DEFAULT_PREFIX = "attnres"


def param_groups(model: nn.Module, *, lr: float, weight_decay: float,
                 attnres_lr_mult: float = DEFAULT_ATTNRES_LR_MULT, attnres_weight_decay: float = 0.0
                 ) -> list[dict[str, Any]]:
    """Optimizer parameter groups for ``model``, converted or not, named by their ``"name"`` key:

    - ``"decay"``: every other parameter with two or more dimensions (weight matrices, embeddings):
      ``lr``, ``weight_decay``;
    - ``"no_decay"``: every other parameter with fewer (norm weights, biases): ``lr``, no decay;
    - ``"attnres_queries"``: the pseudo-queries, ``lr * attnres_lr_mult``, ``attnres_weight_decay``
      (the method suggests at most a light L2, ~1e-4);
    - ``"attnres_norms"``: the key norms' weights, ``lr * attnres_lr_mult``, no decay.

    Empty groups are left out (an unconverted model has no AttnRes groups), so the same call serves a
    baseline. Frozen parameters (:func:`freeze`) are included: optimizers skip parameters without a
    gradient, and they train once released. Learning-rate schedulers scale every group's own ``lr``,
    so the multiplier holds through a schedule.

    Example::

        >>> optimizer = torch.optim.AdamW(param_groups(model, lr=3e-3, weight_decay=0.1))
        >>> [(g["name"], g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
        [('decay', 0.003, 0.1), ('no_decay', 0.003, 0.0), ('attnres_queries', 0.006, 0.0),
         ('attnres_norms', 0.006, 0.0)]
    """
    _check_rate("lr", lr)
    _check_rate("attnres_lr_mult", attnres_lr_mult)
    _check_decay("weight_decay", weight_decay)
    _check_decay("attnres_weight_decay", attnres_weight_decay)
    queries = {id(m.proj.weight) for m in model.modules() if isinstance(m, BlockAttnRes)}
    norms = {id(p) for m in model.modules() if isinstance(m, BlockAttnRes) for p in m.norm.parameters()}
    groups = {
        "decay": {"lr": lr, "weight_decay": weight_decay},
        "no_decay": {"lr": lr, "weight_decay": 0.0},
        "attnres_queries": {"lr": lr * attnres_lr_mult, "weight_decay": attnres_weight_decay},
        "attnres_norms": {"lr": lr * attnres_lr_mult, "weight_decay": 0.0},
    }
    members: dict[str, list[nn.Parameter]] = {name: [] for name in groups}
    for parameter in model.parameters():
        if id(parameter) in queries:
            members["attnres_queries"].append(parameter)
        elif id(parameter) in norms:
            members["attnres_norms"].append(parameter)
        elif parameter.dim() >= 2:
            members["decay"].append(parameter)
        else:
            members["no_decay"].append(parameter)
    return [{"name": name, "params": members[name], **options} for name, options in groups.items() if members[name]]


def freeze(model: nn.Module) -> nn.Module:
    """Hold the AttnRes parameters of the converted ``model`` fixed (``requires_grad=False``); returns
    ``model``. The rest trains as before; :func:`unfreeze` releases them.

    Used as a warm-up after converting a trained model: the new sites start as the original stream
    (zero pseudo-queries) and the rest of the network adapts to the rewired stream first. A model routed
    through Inductor recompiles at its next call: its graphs were built for the parameters'
    previous ``requires_grad``.
    """
    _set_trainable(model, False)
    return model


def unfreeze(model: nn.Module) -> nn.Module:
    """Release the AttnRes parameters held by :func:`freeze`; returns ``model``."""
    _set_trainable(model, True)
    return model


def depth_metrics(weights: DepthWeights, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """Flat metrics for a logger: ``{prefix}/{site}/entropy`` (per-token entropy, nats) and
    ``{prefix}/{site}/max_weight`` (the largest weight a token gives one source), both averaged over
    tokens, for every site with more than one source (a single source always has weight 1)."""
    metrics = {}
    for row in weights:
        if row.site.num_sources > 1:
            metrics[f"{prefix}/{row.site.name}/entropy"] = row.entropy
            metrics[f"{prefix}/{row.site.name}/max_weight"] = row.max_weight
    return metrics


def warn_collapsed(weights: DepthWeights, threshold: float = DEFAULT_COLLAPSE_THRESHOLD, *,
                   step: int | None = None) -> list[str]:
    """Warn (:class:`~attnres_fx.AttnResWarning`) when the tokens of a site put, on average, at least
    ``threshold`` of their weight on one source (:meth:`DepthWeights.collapsed`); returns the names of
    those sites."""
    collapsed = weights.collapsed(threshold)
    if collapsed:
        where = "" if step is None else f" at step {step}"
        details = ", ".join(f"{row.site.name} -> {source_label(row.top_source)} (max weight per token "
                            f"{row.max_weight:.3f}, {row.site.num_sources} sources)" for row in collapsed)
        warnings.warn(f"depth attention collapsed onto one source{where}: {details}. Early in training "
                      "this signals instability: lower the AttnRes learning rate (param_groups's "
                      "attnres_lr_mult) or warm up with attnres_fx.freeze.", AttnResWarning, stacklevel=3)
    return [row.site.name for row in collapsed]


def monitor_depth(model: nn.Module, *inputs: Any, collapse_threshold: float = DEFAULT_COLLAPSE_THRESHOLD,
                  prefix: str = DEFAULT_PREFIX, **kwargs: Any) -> dict[str, float]:
    """One no-grad call of ``model(*inputs, **kwargs)`` and the depth-attention metrics of every site
    (:func:`depth_metrics`), warning when a site collapses onto one source (:func:`warn_collapsed`).

    For a hand-written loop: the cost is one forward pass of the inputs given (pass a small batch)
    every time it is called, e.g. every few hundred steps::

        if step % 200 == 0:
            writer.add_scalars("depth", attnres_fx.monitor_depth(model, batch[:4]), step)
    """
    _check_threshold(collapse_threshold)
    weights = depth_weights(model, *inputs, **kwargs)
    warn_collapsed(weights, collapse_threshold)
    return depth_metrics(weights, prefix)


def depth_monitor_callback(every: int | None = None, *, collapse_threshold: float = DEFAULT_COLLAPSE_THRESHOLD,
                           prefix: str = DEFAULT_PREFIX):
    """A ``transformers.TrainerCallback`` that records the depth attention during the training step
    itself (no extra forward pass) every ``every`` optimizer steps (default: the Trainer's logging
    interval, so that every log has them), adds :func:`depth_metrics` to the Trainer's next log and
    warns when a site collapses (:func:`warn_collapsed`).

    The metrics reach ``trainer.state.log_history`` and every callback that comes after this one; the
    Trainer places its reporting integrations (TensorBoard, W&B) before callbacks passed to it, so to
    have them report the metrics too, put the monitor first:
    ``trainer.callback_handler.callbacks.insert(0, monitor)``. ``monitor.history`` keeps
    ``(step, metrics)`` for every recorded step. On a model routed through Inductor the recorded steps
    run on the eager route.

    Example::

        >>> monitor = attnres_fx.depth_monitor_callback(every=50)
        >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[monitor])
    """
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"every must be a positive int, got {every!r}")
    _check_threshold(collapse_threshold)
    return _callback_class()(every, collapse_threshold, prefix)


@functools.cache
def _callback_class():
    try:
        from transformers import TrainerCallback
    except ImportError as err:
        raise ImportError("depth_monitor_callback needs transformers: pip install 'attnres-fx[hf]'") from err

    class DepthMonitorCallback(TrainerCallback):
        """See :func:`depth_monitor_callback`."""

        def __init__(self, every: int | None, collapse_threshold: float, prefix: str):
            self.every = every
            self.collapse_threshold = collapse_threshold
            self.prefix = prefix
            self.history: list[tuple[int, dict[str, float]]] = []
            self._recorder: DepthRecorder | None = None
            self._pending: dict[str, float] = {}

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            # The Trainer's logging interval in steps (``args.logging_steps`` may be a fraction of the run).
            every = self.every or state.logging_steps
            # Recorded: the steps whose end the Trainer logs at (global_step counts finished steps).
            if model is not None and (state.global_step + 1) % every == 0:
                self._recorder = DepthRecorder(model).__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self._recorder is None:
                return
            recorder, self._recorder = self._recorder, None
            recorder.__exit__(None, None, None)
            weights = recorder.result()
            warn_collapsed(weights, self.collapse_threshold, step=state.global_step)
            metrics = depth_metrics(weights, self.prefix)
            self.history.append((state.global_step, metrics))
            self._pending = metrics

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not self._pending or logs is None:
                return
            logs.update(self._pending)
            # The Trainer appended a copy of the logs to log_history before calling back.
            if state.log_history:
                state.log_history[-1].update(self._pending)
            self._pending = {}

        def on_train_end(self, args, state, control, **kwargs):
            if self._recorder is not None:
                self._recorder.__exit__(None, None, None)
                self._recorder = None

    return DepthMonitorCallback


def _set_trainable(model: nn.Module, trainable: bool) -> None:
    found = sites(model)
    if not found:
        raise ValueError(f"model: {'unfreeze' if trainable else 'freeze'} needs a model converted by "
                         f"attnres_fx.attnresify; {type(model).__name__} has no AttnRes sites")
    root = unwrapped(model)
    for site in found:
        root.get_submodule(site.name).requires_grad_(trainable)
    conversion = conversion_of(root)
    if conversion is not None and conversion.compiler != "eager":
        routing.set_compiler(root, conversion, conversion.compiler, conversion.compile_options)


def _check_rate(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_decay(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")


def _check_threshold(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"collapse_threshold must be in (0, 1], got {value!r}")
