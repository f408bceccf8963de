"""The offline ``LLM`` API on the real model: sampling features, outputs and bad input."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.api import LLM, SamplingParams
from engine.errors import ConfigError, InvalidParameterError

pytestmark = pytest.mark.slow

OTHER_PROMPTS = ["Tell me a story about a dragon.", "1, 2, 3, 4,", "The best way to learn Python is",
                 "Roses are red,", "A" * 40]


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    alone = llm.generate("Write a haiku about the sea.", params)[0].outputs[0].token_ids
    crowd = llm.generate(["Write a haiku about the sea."] + OTHER_PROMPTS,
                         [params] + [SamplingParams(temperature=0.8, max_tokens=12)] * len(OTHER_PROMPTS))
    assert crowd[0].outputs[0].token_ids == alone
    other_seed = llm.generate("Write a haiku about the sea.", SamplingParams(temperature=1.0, seed=99, max_tokens=16))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_completions_share_the_prompt_blocks(llm):
    before = llm.engine.stats().prefix_cache_hits
    prompt = "Here is a long shared prompt about the history of the printing press in Europe. " * 3
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # each child has its own seed
    assert llm.engine.stats().prefix_cache_hits > before


def test_logprobs_are_the_models_log_softmax(llm, hf_oracle):
    prompt = "The capital of France is"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    ref = hf_oracle.greedy(llm.get_tokenizer().encode(prompt), 5)
    assert len(out.logprobs) == len(out.token_ids) == 5
    for step, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        assert 1 <= len(position) <= 4 and next(iter(position)) == token
        assert position[token].rank == 1  # greedy picks the most likely token
        expected = ref.logits[step].log_softmax(-1)[token].item()
        assert position[token].logprob == pytest.approx(expected, abs=1e-3)
        assert position[token].decoded_token == llm.get_tokenizer().decode([token])
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


def test_prompt_logprobs_are_the_models_log_softmax(llm, hf_oracle):
    prompt = "one two three four five six"
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    ids = llm.get_tokenizer().encode(prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.inference_mode():
        expected = hf_oracle.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for i, (token, position) in enumerate(zip(ids[1:], out.prompt_logprobs[1:])):
        assert position[token].logprob == pytest.approx(expected[i, token].item(), abs=1e-3)
        top = expected[i].topk(2).indices.tolist()
        assert [t for t, lp in position.items() if lp.rank <= 2 and t in top] != []


def test_stop_strings_and_stop_tokens(llm):
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert "answer" in full.text
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=["answer"]))[0].outputs[0]
    assert cut.text == full.text[:full.text.index("answer")]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", "answer") and cut.finished()  # (a method, as vLLM's)
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop="answer",
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text.endswith("answer") and kept.text.startswith(cut.text)
    third = full.token_ids[2]
    by_token = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[third]))
    assert by_token[0].outputs[0].token_ids == full.token_ids[:3]
    assert by_token[0].outputs[0].stop_reason == third
    # the stop token ends the token ids, not the text (as vLLM), unless include_stop_str_in_output
    decode = llm.get_tokenizer().decode
    assert by_token[0].outputs[0].text == decode(full.token_ids[:2]) != decode(full.token_ids[:3])
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[third],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == decode(full.token_ids[:3])
    eos = llm.engine.eos_token_id  # (a special token: its text shows only without skip_special_tokens)
    ended = SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100}, min_tokens=2, skip_special_tokens=False)
    out = llm.generate(prompt, ended)[0].outputs[0]
    assert out.token_ids[-1] == eos and out.text == decode(out.token_ids[:-1], skip_special_tokens=False)
    assert decode([eos], skip_special_tokens=False) not in out.text


def test_bad_words_and_allowed_token_ids_restrict_the_output(llm):
    prompt, greedy = "The capital of France is", dict(temperature=0, max_tokens=20)
    full = llm.generate(prompt, SamplingParams(**greedy))[0].outputs[0]
    assert full.text.startswith(" Paris.\n\nThe answer is:")
    answer, is_ = full.token_ids[5:7]  # ' answer', ' is'
    # A word of two tokens bans its second after its first: ' answer' stays, ' is' does not follow it.
    out = llm.generate(prompt, SamplingParams(**greedy, bad_words=["answer is"]))[0].outputs[0]
    assert out.token_ids[:6] == full.token_ids[:6] and out.token_ids[6] != is_
    assert is_ in out.token_ids and "answer is" not in out.text
    out = llm.generate(prompt, SamplingParams(**greedy, bad_words=["  answer"]))[0].outputs[0]  # (space or not)
    assert out.token_ids[:5] == full.token_ids[:5] and "answer" not in out.text
    allowed = full.token_ids[4:8]  # 'The', ' answer', ' is', ':'
    out = llm.generate(prompt, SamplingParams(**greedy, allowed_token_ids=allowed))[0].outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 20


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    prompt = "The capital of France is"
    ids = llm.get_tokenizer().encode(prompt)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=2))[0]
    assert out.prompt == prompt and out.prompt_token_ids == ids[-2:]  # (the text given, as vLLM)
    alone = llm.generate(ids[-2:], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.generate(ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))[0].prompt_token_ids == ids
    past_the_context = ids * 2000  # (10k tokens: the prompt is cut before the length check)
    assert llm.generate(past_the_context, SamplingParams(max_tokens=1, truncate_prompt_tokens=5))[0].prompt_token_ids == \
        past_the_context[-5:]
    long_text = "word " * 200_000  # (more characters than 8192 tokens can hold: no refusal before tokenizing)
    assert len(llm.generate(long_text, SamplingParams(max_tokens=1, truncate_prompt_tokens=5))[0].prompt_token_ids) \
        == 5
    with pytest.raises(InvalidParameterError, match="greater than this model's maximum context length") as exc:
        llm.generate(prompt, SamplingParams(truncate_prompt_tokens=10**6))
    assert exc.value.param == "truncate_prompt_tokens"


def test_min_tokens_holds_back_eos(llm):
    eos = llm.engine.eos_token_id
    forced = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100})
    assert llm.generate("Hello", forced)[0].outputs[0].token_ids == [eos]
    held = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100}, min_tokens=3)
    out = llm.generate("Hello", held)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    ignoring = SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100}, ignore_eos=True)
    out = llm.generate("Hello", ignoring)[0].outputs[0]
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"


def test_outputs_keep_prompt_order_and_accept_token_ids(llm):
    ids = llm.get_tokenizer().encode("Good morning")
    outs = llm.generate(["First", ids, {"prompt": "Third"}], SamplingParams(temperature=0, max_tokens=2))
    assert [o.prompt for o in outs] == ["First", None, "Third"]
    assert outs[1].prompt_token_ids == ids
    assert all(o.finished for o in outs)


def test_generate_shows_progress_unless_told_not_to(llm, capsys):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(["a", "b", "c"], params)
    bar = capsys.readouterr().err
    assert "Processed prompts" in bar and "3/3" in bar and "output" in bar and "tok/s" in bar
    outputs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]


def test_the_default_sampling_params_are_the_models_as_vllm_reads_them(llm, monkeypatch):
    assert llm.get_default_sampling_params() == SamplingParams()  # (this GGUF file says none)
    # as a generation_config.json would give them
    monkeypatch.setattr(type(llm.engine), "sampling_defaults", property(lambda self: {"temperature": 0.3, "top_k": 20}))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.3, 20, 1.0)
    # generate and chat without parameters use them, as vLLM's (they used SamplingParams())
    monkeypatch.setattr(type(llm.engine), "sampling_defaults", property(lambda self: {"temperature": 0.0}))
    assert len({llm.generate("Once upon a time", use_tqdm=False)[0].outputs[0].text for _ in range(3)}) == 1
    chats = [llm.chat([{"role": "user", "content": "Tell me a story."}], None, False)[0].outputs[0].text
             for _ in range(3)]
    assert len(set(chats)) == 1


def test_vllm_call_forms_of_the_offline_api(llm):
    """What scripts written for vLLM pass or read: the positional use_tqdm, lora_request=None,
    per-prompt priority, numpy token ids, seed=-1 (no seed), logprobs=True, request ids that
    go on counting across calls, and RequestOutput's fields this engine leaves None."""
    import numpy as np

    ids = llm.get_tokenizer().encode("The capital of France is")
    first = llm.generate([ids, {"prompt_token_ids": np.array(ids)}], SamplingParams(temperature=0, max_tokens=3),
                         False, None, [0, 0])
    assert first[0].outputs[0].token_ids == first[1].outputs[0].token_ids and first[1].prompt_token_ids == ids
    second = llm.generate("Hi", SamplingParams(max_tokens=1), False)
    assert len({o.request_id for o in first + second}) == 3  # (each call's ids once began again at 0)
    assert (first[0].metrics, first[0].lora_request, first[0].encoder_prompt, first[0].outputs[0].lora_request) == \
        (None,) * 4
    assert SamplingParams(seed=-1).seed is None and SamplingParams(logprobs=True, prompt_logprobs=True).logprobs == 1
    with pytest.raises(InvalidParameterError, match="LoRA") as exc:
        llm.generate("Hi", SamplingParams(max_tokens=1), False, lora_request=object())
    assert exc.value.param == "lora_request"
    with pytest.raises(InvalidParameterError, match="not a token id") as exc:
        llm.generate({"prompt_token_ids": [1.5]}, SamplingParams(max_tokens=1), False)
    assert SamplingParams(n=200).n == 200  # (pass@k; vLLM's bound, where the HTTP API holds to OpenAI's 128)


