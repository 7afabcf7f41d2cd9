"""A reward plug-in with signal on any text (the parity of its length): a randomly initialised model over a
151,936-token vocabulary scores 0 on the toy task everywhere, and zero-signal groups are never trained."""


def reward(text, item):
    return float(len(text) % 2)
