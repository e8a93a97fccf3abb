"""Batch input parsing, output shape and resume logic, with a stand-in generator (no model)."""
import json

import pytest

from runtime.batch import completed_ids, parse_line, run_batch
from spec import SamplingConfig


def fake_generate(item, sampling, max_tokens):
    text = f"echo {item.messages[-1]['content']} t={sampling.temperature} n={max_tokens}"
    return text, {"num_prompt_tokens": 3, "num_new_tokens": 5, "stop_reason": "eos"}


def test_parse_simple_and_openai_lines():
    simple = parse_line('{"id": "a", "prompt": "hi"}')
    assert simple.id == "a" and simple.messages == [{"role": "user", "content": "hi"}]
    openai = parse_line(json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "x", "messages": [{"role": "system", "content": "s"},
                                                                        {"role": "user", "content": "q"}],
                                             "max_tokens": 7, "temperature": 0.5}}))
    assert (openai.id, openai.max_tokens, openai.temperature) == ("r1", 7, 0.5)
    assert openai.messages[0]["role"] == "system"


@pytest.mark.parametrize("line, fragment", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"id": "x"}', "expected"),
    ('{"custom_id": "x", "body": {"messages": []}}', "body.messages"),
    ('{"custom_id": "x", "body": {"messages": [{"role": "user", "content": "q"}], "max_tokens": "9"}}', "max_tokens"),
])
def test_malformed_lines_name_the_problem(line, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_line(line)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")


def test_run_batch_writes_openai_output_and_reports_skipped_lines(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(source, ['{"id": "a", "prompt": "one"}', "garbage", '{"id": "b", "prompt": "two", "temperature": 0.7}',
                    '{"id": "a", "prompt": "dup"}'])
    summary = run_batch(source, out, fake_generate, SamplingConfig(), 16, "m")
    assert summary.num_completed == 2 and not summary.is_clean
    assert [s.split(":")[0] for s in summary.skipped_lines] == ["line 2", "line 4"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["a", "b"]
    body = rows[1]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "echo two t=0.7 n=16"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert rows[0]["response"]["status_code"] == 200 and rows[0]["error"] is None


def test_resume_skips_done_ids_and_cuts_a_torn_line(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(source, [json.dumps({"id": str(i), "prompt": f"p{i}"}) for i in range(5)])
    calls = []

    def counting(item, sampling, max_tokens):
        calls.append(item.id)
        return fake_generate(item, sampling, max_tokens)

    run_batch(source, out, counting, SamplingConfig(), 8, "m")
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])   # a crash mid-write of the third line
    assert completed_ids(out) == {"0", "1"}
    calls.clear()
    summary = run_batch(source, out, counting, SamplingConfig(), 8, "m")
    assert calls == ["2", "3", "4"] and summary.num_done_before == 2
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == ["0", "1", "2", "3", "4"]


def test_generation_error_becomes_an_error_line(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(source, ['{"id": "a", "prompt": "x"}'])

    def failing(item, sampling, max_tokens):
        raise ValueError("prompt has 9999 tokens; the context holds 4096")

    summary = run_batch(source, out, failing, SamplingConfig(), 8, "m")
    row = json.loads(out.read_text())
    assert summary.num_failed == 1 and row["response"] is None and "9999" in row["error"]["message"]


def test_unsupported_url_is_reported_and_answered_with_an_error_line(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "q"}]}}
    embed = {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "text"}}
    _write(source, [json.dumps(embed), json.dumps(chat)])
    calls = []

    def counting(item, sampling, max_tokens):
        calls.append(item.id)
        return fake_generate(item, sampling, max_tokens)

    summary = run_batch(source, out, counting, SamplingConfig(), 8, "m")
    assert calls == ["c1"] and not summary.is_clean
    assert summary.skipped_lines[0].startswith("line 1:") and "/v1/embeddings" in summary.skipped_lines[0]
    rows = {json.loads(line)["custom_id"]: json.loads(line) for line in out.read_text().splitlines()}
    assert set(rows) == {"e1", "c1"}
    assert rows["e1"]["response"] is None
    assert rows["e1"]["error"]["code"] == "unsupported_url" and "/v1/embeddings" in rows["e1"]["error"]["message"]
    assert rows["c1"]["error"] is None
    calls.clear()
    run_batch(source, out, counting, SamplingConfig(), 8, "m")   # a rerun writes nothing twice
    assert calls == [] and len(out.read_text().splitlines()) == 2


def test_batch_lines_take_the_penalties():
    line = {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5,
                                       "frequency_penalty": 1, "repetition_penalty": 1.2}}
    item = parse_line(json.dumps(line))
    assert (item.presence_penalty, item.frequency_penalty, item.repetition_penalty) == (0.5, 1.0, 1.2)
    with pytest.raises(ValueError, match="presence_penalty"):
        parse_line(json.dumps({"id": "b", "prompt": "hi", "presence_penalty": "high"}))


def test_requests_the_runner_cannot_honour_get_error_lines(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    messages = [{"role": "user", "content": "q"}]
    lines = [{"custom_id": "n2", "body": {"messages": messages, "n": 2}},
             {"custom_id": "lp", "body": {"messages": messages, "logprobs": True}},
             {"custom_id": "js", "body": {"messages": messages, "response_format": {"type": "json_object"}}},
             {"custom_id": "ok", "body": {"messages": messages, "n": 1, "max_completion_tokens": 5, "seed": 7,
                                          "response_format": {"type": "text"}}}]
    _write(source, [json.dumps(line) for line in lines])
    calls = []

    def recording(item, sampling, max_tokens):
        calls.append((item.id, max_tokens, sampling.seed))
        return fake_generate(item, sampling, max_tokens)

    summary = run_batch(source, out, recording, SamplingConfig(), 8, "m")
    assert calls == [("ok", 5, 7)] and len(summary.skipped_lines) == 3
    rows = {json.loads(line)["custom_id"]: json.loads(line) for line in out.read_text().splitlines()}
    for name, field in (("n2", "n=2"), ("lp", "logprobs=True"), ("js", "response_format=")):
        assert rows[name]["error"]["code"] == "unsupported_parameter" and field in rows[name]["error"]["message"]
    assert rows["ok"]["error"] is None
