"""``meshtrain generate`` (stub until the model lands)."""


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.set_defaults(func=lambda args: print("not built yet") or 1)
