"""Observer registry: recipe names ("minmax", "kl", ...) to classes; users add their own."""
from __future__ import annotations

from typing import Callable

from .base import Observer
from .histogram import KLObserver, MSEObserver, PercentileObserver
from .minmax import MinMaxObserver, MovingAverageMinMaxObserver

OBSERVERS: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "moving_average": MovingAverageMinMaxObserver,
    "percentile": PercentileObserver,
    "kl": KLObserver,
    "mse": MSEObserver,
}


def register_observer(name: str) -> Callable[[type[Observer]], type[Observer]]:
    """Decorator: ``@register_observer("my_obs") class MyObserver(Observer): ...``."""
    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, Observer)):
            raise TypeError(f"register_observer({name!r}) needs an Observer subclass, got {cls!r}")
        OBSERVERS[name] = cls
        return cls
    return wrap


def make_observer(name: str, fmt, granularity, symmetric: bool, narrow_range: bool = False, **kwargs) -> Observer:
    """Build the observer registered as ``name``; unknown names list the known ones."""
    try:
        cls = OBSERVERS[name]
    except KeyError:
        raise ValueError(f"observer={name!r} is not known; known observers: {', '.join(OBSERVERS)}") from None
    return cls(fmt, granularity, symmetric=symmetric, narrow_range=narrow_range, **kwargs)
