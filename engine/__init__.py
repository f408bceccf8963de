"""The inference engine, in layers; each may import only the layers below it (``.importlinter``).

    engine.api         the public entry points: LLM, open_engine, ``python -m engine.api``
    engine.frontend    the async client, per-request state, the output actor, output channels
    engine.transport   the wire, the messages both processes share, remote stand-ins, processes
    engine.core        EngineCore (scheduler + runner), the core actor, the device thread
    engine.sched | engine.runner   what a step computes | computing it (independent of each other)
    engine.models      model definitions and weight loading
    (vocabulary)       config, errors, sampling_params, outputs, messages, plan, kv_groups, structured_outputs,
                       tools, tokenizer: the values and request-shaping features every layer shares
    backends           attention and matrix kernels (below the engine)
"""
