"""End to end through the OpenAI-compatible HTTP front, with the official `openai` client.

Redis + worker + scheduler + `llmserve openai` run as real processes on a tiny random Llama; the
front reaches the engine only through the scheduler's public gRPC API.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve.local_cluster import ClusterSpec, LocalCluster
from openai_api.routes import DISCONNECT_POLL_S
from tests.e2e.cluster_checks import assert_all_blocks_free, redis_state

openai = pytest.importorskip("openai")

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "64", "--max-model-len", "512", "--num-threads", "1"],
        http_port=0,
        http_args=["--served-model-name", MODEL],
    )
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator["openai.OpenAI"]:
    # No retries: a 4xx/5xx must reach the test as it is.
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_models_lists_the_served_name(client: "openai.OpenAI") -> None:
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 512  # type: ignore[attr-defined] - vLLM's extra field


def test_streamed_chat_completion(client: "openai.OpenAI", cluster: LocalCluster) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # The same request, whole: the greedy text is the streamed one.
    whole = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_completion_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0
    assert_all_blocks_free(cluster)


def test_streamed_completion(client: "openai.OpenAI") -> None:
    stream = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks and all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == text


def test_completion_with_usage_logprobs_and_batch(client: "openai.OpenAI") -> None:
    out = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10, 11]], max_tokens=5,
                                    temperature=0.0, logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # The same batch streamed with vLLM's continuous usage: each chunk's counts so far, the last the engine's.
    chunks = list(client.completions.create(
        model=MODEL, prompt=[[5, 6, 7, 8], [9, 10, 11]], max_tokens=5, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == 7 for c in chunks) and counts == sorted(counts) and counts[-1] == 10
    assert counts[-2] == 10 and chunks[-1].choices == []  # the last choices' chunk had counted every token
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # The two most likely tokens, and the sampled one where it is not among them (OpenAI's "up to logprobs+1").
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    assert all(top[token] == logprob for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))


def test_logprobs_name_tokens_by_id_where_asked(client: "openai.OpenAI") -> None:
    """vLLM's return_tokens_as_token_ids: the same logprobs, each token named token_id:<id> (the front has a
    tokenizer, so by default they are decoded)."""
    base = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0.0, logprobs=2)
    named = client.completions.create(**base, extra_body={"ignore_eos": True, "return_token_ids": True})
    by_id = client.completions.create(**base, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = named.choices[0].token_ids  # type: ignore[attr-defined] - vLLM's extra field
    assert by_id.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids] != named.choices[0].logprobs.tokens
    assert by_id.choices[0].logprobs.token_logprobs == named.choices[0].logprobs.token_logprobs
    assert all(all(t.startswith("token_id:") for t in top) for top in by_id.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                      "return_token_ids": True})
    assert [c.token for c in chat.choices[0].logprobs.content] == [
        f"token_id:{i}" for i in chat.choices[0].token_ids]  # type: ignore[attr-defined]


def test_seeded_n_choices_are_reproducible(client: "openai.OpenAI") -> None:
    base = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2, seed=11,
                extra_body={"ignore_eos": True})
    a, b = client.completions.create(**base), client.completions.create(**base)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2


@pytest.mark.parametrize(
    ("body", "param_or_message"),
    [
        ({"prompt": "hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 100000}, "lower max_tokens"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20], got 21."),
        # First come, first served: vLLM's answer to a priority without priority scheduling.
        ({"prompt": "hi", "priority": 2}, "Got priority 2 but Priority scheduling is not enabled."),
    ],
)
def test_invalid_parameters_are_400_in_openai_format(
    cluster: LocalCluster, body: dict, param_or_message: str
) -> None:
    reply = httpx.post(f"{cluster.http_url}/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert param_or_message in error["message"] or param_or_message == error["param"]


def test_openai_client_raises_bad_request_and_not_found(client: "openai.OpenAI") -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert "temperature must be non-negative" in info.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hi")
    assert missing.value.body["code"] == "model_not_found"


def _seconds_until_idle(cluster: LocalCluster, timeout_s: float = 30.0) -> float:
    start = time.monotonic()
    while True:
        state = redis_state(cluster)
        if not state["request_keys"] and state["blocks"]["free"] == state["blocks"]["total"]:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, state
        time.sleep(0.05)


def test_client_disconnect_aborts_the_request(client: "openai.OpenAI", cluster: LocalCluster) -> None:
    """A stream closed after its first chunk (or a plain request whose client gives up) frees its blocks
    long before the request could have finished: its gRPC call is cancelled and the scheduler aborts it."""
    # As long as the model allows (max-model-len 512): the gap between cut short and run to the end is wide.
    body = dict(model=MODEL, prompt="Tell me a long story", max_tokens=480, temperature=0.0,
                extra_body={"ignore_eos": True})
    start = time.monotonic()
    assert client.completions.create(**body).usage.completion_tokens == 480
    full_s = time.monotonic() - start

    stream = client.completions.create(**body, stream=True)
    next(iter(stream))
    stream.close()
    assert _seconds_until_idle(cluster) < full_s / 2

    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=full_s / 4).completions.create(**body)
    # The front notices the gone client at its next poll; run to the end, the request would take ~3/4 full_s.
    assert _seconds_until_idle(cluster) < full_s / 4 + DISCONNECT_POLL_S
    assert_all_blocks_free(cluster)


def test_tokenize_detokenize_and_version(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    """vLLM's /tokenize and /detokenize answer with the scheduler's tokenizer (what Generate computes)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    url = cluster.http_url
    text = "The quick brown fox"
    reply = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}, timeout=30)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = tokenizer(text).input_ids
    assert body == {"count": len(expected), "max_model_len": 512, "tokens": expected,
                    "token_strs": tokenizer.convert_ids_to_tokens(expected)}
    reply = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": expected}, timeout=30)
    assert reply.status_code == 200 and reply.json() == {"prompt": tokenizer.decode(expected)}
    assert httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=30).json()["token_strs"] is None
    # vLLM's benchmark client counts a prompt's tokens without the special ones.
    bare = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}, timeout=30)
    assert bare.status_code == 200 and bare.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    assert httpx.get(f"{url}/version", timeout=30).json()["version"]
    for path, body, param in [
        ("/tokenize", {"prompt": text, "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
        ("/tokenize", {"prompt": text, "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        ("/detokenize", {"tokens": [10**9]}, None),  # outside the vocabulary: the scheduler's 400
        ("/detokenize", {"tokens": [2**32]}, "tokens"),
    ]:
        reply = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert reply.status_code == 400, (path, body, reply.text)
        assert reply.json()["error"]["param"] == param, reply.json()


def test_prompt_options_reach_admission(cluster: LocalCluster) -> None:
    """truncate_prompt_tokens keeps the prompt's last tokens; add_special_tokens is refused with token ids."""
    url = cluster.http_url
    body = {"model": MODEL, "prompt": list(range(100, 120)), "max_tokens": 1, "truncate_prompt_tokens": 3}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 3
    reply = httpx.post(f"{url}/v1/completions", json={**body, "add_special_tokens": True}, timeout=60)
    assert reply.status_code == 400 and "add_special_tokens" in reply.json()["error"]["message"]


def test_logit_bias_and_allowed_token_ids_steer_the_worker(cluster: LocalCluster) -> None:
    """The worker's sampler applies them: +100 on a token makes greedy decoding pick it every time."""
    url = cluster.http_url
    base = {"model": MODEL, "prompt": list(range(40, 52)), "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json={**base, "logit_bias": {"777": 100}, "logprobs": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    def name(token_id: int) -> str:
        return httpx.post(f"{url}/detokenize", json={"tokens": [token_id]}, timeout=30).json()["prompt"]

    assert reply.json()["choices"][0]["logprobs"]["tokens"] == [name(777)] * 4
    reply = httpx.post(f"{url}/v1/completions", json={**base, "allowed_token_ids": [5, 6], "logprobs": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert set(reply.json()["choices"][0]["logprobs"]["tokens"]) <= {name(5), name(6)}
    # A bad word made of the first greedy token is never generated.
    first = httpx.post(f"{url}/v1/completions", json={**base, "logprobs": 0}, timeout=60).json()
    word = first["choices"][0]["logprobs"]["tokens"][0]
    reply = httpx.post(f"{url}/v1/completions", json={**base, "logprobs": 0, "bad_words": [word]}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert word not in reply.json()["choices"][0]["logprobs"]["tokens"], (word, reply.json())


def test_stop_reason_is_the_stop_string_or_the_stop_token_id_as_vllm_gives_them(cluster: LocalCluster) -> None:
    """A stop token id comes back as an int (0 included), a stop string as a string, streamed or not."""
    url = cluster.http_url
    base = {"model": MODEL, "prompt": list(range(40, 52)), "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    for token in (777, 0):
        forced = {**base, "logit_bias": {str(token): 100}, "stop_token_ids": [token]}
        reply = httpx.post(f"{url}/v1/completions", json=forced, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", token), choice
        last = _chunks(f"{url}/v1/completions", forced)[-1]["choices"][0]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", token), last
    text = httpx.post(f"{url}/detokenize", json={"tokens": [777]}, timeout=30).json()["prompt"]
    by_text = {**base, "logit_bias": {"777": 100}, "stop": [text]}
    choice = httpx.post(f"{url}/v1/completions", json=by_text, timeout=60).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", text), choice


def _chunks(url: str, body: dict) -> list[dict]:
    """The chunks of a streamed response, [DONE] checked and left out."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_prompt_logprobs_echo_and_token_ids(cluster: LocalCluster) -> None:
    """vLLM's prompt_logprobs and return_token_ids, OpenAI's echo: the prompt as the scheduler's first message
    reports it, whole and streamed."""
    url, text = cluster.http_url, "The quick brown fox"
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    body = {"model": MODEL, "prompt": text, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, "echo": True,
            "logprobs": 1, "prompt_logprobs": 2, "return_token_ids": True, "priority": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 3
    prompt_logprobs = choice["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for token_id, position in zip(ids[1:], prompt_logprobs[1:]):
        # The prompt token first (its rank in the vocabulary), then the two most likely ones (ranks 1 and 2).
        assert list(position)[0] == str(token_id)
        assert sorted(e["rank"] for e in position.values())[:2] == [1, 2]
    # Echo: the prompt's text and tokens first, its first token without logprobs.
    assert choice["text"].startswith(text)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3 and logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(ids)] == [p[str(t)]["logprob"] for t, p in zip(ids[1:], prompt_logprobs[1:])]
    chunks = _chunks(f"{url}/v1/completions", body)
    first = chunks[0]["choices"][0]
    assert (first["prompt_token_ids"], first["prompt_logprobs"]) == (ids, prompt_logprobs)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    # A token-id prompt echoes as its text.
    reply = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ids, "logprobs": None}, timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == choice["text"]


def test_chat_prompt_logprobs_and_token_ids(cluster: LocalCluster) -> None:
    """The rendered chat prompt's ids and logprobs at the response's top level (a stream's first chunk)."""
    url, messages = cluster.http_url, [{"role": "user", "content": "Say hello"}]
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
            "prompt_logprobs": 0, "return_token_ids": True, "spaces_between_special_tokens": False,
            "skip_special_tokens": False}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    whole = reply.json()
    assert whole["prompt_token_ids"] == ids and whole["prompt_logprobs"][0] is None
    # prompt_logprobs 0: each position has the prompt token alone.
    assert [list(p) for p in whole["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    role, *rest = _chunks(f"{url}/v1/chat/completions", body)
    assert (role["prompt_token_ids"], role["prompt_logprobs"]) == (ids, whole["prompt_logprobs"])
    assert [t for c in rest for ch in c["choices"] for t in ch["token_ids"]] == whole["choices"][0]["token_ids"]


def test_chat_template_kwargs_reach_the_schedulers_rendering(client: "openai.OpenAI", cluster: LocalCluster) -> None:
    """vLLM's chat_template_kwargs and documents go to the scheduler's apply_chat_template (this template reads
    neither, so the tokens are the plain rendering's); a rendering option among them is refused there, a 400."""
    url, messages = cluster.http_url, [{"role": "user", "content": "Say hello"}]
    plain = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "documents": [{"title": "A", "text": "alpha"}]}
    assert httpx.post(f"{url}/tokenize", json={"messages": messages, **extra}, timeout=30).json()["tokens"] == plain
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
    assert chat.usage.prompt_tokens == len(plain)
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "chat_template_kwargs": {"return_tensors": "pt"}})
    assert reply.status_code == 400
    assert "chat_template_kwargs.return_tensors is a rendering option" in reply.json()["error"]["message"]


def test_a_final_message_continued_and_a_rendering_without_the_generation_prompt(
        client: "openai.OpenAI", cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    """vLLM's add_generation_prompt and continue_final_message: the prompt is the template's rendering with them,
    and the chat completion continues it as a completion of the same tokens does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    url = cluster.http_url
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    open_end = {"add_generation_prompt": False, "continue_final_message": True}
    for options in (open_end, {"add_generation_prompt": False}):
        ids = httpx.post(f"{url}/tokenize", json={"messages": messages, **options}, timeout=30).json()["tokens"]
        assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"]
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages, **open_end}, timeout=30).json()["tokens"]
    assert tokenizer.decode(ids).endswith("The color is")
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                          extra_body={**open_end, "ignore_eos": True})
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)
    # vLLM's echo: the answer begun by the caller, then its continuation; streamed alike.
    echo = {**open_end, "ignore_eos": True, "echo": True}
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                            extra_body=echo)
    assert echoed.choices[0].message.content == "The color is" + completion.choices[0].text
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                              extra_body=echo, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == echoed.choices[0].message.content
    for path, body, fragment in [
        ("/v1/chat/completions", {"messages": messages, "continue_final_message": True, "max_tokens": 2},
         "needs add_generation_prompt false"),
        ("/tokenize", {"prompt": "Hi", "add_generation_prompt": False}, "add_generation_prompt applies to messages"),
    ]:
        reply = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=30)
        assert reply.status_code == 400 and fragment in reply.json()["error"]["message"], reply.text


def test_the_openai_client_through_every_vllm_parameter(client: "openai.OpenAI", cluster: LocalCluster) -> None:
    """One completion and one chat completion from the official client with every sampling and prompt option of
    vLLM's at once (extra_body), each checked for its effect; structured outputs: test_structured_outputs.py."""
    url = cluster.http_url

    def ids_of(text: str) -> list[int]:
        return httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()["tokens"]

    allowed = ids_of(" red green blue yellow")
    banned_by_bias, bad_word = allowed[0], httpx.post(f"{url}/detokenize", json={"tokens": [allowed[1]]},
                                                      timeout=30).json()["prompt"]
    text = "Colours: red, green"
    completion = client.completions.create(
        model=MODEL, prompt=text, max_tokens=6, temperature=0.0, echo=True, logprobs=1,
        logit_bias={str(banned_by_bias): -100},
        extra_body={"allowed_token_ids": allowed, "bad_words": [bad_word], "prompt_logprobs": 1,
                    "return_token_ids": True, "add_special_tokens": True, "spaces_between_special_tokens": False,
                    "skip_special_tokens": False, "priority": 0, "ignore_eos": True, "min_tokens": 6})
    (choice,) = completion.choices
    extra = choice.model_extra or {}
    generated = extra["token_ids"]
    # allowed_token_ids, minus the -100 bias and the bad word.
    assert len(generated) == 6 and set(generated) <= set(allowed) - {banned_by_bias, allowed[1]}, generated
    assert choice.text.startswith(text) and extra["prompt_token_ids"] == ids_of(text)  # echo; no BOS here
    assert len(extra["prompt_logprobs"]) == len(extra["prompt_token_ids"]) and extra["prompt_logprobs"][0] is None
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids_of(text)) + 6
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour. " * 20}], max_completion_tokens=4,
        temperature=0.0, extra_body={"truncate_prompt_tokens": 12, "return_token_ids": True, "prompt_logprobs": 0,
                                     "allowed_token_ids": allowed, "ignore_eos": True})
    assert chat.usage.prompt_tokens == 12 and len((chat.model_extra or {})["prompt_token_ids"]) == 12
    assert set(chat.choices[0].model_extra["token_ids"]) <= set(allowed)
    with pytest.raises(openai.BadRequestError, match="Priority scheduling is not enabled"):
        client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"priority": 1})
    assert_all_blocks_free(cluster)
