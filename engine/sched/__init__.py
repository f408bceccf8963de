"""What a step computes: requests, the KV block manager and the scheduler.

Owns each sequence's ``Request`` (its tokens, status and blocks) and decides every step which
tokens of which requests are computed, handing the runner a ``StepPlan`` value. No trio, no
torch: plain Python, stepped by the core. Imports only the shared vocabulary (config, plan,
sampling_params); never the runner, which it talks to only through the plan.
"""
