"""What `serve` and `chat` decide before any model runs: request bodies checked field by field, and the
sampling a request or a chat gets (flags over the model's stated settings over specstream's defaults)."""
import json

import gguf
import pytest

from runtime.sampling_defaults import SPECSTREAM_DEFAULTS, SamplingDefaults, model_sampling_defaults
from server.errors import ApiError
from server.schemas import parse_json, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def error_of(kind: str, body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_request(kind, body, max_tokens_limit=100)
    return caught.value


def test_a_chat_request_maps_onto_sampling_and_limits():
    request = parse_request("chat", {**CHAT, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "END",
                                     "max_completion_tokens": 7, "presence_penalty": 0.1, "stream": True,
                                     "stream_options": {"include_usage": True}, "user": "u1", "n": 1}, 100)
    assert request.sampling == {"temperature": 0.5, "top_p": 0.9, "seed": 3, "presence_penalty": 0.1}
    assert (request.max_tokens, request.stop, request.stream, request.include_usage) == (7, ["END"], True, True)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse_request("chat", {**CHAT, "messages": [{"role": "developer", "content": parts}]}, 100).messages == \
        [{"role": "system", "content": "ab"}]
    assert parse_request("completion", {"model": "m", "prompt": ["once"]}, 100).prompt == "once"
    assert parse_request("completion", {"model": "m", "prompt": [1, 2]}, 100).prompt == [1, 2]
    assert parse_request("chat", {**CHAT, "stop": None, "temperature": None}, 100).sampling == {}


@pytest.mark.parametrize("kind, body, param", [
    ("chat", {**CHAT, "temperature": True}, "temperature"),
    ("chat", {**CHAT, "temperature": 2.5}, "temperature"),
    ("chat", {**CHAT, "top_k": 1.5}, "top_k"),
    ("chat", {**CHAT, "frequency_penalty": 3}, "frequency_penalty"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 101}, "max_tokens"),
    ("chat", {**CHAT, "stop": ["a", ""]}, "stop"),
    ("chat", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {**CHAT, "stream": "yes"}, "stream"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {**CHAT, "tools": []}, "tools"),
    ("chat", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {**CHAT, "messages": "hi"}, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages[0].name"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("chat", {"messages": CHAT["messages"]}, "model"),
    ("completion", {"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ("completion", {"model": "m", "prompt": [-1]}, "prompt"),
    ("completion", {"model": "m", "prompt": "hi", "echo": True}, "echo"),
    ("completion", {"model": "m", "prompt": "hi", "messages": []}, "messages"),
])
def test_a_bad_field_is_a_400_naming_it(kind, body, param):
    error = error_of(kind, body)
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(param) and set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_the_body_must_be_a_json_object():
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for body in (b"{", b"[]", b"\xff"):
        with pytest.raises(ApiError, match="JSON"):
            parse_json(body)


def test_explicit_settings_win_and_temperature_0_is_plain_greedy():
    stated = SamplingDefaults({"temperature": 0.6, "top_k": 20}, "generation_config.json")
    sampling = stated.resolve({"top_p": 0.8, "seed": None})
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.6, 20, 0.8)
    assert sampling.min_p == SPECSTREAM_DEFAULTS["min_p"]
    assert sampling.repetition_penalty == SPECSTREAM_DEFAULTS["repetition_penalty"]
    greedy = stated.resolve({"temperature": 0, "presence_penalty": 0.5})
    assert greedy.is_greedy and (greedy.top_k, greedy.repetition_penalty, greedy.presence_penalty) == (0, 1.0, 0.5)
    line = stated.describe({"top_p": 0.8})
    assert "temperature 0.6" in line and "generation_config.json: temperature, top_k" in line and "flags: top_p" in line
    assert SamplingDefaults({}).describe({}).endswith("(specstream's defaults: the model states none); "
                                                      "--temperature 0 for greedy")


def test_a_gguf_states_its_sampling_in_general_sampling_keys(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_uint32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.penalty_repeat", 50.0)    # out of range: left out
    writer.add_uint32("general.sampling.penalty_last_n", 64)       # no counterpart here
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "gguf.json").write_text(json.dumps({"format": "gguf-inplace", "version": 1, "source": str(path)}))
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.9}))
    defaults = model_sampling_defaults(folder)
    assert defaults.stated == {"temperature": pytest.approx(0.6), "top_k": 20}
    assert defaults.source.startswith("GGUF")


def test_a_generation_config_states_sampling_or_greedy(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}))
    assert model_sampling_defaults(tmp_path).stated == {"temperature": 0.6, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert model_sampling_defaults(tmp_path).resolve({}).is_greedy
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert model_sampling_defaults(tmp_path) == SamplingDefaults({})


@pytest.mark.parametrize("settings, fragment", [
    ({"port": 70000}, "--port"), ({"max_new_tokens": 0}, "--max-new-tokens"), ({"max_queue": -1}, "--max-queue"),
    ({"max_body_bytes": 0}, "--max-body"), ({"api_key": " "}, "--api-key"),
])
def test_bad_server_settings_are_refused_before_a_model_loads(settings, fragment):
    from server import ServeConfig
    with pytest.raises(ValueError, match=fragment):
        ServeConfig(**settings)
    assert ServeConfig().host == "127.0.0.1" and ServeConfig(host="::1", port=9).url == "http://[::1]:9/v1"
