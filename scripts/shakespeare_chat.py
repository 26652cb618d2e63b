"""Conversations (and preference pairs) cut from the plays' dialogue of a Tiny Shakespeare-style text.

The text is a sequence of speeches, each ``NAME:`` on a line of its own, the lines spoken, then a blank line. A
conversation is two consecutive speeches by different speakers: the first one's lines are the user turn, the
second one's the assistant's, and the system turn names who answers ("You are ROMEO."); with ``--turns 2`` two
exchanges follow each other. A preference pair takes the same prompt (its user turn cut to its last lines), the
real answer as ``chosen`` and as ``rejected`` a speech from another play by a character who is not in the scene,
never an answer itself, used once, of about the chosen answer's length (``preference_pairs``).

    python scripts/shakespeare_chat.py --out data/shakespeare_chat.jsonl
    python scripts/shakespeare_chat.py --preference --out data/shakespeare_pairs.jsonl

Writes one JSON object per line: ``{"messages": [...]}`` (chat), or ``{"prompt": [...], "chosen": [...],
"rejected": [...]}`` (preference, TRL's conversational format), in the order of the text.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path

BUNDLED = Path(__file__).resolve().parents[1] / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, lines) of every speech of ``text``, in order; blocks that do not start with ``NAME:`` are skipped."""
    out = []
    for block in text.split("\n\n"):
        head, _, body = block.strip().partition("\n")
        if head.endswith(":") and body.strip():
            out.append((head[:-1].strip(), body.strip()))
    return out


def _exchanges(said: list[tuple[str, str]], turns: int) -> Iterator[tuple[int, list[tuple[str, str]]]]:
    """(index of the first speech, the ``2 * turns`` speeches) of every conversation, in order: consecutive speeches
    whose speakers alternate between two different people, cut greedily without overlap."""
    i = 0
    while i + 2 * turns <= len(said):
        window = said[i:i + 2 * turns]
        asker, answerer = window[0][0], window[1][0]
        if asker != answerer and all(s == (asker if k % 2 == 0 else answerer) for k, (s, _) in enumerate(window)):
            yield i, window
            i += 2 * turns
        else:
            i += 1


def _messages(window: list[tuple[str, str]]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": f"You are {window[1][0]}."}]
    return messages + [{"role": "user" if k % 2 == 0 else "assistant", "content": lines}
                       for k, (_, lines) in enumerate(window)]


def conversations(text: str, turns: int = 1) -> Iterator[dict]:
    """``{"messages": [system, user, assistant, ...]}`` from consecutive speeches: ``turns`` exchanges each,
    the assistant always the same speaker, the user the other one."""
    for _, window in _exchanges(speeches(text), turns):
        yield {"messages": _messages(window)}


SCENE = 50        # speeches either side of a conversation that count as its scene
PROMPT_CHARS = 160  # a pair's user turn: the last lines of the speech, at most this many characters (one line at least)
FAR_SHARE = 5     # a rejected reply is at least 1/FAR_SHARE of the text's speeches away (2 * SCENE at least)
CANDIDATES = 64   # valid rejected replies drawn per pair; the one closest in length to the chosen reply is kept


def last_lines(lines: str, chars: int) -> str:
    """The last lines of ``lines`` that hold at most ``chars`` characters together (newlines included), the last
    line alone when it is longer."""
    kept = lines.split("\n")
    while len(kept) > 1 and len("\n".join(kept)) > chars:
        kept.pop(0)
    return "\n".join(kept)


def preference_pairs(text: str, seed: int = 0) -> Iterator[dict]:
    """``{"prompt", "chosen", "rejected"}`` (message lists), one per single-turn conversation that finds a rejected
    reply: the prompt is the conversation's system turn and its user turn cut to its last lines (``last_lines``,
    ``PROMPT_CHARS``: a whole long speech would fill the 128-token window and leave no completion token in it, a
    pair that ties), ``chosen`` its real answer, ``rejected`` a speech from elsewhere in the text that

    - lies at least a fifth of the text's speeches away (``FAR_SHARE``; 1,419 on the bundled text, more than any
      play's excerpt there, the longest about 1,090 speeches: so it comes from another play) and is spoken by a
      character who does not speak within ``SCENE`` speeches of the conversation (neither the answerer named in the
      system turn nor anyone in the scene): another play's voice, names and matters,
    - is never an answer of any conversation (it is one of the speeches cut as user turns), so no text is both
      pushed up as one pair's chosen and down as another's rejected, and
    - is used as rejected once only, so a held-out pair's rejected text is no train pair's;

    among ``CANDIDATES`` such speeches drawn at random (``random.Random(seed)``), the one closest in length (characters)
    to the chosen answer, so length alone does not tell them apart. The preference: the answer this character gave in
    this scene over a speech from another play by someone who is not in it. Conversations whose draw finds no such
    speech are left out (on the bundled text 164 of 3,537, all from conversation 3,308 on, where the pool of far
    speeches runs out; before it pair k is conversation k, so the pairs that ``prepare``'s positional split rule holds
    out at ``--val-fraction 0.1`` are conversations it holds out of the fine-tuning at 0.1). On a short text (under
    ``5 * 2 * SCENE`` speeches) the distance is ``2 * SCENE``. Deterministic for a given text and seed."""
    said = speeches(text)
    exchanges = list(_exchanges(said, 1))
    answers = {window[1][1] for _, window in exchanges}
    pool, seen = [], set()  # the user turns whose text is no answer's, each text once
    for start, window in exchanges:
        if window[0][1] not in answers and window[0][1] not in seen:
            seen.add(window[0][1])
            pool.append((start, window[0]))
    free = set(range(len(pool)))
    far = max(2 * SCENE, len(said) // FAR_SHARE)
    rng = random.Random(seed)
    for start, window in exchanges:
        scene = {speaker for speaker, _ in said[max(0, start - SCENE):start + 2 + SCENE]}
        chosen = window[1][1]
        found = []
        for _ in range(20 * CANDIDATES):
            k = rng.randrange(len(pool))
            other_start, (speaker, lines) = pool[k]
            if k in free and speaker not in scene and abs(other_start - start) >= far and lines != chosen:
                found.append(k)
                if len(found) == CANDIDATES:
                    break
        if not found:
            continue
        k = min(found, key=lambda k: (abs(len(pool[k][1][1]) - len(chosen)), k))
        free.discard(k)
        messages = _messages([(window[0][0], last_lines(window[0][1], PROMPT_CHARS)), window[1]])
        yield {"prompt": messages[:-1], "chosen": [messages[-1]],
               "rejected": [{"role": "assistant", "content": pool[k][1][1]}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, default=BUNDLED, help="the plays' text (default: the bundled corpus)")
    parser.add_argument("--out", type=Path, required=True, help="jsonl file to write (must not exist)")
    parser.add_argument("--turns", type=int, default=1, help="exchanges per conversation (default 1)")
    parser.add_argument("--preference", action="store_true", help="write preference pairs instead")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"--out {args.out} exists: choose another path")
    text = args.input.read_text(encoding="utf-8")
    records = preference_pairs(text) if args.preference else conversations(text, args.turns)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with open(tmp, "w") as f:
        n = sum(1 for record in records if f.write(json.dumps(record) + "\n"))
    tmp.rename(args.out)
    print(f"wrote {n} {'pairs' if args.preference else 'conversations'} to {args.out}")


if __name__ == "__main__":
    main()
