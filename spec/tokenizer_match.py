"""A draft must speak the target's tokens: same vocabulary, same special tokens."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer

from offload.weights.tokenizer import SPECIAL_TOKEN_KEYS, file_digest


class TokenizerMismatchError(ValueError):
    """A draft's tokens are not its target's."""


def _tokenizer_facts(folder: Path) -> tuple[dict[str, int], dict[str, str], set[str]]:
    """(vocabulary with added tokens, named special tokens, special added tokens) of a model folder."""
    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        raise TokenizerMismatchError(f"{folder} has no tokenizer.json; a draft and its target must both carry their tokenizer")
    fast = FastTokenizer.from_file(str(path))
    settings_path = Path(folder) / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
    named = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = settings.get(key)
        if value:
            named[key] = value["content"] if isinstance(value, dict) else str(value)
    special = {t.content for t in fast.get_added_tokens_decoder().values() if t.special}
    return fast.get_vocab(with_added_tokens=True), named, special


def _same_files(first: Path, second: Path) -> bool:
    """Both folders' tokenizer files exist and are byte for byte the same (the facts then agree)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        a, b = first / name, second / name
        if not (a.is_file() and b.is_file()) or file_digest(a) != file_digest(b):
            return False
    return True


def check_tokenizers_match(target_folder: str | Path, draft_folder: str | Path) -> None:
    """Raises ValueError naming the first difference when the draft's tokenizer is not the target's."""
    if _same_files(Path(target_folder), Path(draft_folder)):
        return                                  # a copy of the same files: nothing to parse
    target_vocab, target_named, target_special = _tokenizer_facts(Path(target_folder))
    draft_vocab, draft_named, draft_special = _tokenizer_facts(Path(draft_folder))
    prefix = f"draft {draft_folder} does not share the tokenizer of target {target_folder}"
    if len(target_vocab) != len(draft_vocab):
        raise TokenizerMismatchError(f"{prefix}: vocabularies have {len(draft_vocab)} vs {len(target_vocab)} tokens "
                         f"(build a draft for this target with `distill --target`)")
    if target_vocab != draft_vocab:
        token = next(t for t in target_vocab if draft_vocab.get(t) != target_vocab[t])
        raise TokenizerMismatchError(f"{prefix}: token {token!r} has id {draft_vocab.get(token)} in the draft and "
                         f"{target_vocab[token]} in the target")
    if target_special != draft_special:
        differ = sorted(target_special ^ draft_special)
        raise TokenizerMismatchError(f"{prefix}: special tokens differ ({', '.join(differ[:5])})")
    for key in sorted(set(target_named) | set(draft_named)):
        if target_named.get(key) != draft_named.get(key):
            raise TokenizerMismatchError(f"{prefix}: {key} is {draft_named.get(key)!r} in the draft and "
                             f"{target_named.get(key)!r} in the target")
