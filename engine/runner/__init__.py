"""Computing a step: the model runner, the sampler and the runner's own per-request state.

Owns the KV cache tensors, the model and the sampler's generators. Reads only ``StepPlan``
values (engine.plan) and returns ``RunnerOutput`` values, so the same runner can sit in
another process (a tensor-parallel rank). torch, no trio. Imports engine.models, backends and
the shared vocabulary; never the scheduler.
"""
