"""frenzy-prefect: serverless, memory-aware LLM training on heterogeneous GPU clusters.

The core (``spec``, ``profiling``, ``memory``, ``allocator``, ``training``, ``launch``,
``scheduling``, ``recycle``, ``storage``) is plain Python over pydantic models and imports no
Prefect. The Prefect shell (the worker and what it uses, tasks, flows, blocks, the CLI) wraps it;
``collection`` registers it with Prefect. docs/architecture.md has the data flow and the layers.
"""

__version__ = "0.1.0"
