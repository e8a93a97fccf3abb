"""`bench batch` wired end to end on a tiny random checkpoint: one prompt file of 3 prompts, batch sizes 1
and 2, no draft, the RAM tier: the JSON's shape, each row's tokens counted, the summary and the 70B plan."""
import json

import cli
from conftest import add_tiny_tokenizer, make_tiny_checkpoint

VOCAB = 48
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def test_bench_batch_wiring(tmp_path, capsys):
    folder, _ = make_tiny_checkpoint(tmp_path / "target", "llama", seed=1, vocab_size=VOCAB, num_hidden_layers=3)
    add_tiny_tokenizer(folder, VOCAB)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": TEMPLATE}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"t{3 + i} t{9 + i} t{27 - i}"}) + "\n" for i in range(3)))
    assert cli.main(["bench", "batch", "--target", str(folder), "--prompts", str(prompts), "--batch-sizes", "1,2",
                     "--max-new-tokens", "4", "--no-draft", "--tiers", "ram", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "batch" and result["prompts"] == 3 and result["modes"] == ["autoregressive"]
    assert set(result["tiers"]) == {"ram"} and result["tiers"]["ram"]["layers"]["ram"] == 3
    assert [(r["tier"], r["mode"], r["batch_size"]) for r in result["rows"]] == [
        ("ram", "autoregressive", 1), ("ram", "autoregressive", 2)]
    for row in result["rows"]:
        assert row["requests"] == 3 and 3 <= row["tokens"] <= 3 * 4
        assert row["tokens_per_second"] > 0 and row["passes"] > 0
        assert row["latency_seconds"]["max"] >= row["latency_seconds"]["p50"] > 0
    summary = result["summary"]
    assert summary["disk_batch16_vs_batch1"] is None and summary["speculative_vs_autoregressive"] == {"ram": None}
    assert [s["tier"] for s in summary["saturation"]] == ["ram"]
    plan = result["plan_70b_spqr_w4"]
    assert plan["tokens_per_second"] > 0 and plan["largest_batch"] >= 1 and plan["layers"]["disk"] == 0
    assert str(tmp_path) not in json.dumps(result)
