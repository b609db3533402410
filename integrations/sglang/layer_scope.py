"""Which layer's reduction SGLang is running: the ``layer_id`` of arfusion's cached decision.

SGLang's gate ``apply_flashinfer_allreduce_fusion(batch_size)`` and its fused call take no layer.
Every reduction they serve runs inside a method of one decoder layer's ``LayerCommunicator``, so
the plugin numbers the communicators in the order they are built (the model's layer order,
identical on every rank) and, while one of their methods runs, records whose reduction it is:

    should_fuse_mlp_allreduce_with_next_layer   layer i: defer i's MLP all-reduce?       -> i
    prepare_mlp                                 layer i: i's attention all-reduce + norm -> i
    prepare_attn                                layer i: i-1's deferred MLP all-reduce   -> i - 1

so layer i's deferral and the reduction that takes it read one cached decision, (i, tokens).
Outside these methods (a model that calls the gate itself) the key is layer 0.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator

ATTR = "_arfusion_layer_id"
_numbers = itertools.count()
_current = [0]  # the layer whose reduction runs now (the forward pass is single-threaded)


def current() -> int:
    """The layer id of the reduction being decided or run now (0 outside a communicator)."""
    return _current[0]


def layer_id(communicator: Any) -> int:
    """The number `number_communicator` gave ``communicator`` (0 when it has none)."""
    return getattr(communicator, ATTR, 0)


@contextlib.contextmanager
def scope(layer: int) -> Iterator[None]:
    """Within it, `current` is ``layer``; the previous value comes back after."""
    previous, _current[0] = _current[0], layer
    try:
        yield
    finally:
        _current[0] = previous


def number_communicator(result: Any, communicator: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``LayerCommunicator.__init__``: number the communicator (0, 1, 2, ...)."""
    setattr(communicator, ATTR, next(_numbers))


def own_layer(original: Callable[..., Any], communicator: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: the communicator's method runs its own layer's reductions."""
    with scope(layer_id(communicator)):
        return original(communicator, *args, **kwargs)


def previous_layer(original: Callable[..., Any], communicator: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``prepare_attn``: it reduces the previous layer's deferred MLP output."""
    with scope(max(layer_id(communicator) - 1, 0)):
        return original(communicator, *args, **kwargs)