def test_generate_from_two_threads_gives_each_its_own_answers(llm):
    """Two threads' calls on one LLM (each ran its own actor graph over the one core: answers cut
    short, one 'abort'): the second waits for the first, each gets what it would alone."""
    long, short = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True)
    prompts = ["Count to ten:", "The capital of France is", "def add(a, b):"]
    alone = [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in (long, short)]
    results: dict[int, list] = {}

    def run(i: int, params: SamplingParams) -> None:
        results[i] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate((long, short))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[0], results[1]] == alone
    for bad in ({"max_tokens": 2}, ["x"]):
        with pytest.raises(InvalidParameterError, match="sampling_params"):
            llm.generate(prompts[:1], bad, use_tqdm=False)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=16))[0]
    assert "<|im_start|>assistant" in llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "4" in out.outputs[0].text


def test_chat_reads_text_parts_and_template_switches_as_vllm_does(llm):
    """Content as OpenAI's text parts is their text one per line; developer is system, None
    content "" (it failed templates that add to it), an earlier turn's reasoning is the template's
    reasoning_content (as over HTTP); add_generation_prompt in chat_template_kwargs overrides the
    argument; what the engine sets itself, or a part that is not text, is an
    InvalidParameterError naming the field (they were TypeErrors from the template)."""
    params = SamplingParams(temperature=0, max_tokens=2)
    plain = llm.chat([{"role": "user", "content": "Say\nhi"}], params, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}],
                     params, use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids
    showing = "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content or '' }}|{{ m.content + '' }}]{% endfor %}"
    shown = llm.chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": None, "reasoning": "hmm"}], params, use_tqdm=False,
                     chat_template=showing, add_generation_prompt=False)[0]
    assert llm.get_tokenizer().decode(shown.prompt_token_ids) == "[system||Be brief.][user||Hi][assistant|hmm|]"
    switched = llm.chat([{"role": "user", "content": "Say hi"}], params, use_tqdm=False,
                        chat_template_kwargs={"add_generation_prompt": False})[0]
    assert switched.prompt_token_ids == llm.chat([{"role": "user", "content": "Say hi"}], params, use_tqdm=False,
                                                 add_generation_prompt=False)[0].prompt_token_ids
    assert len(switched.prompt_token_ids) < len(plain.prompt_token_ids)
    for messages, kwargs, param in [([{"role": "user", "content": "hi"}], {"tokenize": True}, "chat_template_kwargs"),
                                    ([{"role": "user", "content": [{"type": "image_url"}]}], None, "messages"),
                                    ([{"content": "no role"}], None, "messages")]:
        with pytest.raises(InvalidParameterError) as exc:
            llm.chat(messages, params, use_tqdm=False, chat_template_kwargs=kwargs)
        assert exc.value.param == param


