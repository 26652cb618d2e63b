"""``meshtrain train`` (stub until the trainer lands)."""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train on the device mesh")
    p.set_defaults(func=lambda args: print("not built yet") or 1)
