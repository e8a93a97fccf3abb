"""`serve` end to end on the default model with the official openai client: a server started in this process
on a free port (8 slots, a 512-token context, short answers), answers streamed and not, concurrent requests
equal to each alone, disconnects freeing slots, every bad request refused with its error while the server
keeps serving, the API key; and a `cli.py serve` process stopped by SIGTERM (error chunk, exit 0)."""
from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from runtime import RuntimeConfig, Session
from server import ServeConfig, SpecstreamServer

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
CONTEXT, SLOTS, MAX_TOKENS, MAX_QUEUE, MAX_BODY = 512, 8, 200, 2, 64 * 1024
QUESTIONS = ["What is 2+2?", "Name a primary color.", "Why is the sky blue?", "What is a cat?",
             "Say hello.", "What is the capital of France?", "Count to three.", "What is water made of?"]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server():
    session = Session(RuntimeConfig(max_context=CONTEXT, batch_size=SLOTS, budget=16))
    config = ServeConfig(port=0, api_key=KEY, max_new_tokens=MAX_TOKENS, max_body_bytes=MAX_BODY,
                         max_queue=MAX_QUEUE, quiet=True)
    served = SpecstreamServer(session, config)
    thread = served.start_in_thread()
    yield served
    served.stop()
    thread.join(30)
    session.close()
    assert not thread.is_alive()


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0, timeout=120)


def ask(server, question: str, stream: bool = False, **fields) -> str:
    fields = {"max_tokens": 16, "temperature": 0, **fields}
    messages = [{"role": "user", "content": question}]
    answer = client(server).chat.completions.create(model=MODEL, messages=messages, stream=stream, **fields)
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    return answer.choices[0].message.content


def raw(server, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
    """-> (status, parsed JSON body) of one plain HTTP request."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request(method, path, body=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    response = connection.getresponse()
    status, data = response.status, response.read()
    connection.close()
    return status, json.loads(data)


def health(server) -> dict:
    return raw(server, "GET", "/health")[1]


def wait_idle(server, seconds: float) -> float:
    """Waits until no request runs or waits -> how long it took."""
    began = time.monotonic()
    while (state := health(server))["running"] or state["waiting"]:
        assert time.monotonic() - began < seconds, f"still busy after {seconds} s: {state}"
        time.sleep(0.05)
    return time.monotonic() - began


def test_chat_and_completions_streamed_and_not(server):
    answer = ask(server, "What is 2+2?")
    assert "4" in answer
    assert ask(server, "What is 2+2?", stream=True) == answer
    chunks = list(client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    completion = client(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                   temperature=0)
    streamed = client(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                 temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == completion.choices[0].text
    assert completion.usage.completion_tokens == 8
    assert [m.id for m in client(server).models.list()] == [MODEL]
    stopped = ask(server, "What is 2+2?", stop=["classic"])
    assert stopped == answer[:answer.index("classic")]


def test_concurrent_answers_equal_each_alone(server):
    """8 clients at once (greedy and seeded sampling, streamed and not) get what each got alone."""
    requests = [dict(question=q, stream=i % 2 == 1, **({"temperature": 0.8, "seed": i} if i >= 4 else {}))
                for i, q in enumerate(QUESTIONS)]
    alone = [ask(server, **request) for request in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda request: ask(server, **request), requests))
    assert together == alone
    assert health(server)["requests"] >= 2 * len(requests)


def test_a_disconnect_frees_the_slot_within_a_pass(server):
    stream = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True)
    for _, chunk in zip(range(3), stream):
        pass
    assert health(server)["running"] == 1
    stream.close()
    assert wait_idle(server, 5) < 2
    slow = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):     # a non-streamed request whose client gives up
        slow.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                                     max_tokens=MAX_TOKENS, temperature=0)
    assert wait_idle(server, 5) < 2


def test_a_full_queue_gets_429_and_the_server_keeps_serving(server):
    streams = [client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Tell story number {i}."}], max_tokens=MAX_TOKENS,
        temperature=0, stream=True) for i in range(SLOTS + MAX_QUEUE)]
    with pytest.raises(openai.RateLimitError, match="--max-queue"):
        ask(server, "What is 2+2?")
    for stream in streams:
        stream.close()
    wait_idle(server, 10)
    assert "4" in ask(server, "What is 2+2?")


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    ("malformed JSON", b'{"model": ', 400, None, None),
    ("not an object", b"[1, 2]", 400, None, None),
    ("wrong type", {**CHAT, "temperature": "hot"}, 400, "temperature", None),
    ("out of range", {**CHAT, "top_p": 1.5}, 400, "top_p", None),
    ("unsupported field", {**CHAT, "logprobs": True}, 400, "logprobs", None),
    ("several choices", {**CHAT, "n": 2}, 400, "n", None),
    ("bad message", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
    ("too many tokens asked", {**CHAT, "max_tokens": MAX_TOKENS + 1}, 400, "max_tokens", None),
    ("no model", {"messages": CHAT["messages"]}, 400, "model", None),
    ("unknown model", {**CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("prompt over the context", {**CHAT, "messages": [{"role": "user", "content": "word " * CONTEXT}]}, 400,
     "messages", "context_length_exceeded"),
    ("body too large", {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}, 413, None, None),
]


@pytest.mark.parametrize("body, status, param, code", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_each_bad_request_gets_its_error_and_the_server_keeps_serving(server, body, status, param, code):
    payload = body if isinstance(body, bytes) else json.dumps(body)
    got, error = raw(server, "POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["message"]
    assert (error["error"]["param"], error["error"]["code"]) == (param, code)
    assert raw(server, "GET", "/health")[0] == 200


def test_a_bad_prompt_token_and_route_are_refused(server):
    status, error = raw(server, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": [10 ** 6]}))
    assert (status, error["error"]["param"]) == (400, "prompt")
    assert raw(server, "GET", "/v1/nothing")[0] == 404
    assert raw(server, "GET", "/v1/chat/completions")[0] == 405


def test_the_api_key_is_required(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    status, error = raw(server, "GET", "/v1/models", headers={"Authorization": ""})
    assert (status, error["error"]["code"]) == (401, "invalid_api_key")
    assert client(server).models.list().data[0].id == MODEL


def test_sigterm_ends_streams_with_an_error_chunk_and_exits_0():
    process = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "serve", "--port", "0", "--context", "256",
                                "--batch-size", "2", "--budget", "4", "--max-new-tokens", "400"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    port = _bound_port(lines, process)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "stream": True}))
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    process.send_signal(signal.SIGTERM)
    events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert json.loads(events[-1][6:])["error"]["message"] == "the server is shutting down (SIGTERM)"
    assert process.wait(timeout=30) == 0
    reader.join(5)
    assert "server stopped" in "".join(lines)


def _bound_port(lines: list[str], process: subprocess.Popen) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        for line in list(lines):
            if "Uvicorn running on http://127.0.0.1:" in line:
                return int(line.split("127.0.0.1:")[1].split()[0])
        time.sleep(0.1)
    raise AssertionError("the server never said where it listens:\n" + "".join(lines))
