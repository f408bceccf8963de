"""The engine core: ``EngineCore`` (scheduler + runner, stepped synchronously), the core actor
that steps it in a trio nursery, and the device thread every forward pass runs on.

``Core`` (interface.py) is what the front drives; ``EngineCore`` gives it in this process, and
engine.transport's stand-ins give it for a core in another process. Imports engine.sched,
engine.runner, engine.models, backends and the shared vocabulary.
"""