@pytest.mark.parametrize("prompt, params, param, words", [
    ("", SamplingParams(), "prompt", "empty"),
    ([1, 2, 10**6], SamplingParams(), "prompt", "vocabulary"),
    ("hi", SamplingParams(max_tokens=10**6), "max_tokens", "8192"),
    ("hi", SamplingParams(stop_token_ids=[-5 + 10**7]), "stop_token_ids", "vocabulary"),
    ("hi", SamplingParams(allowed_token_ids=[3, 10**7]), "allowed_token_ids", "vocabulary"),
    (None, SamplingParams(), "prompts", "NoneType"),  # (they were TypeErrors)
    ([True, 5], SamplingParams(), "prompt", "bool"),
])
def test_bad_prompts_are_rejected_naming_the_parameter(llm, prompt, params, param, words, monkeypatch):
    queued = spy_on_queueing(llm, monkeypatch)
    with pytest.raises(InvalidParameterError) as exc:
        llm.generate(prompt, params)
    assert exc.value.param == param and words in str(exc.value)
    assert queued == []


def spy_on_queueing(llm, monkeypatch) -> list[str]:
    """The request ids that reach the engine core from now on."""
    queued = []
    real = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda request_id, *a: (queued.append(request_id),
                                                                           real(request_id, *a)))
    return queued


