"""``meshtrain generate --checkpoint DIR --prompt TEXT --max-new-tokens N``: sample text from a checkpoint.

Runs in one process without a process group: DCP reads the (possibly dp-sharded) checkpoint into a
plain model, whatever layout saved it; or the model comes from a ``meshtrain export`` safetensors file,
or from a Hugging Face model folder (``config.json`` + safetensors, e.g. ``meshtrain export --format hf``),
whose ``tokenizer.json`` (``tokenizers`` library) encodes the prompt. ``--temperature 0`` decodes greedily.

``--chat`` talks to a fine-tuned model (docs/posttraining.md): the prompt (a text, one user message; or a JSON list
of ``{"role", "content"}`` messages; ``--system`` adds a system turn) is rendered with the tokenizer's chat
template and the generation prompt, as ``meshtrain prepare --format chat`` renders conversations
(:mod:`meshtrain.data.chat`: the template next to the tokenizer file, else ChatML when the tokenizer has its
tokens), sampling stops at the end-of-turn token, and only the reply is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from meshtrain.argtypes import nonnegative_float, seed_int
from meshtrain.cli.export import SUFFIX, load_checkpoint_model, load_export, load_hf_model
from meshtrain.data.chat import CHAT, CHATML_TOKENS, chat_format, checked_messages, pieces, render
from meshtrain.data.tokenizers import HFTokenizer, tokenizer_from_dict
from meshtrain.errors import ConfigError
from meshtrain.models import hf_io as hf
from meshtrain.paths import path_problem


def add_parser(sub: argparse._SubParsersAction, line: str) -> None:
    p = sub.add_parser("generate", help=line,
                       description="Sample from a trained model. DIR is a run folder (its latest checkpoint) "
                                   "or a checkpoints/step_* folder.")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="run folder, step folder, a .safetensors file written by meshtrain export, or a Hugging "
                        "Face model folder (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompt", default=None,
                   help="text to continue (with the char tokenizer, characters of the corpus vocabulary; default a "
                        "newline); with --chat the user's message, or a JSON list of {\"role\", \"content\"} messages")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt with the tokenizer's chat template (ChatML when it has none), stop at the "
                        "end of the turn and print only the reply")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system turn before the prompt")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (characters, with the char tokenizer)")
    p.add_argument("--temperature", type=nonnegative_float, default=0.8,
                   help="softmax temperature; 0 = greedy (always the most likely token)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=seed_int, default=1337, help="sampling seed (0 .. 2**64 - 1)")
    p.set_defaults(func=run)


def sample(checkpoint: str | Path, prompt: str, max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = None, seed: int = 1337, on_text: Callable[[str], None] | None = None,
           chat: bool = False, system: str | None = None) -> str:
    """Continue ``prompt`` by ``max_new_tokens`` tokens with the model saved in ``checkpoint``. With ``on_text``,
    the text is also handed out as it grows (:class:`TextStream`): the prompt, then each new piece. With ``chat``,
    the prompt is a conversation (:func:`chat_prompt`, ``system`` its system turn), sampling stops at an
    end-of-turn token, and the text (and what ``on_text`` gets) is the reply alone, without that token.

    Raises:
        ConfigError: no checkpoint there, bad sampling arguments, a prompt character outside the vocabulary, or
            (chat) a bad message list or a tokenizer without a chat template.
    """
    import torch

    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens = {max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ConfigError(f"--temperature = {temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k = {top_k} must be >= 1")
    if system is not None and not chat:
        raise ConfigError("--system adds a system turn to a conversation: use it with --chat")
    model, tokenizer = _load(checkpoint)
    ids, stop = chat_prompt(tokenizer, prompt, system) if chat else (_encode(tokenizer, prompt), set())
    model.eval()
    idx = torch.tensor([ids], dtype=torch.long)  # (1, T0)
    shown = [] if chat else ids  # what the text holds: the reply alone, or the prompt and its continuation
    stream = TextStream(tokenizer, shown, on_text) if on_text is not None else None
    drawn: list[int] = []

    def on_token(token: torch.Tensor) -> bool:  # token: (1, 1)
        if int(token) in stop:
            return True
        drawn.append(int(token))
        if stream is not None:
            stream(token)
        return False

    model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k,
                   generator=torch.Generator().manual_seed(seed), on_token=on_token)
    text = tokenizer.decode(shown + drawn)
    if stream is not None:
        stream.finish(text)
    return text


def _encode(tokenizer, prompt: str) -> list[int]:
    """Ids of a plain ``prompt``. Raises ConfigError: text the tokenizer cannot encode, or no ids at all."""
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        raise ConfigError(f"--prompt: {e}") from None
    if not ids:
        raise ConfigError("--prompt is empty: give at least one character to continue")
    return ids


def chat_messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    """The conversation ``--prompt`` (and ``--system``) give: a JSON list of messages when the text starts with
    ``[``, else one user message; ``system`` a system turn before them.

    Raises:
        ConfigError: a ``[`` text that is not JSON, not a list of ``{"role", "content"}`` messages, a role other
            than system, user, assistant, or a system turn given twice.
    """

    if prompt.lstrip().startswith("["):
        try:
            messages = json.loads(prompt)
        except ValueError as e:
            raise ConfigError(f"--prompt starts with '[' but is not JSON ({e}): give a JSON list of "
                              f"{{\"role\", \"content\"}} messages, or plain text for one user message") from None
    else:
        messages = [{"role": "user", "content": prompt}]
    messages = checked_messages({"messages": messages}, "messages", "--prompt", assistant=False)
    if system is not None:
        if messages[0]["role"] == "system":
            raise ConfigError("--system and a system message in --prompt: give the system turn once")
        messages.insert(0, {"role": "system", "content": system})
    return messages


def chat_prompt(tokenizer, prompt: str, system: str | None) -> tuple[list[int], set[int]]:
    """(prompt ids, end-of-turn ids) of a conversation: :func:`chat_messages` rendered with the tokenizer's
    template (:func:`meshtrain.data.chat.chat_format`) and ``add_generation_prompt=True``, cut at the assistant
    spans of a template with generation markers and each piece encoded with special tokens recognised, as
    ``prepare --format chat`` encodes (so equal to transformers' ``apply_chat_template``). The end-of-turn ids:
    ``<|im_end|>`` where the template writes it, and the EOS (the template's ``eos_token``, the tokenizer's).

    Raises:
        ConfigError: what :func:`chat_messages` refuses; the char tokenizer, or a tokenizer file with no template
            that lacks the ChatML tokens; a template that fails on the messages.
    """

    messages = chat_messages(prompt, system)
    if tokenizer.kind == "char":
        raise ConfigError("--chat needs a tokenizer file with a chat template; this model's is the char tokenizer: "
                          "fine-tune a model of a tokenizer file on data from meshtrain prepare --format chat")
    fmt, missing = chat_format(tokenizer, CHAT, prompt_loss=False)
    if missing:  # chat_format would extend the tokenizer with ChatML: this model was not trained on that
        raise ConfigError(f"--chat: the tokenizer '{tokenizer.path}' has no chat template (chat_template.jinja, or "
                          f"chat_template in tokenizer_config.json) and no {'/'.join(CHATML_TOKENS)} tokens: give a "
                          f"model fine-tuned on data from meshtrain prepare --format chat")
    text, spans = render(fmt, messages, "--prompt", generation_prompt=True)
    try:
        ids = [i for piece, _ in pieces(text, spans) for i in tokenizer.encode_with_special(piece)]
    except ValueError as e:
        raise ConfigError(f"--prompt cannot be tokenized: {e}") from None
    names = [CHATML_TOKENS[1]] * (CHATML_TOKENS[1] in fmt.template) + [fmt.special_tokens.get("eos_token")]
    stop = {tokenizer.token_to_id(name) for name in names if name} | {tokenizer.eos_id}
    return ids, stop - {None}


class TextStream:
    """Hands out the decoded text of a growing token sequence piece by piece, as ``generate`` draws tokens.

    Each call appends the new token (a (1, 1) tensor) and decodes only a window: the tokens since the last
    piece plus the ones before it (the prefix), whose own decoding is subtracted, so that a tokenizer that
    decodes a token differently after a neighbour (a leading space) still yields the right piece (the scheme of
    Hugging Face's text-generation-inference ``decode_token``). Work per token is the window's, not the whole
    sequence's. A window ending in U+FFFD (a character whose bytes are not all drawn yet, byte-level BPE) or one
    that rewrites the prefix waits for later tokens; :meth:`finish` hands out the rest of the final text, so the
    pieces add up to it whenever decoding only ever appends."""

    def __init__(self, tokenizer, ids: list[int], on_text: Callable[[str], None]) -> None:
        self.tokenizer, self.ids, self.on_text = tokenizer, list(ids), on_text
        self.sent = ""
        self.prefix = self.read = 0  # ids[prefix:read] decoded last time; ids[read:] not handed out yet
        self._step()

    def __call__(self, token) -> None:
        self.ids.append(int(token.reshape(-1)[0]))
        self._step()

    def _step(self) -> None:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if text.startswith(before) and not text.endswith("\ufffd") and len(text) > len(before):
            self.on_text(text[len(before):])
            self.sent += text[len(before):]
            self.prefix, self.read = self.read, len(self.ids)

    def finish(self, text: str) -> None:
        """Hand out what of the final ``text`` is not out yet."""
        if text.startswith(self.sent):
            self.on_text(text[len(self.sent):])
            self.sent = text


def _load(checkpoint: str | Path):
    """(model, tokenizer with ``encode``/``decode``) from a DCP checkpoint folder, a ``meshtrain export`` file
    or a Hugging Face model folder.

    Raises:
        ConfigError: nothing loadable there, a Hugging Face folder without ``tokenizer.json``, or a run's
            tokenizer file that is gone or changed since (:func:`meshtrain.data.tokenizers.tokenizer_from_dict`).
    """

    path = Path(checkpoint).expanduser()
    if path.is_dir() and any(os.path.lexists(path / name) for name in (hf.CONFIG_FILE, hf.SINGLE_FILE, hf.INDEX_FILE)):

        model, _ = load_hf_model(path)
        problem = path_problem(path / hf.TOKENIZER_FILE)
        if problem == "does not exist":
            raise ConfigError(f"'{path}' has no {hf.TOKENIZER_FILE}: generate needs the model's tokenizer to read "
                              f"the prompt and write the text")
        if problem:
            raise ConfigError(f"'{path / hf.TOKENIZER_FILE}' {problem}: copy the model's tokenizer.json again")
        try:
            return model, HFTokenizer(path)
        except Exception as e:  # the tokenizers library raises its own exception types
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"'{path / hf.TOKENIZER_FILE}' cannot be read as a tokenizer ({reason}): copy the "
                              f"model's tokenizer.json again") from None
    if path.suffix == SUFFIX and path.is_file():
        model, info = load_export(path)
    else:
        model, info = load_checkpoint_model(checkpoint)[:2]
    return model, tokenizer_from_dict(info["tokenizer"])  # any kind; a file tokenizer must be unchanged


def run(args: argparse.Namespace) -> int:
    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if args.chat and args.prompt is None:
        raise ConfigError("--chat needs --prompt: the user's message, or a JSON list of messages")
    prompt = "\n" if args.prompt is None else args.prompt
    sample(args.checkpoint, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, on_text=write,
           chat=args.chat, system=args.system)
    write("\n")
    return 0
