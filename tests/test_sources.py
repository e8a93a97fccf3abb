"""Model sources: a Hub id resolved offline from the local Hugging Face cache, and clear errors."""
import pytest

from offload.weights.resolve import ModelNotFoundError, resolve_model


def _fake_hub_cache(root, repo_id, files):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _fake_hub_cache(tmp_path, "someorg/tiny-llama", {"config.json": "{}", "model.safetensors": "x"})
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("someorg/tiny-llama").resolve() == snapshot.resolve()


def test_uncached_hub_id_names_the_download_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="--download"):
        resolve_model("someorg/not-cached")


@pytest.mark.parametrize("spec, fragment", [("/no/such/dir", "model not found"), ("a/b/c", "model not found")])
def test_missing_paths_are_named(spec, fragment):
    with pytest.raises(ModelNotFoundError, match=fragment):
        resolve_model(spec)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_a_file_digest_is_read_once_and_follows_a_rewrite(tmp_path, monkeypatch):
    import hashlib
    import os
    from pathlib import Path

    from offload.weights.tokenizer import file_digest
    path = tmp_path / "tokenizer.json"
    path.write_text('{"a": 1}')
    reads = []
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or real_read(self))
    assert file_digest(path) == hashlib.sha256(b'{"a": 1}').digest()
    assert file_digest(path) == file_digest(path) and len(reads) == 1
    path.write_text('{"a": 22}')
    os.utime(path, ns=(1, 1))       # a rewrite shows in the size, and in the time where the size stays
    assert file_digest(path) == hashlib.sha256(b'{"a": 22}').digest() and len(reads) == 2
