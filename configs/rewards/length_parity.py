"""A reward with signal on any text: the parity of its length. For rehearsals of the loop's costs at real
sizes with a randomly initialised model: over a 151,936-token vocabulary it scores 0 on every real task,
and zero-signal groups are never trained, so no step would be taken. It teaches nothing worth having."""


def reward(text, item):
    return float(len(text) % 2)
