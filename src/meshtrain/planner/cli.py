"""``meshtrain plan`` (stub until the planner lands)."""


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory, step time, MFU and total time of layouts")
    p.set_defaults(func=lambda args: print("not built yet") or 1)
