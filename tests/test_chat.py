"""The chat REPL driven through a pipe: commands, stats footer, and Ctrl-C stopping one answer."""
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def _default_sigint() -> None:
    """A test run started in the background inherits an ignored SIGINT, and Python then never turns
    Ctrl-C into KeyboardInterrupt: the chat gets the default disposition, as from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Chat:
    def __init__(self, *flags: str) -> None:
        self.process = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "chat", *flags], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, preexec_fn=_default_sigint)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen = ""
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        while chunk := self.process.stdout.read(1):
            self.lines.put(chunk)

    def send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def wait_for(self, text: str, timeout: float = 120) -> str:
        deadline = time.time() + timeout
        while text not in self.seen:
            try:
                self.seen += self.lines.get(timeout=max(deadline - time.time(), 0.01))
            except queue.Empty:
                raise AssertionError(f"{text!r} never appeared; output so far:\n{self.seen}") from None
        return self.seen


def test_chat_commands_and_footer():
    chat = Chat("--max-new-tokens", "16", "--temperature", "0")
    assert "sampling: greedy (temperature 0)" in chat.wait_for("you>")
    chat.send("What is 2+2?")
    out = chat.wait_for("tok/s")
    assert "The answer to this classic math problem is 4." in out
    chat.send("/stats")
    assert '"num_new_tokens"' in chat.wait_for('"tokens_per_pass"')
    chat.send("/system Answer in French.")
    chat.wait_for("system prompt set")
    chat.send("/reset")
    chat.wait_for("conversation cleared")
    chat.send("/quit")
    assert chat.process.wait(timeout=30) == 0


def test_ctrl_c_stops_the_answer_but_not_the_session():
    chat = Chat("--max-new-tokens", "400")      # samples, as the model states or specstream's defaults say
    started = chat.wait_for("you>")
    assert "sampling: temperature 0.7, top-p 0.95, min-p 0.05, repetition penalty 1.1" in started
    chat.send("Write a very long story about a dragon, with many chapters.")
    before = len(chat.seen)
    deadline = time.time() + 120
    while len(chat.seen) < before + 40 and time.time() < deadline:   # the answer is streaming
        try:
            chat.seen += chat.lines.get(timeout=1)
        except queue.Empty:
            pass
    chat.process.send_signal(signal.SIGINT)
    chat.wait_for("(answer stopped)")
    chat.send("What is 2+2?")
    chat.wait_for("tok/s")
    chat.send("/quit")
    assert chat.process.wait(timeout=30) == 0
