"""The front of the engine: ``Engine`` and ``EngineClient`` (async_engine.py), each request's
state (request_state.py), the output actor that applies step outputs to it (output_actor.py),
one output channel per request (output_channel.py), the text-only incremental detokenizer
(detokenizer.py) and the iteration stats.

Imports engine.core and engine.transport (it runs a core here or stands one in for a core in
another process) and the shared vocabulary; never the HTTP layer (api/).
"""