def test_too_long_request_says_both_lengths(llm):
    with pytest.raises(ValueError) as exc:
        llm.generate([5] * 8000, SamplingParams(max_tokens=500))
    assert "8192" in str(exc.value) and "8500" in str(exc.value)


def test_a_bad_prompt_in_a_batch_queues_nothing(llm, monkeypatch):
    queued = spy_on_queueing(llm, monkeypatch)
    with pytest.raises(InvalidParameterError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert queued == []
    llm.generate(["fine"], SamplingParams(max_tokens=2))
    assert len(queued) == 1  # (the spy itself works)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("n", 0),
    ("max_tokens", 0), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("logprobs", 21),
    ("min_tokens", 100), ("stop", [""]), ("logit_bias", {1: 500}), ("top_k", 1.5), ("n", True),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("bad_words", [""]), ("bad_words", ["w"] * 129),
    ("bad_words_token_ids", [[]]), ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
    ("stop", 5), ("stop_token_ids", 5), ("allowed_token_ids", 5), ("bad_words", 5),  # (they were TypeErrors)
    ("temperature", 1e31), ("repetition_penalty", 1e-31),
])
def test_sampling_params_reject_bad_values(field, value):
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams(**{field: value})
    assert exc.value.param == field and field in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_sampling_params_change_as_vllms_do_and_are_checked(llm):
    params = llm.get_default_sampling_params()
    params.max_tokens, params.temperature = 3, 0  # (vLLM's example sets fields so)
    with pytest.raises(InvalidParameterError) as exc:
        params.top_p = 1.5
    assert exc.value.param == "top_p" and params.top_p == 1.0  # refused, and left as it was
    copy = params.clone()
    copy.stop.append("x")
    assert params.stop == [] and copy.stop == ["x"]
    assert len(llm.generate("Hi", params, use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("refused, fine", [
    (dict(allowed_token_ids=[5], bad_words_token_ids=[[5], [6, 5]]),
     dict(allowed_token_ids=[5], bad_words_token_ids=[[6, 5]])),  # (5 is banned only after 6)
    (dict(allowed_token_ids=[5, 6], stop_token_ids=[6], min_tokens=1, bad_words_token_ids=[[5]]),
     dict(allowed_token_ids=[5, 6], stop_token_ids=[6], min_tokens=0, bad_words_token_ids=[[5]])),
])
def test_restrictions_that_leave_no_token_are_refused(refused, fine):
    SamplingParams(**fine)
    with pytest.raises(InvalidParameterError, match="allowed_token_ids leaves no token to sample") as exc:
        SamplingParams(**refused)
    assert exc.value.param == "allowed_token_ids"


def test_unknown_engine_option_is_named():
    with pytest.raises(ConfigError) as exc:
        LLM(backend="torch", num_kv_block=4)
    assert exc.value.param == "num_kv_block"
