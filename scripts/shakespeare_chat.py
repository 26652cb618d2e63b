"""Conversations (and preference pairs) cut from the plays' dialogue of a Tiny Shakespeare-style text.

The text is a sequence of speeches, each ``NAME:`` on a line of its own, the lines spoken, then a blank line. A
conversation is two consecutive speeches by different speakers: the first one's lines are the user turn, the
second one's the assistant's, and the system turn names who answers ("You are ROMEO."); with ``--turns 2`` two
exchanges follow each other. A preference pair takes the same prompt, the real answer as ``chosen`` and the
answer of a speech far away in the text as ``rejected``.

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


def conversations(text: str, turns: int = 1) -> Iterator[dict]:
    """``{"messages": [system, user, assistant, ...]}`` from consecutive speeches: ``turns`` exchanges each,
    the assistant always the same speaker, the user the other one."""
    said = speeches(text)
    i = 0
    while i + 2 * turns <= len(said):
        window = said[i:i + 2 * turns]
        asker, answerer = window[0][0], window[1][0]
        if asker != answerer and all(s == (asker if k % 2 == 0 else answerer) for k, (s, _) in enumerate(window)):
            messages = [{"role": "system", "content": f"You are {answerer}."}]
            messages += [{"role": "user" if k % 2 == 0 else "assistant", "content": lines}
                         for k, (_, lines) in enumerate(window)]
            yield {"messages": messages}
            i += 2 * turns
        else:
            i += 1


def preference_pairs(text: str, seed: int = 0) -> Iterator[dict]:
    """``{"prompt", "chosen", "rejected"}`` (message lists): each single-turn conversation's real answer, and for
    rejected the answer of a conversation drawn at random from those at least 100 away in the text."""
    convs = list(conversations(text))
    rng = random.Random(seed)
    for i, conv in enumerate(convs):
        j = rng.randrange(len(convs) - 200) if len(convs) > 200 else (i + len(convs) // 2) % len(convs)
        j = j if j < i - 100 else j + 200  # skip the neighbourhood of i
        other = convs[j % len(convs)]["messages"][-1]
        chosen = conv["messages"][-1]
        if other["content"] != chosen["content"]:
            yield {"prompt": conv["messages"][:-1], "chosen": [chosen], "rejected": [other]}


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
