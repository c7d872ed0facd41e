"""hf-dspark serve: the OpenAI-compatible server on a tiny target, through real clients (the official ``openai``
package, and huggingface_hub's InferenceClient as ``transformers chat`` uses it), with many clients at once, a client
that leaves mid-stream and bad requests between good ones. Greedy outputs must equal plain ``generate()``."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import torch

from tests.helpers import char_tokenizer, make_drafter, make_target

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

# A chat template the character tokenizer can spell (it has no newline)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MODEL = "tiny-dspark"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    import uvicorn

    from hf_dspark.engine import DSparkEngine
    from hf_dspark.serving import EngineWorker, ModelInfo, build_app

    target = make_target("llama")
    tokenizer = char_tokenizer(target.config.vocab_size)
    tokenizer.chat_template = TEMPLATE
    drafter = make_drafter(target, block_size=4)
    engine = DSparkEngine(target, drafter, tokenizer=tokenizer, policy="fixed", max_concurrency=8)
    worker = EngineWorker(engine)
    worker.start()
    assert worker.ready.wait(30), "the engine did not get ready"
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(worker, ModelInfo(MODEL, tokenizer, 512)), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "the server did not start"
    yield {"url": f"http://127.0.0.1:{port}", "target": target, "tokenizer": tokenizer, "engine": engine,
           "worker": worker}
    server.should_exit = True
    thread.join(10)
    worker.stop()


def plain_chat(served, messages, max_tokens: int) -> str:
    tokenizer, target = served["tokenizer"], served["target"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([list(ids["input_ids"] if isinstance(ids, dict) else ids)])
    out = target.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(served):
    models = client(served).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(served["url"] + "/health").json() == {"status": "ok"}


def test_health_says_profiling_until_the_engine_is_prepared_and_requests_wait_for_it():
    """The engine thread measures its profile before it takes requests: /health answers 503 "profiling" with the
    progress meanwhile, a request sent then is answered once it is done, and each stage is announced."""
    from fastapi.testclient import TestClient

    from hf_dspark.engine import DSparkEngine
    from hf_dspark.serving import EngineWorker, ModelInfo, build_app

    target = make_target("llama")
    tokenizer = char_tokenizer(target.config.vocab_size)
    engine = DSparkEngine(target, make_drafter(target, block_size=4), tokenizer=tokenizer, policy="fixed")
    release, lines = threading.Event(), []

    def slow_prepare(progress=None):
        progress([], [1, 2], 0.0)
        progress([1], [1, 2], 0.5)
        assert release.wait(30)
        progress([1, 2], [1, 2], 1.0)

    engine.prepare = slow_prepare
    worker = EngineWorker(engine, announce=lines.append)
    worker.start()
    try:
        with TestClient(build_app(worker, ModelInfo(MODEL, tokenizer, 512))) as http:
            deadline = time.time() + 30
            while worker.progress is None or worker.progress["batch_sizes_measured"] < 1:
                assert time.time() < deadline
                time.sleep(0.01)
            health = http.get("/health")
            assert health.status_code == 503
            assert health.json() == {"status": "profiling",
                                     "progress": {"batch_sizes_measured": 1, "batch_sizes": 2, "seconds": 0.5}}
            answer = {}
            waiting = threading.Thread(target=lambda: answer.update(http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3}).json()))
            waiting.start()
            time.sleep(0.2)
            assert not answer  # queued behind the profile
            release.set()
            waiting.join(30)
            assert answer["usage"]["completion_tokens"] == 3
            assert http.get("/health").json() == {"status": "ok"}
    finally:
        release.set()
        worker.stop()
    assert "/health says \"profiling\"" in lines[0] and "at 2 batch sizes (1, 2;" in lines[0]
    assert lines[1].startswith("batch size 1 measured (1/2") and lines[-1].startswith("ready after")


def test_chat_completion_equals_plain_generate(served):
    messages = [{"role": "user", "content": "Hello there"}]
    reply = client(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == plain_chat(served, messages, 20)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 20 and reply.usage.prompt_tokens > 0
    assert reply.usage.model_extra["accepted_length"] >= 1.0  # tokens per target forward, the request's own


def test_streamed_chat_equals_the_whole_answer(served):
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Name a colour"}]
    stream = client(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain_chat(served, messages, 24)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_stop_sequences_end_the_answer_before_them(served):
    messages = [{"role": "user", "content": "Count with me"}]
    full = plain_chat(served, messages, 40)
    stop = full[10:12]  # a sequence the answer reaches
    expected = full[: full.index(stop)]
    api = client(served)
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=[stop])
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
    streamed = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=stop,
                                           stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_completions_endpoint(served):
    tokenizer, target = served["tokenizer"], served["target"]
    prompt = "Once upon a time"
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    expected = tokenizer.decode(target.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:],
                                skip_special_tokens=True)
    api = client(served)
    reply = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert reply.choices[0].text == expected and reply.usage.completion_tokens == 16
    streamed = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_sampling_runs_and_keeps_its_length(served):
    reply = client(served).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=12, temperature=0.8, top_p=0.9)
    assert reply.usage.completion_tokens == 12


def test_sixteen_streaming_clients_at_once(served):
    chats = [[{"role": "user", "content": f"Question number {i}: what comes next?"}] for i in range(16)]

    async def one(api, messages):
        stream = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                   stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def everyone():
        api = openai.AsyncOpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(api, messages) for messages in chats))

    texts = asyncio.run(everyone())
    assert texts == [plain_chat(served, messages, 24) for messages in chats]


def test_a_client_that_leaves_frees_its_slot(served):
    engine, worker = served["engine"], served["worker"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 470,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", served["url"] + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        next(lines)
    deadline = time.time() + 20
    while (engine.num_active or worker._streams) and time.time() < deadline:
        time.sleep(0.05)
    assert engine.num_active == 0 and not worker._streams
    aborted = [o for o in engine.outputs.values() if o.finish_reason == "abort"]
    assert aborted and len(aborted[-1].token_ids) < 470
    test_chat_completion_equals_plain_generate(served)  # the server goes on serving


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
])
def test_bad_requests_get_400_and_the_server_goes_on(served, body, param):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    data = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(served["url"] + path, content=data, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    reply = client(served).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok"}],
                                                   max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


def test_transformers_chat_client(served, monkeypatch):
    """``transformers chat`` talks through huggingface_hub's InferenceClient, settings as a GenerationConfig diff."""
    from huggingface_hub import InferenceClient, constants
    from transformers import GenerationConfig

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the client refuses every URL offline, local ones too

    messages = [{"role": "user", "content": "Hello from transformers"}]
    settings = GenerationConfig(max_new_tokens=18, do_sample=False).to_json_string()
    with InferenceClient(base_url=served["url"]) as hf_client:  # the client holds the stream open
        chunks = list(hf_client.chat_completion(messages, model=MODEL, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"generation_config": settings}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain_chat(served, messages, 18)
    assert chunks[-1].usage.completion_tokens == 18
