"""Stop strings: the window check agrees with a search of the whole text, streaming never shows a stop
string or its start, batch lines take OpenAI's `stop`, and on the default pair an answer with --stop is the
free answer cut before the string, speculative or not."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.batch import parse_line
from runtime.stop import HeldBackText, StopStrings, check_stop_strings

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("Sure! Here is the plan:\n\n1. Café au lait at 7 – the usual.\n2. Then the walk.\n\nUser: thanks "
        "naïve résumé 😀 the end")


def shown_while_streaming(chunks: list[str], strings: list[str], final: str) -> list[str]:
    shown: list[str] = []
    held = HeldBackText(strings, shown.append)
    for chunk in chunks:
        held.push(chunk)
        assert all(s not in "".join(shown) for s in strings)
    held.finish(final)
    return shown


def test_streaming_holds_back_what_may_start_a_stop_string():
    shown = shown_while_streaming(["Hello", "\n\nUs"], ["\n\nUser:"], "Hello\n\nUs")
    assert shown == ["Hello", "\n\nUs"]                # held until the answer ended without the string
    shown: list[str] = []
    held = HeldBackText(["\n\nUser:"], shown.append)
    held.push("Hello\n\nUs")
    assert shown == ["Hello"]
    held.push("ually")
    assert "".join(shown) == "Hello\n\nUsually"
    shown = shown_while_streaming(["Hello\n\nUs", "er: hi"], ["\n\nUser:"], "Hello")
    assert "".join(shown) == "Hello"


@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_text_adds_up_to_the_returned_answer(size):
    strings = ["User:", "walk"]
    final = TEXT[:TEXT.find("walk")]
    chunks = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
    assert "".join(shown_while_streaming(chunks, strings, final)) == final


@pytest.mark.parametrize("strings", [[""], ["ok", ""]])
def test_empty_stop_strings_are_refused(strings):
    with pytest.raises(ValueError, match="non-empty"):
        check_stop_strings(strings)


def test_batch_lines_take_openai_stop():
    line = {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "stop": "\n"}}
    assert parse_line(json.dumps(line)).stop == ["\n"]
    assert parse_line(json.dumps({"id": "b", "prompt": "hi", "stop": ["x", "yz"]})).stop == ["x", "yz"]
    assert parse_line(json.dumps({"id": "c", "prompt": "hi"})).stop is None
    for bad in (3, [], ["ok", ""], [1]):
        with pytest.raises(ValueError, match="stop must be"):
            parse_line(json.dumps({"id": "d", "prompt": "hi", "stop": bad}))


@pytest.mark.e2e
@pytest.mark.parametrize("strings", [["the"], [" the walk"], ["é"], ["😀", "thanks"], ["\n\nUser:"]])
def test_the_window_check_agrees_with_searching_the_whole_text(strings):
    from offload import Tokenizer
    from offload.weights.resolve import resolve_model
    tokenizer = Tokenizer(resolve_model(None))
    stops = StopStrings(tokenizer, strings)
    ids = tokenizer.encode(TEXT)
    first = next(n for n in range(1, len(ids) + 1) if any(s in tokenizer.decode(ids[:n]) for s in strings))
    assert [stops.reached(ids[:n]) for n in range(1, first + 1)] == [False] * (first - 1) + [True]
    cut = stops.trim(tokenizer.decode(ids))
    assert not any(s in cut for s in strings) and TEXT.startswith(cut)


def cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.e2e
def test_run_stops_before_the_stop_string_speculative_or_not():
    prompt = ["run", "Name three primary colors and one fact about each.", "--json", "--max-new-tokens", "64"]
    free = json.loads(cli(*prompt, "--no-draft").stdout)["text"]
    word = free.split()[len(free.split()) // 2]
    for flags in (["--no-draft"], ["--budget", "16"]):
        done = cli(*prompt, *flags, "--stop", word, "--stop", "no such text")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["text"] == free[:free.find(word)] and report["stop_reason"] == "stop_string"
    done = cli("run", "hi", "--stop", "")
    assert done.returncode != 0 and "Traceback" not in done.stderr and "non-empty" in done.stderr

