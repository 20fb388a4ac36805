def add_args(p):
    pass
def run(args):
    raise SystemExit("todo")
