"""OpenAI-compatible HTTP layer (quart-trio app served by hypercorn in the engine's nursery)."""
