"""frenzy-prefect: serverless, memory-aware LLM training on heterogeneous GPU clusters.

The core (``spec``, ``profiling``, ``memory``, ``allocator``, ``training``, ``launch``,
``scheduling``, ``recycle``) is plain Python over pydantic models and imports no Prefect. The Prefect shell lives in ``tasks``,
``flows``, ``blocks`` and ``worker``; ``collection`` registers it with Prefect.
"""

__version__ = "0.1.0"
