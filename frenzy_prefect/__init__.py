"""frenzy-prefect: serverless, memory-aware LLM training on heterogeneous GPU clusters.

The core (``spec``, ``profiling``, ``memory``, ``allocator``, ``training``, ``launch``,
``scheduling``, ``recycle``, ``storage``) is plain Python over pydantic models and imports no
Prefect. The Prefect shell (the worker and what it uses, tasks, flows, blocks, the CLI) wraps it;
``collection`` registers it with Prefect. docs/architecture.md has the data flow and the layers.

The block types are attributes of the package, imported on first use only (importing the core
must not import Prefect), so that `prefect block register -m frenzy_prefect` finds them.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_BLOCKS = {"FrenzyCluster": "frenzy_prefect.blocks"}
__all__ = ["__version__", *_BLOCKS]


def __getattr__(name: str) -> Any:
    if name in _BLOCKS:
        return getattr(import_module(_BLOCKS[name]), name)
    raise AttributeError(f"module 'frenzy_prefect' has no attribute {name!r}")


def __dir__() -> list[str]:  # inspect.getmembers (Prefect's block registration) lists these
    return sorted([*globals(), *_BLOCKS])
