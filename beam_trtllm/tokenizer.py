"""The tiny Beam's tokenizer: a byte-level BPE trained on the bundled corpus, Beam's special
tokens, its chat template and the `response_template` metadata (beam_trtllm/chat/, docs/CHAT.md).

Special tokens are appended after the learned vocabulary, so the total equals the config's
`vocab_size` exactly and every id the model can emit decodes to text.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .chat.format import BEAM_SPECIAL_TOKENS, CALL, RETURN, chat_template, response_template

END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (END_OF_TEXT, PAD) + BEAM_SPECIAL_TOKENS
# A turn ends at <|return|> (an answer) or <|call|> (tool calls); <|endoftext|> ends a document.
EOS_TOKENS = (RETURN, CALL, END_OF_TEXT)
CHAT_TEMPLATE = chat_template()


def corpus_text() -> str:
    return resources.files("beam_trtllm.data").joinpath("corpus.txt").read_text()


def build_tokenizer(vocab_size: int, lines: list[str] | None = None) -> Tokenizer:
    """Train a deterministic byte-level BPE of exactly `vocab_size` tokens (specials last) on
    `lines` (default: the bundled corpus)."""
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
    if lines is None:
        lines = corpus_text().splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer)
    if tok.get_vocab_size() != learned:
        raise RuntimeError(
            f"BPE training gave {tok.get_vocab_size()} tokens, wanted {learned}: the training "
            "corpus is too small for this vocab_size"
        )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def special_token_ids(vocab_size: int) -> dict[str, int]:
    first = vocab_size - len(SPECIAL_TOKENS)
    return {name: first + i for i, name in enumerate(SPECIAL_TOKENS)}


def write_tokenizer_files(out_dir: Path, vocab_size: int, max_length: int,
                          lines: list[str] | None = None) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json (the BPE trained on `lines`, default the
    bundled corpus); returns the special token ids."""
    tok = build_tokenizer(vocab_size, lines)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = special_token_ids(vocab_size)
    for name, i in ids.items():
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name), i)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": END_OF_TEXT,
        "eos_token": RETURN,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
        "response_template": response_template(),
        "added_tokens_decoder": {
            str(i): {"content": name, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for name, i in ids.items()
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


class TextTokenizer:
    """What the CLI, engine and chat frontend need: encode, decode, chat prompt, stop ids.

    `encode` reads special-token strings as control tokens (a raw prompt); `encode_plain`
    never does; `chat_ids` renders a chat and tokenizes it so that only the template's
    delimiters are control tokens (beam_trtllm/chat/template.py).
    """

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer in {model_dir}")
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = self.config.get("chat_template")
        self.special_tokens = [t["content"] for t in self.config.get(
            "added_tokens_decoder", {}).values() if t.get("special")]
        self._prompt_tok = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        return self.prompt_tokenizer.encode_plain(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True):
        """An incremental decoder (engine/detok.py): `.step(ids)` -> the new text or None."""
        return _Stream(self.tok, skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def vocab(self) -> list[str]:
        """Token strings by id (byte-level encoded), for the grammar's token masks."""
        by_id = {i: t for t, i in self.tok.get_vocab(with_added_tokens=True).items()}
        return [by_id.get(i, "") for i in range(max(by_id) + 1)]

    @property
    def prompt_tokenizer(self):
        from .chat.template import PromptTokenizer

        if self._prompt_tok is None:
            self._prompt_tok = PromptTokenizer(self.tok, self.special_tokens)
        return self._prompt_tok

    def _render(self, messages, tools, add_generation_prompt, **kwargs) -> str:
        from .chat.template import normalize_messages, render

        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        return render(self.chat_template, normalize_messages(messages), tools,
                      add_generation_prompt, **kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt as text (for display; tokenize chats with `chat_ids`)."""
        from .chat.template import unescape

        return unescape(self._render(messages, tools, add_generation_prompt, **kwargs))

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None, **kwargs) -> list[int]:
        rendered = self._render(messages, tools, add_generation_prompt, **kwargs)
        return self.prompt_tokenizer.encode_rendered(rendered)


class _Stream:
    """`tokenizers`' DecodeStream bound to its tokenizer."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.tok, self.stream = tok, DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, ids: list[int]) -> str | None:
        return self.stream.step(self.tok, ids)
