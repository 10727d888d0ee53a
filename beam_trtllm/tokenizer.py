"""The tiny Beam's tokenizer: a byte-level BPE trained on the bundled corpus, plus chat template.

Special tokens are appended after the learned vocabulary, so the total equals the config's
`vocab_size` exactly and every id the model can emit decodes to text.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, PAD)

# ChatML, the format Dynamo's frontend and transformers both render with Jinja.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus_text() -> str:
    return resources.files("beam_trtllm.data").joinpath("corpus.txt").read_text()


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a deterministic byte-level BPE of exactly `vocab_size` tokens (specials last)."""
    learned = vocab_size - len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=learned,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_text()
    tok.train_from_iterator([line for line in text.splitlines(keepends=True)], trainer)
    if tok.get_vocab_size() != learned:
        raise RuntimeError(
            f"BPE training gave {tok.get_vocab_size()} tokens, wanted {learned}: the bundled "
            "corpus is too small for this vocab_size"
        )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def special_token_ids(vocab_size: int) -> dict[str, int]:
    first = vocab_size - len(SPECIAL_TOKENS)
    return {name: first + i for i, name in enumerate(SPECIAL_TOKENS)}


def write_tokenizer_files(out_dir: Path, vocab_size: int, max_length: int) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json; returns the special token ids."""
    tok = build_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = special_token_ids(vocab_size)
    for name, i in ids.items():
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name), i)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": END_OF_TEXT,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": name, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for name, i in ids.items()
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


class TextTokenizer:
    """What the CLI and engine need: encode, decode, chat prompt, stop ids."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer in {model_dir}")
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        import jinja2  # installed with torch; only needed for chat prompts

        template = jinja2.Environment().from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)
