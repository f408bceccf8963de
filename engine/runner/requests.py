"""The runner's own state of each request it runs, built from step plans alone."""

from __future__ import annotations

import attrs

from engine.sampling_params import SamplingParams


@attrs.define(slots=True, eq=False)
class RunnerRequest:
    """The runner's own state of one request, built from the plans (``NewRequest`` and the
    rows since): what the sampler and prompt logprobs read. ``token_ids`` is kept complete only
    for requests whose sampling reads past output tokens (``SamplingParams.reads_output``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    num_prompt_logprobs: int
    token_ids: list[int] | None  # prompt + output (None: not kept, not read)
    num_tokens: int = 0  # tokens known at this step's sampling position (set per step)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        assert self.token_ids is not None, "output tokens are kept only for requests that read them"
        return self.token_ids[len(self.prompt_token_ids):self.num_tokens]
