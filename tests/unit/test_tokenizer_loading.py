"""shared.tokenizer_loading: the direct TokenizersBackend path gives AutoTokenizer's tokenizer, without torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.models.auto import tokenization_auto

from shared.tokenizer_loading import DIRECT_CLASS, DIRECT_MODEL_TYPES, load_tokenizer, loads_directly

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines",
    "unicode: naïve café 東京 🙂",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def _checkpoint(root: Path, tokenizer_dir: Path, model_type: str, **config: object) -> Path:
    """A directory with the default model's tokenizer files and a config.json of `model_type` (no weights)."""
    directory = root / model_type
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    return directory


def _behaviour(tokenizer: object) -> dict[str, object]:
    """What the services use of a tokenizer: encoding, decoding, the chat template, special tokens."""
    ids = [tokenizer.encode(text) for text in TEXTS]
    return {
        "class": type(tokenizer).__name__,
        "encode": ids,
        "encode_plain": [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS],
        "decode": [tokenizer.decode(i) for i in ids],
        "decode_skip": [tokenizer.decode(i, skip_special_tokens=True) for i in ids],
        "tokens": tokenizer.convert_ids_to_tokens(list(range(0, 49152, 997))),
        "chat": tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        "special": (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id,
                    sorted(tokenizer.all_special_ids)),
        "size": len(tokenizer),
    }


def test_direct_model_types_keep_a_hub_declared_tokenizers_backend() -> None:
    # The rule AutoTokenizer applies (transformers/models/auto/tokenization_auto.py): a hub-declared class is
    # replaced for these model types only. If a transformers upgrade adds one of ours, the direct path must drop it.
    for model_type in DIRECT_MODEL_TYPES:
        assert model_type not in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, model_type
        assert tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend", model_type


@pytest.mark.parametrize("model_type", sorted(DIRECT_MODEL_TYPES))
def test_direct_load_equals_auto_tokenizer(tmp_path: Path, default_model_dir: Path, model_type: str) -> None:
    directory = _checkpoint(tmp_path, default_model_dir, model_type)
    assert json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"] == DIRECT_CLASS
    assert loads_directly(directory)
    direct = load_tokenizer(str(directory))
    assert _behaviour(direct) == _behaviour(AutoTokenizer.from_pretrained(directory))


@pytest.mark.parametrize(("model_type", "config", "edit"), [
    ("qwen2", {}, None),  # AutoTokenizer builds Qwen2Tokenizer for it
    ("llama", {"auto_map": {"AutoConfig": "x.Config"}}, None),
    ("llama", {"model_name": "x"}, None),
    ("llama", {}, {"tokenizer_class": "LlamaTokenizer"}),
    ("llama", {}, {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}),
])
def test_other_checkpoints_go_through_auto_tokenizer(tmp_path: Path, default_model_dir: Path, model_type: str,
                                                     config: dict[str, object], edit: dict[str, object] | None) -> None:
    directory = _checkpoint(tmp_path, default_model_dir, model_type, **config)
    if edit is not None:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, **edit}))
    assert not loads_directly(directory)


def test_qwen2_gets_auto_tokenizers_class(tmp_path: Path, default_model_dir: Path) -> None:
    directory = _checkpoint(tmp_path, default_model_dir, "qwen2")
    loaded = load_tokenizer(str(directory))
    assert type(loaded) is type(AutoTokenizer.from_pretrained(directory))
    assert type(loaded).__name__ != DIRECT_CLASS


def test_missing_files_go_through_auto_tokenizer(tmp_path: Path, default_model_dir: Path) -> None:
    directory = _checkpoint(tmp_path, default_model_dir, "llama")
    (directory / "config.json").write_text("{not json")
    assert not loads_directly(directory)
    assert not loads_directly(tmp_path / "absent")


def test_the_default_model_loads_without_torch(default_model_dir: Path) -> None:
    # What a scheduler replica and the HTTP front gain: no torch in the process.
    code = ("import sys\nfrom shared.tokenizer_loading import load_tokenizer\n"
            f"t = load_tokenizer({str(default_model_dir)!r})\n"
            "print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == [DIRECT_CLASS, "False"]


@pytest.mark.parametrize("given", ["missing", "HuggingFaceTB/SmolLM2-135M", "missing.gguf"])
def test_only_a_local_checkpoint_is_read(given: str, tmp_path: Path) -> None:
    """Nothing is downloaded at run time: a name that is no local directory or GGUF file is refused, named, before
    transformers takes it for a Hub repository id."""
    path = str(tmp_path / given) if given.startswith("missing") else given
    with pytest.raises(ValueError, match=r"tokenizer must be a local checkpoint directory or \.gguf file, got "
                                         rf"'{path}' \(neither exists\)"):
        load_tokenizer(path)


def test_a_directory_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=rf"{tmp_path} holds no tokenizer \(none of tokenizer.json, tokenizer.model, "
                                         r"vocab.json\)"):
        load_tokenizer(str(tmp_path))


def test_transformers_errors_name_the_checkpoint(tmp_path: Path) -> None:
    """A tokenizer file transformers cannot read: its own message, with the directory it came from."""
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"the tokenizer in {tmp_path} could not be loaded: "):
        load_tokenizer(str(tmp_path))
