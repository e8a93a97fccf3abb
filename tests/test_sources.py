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
